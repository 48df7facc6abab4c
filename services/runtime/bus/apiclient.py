"""A client of the claims and admin APIs: NATS request/reply, one JSON reply each.

The claims service answers on ``names.api(namespace, op)`` (tenants) and
``names.admin(op)`` (operators) with ``{"ok": true, ...}`` or ``{"ok": false,
"error": {"code", "field", "rule", "message"}}`` (payloads: ``docs/services.md``).
:class:`ApiClient` sends one request and returns the first form; the second raises
:class:`ApiError`, whose ``code`` also picks the exit code a command ends with:
``invalid`` -> bad input, ``not_found`` -> not found, ``rejected`` / ``conflict`` ->
rejected, anything else -> error (:mod:`services.exitcodes`).

It is plumbing shared by whoever talks to the API from outside the service: the
``dracap claim`` commands, ``dracap up`` loading its inventory, ``dracap prove``. So it
lives here, not in the claims package, and no service imports another's internals to
reach it. :meth:`ApiClient.claim_changes` queues what a claims ``watch`` publishes
(``dracap claim watch``, ``dracap prove``). A server that cannot be reached is a
:class:`~services.runtime.bus.endpoints.ServerUnavailable`; a request nobody answers, one
that times out, or one larger than the server's ``max_payload`` is a
:class:`~services.exitcodes.CommandError` with a message for a person. A reply larger
than ``max_payload`` comes in parts and is put back together here
(:mod:`services.runtime.bus.replies`). Every reply of one client comes to one
subscription (:class:`Inbox`), made at its first request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Final

import nats
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from events.subjects import BusNames
from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.credentials import Credential
from services.runtime.bus.endpoints import reaching
from services.runtime.bus.flushing import flushed
from services.runtime.bus.jetstream import MAX_OUTSTANDING_PINGS, PING_INTERVAL_S, server_urls
from services.runtime.bus.replies import Assembly, ReplyPartError
from services.runtime.ground.waiting import wait_for

__all__ = ["REQUEST_TIMEOUT_S", "ApiClient", "ApiError", "Inbox"]

REQUEST_TIMEOUT_S: Final = 10.0
_EXIT_BY_CODE: Final = {
    "invalid": ExitCode.BAD_INPUT,
    "not_found": ExitCode.NOT_FOUND,
    "rejected": ExitCode.REJECTED,
    "conflict": ExitCode.REJECTED,
    "forbidden": ExitCode.REJECTED,
    "too_large": ExitCode.BAD_INPUT,
}
_DENIED: Final = "permissions violation for publish to "
#: the server's answer to a request nobody subscribes to: a status message
_STATUS: Final = "Status"
_NO_RESPONDERS: Final = "503"


class ApiError(CommandError):
    """The API answered ``{"ok": false}``."""

    def __init__(self, error: dict[str, Any]) -> None:
        self.code = str(error.get("code", "internal"))
        self.field = error.get("field")
        self.rule = error.get("rule")
        text = str(error.get("message", ""))
        # the API's message usually names field and rule already; add them only when not
        where = (
            f" ({self.field}: {self.rule})" if self.field and str(self.field) not in text else ""
        )
        message = f"{self.code}: {text}{where}"
        super().__init__(message, _EXIT_BY_CODE.get(self.code, ExitCode.ERROR))


class _Denials:
    """The subjects the server refused this connection to publish to (its error callback).

    nats-py reports a permissions violation only to the error callback; the request
    itself would wait for its timeout. Here a request ends as soon as its subject is
    refused.
    """

    def __init__(self) -> None:
        #: subject -> the requests on it in flight (several may share a subject)
        self.waiting: dict[str, set[asyncio.Future[None]]] = {}

    async def error(self, exc: Exception) -> None:
        text = str(exc)
        start = text.lower().find(_DENIED)
        if start < 0:
            return  # nats-py logs every failed attempt by default; the CLI reports the last
        subject = text[start + len(_DENIED) :].strip().strip('"').lower()
        for wanted, futures in self.waiting.items():
            if wanted.lower() == subject:
                for future in futures:
                    if not future.done():
                        future.set_result(None)


def _take(whole: asyncio.Future[bytes], assembly: Assembly, msg: Msg) -> None:
    """One message of a reply: the whole reply, a part, or why there is none."""
    if whole.done():
        return
    if msg.headers and msg.headers.get(_STATUS) == _NO_RESPONDERS and not msg.data:
        whole.set_exception(nats.errors.NoRespondersError())
        return
    try:
        data = assembly.add(msg.data, msg.headers)
    except ReplyPartError as exc:
        whole.set_exception(exc)
        return
    if data is not None:
        whole.set_result(data)


class Inbox:
    """Requests and their whole replies, however many messages each takes
    (:mod:`services.runtime.bus.replies`): every reply comes to one subscription
    (``<inbox>.*``, made at the first request), each request's to a token of its own,
    instead of a subscription made and dropped per request (a ``SUB`` written and
    flushed, a task started, an ``UNSUB``, and nats-server's bookkeeping of each). The
    parts of one reply come in order on the one subscription, as on a private one."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = ""
        self._waiting: dict[str, tuple[asyncio.Future[bytes], Assembly]] = {}
        self._asked = 0
        self._starting = asyncio.Lock()

    async def _start(self) -> None:
        async with self._starting:
            if not self._prefix:
                prefix = self._nc.new_inbox()
                await self._nc.subscribe(f"{prefix}.*", cb=self._arrived)
                self._prefix = prefix

    async def _arrived(self, msg: Msg) -> None:
        waiting = self._waiting.get(msg.subject.rpartition(".")[2])
        if waiting is not None:
            _take(*waiting, msg)

    async def ask(self, subject: str, payload: bytes, timeout: float) -> bytes:  # noqa: ASYNC109
        """Publish a request and wait for the whole reply: ``nats.errors.TimeoutError``
        after ``timeout``, ``NoRespondersError`` when nobody listens,
        :class:`ReplyPartError` for a broken one."""
        return await (await self.send(subject, payload, timeout))

    async def send(
        self,
        subject: str,
        payload: bytes,
        timeout: float,  # noqa: ASYNC109
    ) -> Coroutine[None, None, bytes]:
        """Publish a request; once this returns it is out, and the coroutine returned
        waits for its answer (as :meth:`ask`; it must be awaited, or run as a task)."""
        if not self._prefix:
            await self._start()
        token = str(self._asked)
        self._asked += 1
        whole: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting[token] = (whole, Assembly())
        try:
            await self._nc.publish(subject, payload, reply=f"{self._prefix}.{token}")
        except BaseException:
            del self._waiting[token]
            raise
        return self._answer(token, whole, timeout)

    async def _answer(self, token: str, whole: asyncio.Future[bytes], timeout: float) -> bytes:  # noqa: ASYNC109
        try:
            try:
                return await wait_for(whole, timeout)
            except TimeoutError:
                raise nats.errors.TimeoutError from None
        finally:
            del self._waiting[token]


class ApiClient:
    """Request/reply calls to the claims and admin APIs over one NATS connection."""

    def __init__(self, nc: Client, names: BusNames, *, timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.nc = nc
        self.names = names
        self.timeout = timeout
        self._denials = _Denials()
        #: every reply comes to one subscription, made at the first request (a command
        #: that asks once pays what it did; a client that asks again and again — a tenant's
        #: ``claim apply`` of a directory, the benchmark — no SUB, task and UNSUB each time)
        self._inbox = Inbox(nc)

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls, url: str, prefix: str, credential: Credential | None = None
    ) -> AsyncIterator[ApiClient]:
        """A client over a new connection, logged in as ``credential`` when given.

        ``url``: one server, or a cluster's, comma-separated: then each is tried once (at
        the start, and once more should the one reached be lost), and a command rides
        out the loss of one server."""
        denials = _Denials()
        login = credential.connect_options() if credential is not None else {}
        servers = server_urls(url)
        with reaching("NATS", url):
            nc = await nats.connect(
                servers=servers,
                connect_timeout=3,
                allow_reconnect=len(servers) > 1,
                ping_interval=PING_INTERVAL_S,  # a hung server: lost after two pings
                max_outstanding_pings=MAX_OUTSTANDING_PINGS,
                max_reconnect_attempts=1,  # 0 would mean "forever" to nats-py
                reconnect_time_wait=0.1,
                error_cb=denials.error,
                **login,
            )
        try:
            client = cls(nc, BusNames(prefix=prefix))
            client._denials = denials
            yield client
        finally:
            await nc.close()

    async def request(self, subject: str, payload: bytes) -> dict[str, Any]:
        url = self.nc.connected_url
        with reaching("NATS", url.geturl() if url else "?"):  # the server went away meanwhile
            try:
                reply = await self._request(subject, payload)
            except nats.errors.NoRespondersError:
                raise CommandError(f"no dracap API answers on {subject}", ExitCode.ERROR) from None
            except nats.errors.MaxPayloadError:
                raise CommandError(
                    f"the request to {subject} is {len(payload)} bytes, more than the server "
                    f"accepts (max_payload {self.nc.max_payload} bytes)",
                    ExitCode.BAD_INPUT,
                ) from None
            except nats.errors.TimeoutError:
                raise CommandError(
                    f"no reply on {subject} within {self.timeout}s", ExitCode.ERROR
                ) from None
        body: dict[str, Any] = json.loads(reply)
        if not body.get("ok"):
            raise ApiError(body.get("error") or {"code": "internal", "message": "no error"})
        return body

    async def _request(self, subject: str, payload: bytes) -> bytes:
        """The reply's data; :class:`~services.exitcodes.CommandError` when the server
        refuses this user the subject."""
        denied: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._denials.waiting.setdefault(subject, set())
        waiting.add(denied)
        asking = asyncio.ensure_future(self._ask(subject, payload))
        try:
            either: set[asyncio.Future[Any]] = {asking, denied}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.discard(denied)
            if not waiting:
                self._denials.waiting.pop(subject, None)
        if denied.done() and not asking.done():
            asking.cancel()
            raise CommandError(
                f"the NATS server does not let this user publish to {subject}: use credentials "
                "allowed to (--creds, DRACAP_NATS_CREDS)",
                ExitCode.REJECTED,
            )
        data: bytes = asking.result()
        return data

    async def _ask(self, subject: str, payload: bytes) -> bytes:
        try:
            return await self._inbox.ask(subject, payload, self.timeout)
        except ReplyPartError as exc:
            raise CommandError(f"a broken reply on {subject}: {exc}", ExitCode.ERROR) from None

    async def claims(self, namespace: str, op: str, body: Any = None) -> dict[str, Any]:
        payload = body if isinstance(body, bytes) else json.dumps(body or {}).encode()
        return await self.request(self.names.api(namespace, op), payload)

    async def admin(self, op: str, body: Any = None) -> dict[str, Any]:
        payload = body if isinstance(body, bytes) else json.dumps(body or {}).encode()
        return await self.request(self.names.admin(op), payload)

    @contextlib.asynccontextmanager
    async def claim_changes(
        self, namespace: str, name: str | None
    ) -> AsyncIterator[asyncio.Queue[dict[str, Any]]]:
        """The claim views the ``watch`` of ``namespace`` (``name``: one claim) publishes,
        queued from entry (subscribed and flushed) to exit (unsubscribed)."""
        subject = (await self.claims(namespace, "watch", {"name": name}))["subject"]
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def on_change(msg: Msg) -> None:
            queue.put_nowait(json.loads(msg.data))

        sub = await self.nc.subscribe(subject, cb=on_change)
        try:
            await flushed(self.nc)
            yield queue
        finally:
            await sub.unsubscribe()
