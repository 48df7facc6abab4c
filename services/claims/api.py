"""The tenant and admin APIs: NATS micro endpoints over the live state and the event log.

Tenant endpoints listen on ``names.api("*", op)`` = ``{prefix}.api.*.claims.{op}`` for
``op`` in ``apply``, ``get``, ``list``, ``delete``, ``watch`` and ``devices`` (the
devices of the classes the namespace may use, with only the attributes those classes
allow-list: :func:`services.claims.views.tenant_device_views`). The namespace is the
subject's third token and **only** that: a manifest's ``metadata.namespace`` may be
empty or equal to it, never different (the request is refused naming the field and
nothing is recorded). The broker's subject permissions give each tenant only its own
namespace's subjects (invariant 10); this service never trusts a namespace from a
payload.

Admin endpoints listen on ``names.admin(op)`` for ``deviceclasses.apply``,
``deviceclasses.mode``, ``deviceclasses.list``, ``deviceclasses.get``,
``deviceclasses.remove``, ``slices.apply``, ``slices.get``, ``namespaces.access``,
``namespaces.get``, ``policies.set``, ``policies.list``, ``devices.list``, ``nodes.list``,
``nodes.get`` and ``nodes.fence``. The ``*.get`` reads answer ``{"objects": [...]}``, the
objects in their Kubernetes shape (all of the kind, or the one ``{"name"}`` names:
:mod:`services.claims.kubeobjects`), what ``dracap get`` prints.

Every reply is JSON (:mod:`services.claims.views`): ``{"ok": true, ...}`` or
``{"ok": false, "error": {code, field, rule, message}}`` with code ``invalid``,
``rejected``, ``not_found`` or ``conflict``. ``docs/services.md`` lists the payloads.

Writes
------
Every write is a pure decision (:func:`services.claims.admission.decide_apply`, the
others in :mod:`services.claims.adminwrites`) on the live state, asked for with
``live.fresh(SEEN)`` (every commit this process has appended or been notified of is
folded — read-your-writes — without a read when the tailed state is already there).
Tenant writes are appended with the claim stream's expected version
(:meth:`LiveState.stream_version`), so two concurrent requests about one claim cannot
both win: the loser gets ``ConflictError``, asks for ``fresh(HEAD)`` (the winner may be
another process, not announced yet) and decides again (it then sees the winner's
claim). What is recorded:

* ``apply``: :func:`services.claims.admission.decide_apply` — ``ClaimSubmitted`` plus
  ``ClaimAdmitted`` or ``ClaimRejected``, or nothing (undecodable input, wrong
  namespace, a live claim of that name). Re-applying the same spec is a no-op.
* ``delete``: an allocated (or ready, or failed but still holding) claim gets
  ``ReleaseRequested(node=...)``, which the node agent turns into ``LimitRemoved`` +
  ``CapacityReleased``; a claim without live shares gets ``ClaimWithdrawn``; a claim
  already releasing, withdrawn or released is left alone and its phase is the answer
  (a second delete, concurrent or late, finds the caller's wish done); only a claim
  that never existed is ``not_found``.
* admin writes are last-writer-wins (no expected version) and skip objects equal to
  what the log already holds, so re-applying an inventory appends nothing.
  ``slices.apply`` is ``rejected`` when a new total is below what live shares hold on
  the device (naming device, capacity, the total asked and the amount allocated):
  decided on the live state, and the same answer when the capacity ledger's CHECK
  refuses the append because a reservation won the race.
* ``deviceclasses.mode`` records ``ClassModeSet`` (a class's mode: ``consumable``,
  ``whole-device`` or ``disabled``; :func:`services.claims.adminwrites.decide_mode`) and
  ``deviceclasses.remove`` ``DeviceClassRemoved``
  (:func:`services.claims.adminwrites.decide_remove`); neither touches an allocation:
  only claims decided afterwards follow the class's new mode or find it gone.
* ``policies.set`` records ``RequestPolicyChanged`` (one device capacity, the device's
  next policy version: :func:`services.claims.adminwrites.decide_policy`), appended
  with the device stream's expected version like a tenant write, so a reservation
  committed meanwhile makes it decide again on the fresh state.
* ``nodes.fence`` records ``NodeFenced`` at the node's newest epoch with the
  operator's reason (:func:`services.claims.adminwrites.decide_fence`), appended to the
  node's ``lease:<node>`` stream at the version read: the fold and the store's
  ``fence`` guard release the node's live shares in that same append, and every later
  append of that epoch is refused. ``nodes.list`` / ``nodes.get`` read the fold and
  ``node_leases`` (lease age, epoch, boot id, taints, unknown shares).

:mod:`services.claims.adminwrites` holds the rules of delete and the admin writes.

Requests are served concurrently (a task per request, at most ``concurrency`` at a
time); decisions serialise only on the live state's lock, and the tenant writes of
concurrent requests are committed together (:mod:`services.runtime.committing`), each
still with its own stream's expected version.

Watch
-----
``watch`` replies with a subject: ``{prefix}.watch.{namespace}.{name}`` for one claim,
``{prefix}.watch.{namespace}.>`` for all claims of the namespace. The API publishes a
claim's :class:`~services.claims.views.ClaimView` JSON there (core NATS, no
persistence) each time an event changes the claim or one of its shares. Watches cost
nothing on the server side (no registration, nothing to expire); a watcher reads the
current view with ``get`` after subscribing. Publication is driven by the live state,
so the live state must be tailed (``LiveState.run``; ``ClaimsApi(tail=True)`` does it
itself). Several API instances each publish every change (a watcher may see
duplicates; views are idempotent).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

import msgspec
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import Service

from events import model
from events.actors import Actor
from events.catalog import (
    Envelope,
    Event,
    claim_stream,
    device_stream,
    lease_stream,
    stream_of,
)
from events.errors import ValidationError
from events.features import DEFAULT_GATES, FeatureGates
from events.fold import ClaimKey, ClaimState, ClusterState
from events.inventory import build_inventory
from events.manifests import load_documents
from events.model import DeviceClass, Manifest, ResourceSlice, describe_policy
from events.nesting import MAX_MANIFEST_DEPTH, depth_rule, too_deep
from events.selectors import INLINE_COMPILE_CHARS, is_checked, record_verdict
from events.subjects import BusNames
from events.tenancy import NamespacePolicy, check_policy
from events.validation import DNS_SUBDOMAIN_RULE, is_dns_subdomain
from services.claims.adminwrites import (
    AdminWrite,
    ClassMode,
    ClassRemoval,
    NodeFence,
    PolicyChange,
    Reservation,
    access_classes,
    decide_access,
    decide_classes,
    decide_delete,
    decide_fence,
    decide_mode,
    decide_policy,
    decide_remove,
    decide_reservation,
    decide_slices,
    ledger_refusal,
)
from services.claims.admission import (
    MAX_MANIFEST_BYTES,
    REJECTION_REASONS,
    ApplyDecision,
    DeviceLimits,
    Refusal,
    decide_apply,
    read_claim,
    selector_expressions,
)
from services.claims.kubeobjects import (
    class_objects,
    namespace_objects,
    resource_claim_object,
    slice_objects,
)
from services.claims.views import (
    ClaimsTouched,
    ClaimView,
    LeaseRow,
    claim_view,
    class_views,
    device_views,
    node_views,
    policy_views,
    tenant_device_views,
)
from services.runtime import recorded
from services.runtime.committing import GroupCommitter
from services.runtime.credentials import Directory
from services.runtime.errors import CapacityExceeded, ConflictError, RetryableError
from services.runtime.eventstore import Batch, EventStore, Metadata
from services.runtime.livestate import HEAD, SEEN, LiveState
from services.runtime.metrics import CLAIMS, REJECTIONS
from services.runtime.outages import is_unreachable, one_line
from services.runtime.queries import (
    admin_caller,
    error_reply,
    ok_reply,
    send_reply,
    tenant_caller,
)
from services.runtime.selectorpool import SelectorPool

__all__ = ["ADMIN_OPS", "TENANT_OPS", "ClaimsApi"]

#: The lease rows, their ages by the database's clock (``nodes.list``).
_LEASES: Final = """
SELECT node, epoch, boot_id, ttl_ms,
       extract(epoch FROM clock_timestamp() - renewed_at)::float8 AS renewed_ago_s,
       extract(epoch FROM expires_at - clock_timestamp())::float8 AS expires_in_s
  FROM node_leases
"""


class NodeName(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A ``nodes.get`` request."""

    node: str


log = logging.getLogger("dracap.claims")

TENANT_OPS: Final = (
    "apply",
    "get",
    "list",
    "delete",
    "watch",
    "devices",
    "reserve",
    "unreserve",
)
#: Applies of one namespace that may wait for the selector pool at once (see apply).
CHECKS_PER_NAMESPACE: Final = 4
ADMIN_OPS: Final = (
    "deviceclasses.apply",
    "deviceclasses.mode",
    "deviceclasses.list",
    "deviceclasses.get",
    "deviceclasses.remove",
    "slices.apply",
    "slices.get",
    "namespaces.access",
    "namespaces.get",
    "policies.set",
    "policies.list",
    "devices.list",
    "nodes.list",
    "nodes.get",
    "nodes.fence",
)
_HIDDEN_FROM_LIST: Final = frozenset({"withdrawn", "released"})


class _NameRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str


class _WatchRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str | None = None


class _ListRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    objects: bool = False  #: also each claim as a ResourceClaim (``dracap get -o yaml``)


class _ObjectsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str | None = None  #: one object; none: every object of the kind


class _InvalidRequestError(Exception):
    """A request payload that cannot be used; becomes an ``invalid`` reply."""

    def __init__(self, field: str | None, rule: str, detail: str = "") -> None:
        super().__init__(rule)
        self.field = field
        self.rule = rule
        self.detail = detail


def _invalid_reply(exc: _InvalidRequestError) -> bytes:
    where = f"{exc.field}: " if exc.field else ""
    message = f"{where}{exc.rule}" + (f" ({exc.detail})" if exc.detail else "")
    return error_reply("invalid", message, field=exc.field, rule=exc.rule)


def _refusal_reply(refusal: Refusal) -> bytes:
    return error_reply(refusal.code, refusal.message, field=refusal.field, rule=refusal.rule)


_TenantOperation = Callable[[str, bytes, Actor], Awaitable[bytes]]
_AdminOperation = Callable[[bytes, Actor], Awaitable[bytes]]


async def _done(reply: bytes) -> bytes:
    return reply


def _decode(data: bytes, typ: type[Any]) -> Any:
    deep = too_deep(data, MAX_MANIFEST_DEPTH)  # before msgspec recurses into it
    if deep is not None:
        raise _InvalidRequestError(deep, depth_rule(MAX_MANIFEST_DEPTH))
    try:
        return msgspec.json.decode(data or b"{}", type=typ, dec_hook=model.decode_hook)
    except msgspec.ValidationError as exc:
        raise _InvalidRequestError(_field_of(str(exc)), str(exc)) from None
    except msgspec.DecodeError as exc:
        raise _InvalidRequestError(None, f"the request must be a JSON object: {exc}") from None


def _field_of(message: str) -> str | None:
    if "`$." in message:
        return message.split("`$.", 1)[1].split("`", 1)[0]
    if "field `" in message:
        return message.split("field `", 1)[1].split("`", 1)[0]
    return None


class ClaimsApi:
    """The tenant and admin endpoints of one API instance (see the module docstring)."""

    def __init__(
        self,
        store: EventStore,
        live: LiveState,
        nc: Client,
        names: BusNames,
        *,
        gates: FeatureGates = DEFAULT_GATES,
        directory: Directory | None = None,
        authenticated: bool = False,
        max_attempts: int = 8,
        concurrency: int = 256,
        tail: bool = False,
        selectors: SelectorPool | None = None,
    ) -> None:
        self.store = store
        #: where tenants' long selector expressions are compiled (not on this loop); at the
        #: usual priority: a compile is bounded (10 KiB, 2 s) and the tenant waits for it
        self.selectors = selectors if selectors is not None else SelectorPool(niceness=0)
        self.live = live
        self.nc = nc
        self.names = names
        self.gates = gates
        #: requests must carry the broker's identity (a broker with accounts); without,
        #: every request is anonymous (``dracap up --insecure``)
        self.authenticated = authenticated
        self.directory = directory
        self._known = directory.index() if directory is not None else {}  # by public key
        self.max_attempts = max_attempts
        self.tail = tail
        self._slots = asyncio.Semaphore(concurrency)
        self._checking: collections.Counter[str] = collections.Counter()  # by namespace
        #: per namespace, the claims admitted here whose append may not be folded yet
        self._admitting: dict[str, set[str]] = {}
        self._committer = GroupCommitter(store, str(Actor.system("claims-api")))
        self._tasks: set[asyncio.Task[None]] = set()
        self._service: Service | None = None
        self._limits: tuple[int, DeviceLimits] | None = None
        self._dirty: dict[ClaimKey, None] = {}
        self._wake = asyncio.Event()
        self._touched = ClaimsTouched(live.state)
        #: the claims of each namespace (what ``claims.list`` walks), kept as they come
        self._names: dict[str, set[str]] = {}
        for namespace, name in live.state.claims:
            self._names.setdefault(namespace, set()).add(name)
        self._unsubscribe = live.subscribe(self._changed)

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Register the micro service and its endpoints (idempotent)."""
        if self._service is not None:
            return
        for reason in REJECTION_REASONS:  # each at 0 from the start
            REJECTIONS.labels(reason=reason)
        service = await add_service(
            self.nc,
            name=f"{self.names.prefix}-claims",
            version="0.1.0",
            description="dracap claims and admin API",
            queue_group=f"{self.names.prefix}-claims",
        )
        tenant: dict[str, _TenantOperation] = {
            "apply": self.apply,
            "get": self.get,
            "list": self.list_claims,
            "delete": self.delete,
            "watch": self.watch,
            "devices": self.list_devices_of,
            "reserve": self.reserve,
            "unreserve": self.unreserve,
        }
        for op, fn in tenant.items():
            await service.add_endpoint(
                name=f"claims-{op}", subject=self.names.api("*", op), handler=self._tenant(fn)
            )
        admin: dict[str, _AdminOperation] = {
            "deviceclasses.apply": self.apply_classes,
            "deviceclasses.mode": self.set_class_mode,
            "deviceclasses.list": self.list_classes,
            "deviceclasses.get": self.get_classes,
            "deviceclasses.remove": self.remove_class,
            "slices.apply": self.apply_slices,
            "slices.get": self.get_slices,
            "namespaces.access": self.set_access,
            "namespaces.get": self.get_namespaces,
            "policies.set": self.set_policy,
            "policies.list": self.list_policies,
            "devices.list": self.list_devices,
            "nodes.list": self.list_nodes,
            "nodes.get": self.get_node,
            "nodes.fence": self.fence_node,
        }
        for op, afn in admin.items():
            await service.add_endpoint(
                name=f"admin-{op.replace('.', '-')}",
                subject=self.names.admin(op),
                handler=self._admin(afn),
            )
        await self.nc.flush()
        self._service = service

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set: publish watch views (and tail, with ``tail``)."""
        await self.start()
        workers = [asyncio.ensure_future(self._publish_changes(stop))]
        if self.tail:
            workers.append(asyncio.ensure_future(self.live.run(stop)))
        try:
            await stop.wait()
        finally:
            self._wake.set()
            await self.close()
            for worker in workers:
                with contextlib.suppress(asyncio.CancelledError):
                    await worker

    async def close(self) -> None:
        """Stop the endpoints and finish the requests in flight."""
        if self._service is not None:
            await self._service.stop()
            self._service = None
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._committer.close()
        await self.selectors.close()
        self._unsubscribe()

    # -- request plumbing ---------------------------------------------------------------

    def _spawn(self, request: Request, work: Callable[[], Awaitable[bytes]]) -> None:
        async def serve() -> None:
            async with self._slots:
                try:
                    reply = await work()
                except _InvalidRequestError as exc:
                    reply = _invalid_reply(exc)
                except Exception as exc:
                    if isinstance(exc, RetryableError) or is_unreachable(exc):
                        # a server stayed away (past a failover's deadline): the caller
                        # may try again; not a bug, so no traceback
                        log.warning("request on %s failed: %s", request.subject, one_line(exc))
                        reply = error_reply("unavailable", f"try again: {one_line(exc)}")
                    else:
                        log.exception("request on %s failed", request.subject)
                        reply = error_reply("internal", f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(Exception):
                    await send_reply(request, reply, self.nc.max_payload)

        task = asyncio.create_task(serve())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _tenant(self, fn: _TenantOperation) -> Callable[[Request], Any]:
        async def handler(request: Request) -> None:
            namespace, caller, refusal = tenant_caller(
                request, self._known, authenticated=self.authenticated
            )
            if refusal is not None:
                self._spawn(request, lambda: _done(refusal))
                return
            assert caller is not None
            actor = caller
            self._spawn(request, lambda: fn(namespace, request.data, actor))

        return handler

    def _admin(self, fn: _AdminOperation) -> Callable[[Request], Any]:
        async def handler(request: Request) -> None:
            caller, refusal = admin_caller(request, self._known, authenticated=self.authenticated)
            if refusal is not None:
                self._spawn(request, lambda: _done(refusal))
                return
            assert caller is not None
            actor = caller
            self._spawn(request, lambda: fn(request.data, actor))

        return handler

    def _device_limits(self, state: ClusterState) -> DeviceLimits:
        generation = self.live.inventory_generation
        if self._limits is None or self._limits[0] != generation:
            self._limits = (generation, DeviceLimits(build_inventory(state, self.gates)))
        return self._limits[1]

    async def _append(
        self, stream: str, version: int | None, events: list[Event], actor: Actor
    ) -> None:
        await self._committer.append(stream, version, events, actor=str(actor))

    async def _fresh(self, attempt: int) -> None:
        """Before a decision: what is known first, the whole log after a conflict."""
        # after a conflict the winner may be another process, not announced yet
        await self.live.fresh(HEAD if attempt else SEEN)

    # -- tenant operations --------------------------------------------------------------

    async def apply(self, namespace: str, data: bytes, actor: Actor | None = None) -> bytes:
        """``claims.apply``: admit or reject a ResourceClaim manifest."""
        actor = actor or Actor.anonymous(namespace)
        busy = await self._check_selectors(namespace, data)
        if busy is not None:
            return busy
        for attempt in range(self.max_attempts):
            await self._fresh(attempt)
            async with self.live.frozen() as state:
                decision = decide_apply(
                    state,
                    namespace,
                    data,
                    self.gates,
                    limits=self._device_limits(state),
                    admitting=self._admitting.get(namespace, ()),
                )
                held = self._hold(namespace, decision)  # before any await: the quota sees it
                stream = claim_stream(namespace, decision.name or "")
                version = await self.live.stream_version(stream) if decision.events else 0
            try:
                reply = await self._record_apply(namespace, decision, stream, version, actor)
            finally:
                if held is not None:
                    self._unhold(namespace, held)
            if reply is not None:
                return reply
        return error_reply("conflict", "the claim kept changing while it was applied; retry")

    def _hold(self, namespace: str, decision: ApplyDecision) -> str | None:
        """Count an admitted claim against the quota until its append is folded."""
        name = decision.name
        admitting = self._admitting.setdefault(namespace, set())
        if decision.refusal is not None or name is None or name in admitting:
            if not admitting:
                del self._admitting[namespace]
            return None
        admitting.add(name)
        return name

    def _unhold(self, namespace: str, name: str) -> None:
        admitting = self._admitting.get(namespace)
        if admitting is not None:
            admitting.discard(name)
            if not admitting:
                del self._admitting[namespace]

    async def _record_apply(
        self, namespace: str, decision: ApplyDecision, stream: str, version: int, actor: Actor
    ) -> bytes | None:
        """Append an apply's decision and reply; ``None``: it lost a race, decide again."""
        if decision.events:
            try:
                await self._append(stream, version, list(decision.events), actor)
            except ConflictError:
                return None
            self._count(decision.refusal)
        elif decision.refusal is not None:
            REJECTIONS.labels(reason=decision.refusal.kind).inc()
        if decision.refusal is not None:
            return _refusal_reply(decision.refusal)
        assert decision.name is not None
        state = await self.live.fresh(SEEN)
        claim = state.claim(namespace, decision.name)
        assert claim is not None
        (view,) = await self._views(state, [claim])
        return ok_reply(claim=view)

    async def _check_selectors(self, namespace: str, data: bytes) -> bytes | None:
        """Have the claim's long selector expressions compiled in the pool, off this loop.

        Admission then takes the pool's verdicts (:func:`events.selectors.record_verdict`)
        instead of parsing them here: 10 KiB of CEL costs cel-python half a second. A
        namespace may have :data:`CHECKS_PER_NAMESPACE` applies waiting for the pool;
        one more is answered ``conflict`` (retry) at once, so that one tenant's applies
        cannot take every request slot of the API while they wait. Returns that reply.
        """
        if b"expression" not in data:
            return None
        claim = read_claim(data, namespace)
        if isinstance(claim, Refusal):
            return None  # admission refuses it again, without reaching the selectors
        flag = self.gates.consumable_capacity
        long = [
            e
            for e in selector_expressions(claim)
            if len(e) > INLINE_COMPILE_CHARS and not is_checked(e, consumable_capacity=flag)
        ]
        if not long:
            return None
        if self._checking[namespace] >= CHECKS_PER_NAMESPACE:
            return error_reply(
                "conflict",
                f"namespace {namespace!r} has {CHECKS_PER_NAMESPACE} claims whose selectors "
                "are being compiled; retry when they are done",
                rule=f"at most {CHECKS_PER_NAMESPACE} applies with long selectors in flight",
            )
        self._checking[namespace] += 1
        try:
            verdicts = await self.selectors.check(long, owner=namespace, consumable_capacity=flag)
        finally:
            self._checking[namespace] -= 1
            if not self._checking[namespace]:
                del self._checking[namespace]
        for expression, problem in verdicts.items():
            record_verdict(expression, problem, consumable_capacity=flag)
        return None

    @staticmethod
    def _count(refusal: Refusal | None) -> None:
        if refusal is None:
            CLAIMS.labels(outcome="admitted").inc()
        else:
            CLAIMS.labels(outcome="rejected").inc()
            REJECTIONS.labels(reason=refusal.kind).inc()

    async def get(self, namespace: str, data: bytes, actor: Actor | None = None) -> bytes:
        """``claims.get``: the view of one claim, and the claim as a ResourceClaim."""
        request: _NameRequest = _decode(data, _NameRequest)
        await self.live.fresh(SEEN)
        # held still while the log is read: the manifest read is the one this state folded
        async with self.live.frozen() as state:
            claim = state.claim(namespace, request.name)
            if claim is None:
                return _not_found(namespace, request.name)
            key = (namespace, request.name)
            manifests = await recorded.manifests(self.store.pool, [key], state.position)
            whole = await recorded.allocations(self.store.pool, [claim])
            allocation = whole.get(claim.bound_position)
            view = claim_view(state, claim, allocation)
            now = datetime.datetime.now(datetime.UTC)
            resource = resource_claim_object(
                state,
                claim,
                msgspec.to_builtins(view),
                now,
                recorded=manifests.get(key),
                allocation=allocation,
            )
        return ok_reply(claim=view, object=resource)

    async def list_claims(self, namespace: str, data: bytes, actor: Actor | None = None) -> bytes:
        """``claims.list``: every claim of the namespace that is not gone (with
        ``{"objects": true}`` also each as a ResourceClaim)."""
        request: _ListRequest = _decode(data, _ListRequest)
        state = await self.live.fresh(SEEN)
        if not request.objects:
            return ok_reply(claims=await self._views(state, self._listed(state, namespace)))
        # held still while the log is read: the manifests read are the ones it folded
        async with self.live.frozen() as held:
            claims = self._listed(held, namespace)
            keys = [(c.namespace, c.name) for c in claims]
            manifests = await recorded.manifests(self.store.pool, keys, held.position)
            whole = await recorded.allocations(self.store.pool, claims)
            now = datetime.datetime.now(datetime.UTC)
            views, objects = [], []
            for claim in claims:
                allocation = whole.get(claim.bound_position)
                view = claim_view(held, claim, allocation)
                views.append(view)
                objects.append(
                    resource_claim_object(
                        held,
                        claim,
                        msgspec.to_builtins(view),
                        now,
                        recorded=manifests.get((claim.namespace, claim.name)),
                        allocation=allocation,
                    )
                )
        return ok_reply(claims=views, objects=objects)

    def _listed(self, state: ClusterState, namespace: str) -> list[ClaimState]:
        """The namespace's claims a list shows (not gone), by name."""
        names = sorted(self._names.get(namespace, ()))
        found = (state.claims.get((namespace, n)) for n in names)
        return [c for c in found if c is not None and c.phase not in _HIDDEN_FROM_LIST]

    async def _whole_allocations(
        self, claims: list[ClaimState | None]
    ) -> dict[int, model.AllocationResult]:
        """:func:`recorded.allocations` for the watch publisher: while the database cannot
        be reached it publishes the allocations as the fold keeps them (a later ``get``
        shows them whole)."""
        try:
            return await recorded.allocations(self.store.pool, [c for c in claims if c])
        except Exception as exc:
            if not is_unreachable(exc):
                raise
            log.warning("could not read allocations for the watch: %s", one_line(exc))
            return {}

    async def _views(self, state: ClusterState, claims: list[ClaimState]) -> list[ClaimView]:
        """The views of ``claims``, each allocation whole: the ones the fold keeps without
        their configuration are read from the log first (one query for all)."""
        whole = await recorded.allocations(self.store.pool, claims)
        return [claim_view(state, c, whole.get(c.bound_position)) for c in claims]

    async def delete(self, namespace: str, data: bytes, actor: Actor | None = None) -> bytes:
        """``claims.delete``: release an allocated claim, withdraw any other."""
        actor = actor or Actor.anonymous(namespace)
        request: _NameRequest = _decode(data, _NameRequest)
        stream = claim_stream(namespace, request.name)
        for attempt in range(self.max_attempts):
            await self._fresh(attempt)
            async with self.live.frozen() as state:
                deletion = decide_delete(state, namespace, request.name)
                event = deletion.event
                version = await self.live.stream_version(stream) if event is not None else 0
            if not deletion.found:
                return _not_found(namespace, request.name)
            if event is not None:
                try:
                    await self._append(stream, version, [event], actor)
                except ConflictError:
                    continue
            return ok_reply(phase=deletion.phase)
        return error_reply("conflict", "the claim kept changing while it was deleted; retry")

    async def reserve(self, namespace: str, data: bytes, actor: Actor | None = None) -> bytes:
        """``claims.reserve``: a consumer reserves the claim (``status.reservedFor``)."""
        return await self._reservation(namespace, data, actor, reserve=True)

    async def unreserve(self, namespace: str, data: bytes, actor: Actor | None = None) -> bytes:
        """``claims.unreserve``: a consumer gives its reservation up."""
        return await self._reservation(namespace, data, actor, reserve=False)

    async def _reservation(
        self, namespace: str, data: bytes, actor: Actor | None, *, reserve: bool
    ) -> bytes:
        who = actor or Actor.anonymous(namespace)
        request: Reservation = _decode(data, Reservation)
        stream = claim_stream(namespace, request.name)

        def reply(state: ClusterState, write: AdminWrite) -> bytes:
            claim = state.claim(namespace, request.name)
            return ok_reply(
                applied=list(write.applied),
                unchanged=list(write.unchanged),
                reserved_for=list(claim.reserved_for) if claim is not None else [],
            )

        return await self._write_at_version(
            stream,
            lambda state: decide_reservation(state, namespace, request, reserve=reserve),
            who,
            "the claim kept changing while it was reserved",
            reply,
        )

    async def watch(self, namespace: str, data: bytes, actor: Actor | None = None) -> bytes:
        """``claims.watch``: the subject where changes of the claim(s) are published."""
        request: _WatchRequest = _decode(data, _WatchRequest)
        if request.name is not None and not is_dns_subdomain(request.name):
            raise _InvalidRequestError("name", DNS_SUBDOMAIN_RULE, request.name)
        return ok_reply(subject=self.watch_subject(namespace, request.name))

    def watch_subject(self, namespace: str, name: str | None) -> str:
        """Where changes of ``namespace/name`` (``None``: of every claim) are published."""
        return f"{self.names.prefix}.watch.{namespace}.{name if name else '>'}"

    # -- admin operations ---------------------------------------------------------------

    def _manifests(self, data: bytes, source: str, kind: type[Manifest]) -> list[Any]:
        if len(data) > 4 * MAX_MANIFEST_BYTES:
            raise _InvalidRequestError(
                None, f"the manifests must be at most {4 * MAX_MANIFEST_BYTES} bytes"
            )
        try:
            objects = load_documents(data.decode("utf-8"), source, self.gates)
        except UnicodeDecodeError as exc:
            raise _InvalidRequestError(None, "the manifests must be UTF-8 text", str(exc)) from None
        except ValidationError as exc:
            raise _InvalidRequestError(exc.field, exc.rule, exc.obj) from None
        for obj in objects:
            if not isinstance(obj, kind):
                raise _InvalidRequestError(
                    "kind", f"must be {kind.__name__}, got {type(obj).__name__}"
                )
        if not objects:
            raise _InvalidRequestError(None, f"no {kind.__name__} in the request")
        return objects

    async def _write_at_version(
        self,
        stream: str,
        decide: Callable[[ClusterState], AdminWrite],
        who: Actor,
        changing: str,
        reply: Callable[[ClusterState, AdminWrite], bytes],
    ) -> bytes:
        """Decide on a frozen state, append to ``stream`` at the version read with it, and
        decide again (on the whole log) when somebody else wrote there first; ``reply``
        builds the answer from the state after the write. ``changing``: the reply when
        every attempt lost its race ("the device kept changing while …")."""
        for attempt in range(self.max_attempts):
            await self._fresh(attempt)
            async with self.live.frozen() as state:
                write = decide(state)
                version = await self.live.stream_version(stream)
            if write.refusal is not None:
                return _refusal_reply(write.refusal)
            if write.events:
                try:
                    await self._append(stream, version, list(write.events), who)
                except ConflictError:
                    continue
            return reply(await self.live.fresh(SEEN), write)
        return error_reply("conflict", f"{changing}; retry")

    async def _record(self, write: AdminWrite, actor: Actor | None) -> None:
        """Append an admin write's events, each on its own stream, last writer wins."""
        if write.events:
            batches = [Batch(stream_of(event), None, [event]) for event in write.events]
            who = actor or Actor.anonymous(None)
            await self.store.append_many(batches, Metadata(actor=str(who)))

    async def apply_classes(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``deviceclasses.apply``: record DeviceClasses that differ from the log's."""
        classes: list[DeviceClass] = self._manifests(data, "deviceclasses.apply", DeviceClass)
        write = decide_classes(await self.live.fresh(SEEN), classes)
        await self._record(write, actor)
        return ok_reply(applied=list(write.applied), unchanged=list(write.unchanged))

    async def set_class_mode(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``deviceclasses.mode``: how new claims of a class are decided (never old ones)."""
        request: ClassMode = _decode(data, ClassMode)
        write = decide_mode(
            await self.live.fresh(SEEN), request.name, request.mode, request.min_enforcement
        )
        if write.refusal is not None:
            return _refusal_reply(write.refusal)
        await self._record(write, actor)
        recorded = (await self.live.fresh(SEEN)).classes[request.name]
        return ok_reply(
            applied=list(write.applied),
            unchanged=list(write.unchanged),
            mode=recorded.mode,
            min_enforcement=recorded.min_enforcement,
        )

    async def list_classes(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``deviceclasses.list``: every class with its mode and minimum enforcement."""
        state = await self.live.fresh(SEEN)
        return ok_reply(classes=class_views(state))

    async def get_classes(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``deviceclasses.get``: DeviceClasses as recorded (``{"name"}``: one)."""
        return await self._objects(data, "DeviceClass", class_objects)

    async def get_slices(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``slices.get``: ResourceSlices as recorded (``{"name"}``: one)."""
        return await self._objects(data, "ResourceSlice", slice_objects)

    async def get_namespaces(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``namespaces.get``: each namespace's access as a Namespace (``{"name"}``: one)."""
        return await self._objects(data, "Namespace", namespace_objects)

    async def _objects(
        self,
        data: bytes,
        kind: str,
        objects_of: Callable[[ClusterState, str | None], list[dict[str, Any]]],
    ) -> bytes:
        request: _ObjectsRequest = _decode(data, _ObjectsRequest)
        objects = objects_of(await self.live.fresh(SEEN), request.name)
        if request.name is not None and not objects:
            return error_reply("not_found", f"{kind} {request.name!r} not found", field="name")
        return ok_reply(objects=objects)

    async def remove_class(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``deviceclasses.remove``: no new claims of the class; allocated ones keep running."""
        request: ClassRemoval = _decode(data, ClassRemoval)
        write = decide_remove(await self.live.fresh(SEEN), request.name)
        if write.refusal is not None:
            return _refusal_reply(write.refusal)
        await self._record(write, actor)
        return ok_reply(applied=list(write.applied))

    async def apply_slices(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``slices.apply``: record ResourceSlices that differ from the log's.

        Rejected when a new total is below what is allocated on the device: decided on
        the live state, and again (on a state read afresh) when the capacity ledger
        refuses the append because a reservation committed in between.
        """
        slices: list[ResourceSlice] = self._manifests(data, "slices.apply", ResourceSlice)
        write = decide_slices(await self.live.fresh(SEEN), slices)
        if write.refusal is not None:
            return _refusal_reply(write.refusal)
        try:
            await self._record(write, actor)
        except CapacityExceeded:
            return _refusal_reply(ledger_refusal(await self.live.fresh(HEAD), write))
        return ok_reply(applied=list(write.applied), unchanged=list(write.unchanged))

    async def set_access(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``namespaces.access``: what a namespace may do (the whole record, see docs)."""
        request: NamespacePolicy = _decode(data, NamespacePolicy)
        try:
            check_policy(request)
        except ValidationError as exc:
            raise _InvalidRequestError(exc.field, exc.rule) from None
        state = await self.live.fresh(SEEN)
        write = decide_access(
            state,
            request.namespace,
            request.classes,
            request.admin_access,
            opaque_config_classes=request.opaque_config_classes,
            max_claims=request.max_claims,
            max_requests_per_claim=request.max_requests_per_claim,
        )
        await self._record(write, actor)
        recorded = msgspec.structs.replace(
            request,
            classes=access_classes(request.classes),
            opaque_config_classes=access_classes(request.opaque_config_classes),
        )
        return ok_reply(
            **msgspec.structs.asdict(recorded),
            applied=list(write.applied),
            unchanged=list(write.unchanged),
        )

    async def set_policy(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``policies.set``: a device capacity's new request policy, under a new version."""
        change: PolicyChange = _decode(data, PolicyChange)
        stream = device_stream(change.driver, change.pool, change.device)
        who = actor or Actor.anonymous(None)

        def reply(state: ClusterState, write: AdminWrite) -> bytes:
            dev = state.device(change.driver, change.pool, change.device)
            policy = dev.policies.get(change.capacity) if dev is not None else None
            return ok_reply(
                applied=list(write.applied),
                unchanged=list(write.unchanged),
                policy_version=dev.policy_version if dev is not None else None,
                policy=describe_policy(policy),
                request_policy=model.to_builtins(policy) if policy is not None else None,
            )

        return await self._write_at_version(
            stream,
            lambda state: decide_policy(state, change, self.gates),
            who,
            "the device kept changing while its policy was set",
            reply,
        )

    async def list_policies(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``policies.list``: each device's policies and the versions its live shares hold."""
        return ok_reply(devices=policy_views(await self.live.fresh(SEEN)))

    async def list_devices(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``devices.list``: every device with its capacity, shares and tenants."""
        return ok_reply(devices=device_views(await self.live.fresh(SEEN)))

    async def _leases(self) -> dict[str, LeaseRow]:
        rows = await self.store.pool.fetch(_LEASES)
        return {r["node"]: LeaseRow(**dict(r)) for r in rows}

    async def list_nodes(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``nodes.list``: every node's lease, epoch, boot id, taints and unknown shares."""
        leases = await self._leases()
        return ok_reply(nodes=node_views(await self.live.fresh(SEEN), leases))

    async def get_node(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``nodes.get``: one node (``{"node": NAME}``)."""
        request: NodeName = _decode(data, NodeName)
        leases = await self._leases()
        views = node_views(await self.live.fresh(SEEN), leases)
        found = [v for v in views if v.node == request.node]
        if not found:
            return error_reply("not_found", f"node: no node {request.node!r} is known")
        return ok_reply(node=found[0])

    async def fence_node(self, data: bytes, actor: Actor | None = None) -> bytes:
        """``nodes.fence``: declare a node off; its shares are released with the record.

        Appended to the node's lease stream at the version read, so a lease taken or an
        expiry recorded meanwhile makes it decide again on the newer state.
        """
        request: NodeFence = _decode(data, NodeFence)
        stream = lease_stream(request.node)
        who = actor or Actor.anonymous(None)

        def reply(state: ClusterState, write: AdminWrite) -> bytes:
            return ok_reply(
                applied=list(write.applied),
                unchanged=list(write.unchanged),
                epoch=state.nodes[request.node].fenced_epoch,
            )

        return await self._write_at_version(
            stream,
            lambda state: decide_fence(state, request),
            who,
            "the node's lease kept changing while fencing",
            reply,
        )

    async def list_devices_of(
        self, namespace: str, data: bytes, actor: Actor | None = None
    ) -> bytes:
        """``claims.devices``: the devices the namespace may use, as a tenant sees them."""
        state = await self.live.fresh(SEEN)
        inventory = self._device_limits(state).inventory
        views = tenant_device_views(state, inventory, state.namespaces.get(namespace))
        return ok_reply(devices=views)

    # -- watch publishing ---------------------------------------------------------------

    def _changed(self, env: Envelope) -> None:
        claims = self.live.state.claims
        for key in self._touched(self.live.state, env):
            self._dirty[key] = None
            if key in claims:  # the event that made a claim names it
                self._names.setdefault(key[0], set()).add(key[1])
        if self._dirty:
            self._wake.set()

    async def _publish_changes(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._wake.wait()
            self._wake.clear()
            dirty, self._dirty = self._dirty, {}
            state = self.live.state
            whole = await self._whole_allocations([state.claims.get(key) for key in dirty])
            for key in dirty:
                claim = state.claims.get(key)
                if claim is None:
                    continue
                subject = self.watch_subject(*key)
                view = claim_view(state, claim, whole.get(claim.bound_position))
                body = msgspec.json.encode(view)
                try:
                    await self.nc.publish(subject, body)
                except Exception as exc:  # the bus is reconnecting: watchers re-read
                    log.warning("watch publish to %s failed: %s", subject, exc)


def _not_found(namespace: str, name: str) -> bytes:
    return error_reply(
        "not_found", f"claim {name!r} not found in namespace {namespace!r}", field="name"
    )
