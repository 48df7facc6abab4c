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
reach it. A server that cannot be reached is a
:class:`~services.runtime.endpoints.ServerUnavailable`; a request nobody answers, one
that times out, or one larger than the server's ``max_payload`` is a
:class:`~services.exitcodes.CommandError` with a message for a person.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, Final

import nats
import nats.errors
from nats.aio.client import Client

from events.subjects import BusNames
from services.exitcodes import CommandError, ExitCode
from services.runtime.endpoints import reaching

__all__ = ["REQUEST_TIMEOUT_S", "ApiClient", "ApiError"]

REQUEST_TIMEOUT_S: Final = 10.0
_EXIT_BY_CODE: Final = {
    "invalid": ExitCode.BAD_INPUT,
    "not_found": ExitCode.NOT_FOUND,
    "rejected": ExitCode.REJECTED,
    "conflict": ExitCode.REJECTED,
}


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


async def _quiet(_: Exception) -> None:
    """nats-py logs every failed attempt by default; the CLI reports the final error."""


class ApiClient:
    """Request/reply calls to the claims and admin APIs over one NATS connection."""

    def __init__(self, nc: Client, names: BusNames, *, timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.nc = nc
        self.names = names
        self.timeout = timeout

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, url: str, prefix: str) -> AsyncIterator[ApiClient]:
        with reaching("NATS", url):
            nc = await nats.connect(
                url,
                connect_timeout=3,
                allow_reconnect=False,
                max_reconnect_attempts=1,  # 0 would mean "forever" to nats-py
                reconnect_time_wait=0.1,
                error_cb=_quiet,
            )
        try:
            yield cls(nc, BusNames(prefix=prefix))
        finally:
            await nc.close()

    async def request(self, subject: str, payload: bytes) -> dict[str, Any]:
        url = self.nc.connected_url
        with reaching("NATS", url.geturl() if url else "?"):  # the server went away meanwhile
            try:
                reply = await self.nc.request(subject, payload, timeout=self.timeout)
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
        body: dict[str, Any] = json.loads(reply.data)
        if not body.get("ok"):
            raise ApiError(body.get("error") or {"code": "internal", "message": "no error"})
        return body

    async def claims(self, namespace: str, op: str, body: Any = None) -> dict[str, Any]:
        payload = body if isinstance(body, bytes) else json.dumps(body or {}).encode()
        return await self.request(self.names.api(namespace, op), payload)

    async def admin(self, op: str, body: Any = None) -> dict[str, Any]:
        payload = body if isinstance(body, bytes) else json.dumps(body or {}).encode()
        return await self.request(self.names.admin(op), payload)
