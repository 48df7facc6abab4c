"""What every part of the claims API shares: request plumbing, decoding and the write protocol.

:class:`ApiCore` holds one API instance's state (the store, the live state, the
connection, the request slots, the group committer, the claims each namespace has) and
what its endpoints have in common: a task per request, at most ``concurrency`` at a
time, its reply sent however large (:meth:`ApiCore._spawn`); the caller named by the
broker, never by the payload (:meth:`ApiCore._tenant`, :meth:`ApiCore._admin`); a
fresh enough state before a decision (:meth:`ApiCore._fresh`); and a write appended at
the stream version it was decided on, decided again when it lost a race
(:meth:`ApiCore._write_at_version`). :func:`decode_request` turns a payload into a
request Struct or an :class:`InvalidRequestError` naming the field. The endpoints are
the parts built on it (:mod:`services.claims.apitenant`, :mod:`services.claims.apiwrites`,
:mod:`services.claims.apiadmin`, :mod:`services.claims.apiwatch`), put together as
:class:`services.claims.api.ClaimsApi`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.micro.request import Request
from nats.micro.service import Service

from events import model
from events.actors import Actor
from events.catalog import Event
from events.envelopes import Envelope
from events.features import DEFAULT_GATES, FeatureGates
from events.inventory import build_inventory
from events.nesting import MAX_MANIFEST_DEPTH, depth_rule, too_deep
from events.state import ClaimKey, ClaimState, ClusterState
from services.claims.adminwrites import AdminWrite
from services.claims.admission import DeviceLimits, Refusal
from services.claims.views import ClaimsTouched, ClaimView, claim_view
from services.runtime.bus.credentials import Directory
from services.runtime.bus.queries import admin_caller, error_reply, send_reply, tenant_caller
from services.runtime.ground.context import ServiceContext
from services.runtime.ground.errors import ConflictError
from services.runtime.ground.outages import is_outage, one_line
from services.runtime.ops.selectorpool import SelectorPool
from services.runtime.store import recorded
from services.runtime.store.appends import AdmissionPremise
from services.runtime.store.committing import GroupCommitter
from services.runtime.store.livestate import HEAD, SEEN
from services.runtime.store.logandfold import LogAndFold

__all__ = [
    "AdminOperation",
    "ApiCore",
    "InvalidRequestError",
    "NameRequest",
    "TenantOperation",
    "decode_request",
    "invalid_reply",
    "not_found_reply",
    "refusal_reply",
]

log = logging.getLogger("dracap.claims")


class NameRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request naming one claim (``get``, ``delete``)."""

    name: str


class InvalidRequestError(Exception):
    """A request payload that cannot be used; becomes an ``invalid`` reply."""

    def __init__(self, field: str | None, rule: str, detail: str = "") -> None:
        super().__init__(rule)
        self.field = field
        self.rule = rule
        self.detail = detail


def invalid_reply(exc: InvalidRequestError) -> bytes:
    """The ``invalid`` reply of a request that cannot be used."""
    where = f"{exc.field}: " if exc.field else ""
    message = f"{where}{exc.rule}" + (f" ({exc.detail})" if exc.detail else "")
    return error_reply("invalid", message, field=exc.field, rule=exc.rule)


def refusal_reply(refusal: Refusal) -> bytes:
    """The reply of a decision that refused the request (its code, field and rule)."""
    return error_reply(refusal.code, refusal.message, field=refusal.field, rule=refusal.rule)


TenantOperation = Callable[[str, bytes, Actor], Awaitable[bytes]]
AdminOperation = Callable[[bytes, Actor], Awaitable[bytes]]


async def _done(reply: bytes) -> bytes:
    return reply


def decode_request(data: bytes, typ: type[Any]) -> Any:
    """``data`` as a ``typ`` request; :class:`InvalidRequestError` naming the field if not."""
    deep = too_deep(data, MAX_MANIFEST_DEPTH)  # before msgspec recurses into it
    if deep is not None:
        raise InvalidRequestError(deep, depth_rule(MAX_MANIFEST_DEPTH))
    try:
        return msgspec.json.decode(data or b"{}", type=typ, dec_hook=model.decode_hook)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(_field_of(str(exc)), str(exc)) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(None, f"the request must be a JSON object: {exc}") from None


def _field_of(message: str) -> str | None:
    if "`$." in message:
        return message.split("`$.", 1)[1].split("`", 1)[0]
    if "field `" in message:
        return message.split("field `", 1)[1].split("`", 1)[0]
    return None


def not_found_reply(namespace: str, name: str) -> bytes:
    """The ``not_found`` reply for a claim ``namespace/name``."""
    return error_reply(
        "not_found", f"claim {name!r} not found in namespace {namespace!r}", field="name"
    )


class ApiCore:
    """One API instance's state and what its endpoints share (see the module docstring)."""

    def __init__(
        self,
        context: ServiceContext[LogAndFold],
        *,
        gates: FeatureGates = DEFAULT_GATES,
        directory: Directory | None = None,
        authenticated: bool = False,
        max_attempts: int = 8,
        concurrency: int = 256,
        tail: bool = False,
        selectors: SelectorPool | None = None,
    ) -> None:
        store = self.store = context.stores.store
        #: where tenants' long selector expressions are compiled (not on this loop); at the
        #: usual priority: a compile is bounded (10 KiB, 2 s) and the tenant waits for it
        self.selectors = selectors if selectors is not None else SelectorPool(niceness=0)
        live = self.live = context.stores.live
        self.nc = context.nc
        self.names = context.names
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

    def _spawn(self, request: Request, work: Callable[[], Awaitable[bytes]]) -> None:
        async def serve() -> None:
            async with self._slots:
                try:
                    reply = await work()
                except InvalidRequestError as exc:
                    reply = invalid_reply(exc)
                except Exception as exc:
                    if is_outage(exc):
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

    def _tenant(self, fn: TenantOperation) -> Callable[[Request], Any]:
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

    def _admin(self, fn: AdminOperation) -> Callable[[Request], Any]:
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
        self,
        stream: str,
        version: int | None,
        events: list[Event],
        actor: Actor,
        premise: AdmissionPremise | None = None,
    ) -> None:
        await self._committer.append(stream, version, events, actor=str(actor), premise=premise)

    async def _fresh(self, attempt: int) -> None:
        """Before a decision: what is known first, the whole log after a conflict."""
        # after a conflict the winner may be another process, not announced yet
        await self.live.fresh(HEAD if attempt else SEEN)

    async def _views(self, state: ClusterState, claims: list[ClaimState]) -> list[ClaimView]:
        """The views of ``claims``, each allocation whole: the ones the fold keeps without
        their configuration are read from the log first (one query for all)."""
        whole = await recorded.allocations(self.store.pool, claims)
        return [claim_view(state, c, whole.get(c.bound_position)) for c in claims]

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
                return refusal_reply(write.refusal)
            if write.events:
                try:
                    await self._append(stream, version, list(write.events), who)
                except ConflictError:
                    continue
            return reply(await self.live.fresh(SEEN), write)
        return error_reply("conflict", f"{changing}; retry")

    def _changed(self, env: Envelope) -> None:
        claims = self.live.state.claims
        for key in self._touched(self.live.state, env):
            self._dirty[key] = None
            if key in claims:  # the event that made a claim names it
                self._names.setdefault(key[0], set()).add(key[1])
        if self._dirty:
            self._wake.set()
