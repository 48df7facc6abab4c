"""The enforcement service: the node agents' only way to the log.

A node agent (:mod:`services.enforcement.agent`) has no database login. Everything it
reads of the log and everything it records goes through this service, over NATS
request/reply on ``{prefix}.node.<node token>.<verb>``
(:mod:`services.enforcement.protocol`). Any number of replicas run side by side: each
subscribes ``{prefix}.node.*.>`` in the queue group ``enforcement``, holds the whole
fold (a :class:`~services.runtime.store.livestate.LiveState`) and one small connection pool,
so the database's connections do not grow with the fleet.

Who asks
--------
The node is the broker's word, never the payload's. The agents' account imports the
service's subjects with ``share: true``, so nats-server stamps every request with the
sender's account and NKey (``Nats-Request-Info``); the key names an agent principal of
the broker's directory (``directory.json``), whose node must be the one the subject
names — a request on another node's subject is refused (``forbidden``), as is one
without the stamp. Under ``--insecure`` nobody is authenticated and the subject's node
is taken as is (as the claims API's anonymous mode).

The verbs
---------
* ``lease``: :func:`services.enforcement.leases.acquire` appends the node's next
  ``NodeLeaseAcquired``; the service then creates (or recreates) the node's durable
  consumer ``agent-<node>`` (filter ``names.node_filter(node)``): the agent only pulls
  and acknowledges, it never creates a consumer.
* ``heartbeat``: :class:`~services.enforcement.renewing.Renewals` renews every beat of
  a tick in one statement.
* ``view``: each bus message the agent sends is confirmed against the log
  (:class:`~services.runtime.delivery.confirming.LogConfirmation`: the event at that position,
  same id and payload, addressed to this node); a confirmed message of an event the
  fold refused, and a message that did not decode whose id the log holds as an event
  the fold's driver refuses (:mod:`events.folding`), are answered ``refused``: the agent
  acknowledges them unhandled and never acts on them, as every consumer does
  (:meth:`~services.runtime.delivery.confirming.LogConfirmation.refused`,
  :meth:`~services.runtime.delivery.confirming.LogConfirmation.undecodable`); the redelivered
  ones are looked up in ``processed_messages`` of the node's consumer; the fold is
  brought at least to the messages and to the agent's own last write (``at_least``);
  the answer is a node-scoped view (:func:`services.enforcement.views.scope`) with the
  stream versions read on the same frozen fold.
* ``report``: the events are decoded strictly with the catalog; the lease epoch must be
  the node's live lease in the fold (else ``stale_epoch``); every event must be a node
  agent's report for this node (:func:`services.enforcement.reports.refusal`, else
  ``forbidden`` / ``invalid``); the share reports are then folded on a copy of what
  they touch, and a refusal of the fold is a ``conflict`` (the agent decided on an
  older state; nothing the fold would refuse is appended). What passes is appended in
  one statement as ``agent:<node>#<epoch>`` with the expected versions the agent read
  and the ``processed_messages`` rows of its consumer, so effects stay exactly once;
  the database checks the epoch again under the log's head lock (the service's login,
  ``dracap_enforcement``, may append nothing else: migration 0011).
* ``consumer``: the agent's pull requests found no durable (a broker that lost its
  store): the node's durable is created again if it is missing
  (:func:`services.runtime.delivery.rebuilding.ensure_durables`, as the relay does for the
  services' durables). Its ``CONSUMER.INFO`` waits
  :data:`~services.runtime.delivery.rebuilding.ANSWER_WAIT_S` for an answer: a clustered
  durable between two leaders (its server killed) answers nothing for seconds, and the
  agent, which does not pull while it asks, should hear "not now" and ask again at its
  next ``503``, not after the API's 5 s (issue 29).

Cost per request: O(what the request touches) — the node's devices, slices and
retrying shares are indexed (:class:`NodeIndex`), never found by scanning the fold.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from events.actors import Actor
from events.catalog import (
    Event,
    LimitFailed,
    ResourceSlicePublished,
)
from events.envelopes import Envelope, claim_stream, node_stream
from events.errors import CatalogError, InvariantViolation
from events.eventcodec import decode_event
from events.fold import apply_event
from events.state import ClaimKey, ClusterState, DeviceKey
from events.subjects import node_of
from events.transitions import ClaimBound, ClaimReleasing, meaning
from services.enforcement import leases
from services.enforcement.consumer import durable
from services.enforcement.protocol import (
    VERBS,
    Beat,
    Consumed,
    ConsumerAsk,
    Heartbeat,
    LeaseAsk,
    Leased,
    Refusal,
    RefusalCode,
    Reply,
    Report,
    Reported,
    ViewAsk,
    Viewed,
    consumer_name,
    decode,
    encode,
)
from services.enforcement.renewing import TICK_S, Renewals
from services.enforcement.reports import (
    SHARE_REPORTS,
    refusal,
    shares_of,
    version_check_refusal,
)
from services.enforcement.views import Scope, decode_view, encode_view, scope
from services.runtime.bus.credentials import Directory, Principal, principal_of
from services.runtime.bus.flushing import flushed
from services.runtime.bus.jetstream import durable_config, with_timeout
from services.runtime.bus.replies import split
from services.runtime.delivery.confirming import LogConfirmation
from services.runtime.delivery.consuming import HANDLED_BEFORE
from services.runtime.delivery.rebuilding import ANSWER_WAIT_S, ensure_durables
from services.runtime.ground.context import ServiceContext
from services.runtime.ground.errors import (
    ConflictError,
    InvalidEvent,
    NodeScopeViolation,
    PermanentError,
    RetryableError,
    StaleEpoch,
    map_bus_error,
)
from services.runtime.ground.metrics import NODE_REQUESTS
from services.runtime.ground.outages import is_outage
from services.runtime.ground.settings import ServiceKind
from services.runtime.store.appends import Batch, Cause, Metadata, Processed
from services.runtime.store.livestate import SEEN, LiveState
from services.runtime.store.logandfold import LogAndFold
from services.runtime.store.refusals import note

__all__ = ["QUEUE_GROUP", "STORE_KIND", "EnforcementService", "NodeIndex", "agent_of_request"]

log = logging.getLogger("dracap.enforcement")

#: The queue group every replica subscribes in.
QUEUE_GROUP: Final = "enforcement"
#: The database user kind the service appends as: a member of ``dracap_enforcement``
#: (``DRACAP_DATABASE_URL_ENFORCEMENT``; migration 0011): node reports for any node,
#: each naming the node's live lease epoch.
STORE_KIND: Final = ServiceKind.ENFORCEMENT
#: Requests served at once by one replica (more wait for a slot).
CONCURRENCY: Final = 512

_T = TypeVar("_T")


class _Refused(Exception):  # noqa: N818 (a reply, not a failure)
    """A request answered with a :class:`Refusal`."""

    def __init__(self, code: RefusalCode, message: str, current: int = 0) -> None:
        super().__init__(message)
        self.refusal = Refusal(code=code, message=message, current=current)


def agent_of_request(headers: dict[str, str] | None, known: dict[str, Principal]) -> str | None:
    """The node whose agent sent a request, from the header the broker stamped (``None``:
    no stamp, a key that is no agent's, or an account that is not the key's own)."""
    principal = principal_of(headers, known)
    if principal is None or principal.kind != "agent":
        return None
    return principal.node or principal.name


class NodeIndex:
    """Per node, what a view asks for that the fold keeps no index of: its devices, its
    slices, its shares waiting for a retry. Built once from the fold, then kept by a
    listener; stale entries are dropped when read (the fold has the last word)."""

    def __init__(self, live: LiveState) -> None:
        self.devices: dict[str, set[DeviceKey]] = {}
        self.slices: dict[str, set[str]] = {}
        self._retrying: dict[str, set[str]] = {}
        state = live.state
        for key, device in state.devices.items():
            if device.node is not None:
                self.devices.setdefault(device.node, set()).add(key)
        for name, found in state.slices.items():
            if found.spec.node_name:
                self.slices.setdefault(found.spec.node_name, set()).add(name)
        for share_id, share in state.shares.items():
            if share.retry_at is not None and share.node is not None:
                self._retrying.setdefault(share.node, set()).add(share_id)
        self._unsubscribe = live.subscribe(self._folded)

    def close(self) -> None:
        self._unsubscribe()

    def _folded(self, envelope: Envelope) -> None:
        event = envelope.event
        if isinstance(event, ResourceSlicePublished):
            spec = event.slice.spec
            if spec.node_name:
                self.slices.setdefault(spec.node_name, set()).add(event.slice.metadata.name)
                keys = {(spec.driver, spec.pool.name, d.name) for d in spec.devices or ()}
                self.devices.setdefault(spec.node_name, set()).update(keys)
        elif isinstance(event, LimitFailed) and event.retry_at is not None:
            self._retrying.setdefault(event.node, set()).add(event.share_id)

    def retrying(self, state: ClusterState, node: str) -> list[str]:
        """The node's shares waiting for a retry of their limit, in ShareID order."""
        candidates = self._retrying.get(node)
        if not candidates:
            return []
        for share_id in list(candidates):
            share = state.shares.get(share_id)
            claim = state.claims.get(share.claim) if share is not None else None
            if (
                share is None
                or share.retry_at is None
                or share.state != "bound"
                or claim is None
                or claim.phase != "retrying"
                or claim.allocation_version != share.allocation_version
            ):
                candidates.discard(share_id)  # as decide_retries: no retry comes of it
        return sorted(candidates)

    def next_retry(self, state: ClusterState, node: str) -> datetime.datetime | None:
        """When the node's next retry is due (``None``: none waits)."""
        due = [state.shares[s].retry_at for s in self.retrying(state, node)]
        return min((d for d in due if d is not None), default=None)


class EnforcementService:
    """One replica of the enforcement service (see the module docstring)."""

    def __init__(
        self,
        context: ServiceContext[LogAndFold],
        *,
        directory: Directory | None = None,
        authenticated: bool = False,
        tick_s: float = TICK_S,
        tail: bool = False,
        concurrency: int = CONCURRENCY,
    ) -> None:
        store = self.store = context.stores.store
        live = self.live = context.stores.live
        self.nc = context.nc
        self.js = context.js
        self._look = with_timeout(self.js, ANSWER_WAIT_S)  # what only looks: answered at once
        self.names = context.names
        #: requests must carry the broker's stamp of an agent's key (a broker with accounts)
        self.authenticated = authenticated
        self._known = directory.index() if directory is not None else {}
        self.tail = tail
        self.renewals = Renewals(store.renew_leases, tick_s=tick_s, clock=context.clock)
        self.confirmation = LogConfirmation(store, live)
        self.index: NodeIndex | None = None
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._sub: Subscription | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Index the fold and subscribe the node requests (idempotent)."""
        if self._sub is not None:
            return
        self.index = NodeIndex(self.live)
        self._sub = await self.nc.subscribe(
            self.names.node_requests, queue=QUEUE_GROUP, cb=self._received
        )
        await flushed(self.nc)

    async def run(self, stop: asyncio.Event) -> None:
        """Answer requests and renew leases until ``stop`` is set."""
        await self.start()
        workers = [asyncio.ensure_future(self.renewals.run(stop))]
        if self.tail:
            workers.append(asyncio.ensure_future(self.live.run(stop)))
        try:
            await stop.wait()
        finally:
            await self.close()
            for worker in workers:
                with contextlib.suppress(asyncio.CancelledError):
                    await worker

    async def close(self) -> None:
        """Stop taking requests and finish those in flight."""
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.index is not None:
            self.index.close()

    # -- requests -------------------------------------------------------------------------

    async def _received(self, msg: Msg) -> None:
        task = asyncio.create_task(self._serve(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, msg: Msg) -> None:
        # a heartbeat only waits for its tick: it never queues behind views and reports,
        # so a busy replica does not let leases run out
        heartbeat = msg.subject.endswith(".heartbeat")
        async with contextlib.nullcontext() if heartbeat else self._slots:
            verb, outcome, reply = await self.answer(msg.subject, msg.headers, msg.data)
        NODE_REQUESTS.labels(verb=verb, outcome=outcome).inc()
        if not msg.reply:
            return
        for data, headers in split(reply, self.nc.max_payload) or [(_too_large(), None)]:
            with contextlib.suppress(nats.errors.Error):
                await self.nc.publish(msg.reply, data, headers=headers)

    async def answer(
        self, subject: str, headers: dict[str, str] | None, data: bytes
    ) -> tuple[str, str, bytes]:
        """A request on ``subject``: its verb, its outcome and its encoded :class:`Reply`."""
        asked = self.names.node_of_request(subject)
        verb = asked[1] if asked is not None and asked[1] in VERBS else "unknown"
        try:
            if asked is None:
                raise _Refused("invalid", f"{subject} is not a node request subject")
            node = self._caller(asked[0], headers)
            handler = self._handlers().get(asked[1])
            if handler is None:
                raise _Refused("invalid", f"no verb {asked[1]!r} (lease, heartbeat, view, report)")
            answer = await handler(node, data)
        except _Refused as refused:
            return verb, refused.refusal.code, encode(Reply[Any](refusal=refused.refusal))
        except Exception as exc:
            code, message, current = _refusal_of(exc)
            if code == "internal":
                log.exception("node request on %s failed", subject)
            refusal_ = Refusal(code=code, message=message, current=current)
            return verb, code, encode(Reply[Any](refusal=refusal_))
        return verb, "ok", answer

    def _handlers(self) -> dict[str, Callable[[str, bytes], Awaitable[bytes]]]:
        return {
            "lease": self.lease,
            "heartbeat": self.heartbeat,
            "view": self.view,
            "report": self.report,
            "consumer": self.consumer,
        }

    def _caller(self, node: str, headers: dict[str, str] | None) -> str:
        """The node the request may act for: the subject's, if the broker vouches for it."""
        if not self.authenticated:
            return node
        sender = agent_of_request(headers, self._known)
        if sender is None:
            raise _Refused("forbidden", "the request carries no node agent's identity")
        if sender != node:
            raise _Refused(
                "forbidden", f"the agent of node {sender!r} may not ask for node {node!r}"
            )
        return node

    @staticmethod
    def _decode(data: bytes, kind: type[_T]) -> _T:
        try:
            return decode(data, kind)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _Refused("invalid", f"{kind.__name__}: {exc}") from None

    # -- lease and heartbeat -------------------------------------------------------------

    async def lease(self, node: str, data: bytes) -> bytes:
        """Take the node's next lease; (re)create its consumer."""
        ask = self._decode(data, LeaseAsk)
        if ask.ttl_ms <= 0:
            raise _Refused("invalid", "ttl_ms: must be positive")
        await self.ensure_consumer(node)  # first: a lease without its consumer is no use
        state = await self.live.fresh(SEEN)
        before = state.nodes.get(node)
        previous = before.boot_id if before is not None else ""
        epoch, position = await leases.acquire(
            self.store, node, boot_id=ask.boot_id, ttl_ms=ask.ttl_ms, enforcement=ask.enforcement
        )
        return encode(
            Reply(answer=Leased(epoch=epoch, previous_boot_id=previous, position=position))
        )

    async def ensure_consumer(self, node: str) -> None:
        """Create (or update) the node's durable consumer ``agent-<node>``; a broker that
        will not (away, its stream missing or full) is an outage for the agent: it asks
        again."""
        try:
            await self.js.add_consumer(self.names.stream, durable_config(durable(self.names, node)))
        except (nats.errors.Error, OSError) as exc:
            raise self._no_consumer(node, exc) from exc

    def _no_consumer(self, node: str, exc: BaseException) -> RetryableError:
        failure = map_bus_error(exc, subject=self.names.node_filter(node))
        log.warning("consumer of node %s not made: %s", node, failure)
        return RetryableError(f"the node's consumer cannot be made now: {failure}")

    async def consumer(self, node: str, data: bytes) -> bytes:
        """Create the node's durable again if the broker lost it (the agent found it
        missing); one log line when it does."""
        self._decode(data, ConsumerAsk)
        try:
            created = await ensure_durables(
                self.js, self.names, [durable(self.names, node)], look=self._look
            )
        except (nats.errors.Error, OSError) as exc:
            raise self._no_consumer(node, exc) from exc
        return encode(Reply(answer=Consumed(created=created > 0)))

    async def heartbeat(self, node: str, data: bytes) -> bytes:
        """Renew the lease with this tick's other beats."""
        beat = self._decode(data, Heartbeat)
        held = await self.renewals.beat(node, beat.epoch)
        return encode(Reply(answer=Beat(held=held)))

    # -- view -----------------------------------------------------------------------------

    async def view(self, node: str, data: bytes) -> bytes:
        """Confirm the agent's messages and answer a view for its decision."""
        ask = self._decode(data, ViewAsk)
        confirmed, unconfirmed = await self._confirm(node, ask.messages)
        confirmed, refused = await self._unrefused(confirmed)
        for event_id in ask.undecodable:
            if await self._refused_undecodable(event_id):
                refused.append(event_id)
            else:
                unconfirmed.append(event_id)
        handled = await self._handled(node, ask.redelivered, confirmed)
        positions = [env.position for env in confirmed]
        state = await self.live.fresh(SEEN, ask.at_least, *positions)
        index = self.index
        assert index is not None
        claims: list[ClaimKey] = list(ask.claims)
        shares: list[str] = list(ask.shares)
        for env in confirmed:
            for t in meaning(env.event):
                match t:
                    case ClaimBound():
                        claims.append((t.namespace, t.name))
                        shares += t.share_ids
                    case ClaimReleasing():
                        claims.append((t.namespace, t.name))
        if ask.retries:
            shares += index.retrying(state, node)
        what = Scope(claims=tuple(claims), shares=tuple(shares), node=ask.node)
        async with self.live.frozen() as state:
            cut = scope(
                state,
                node,
                what,
                devices=index.devices.get(node, ()) if ask.node else (),
                slices=index.slices.get(node, ()) if ask.node else (),
            )
            streams = [node_stream(node)]
            streams += [claim_stream(*key) for key, claim in cut.claims if claim.node == node]
            cut.versions = {s: await self.live.stream_version(s) for s in streams}
            view = encode_view(cut)
            next_retry = index.next_retry(state, node)
        viewed = Viewed(
            view=msgspec.Raw(view),
            unconfirmed=unconfirmed,
            handled=sorted(handled),
            refused=refused,
            next_retry_at=next_retry,
        )
        return encode(Reply(answer=viewed))

    async def _confirm(
        self, node: str, messages: Sequence[Envelope]
    ) -> tuple[list[Envelope], list[str]]:
        """The messages the log holds as sent and addressed to ``node``, and the others."""
        if not messages:
            return [], []
        held = await self.confirmation.confirm(messages)
        confirmed: list[Envelope] = []
        unconfirmed: list[str] = []
        for env, ok in zip(messages, held, strict=True):
            if ok and node_of(env.event) == node:
                confirmed.append(env)
            else:
                unconfirmed.append(env.event_id)
        return confirmed, unconfirmed

    async def _unrefused(self, confirmed: list[Envelope]) -> tuple[list[Envelope], list[str]]:
        """``confirmed`` less the events the fold refused, and the ids of those (their
        messages are acknowledged unhandled: :mod:`services.runtime.delivery.confirming`)."""
        reasons = await self.confirmation.refused(confirmed)
        kept = [env for env, reason in zip(confirmed, reasons, strict=True) if reason is None]
        refused = [env.event_id for env, r in zip(confirmed, reasons, strict=True) if r]
        return kept, refused

    async def _refused_undecodable(self, event_id: str) -> bool:
        """Whether a message that did not decode is an event of the log the fold's driver
        refuses too (counted and logged once); else the log does not hold it as sent."""
        found = await self.confirmation.undecodable(event_id)
        if found is None:
            return False
        note(found[0], event_id, found[1])
        return True

    async def _handled(
        self, node: str, redelivered: Sequence[str], confirmed: Sequence[Envelope]
    ) -> set[str]:
        """Which of the redelivered (confirmed) messages the node's consumer recorded."""
        ids = {env.event_id for env in confirmed} & set(redelivered)
        if not ids:
            return set()
        rows = await self.store.pool.fetch(HANDLED_BEFORE, consumer_name(node), sorted(ids))
        return {row[0] for row in rows}

    # -- report ---------------------------------------------------------------------------

    async def report(self, node: str, data: bytes) -> bytes:
        """Check the agent's events and append them (see the module docstring)."""
        report = self._decode(data, Report)
        decoded = [(b, self._events(b.stream, b.events)) for b in report.batches]
        for event_id in report.processed:
            _require_uuid(event_id)
        state = await self.live.fresh(SEEN, report.at_least)
        held = state.nodes.get(node)
        if held is None or held.lease != "live" or held.lease_epoch != report.epoch:
            current = held.lease_epoch if held is not None else 0
            raise _Refused(
                "stale_epoch",
                f"node {node}: lease epoch {report.epoch} is not its live lease "
                f"(epoch {current}, {held.lease if held is not None else 'none'})",
                current,
            )
        events: list[Event] = []
        for batch, batch_events in decoded:
            if not batch_events:
                why = version_check_refusal(state, node, batch.stream)
                if why is not None:
                    raise _Refused("forbidden", why)
            for event in batch_events:
                refused = refusal(state, node, batch.stream, event)
                if refused is not None:
                    raise _Refused(*refused)
            events += batch_events
        self._trial(state, node, events)
        batches = [
            Batch(
                b.stream,
                b.expected_version,
                evs,
                [Cause(c.correlation_id, c.causation_id) for c in b.causes]
                if b.causes is not None
                else None,
            )
            for b, evs in decoded
        ]
        processed = (
            Processed(consumer_name(node), list(report.processed)) if report.processed else None
        )
        stored = await self.store.append_many(
            batches, Metadata(actor=str(Actor.agent(node, report.epoch))), processed=processed
        )
        if not stored and processed is not None:
            await self._mark(processed)
        retry = self.index.next_retry(self.live.state, node) if self.index is not None else None
        retry = _earliest(retry, *(e.retry_at for e in events if isinstance(e, LimitFailed)))
        position = stored[-1].position if stored else 0
        return encode(Reply(answer=Reported(position=position, next_retry_at=retry)))

    def _events(self, stream: str, raws: Sequence[msgspec.Raw]) -> list[Event]:
        events: list[Event] = []
        for i, raw in enumerate(raws):
            try:
                events.append(decode_event(bytes(raw)))
            except CatalogError as exc:
                raise _Refused("invalid", f"stream {stream!r}, event {i}: {exc}") from None
        return events

    def _trial(self, state: ClusterState, node: str, events: Sequence[Event]) -> None:
        """Fold the share reports on a copy of what they touch; a refusal is a conflict."""
        touched = shares_of(events)
        if not touched:
            return
        keys = tuple({state.shares[s].claim for s in touched if s in state.shares})
        trial = decode_view(
            encode_view(scope(state, node, Scope(claims=keys, shares=tuple(touched))))
        ).state()
        for event in events:
            if not isinstance(event, SHARE_REPORTS):
                continue
            try:
                apply_event(trial, event, 0)
            except InvariantViolation as exc:
                raise _Refused("conflict", f"the log refuses it now: {exc}") from None
            except KeyError as exc:  # something the cut does not hold: the database decides
                log.debug("node %s: report not tried on the fold (%r)", node, exc)
                return

    async def _mark(self, processed: Processed) -> None:
        """Record messages handled without events (a dead letter that wrote nothing)."""
        await self.store.pool.execute(
            "INSERT INTO processed_messages (consumer, event_id) "
            "SELECT $1, unnest($2::uuid[]) ON CONFLICT DO NOTHING",
            processed.consumer,
            processed.event_ids,
        )


def _require_uuid(value: str) -> None:
    try:
        uuid.UUID(value)
    except ValueError:
        raise _Refused("invalid", f"processed: {value!r} is not an event id") from None


def _earliest(*times: datetime.datetime | None) -> datetime.datetime | None:
    return min((t for t in times if t is not None), default=None)


def _refusal_of(exc: BaseException) -> tuple[RefusalCode, str, int]:
    """The refusal a failure of the service's own work is answered with."""
    if isinstance(exc, StaleEpoch):
        return "stale_epoch", str(exc), exc.current
    if isinstance(exc, ConflictError):
        return "conflict", str(exc), 0
    if isinstance(exc, NodeScopeViolation):
        return "forbidden", str(exc), 0
    if isinstance(exc, InvalidEvent):
        return "invalid", str(exc), 0
    if is_outage(exc):
        return "unavailable", str(exc), 0
    if isinstance(exc, PermanentError):
        return "invalid", str(exc), 0
    return "internal", f"{type(exc).__name__}: {exc}", 0


def _too_large() -> bytes:
    message = "the answer is larger than one reply may carry; ask for less"
    return encode(Reply[Any](refusal=Refusal(code="invalid", message=message)))
