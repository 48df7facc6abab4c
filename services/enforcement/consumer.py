"""The node agent's durable consumer, with no database: pull, hand over in groups, acknowledge.

The node's events reach its agent through the durable JetStream consumer
``agent-<node>`` (filter ``names.node_filter(node)``), which the enforcement service
creates when the agent takes its lease; the agent's credential may only pull from it
(``$JS.API.CONSUMER.MSG.NEXT``) and acknowledge its messages (``$JS.ACK``).
:class:`NodeConsumer` keeps pull requests outstanding
(:class:`~services.runtime.delivery.pulling.Puller`) and hands what arrived to the agent in
groups, as :class:`services.runtime.delivery.consuming.Consumer` does for the services, but
everything that needs the log goes through the agent's handler and the enforcement
service:

* each message is decoded; one that does not decode is looked up by its id through
  the service (``undecodable``): the event of the log the fold refuses as well is
  acknowledged unhandled (every reader skips it, :mod:`events.folding`), anything else
  is terminated and counted as unconfirmed. Messages the agent does not act on
  (``wants``) are acknowledged at once;
* the handler gets the group with each message's delivery count; it asks the service to
  confirm the messages against the log and to say which redelivered ones were handled
  before (exactly once: the service appends the agent's events with the
  ``processed_messages`` rows of this consumer), decides, enforces, reports, and
  returns the ids the log does not hold as sent — those are terminated and counted
  (``dracap_unconfirmed_messages_total``), the others acknowledged;
* with ``stages`` (the agent: :class:`Stages`) a group is handled in two steps — view,
  decide and enforce (``stage``), then report (``land``, which sends the report and
  leaves a coroutine to wait for the answer) — and when more messages are already
  waiting as a report goes out (a backlog), they are staged while it is in flight: one
  report at a time, in order, each group's messages settled once its report is
  answered, all under ``hold()`` (the agent's lease and writer), which the run gives
  back as soon as nothing waits or another path of the agent waits for its writer
  (``going``). Without a backlog nothing is staged beside a report: what arrives
  meanwhile makes one group after it, so groups stay as large as before and the
  requests per message as few. A group staged beside a report that failed is not
  reported: both are handled again message by message, after the run;
* a group that fails is handled again message by message; a message that fails is
  nak'd with back-off, and on its ``max_deliver``-th delivery it is dead-lettered
  (``MessageDeadLettered``, reported like any other event, with the message recorded
  as handled) and terminated. A failure that says the service cannot be reached
  (:class:`~services.runtime.ground.errors.RetryableError`) is an outage: the message waits
  with the longest back-off and the try does not count.

The pull requests go to the API prefix of the agent's account (``JS.API`` across the
broker's imports, :data:`~services.runtime.bus.credentials.JS_API_PREFIX`; ``$JS.API`` on
an open broker). When they find nobody to answer (``503``: the broker lost its store, and
the durable with it), the consumer asks its owner, the enforcement service, to create it
again (``missing``), then pulls on.

Delivery is at least once, the effects exactly once, as for every consumer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Final, Protocol

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import Header

from events.envelopes import Envelope
from events.errors import CatalogError
from events.eventcodec import decode_envelope
from events.subjects import BusNames
from services.enforcement.protocol import consumer_name
from services.runtime.bus.jetstream import Durable
from services.runtime.delivery.pulling import MAX_EXPIRES_S, Puller
from services.runtime.ground.errors import RetryableError
from services.runtime.ground.metrics import (
    CONSUMER_REDELIVERIES,
    DEAD_LETTERS,
    UNCONFIRMED_MESSAGES,
)
from services.runtime.ground.waiting import wait_for

__all__ = ["Delivery", "NodeConsumer", "Stages", "durable"]

log = logging.getLogger("dracap.agent")

#: Event ids whose outage-failed deliveries the consumer remembers (the oldest go first).
_EXCUSED_KEPT: Final = 10_000
#: Unconfirmed messages are logged at most this often.
_WARN_EVERY_S: Final = 10.0
#: How long one pull request waits at the server for messages. A long wait costs nothing
#: (a message arrives as soon as it is stored) and a fleet of 5,000 agents then asks
#: about 250 times a second, not 5,000. No longer than a pull request may wait
#: (:data:`~services.runtime.delivery.pulling.MAX_EXPIRES_S`: the broker keeps the way back for
#: its answers a little longer).
PULL_EXPIRES_S: Final = MAX_EXPIRES_S


def durable(names: BusNames, node: str) -> Durable:
    """The durable of ``node``'s agent: the events addressed to that node (the
    enforcement service creates it: :mod:`services.durables`)."""
    return Durable(consumer_name(node), names.node_filter(node))


class Delivery(msgspec.Struct, frozen=True):
    """One message for the agent: its envelope and how often it was delivered."""

    env: Envelope
    delivery: int


#: The agent's work on a group: the ids of the messages the log does not hold as sent.
GroupHandler = Callable[[list[Delivery]], Awaitable[set[str]]]
#: Whether an undecodable message (by its id) is an event of the log the fold refuses.
Undecodable = Callable[[str], Awaitable[bool]]
#: Have the consumer's durable created again (its pull requests found nobody).
Missing = Callable[[], Awaitable[object]]
#: Record that a message was given up: (envelope, deliveries, reason).
DeadLetter = Callable[[Envelope, int, str], Awaitable[None]]


class Stages(Protocol):
    """A group handler in two steps, so that one group's report can be in flight while
    the next group is decided (see the module docstring). ``stage`` returns what
    ``land`` reports; both run while ``hold()`` is held."""

    def hold(self) -> AbstractAsyncContextManager[None]:
        """Held around a run of groups (the agent: its lease held, its writer taken)."""

    def going(self) -> bool:
        """Whether to take one more group into the run (nobody else waits for it)."""

    async def stage(self, group: list[Delivery]) -> Any:
        """View, decide and enforce ``group``; what :meth:`land` reports."""

    async def land(self, staged: Any, after: Any | None) -> Coroutine[Any, Any, set[str]]:
        """Send the report of ``staged`` (``after``: the group whose report was in flight
        while it was staged, reported since); the coroutine returned waits for the answer
        and gives the ids of messages the log does not hold as sent."""


class _Incoming(msgspec.Struct):
    msg: Msg
    env: Envelope
    delivery: int


class NodeConsumer:
    """The agent's pull consumer (see the module docstring)."""

    def __init__(
        self,
        nc: Client,
        names: BusNames,
        node: str,
        *,
        handle: GroupHandler,
        dead_letter: DeadLetter,
        wants: Callable[[Envelope], bool],
        undecodable: Undecodable | None = None,
        missing: Missing | None = None,
        stages: Stages | None = None,
        api_prefix: str = "$JS.API",
        max_deliver: int = 5,
        backoff: Sequence[float] = (0.1, 0.5, 2, 5),
        batch: int = 256,
        max_group: int = 128,
        poll_interval: float = 1.0,
        pull_expires: float = PULL_EXPIRES_S,
    ) -> None:
        if max_deliver < 1 or not backoff:
            raise ValueError("max_deliver must be at least 1 and backoff not empty")
        self._nc = nc
        self._names = names
        self.name = durable(names, node).name
        self._handle = handle
        self._dead_letter = dead_letter
        self._wants = wants
        self._undecodable = undecodable
        self._missing = missing
        self._stages = stages
        self._api_prefix = api_prefix
        self._max_deliver = max_deliver
        self._backoff = tuple(backoff)
        self._batch = batch
        self._max_group = max_group
        self._poll = poll_interval
        self._expires = pull_expires
        self._excused: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._unlogged = 0
        self._logged_at = -_WARN_EVERY_S
        self.handled = 0  #: messages handled and acknowledged
        self.ignored = 0  #: messages ``wants`` declined (acknowledged at once)
        self.unconfirmed = 0  #: messages the log does not hold as sent (terminated)
        self.dead_lettered = 0
        self.refused = 0  #: messages of events the fold refuses (acknowledged unhandled)
        for series in (CONSUMER_REDELIVERIES, DEAD_LETTERS, UNCONFIRMED_MESSAGES):
            series.labels(consumer=self.name)  # at 0 from the start
        self._pulling = False  # run() has its pull requests out
        self._durable_missing = False  # a pull found no durable; no message came since

    def detached(self) -> str | None:
        """``None`` while the consumer pulls from its durable, else why not (``/readyz``)."""
        if not self._pulling:
            return "not pulling"
        if self._durable_missing:
            return "its durable consumer is missing (the enforcement service makes it)"
        return None

    async def run(self, stop: asyncio.Event) -> None:
        """Pull and hand over until ``stop`` is set; messages not started are nak'd."""
        puller = Puller(
            self._nc,
            self._names.stream,
            self.name,
            batch=self._batch,
            expires=self._expires,
            prefix=self._api_prefix,
        )
        await puller.start()
        self._pulling = True
        try:
            while not stop.is_set():
                try:
                    msgs = await puller.next(self._poll, self._max_group)
                except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
                    log.warning("consumer %s: bus connection unavailable", self.name)
                    with contextlib.suppress(TimeoutError):
                        await wait_for(stop.wait(), self._poll)
                    continue
                if puller.missing:
                    puller.missing = False
                    self._durable_missing = True
                    await self._recreate()
                if msgs:
                    self._durable_missing = False
                    if self._stages is None:
                        await self.process(msgs)
                    else:
                        await self._run_of(puller, msgs, self._stages, stop)
        finally:
            self._pulling = False
            for msg in await puller.stop():
                await _quietly(msg.nak())  # another delivery takes it at once

    async def _recreate(self) -> None:
        """The durable is missing: ask its owner for it (logged; tried again at the next
        pull that finds nobody)."""
        if self._missing is None:
            return
        try:
            await self._missing()
        except Exception as exc:
            log.warning("consumer %s: its durable is missing and not made yet (%s)", self.name, exc)
            return
        self._durable_missing = False
        log.warning("consumer %s: its durable consumer was missing; the service made it", self.name)

    async def process(self, msgs: Sequence[Msg]) -> None:
        """Handle received messages: together where possible (see the module docstring)."""
        group = await self._sorted(msgs)
        if len(group) > 1:
            try:
                dropped = await self._handle(_deliveries(group))
            except Exception as exc:
                log.debug(
                    "consumer %s: group of %d failed (%r); one by one", self.name, len(group), exc
                )
            else:
                await self._settle(group, dropped)
                return
        for incoming in group:
            await self._one(incoming)

    async def _run_of(
        self, puller: Puller, msgs: Sequence[Msg], stages: Stages, stop: asyncio.Event
    ) -> None:
        """Handle ``msgs`` and the groups that arrive meanwhile, each decided while the
        report of the one before is in flight (see the module docstring)."""
        group = await self._sorted(msgs)
        if not group:
            return
        again: list[tuple[list[_Incoming], Exception | None]] = []  # after the run, one by one
        async with stages.hold():
            flight: tuple[list[_Incoming], Any, asyncio.Task[set[str]]] | None = None
            while True:
                staged: Any = None
                if group:
                    try:
                        staged = await stages.stage(_deliveries(group))
                    except Exception as exc:
                        again.append((group, exc))
                        group = []
                after: Any = None
                if flight is not None:
                    done, after, task = flight
                    flight = None
                    try:
                        dropped = await task
                    except Exception as exc:
                        again.insert(0, (done, exc))
                        after = None
                    else:
                        await self._settle(done, dropped)
                    if again and group:  # decided beside a report that failed: again
                        again.append((group, None))
                        group = []
                if again:
                    break
                if group:
                    try:
                        answer = await stages.land(staged, after)  # sent: on its way now
                    except Exception as exc:
                        again.append((group, exc))
                        break
                    flight = (group, staged, asyncio.create_task(answer))
                    group = []
                if flight is None:
                    break
                # a backlog: what waits now is staged beside the report; what arrives
                # while it is in flight makes the next group, as one group at a time did
                if puller.waiting and stages.going() and not stop.is_set():
                    group = await self._sorted(await puller.next(0, self._max_group))
        for incoming_group, failure in again:
            if failure is not None and len(incoming_group) == 1:
                await self._failed_one(incoming_group[0], failure)
                continue
            if failure is not None:
                log.debug(
                    "consumer %s: group of %d failed (%r); one by one",
                    self.name,
                    len(incoming_group),
                    failure,
                )
            for incoming in incoming_group:
                await self._one(incoming)

    async def _sorted(self, msgs: Sequence[Msg]) -> list[_Incoming]:
        """Decode ``msgs``; settle those the agent does not act on; the others, in order."""
        group: list[_Incoming] = []
        for msg in msgs:
            incoming = await self._decoded(msg)
            if incoming is None:
                continue
            if incoming.delivery > self._max_deliver:
                reason = f"delivered {incoming.delivery} times without an outcome"
                await self._give_up(incoming, reason)
            elif not self._wants(incoming.env):
                await _quietly(msg.ack())
                self.ignored += 1
            else:
                group.append(incoming)
        return group

    async def _decoded(self, msg: Msg) -> _Incoming | None:
        delivered = msg.metadata.num_delivered
        if delivered > 1:
            CONSUMER_REDELIVERIES.labels(consumer=self.name).inc()
        try:
            env = decode_envelope(msg.data)
        except CatalogError as exc:
            await self._not_decoded(msg, exc)
            return None
        return _Incoming(msg, env, delivered - self._excused.get(env.event_id, 0))

    async def _not_decoded(self, msg: Msg, exc: CatalogError) -> None:
        """Acknowledge a message of an event the log holds and the fold refuses; drop any
        other that does not decode (the service away: it comes back later)."""
        event_id = (msg.headers or {}).get(Header.MSG_ID.value, "")
        try:
            refused = (
                bool(event_id)
                and self._undecodable is not None
                and (await self._undecodable(event_id))
            )
        except RetryableError as failure:  # the service away: not the message's fault
            log.warning(
                "consumer %s: event %s waits for the service (%s)", self.name, event_id, failure
            )
            await _quietly(msg.nak(delay=self._backoff[-1]))
            return
        if refused:
            self.refused += 1
            await _quietly(msg.ack())
            return
        log.error("consumer %s: a message that does not decode was dropped: %s", self.name, exc)
        await _quietly(msg.term())
        self.unconfirmed += 1
        UNCONFIRMED_MESSAGES.labels(consumer=self.name).inc()

    async def _one(self, incoming: _Incoming) -> None:
        try:
            dropped = await self._handle(_deliveries([incoming]))
        except Exception as exc:
            await self._failed_one(incoming, exc)
            return
        self._excused.pop(incoming.env.event_id, None)
        await self._settle([incoming], dropped)

    async def _failed_one(self, incoming: _Incoming, exc: Exception) -> None:
        """A message handled alone failed: wait for the service, or back off and count."""
        if isinstance(exc, RetryableError):  # the service away: not the message's fault
            self._excuse(incoming, exc)
            await _quietly(incoming.msg.nak(delay=self._backoff[-1]))
            return
        await self._failed(incoming, exc)

    async def _settle(self, group: Sequence[_Incoming], dropped: set[str]) -> None:
        for incoming in group:
            if incoming.env.event_id in dropped:
                await self._drop(incoming)
            else:
                await _quietly(incoming.msg.ack())
                self.handled += 1

    def _excuse(self, incoming: _Incoming, exc: BaseException) -> None:
        event_id = incoming.env.event_id
        self._excused[event_id] = self._excused.pop(event_id, 0) + 1
        while len(self._excused) > _EXCUSED_KEPT:
            self._excused.popitem(last=False)
        log.warning("consumer %s: event %s waits for the service (%s)", self.name, event_id, exc)

    async def _failed(self, incoming: _Incoming, exc: Exception) -> None:
        if incoming.delivery >= self._max_deliver:
            await self._give_up(incoming, f"{type(exc).__name__}: {exc}")
            return
        delay = self._backoff[min(incoming.delivery, len(self._backoff)) - 1]
        log.warning(
            "consumer %s: event %s failed on delivery %d (%s: %s); retrying in %ss",
            self.name,
            incoming.env.event_id,
            incoming.delivery,
            type(exc).__name__,
            exc,
            delay,
        )
        await _quietly(incoming.msg.nak(delay=delay))

    async def _give_up(self, incoming: _Incoming, reason: str) -> None:
        """Record the dead letter, then terminate the message (nak if recording fails)."""
        try:
            await self._dead_letter(incoming.env, incoming.msg.metadata.num_delivered, reason)
        except Exception as exc:
            log.error(
                "consumer %s: could not dead-letter %s: %s", self.name, incoming.env.event_id, exc
            )
            await _quietly(incoming.msg.nak(delay=self._backoff[-1]))
            return
        await _quietly(incoming.msg.term())
        self.dead_lettered += 1
        DEAD_LETTERS.labels(consumer=self.name).inc()
        log.error(
            "consumer %s: dead-lettered event %s after %d deliveries: %s",
            self.name,
            incoming.env.event_id,
            incoming.msg.metadata.num_delivered,
            reason,
        )

    async def _drop(self, incoming: _Incoming) -> None:
        await _quietly(incoming.msg.term())
        self.unconfirmed += 1
        self._unlogged += 1
        UNCONFIRMED_MESSAGES.labels(consumer=self.name).inc()
        now = time.monotonic()
        if now - self._logged_at >= _WARN_EVERY_S:
            log.warning(
                "consumer %s: dropped %d message(s) the log does not hold as sent (latest: %s)",
                self.name,
                self._unlogged,
                incoming.env.event_id[:64],
            )
            self._logged_at = now
            self._unlogged = 0


def _deliveries(group: Sequence[_Incoming]) -> list[Delivery]:
    return [Delivery(i.env, i.delivery) for i in group]


async def _quietly(work: Awaitable[object]) -> None:
    try:
        await work
    except Exception as exc:  # the connection is going away: the ack wait redelivers
        log.debug("ack or nak failed: %r", exc)
