"""The node agent's side of the wire: asking the enforcement service, over NATS only.

:class:`ControlPlane` sends the agent's requests (:mod:`services.enforcement.protocol`)
on its node's subjects and turns each answer into a value or an error of the runtime's
tree, by the refusal's code (never its text):

================= ====================================================================
refusal / failure raised as
================= ====================================================================
``conflict``      :class:`~services.runtime.ground.errors.ConflictError`: decide again
``stale_epoch``   :class:`~services.runtime.ground.errors.StaleEpoch`: take the next lease
``unavailable``   :class:`~services.runtime.ground.errors.RetryableError`
no answer         :class:`~services.runtime.ground.errors.RetryableError` (nobody listens, a
                  timeout, the connection away): an outage, as a database away was
``forbidden``,    :class:`Refused` (permanent: the same request fails the same way)
``invalid``,
``internal``
================= ====================================================================

Views and reports, whose answers may come in parts, all come back to one subscription
of the agent's connection (:class:`~services.runtime.bus.apiclient.Inbox`), not to a
subscription made and dropped per request.

It remembers the newest log position the agent's own writes reached (its lease, its
reports): every view asks for at least that (``at_least``), so a view answered by any
replica of the service shows what the agent wrote last (read-your-writes across
replicas).
"""

from __future__ import annotations

from collections.abc import Awaitable, Coroutine
from typing import Final, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client

from events.catalog import EnforcementLevel
from events.subjects import BusNames
from services.enforcement.protocol import (
    Beat,
    Consumed,
    ConsumerAsk,
    Heartbeat,
    LeaseAsk,
    Leased,
    RefusalCode,
    Reply,
    Report,
    Reported,
    ViewAsk,
    Viewed,
    decode,
    encode,
)
from services.enforcement.views import NodeView, decode_view
from services.runtime.bus.apiclient import Inbox
from services.runtime.bus.replies import ReplyPartError
from services.runtime.ground.errors import (
    ConflictError,
    PermanentError,
    RetryableError,
    RuntimeServiceError,
    StaleEpoch,
    map_bus_error,
)

__all__ = ["REQUEST_TIMEOUT_S", "ControlPlane", "Refused"]

#: Seconds an agent waits for an answer (a heartbeat: a third of its lease's ttl at most).
REQUEST_TIMEOUT_S: Final = 10.0

_T = TypeVar("_T")


class Refused(PermanentError):  # noqa: N818 (what the service answered)
    """The enforcement service refused a request for good (``forbidden``, ``invalid``,
    ``internal``); ``code`` says which."""

    def __init__(self, code: RefusalCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class ControlPlane:
    """A node agent's requests to the enforcement service (see the module docstring)."""

    def __init__(
        self, nc: Client, names: BusNames, node: str, *, timeout: float = REQUEST_TIMEOUT_S
    ) -> None:
        self.nc = nc
        self.names = names
        self.node = node
        self.timeout = timeout
        #: the newest position of the agent's own writes (its lease, its reports)
        self.seen = 0
        self.requests = 0  #: requests sent so far
        self._inbox = Inbox(nc)  # every answer that may come in parts, on one subscription

    async def _ask(
        self,
        verb: str,
        request: msgspec.Struct,
        kind: type[_T],
        timeout: float,  # noqa: ASYNC109
        epoch: int = 0,
        *,
        small: bool = False,
    ) -> _T:
        if not small:  # an answer that may come in parts
            return await (await self._send(verb, request, kind, timeout, epoch))
        subject = self._subject(verb)
        try:  # one message answers: the connection's shared reply inbox will do
            data = (await self.nc.request(subject, encode(request), timeout=timeout)).data
        except (nats.errors.Error, OSError) as exc:
            raise map_bus_error(exc, subject=subject) from None
        return self._answer(subject, data, kind, epoch)

    async def _send(
        self,
        verb: str,
        request: msgspec.Struct,
        kind: type[_T],
        timeout: float,  # noqa: ASYNC109
        epoch: int = 0,
    ) -> Coroutine[None, None, _T]:
        """Send a request whose answer may come in parts; once this returns it is out,
        and the coroutine returned waits for the answer (it must be awaited)."""
        subject = self._subject(verb)
        try:
            answer = await self._inbox.send(subject, encode(request), timeout)
        except (nats.errors.Error, OSError) as exc:
            raise map_bus_error(exc, subject=subject) from None
        return self._answered(subject, answer, kind, epoch)

    def _subject(self, verb: str) -> str:
        """The subject of one more request with ``verb`` (counted in ``requests``)."""
        subject = self.names.node_request(self.node, verb)
        self.requests += 1
        return subject

    async def _answered(
        self, subject: str, answer: Awaitable[bytes], kind: type[_T], epoch: int
    ) -> _T:
        try:
            data = await answer
        except ReplyPartError as exc:
            raise RetryableError(f"a broken answer on {subject}: {exc}") from None
        except (nats.errors.Error, OSError) as exc:
            raise map_bus_error(exc, subject=subject) from None
        return self._answer(subject, data, kind, epoch)

    def _answer(self, subject: str, data: bytes, kind: type[_T], epoch: int) -> _T:
        try:
            reply: Reply[_T] = decode(data, Reply[kind])  # type: ignore[valid-type]
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise Refused("internal", f"an answer on {subject} that is not one: {exc}") from None
        if reply.refusal is not None:
            refusal = reply.refusal
            raise self._error(refusal.code, refusal.message, epoch, refusal.current)
        if reply.answer is None:
            raise Refused("internal", f"an empty answer on {subject}")
        return reply.answer

    def _error(
        self, code: RefusalCode, message: str, epoch: int, current: int
    ) -> RuntimeServiceError:
        if code == "conflict":
            return ConflictError(message)
        if code == "stale_epoch":
            return StaleEpoch(self.node, epoch, current)
        if code == "unavailable":
            return RetryableError(message)
        return Refused(code, message)

    def _saw(self, position: int) -> None:
        self.seen = max(self.seen, position)

    async def lease(self, boot_id: str, ttl_s: float, enforcement: EnforcementLevel) -> Leased:
        """Take the node's next lease."""
        asked = LeaseAsk(boot_id=boot_id, ttl_ms=round(ttl_s * 1000), enforcement=enforcement)
        leased = await self._ask("lease", asked, Leased, self.timeout, small=True)
        self._saw(leased.position)
        return leased

    async def heartbeat(self, epoch: int, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Renew the lease of ``epoch``; False when it is lost."""
        asked = Heartbeat(epoch=epoch)
        beat = await self._ask("heartbeat", asked, Beat, timeout or self.timeout, epoch, small=True)
        return beat.held

    async def view(self, ask_for: ViewAsk) -> tuple[NodeView, Viewed]:
        """A view for a decision (at least as fresh as the agent's own writes)."""
        if ask_for.at_least < self.seen:
            ask_for = msgspec.structs.replace(ask_for, at_least=self.seen)
        viewed = await self._ask("view", ask_for, Viewed, self.timeout)
        try:
            view = decode_view(bytes(viewed.view))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise Refused("internal", f"a view that is not one: {exc}") from None
        return view, viewed

    async def report(self, report: Report) -> Reported:
        """Append what the agent did (under its lease epoch)."""
        return await (await self.send_report(report))

    async def send_report(self, report: Report) -> Coroutine[None, None, Reported]:
        """:meth:`report`, in two steps: once this returns the report is on its way, and
        the coroutine returned waits for the answer (it must be awaited: the agent runs
        it as a task while it decides the next message group)."""
        if report.at_least < self.seen:
            report = msgspec.structs.replace(report, at_least=self.seen)
        answer = await self._send("report", report, Reported, self.timeout, report.epoch)
        return self._reported(answer)

    async def _reported(self, answer: Awaitable[Reported]) -> Reported:
        reported = await answer
        self._saw(reported.position)
        return reported

    async def consumer(self) -> bool:
        """Have the node's durable consumer created again if the broker lost it; whether
        it had to be."""
        consumed = await self._ask("consumer", ConsumerAsk(), Consumed, self.timeout, small=True)
        return consumed.created
