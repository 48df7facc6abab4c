"""The typed errors of the Kubernetes API client, told apart by HTTP status and exception type.

::

    KubeApiError                 root; ``status`` (HTTP code or None), ``reason`` (Status reason)
    ├── Gone                     410: the resourceVersion asked for is older than the server
    │                            keeps (a watch or an exact list); re-list
    ├── Conflict                 409: a write at a stale resourceVersion, or a failed
    │   │                        precondition; re-read and decide again
    │   └── AlreadyExists        409 on create: the name is taken
    ├── Retryable                the network failed, the server timed out, was overloaded
    │                            (429) or failed (5xx); the same call may succeed later
    └── Permanent                any other 4xx: the same call fails the same way again
        ├── NotFound             404
        └── Invalid              422; ``causes`` name the fields and the rules

Each class also derives from the runtime's error of the same meaning
(:mod:`services.runtime.ground.errors`: ``ConflictError``, ``RetryableError``, ``PermanentError``,
``NotFound``), so code that handles runtime errors in general handles these too.
:class:`Gone` derives from none of them: it is neither a retry of the same call nor a
failure, but an instruction to re-list.

:func:`error_from_status` builds the error from a status code and the body the server sent
(a ``Status`` object, decoded when it is one); :func:`error_from_exception` maps client-side
failures (aiohttp, OS, timeouts). Neither reads the message text to decide the type.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

import aiohttp
import msgspec

from services.runtime.ground import errors as runtime_errors

__all__ = [
    "AlreadyExists",
    "Cause",
    "Conflict",
    "Gone",
    "Invalid",
    "KubeApiError",
    "NotFound",
    "Permanent",
    "Retryable",
    "error_from_exception",
    "error_from_status",
]

#: Statuses worth repeating the same call for: throttled, or the server (or a proxy) failed.
RETRYABLE_STATUSES: Final = frozenset({429, 500, 502, 503, 504})


class Cause(msgspec.Struct, frozen=True):
    """One field a 422 names: its path (``spec.pool.generation``) and what is wrong."""

    field: str
    message: str
    reason: str = ""


class KubeApiError(runtime_errors.RuntimeServiceError):
    """Root of every error the Kubernetes API client raises."""

    def __init__(self, message: str, *, status: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class Gone(KubeApiError):  # noqa: N818 (the API's own name for 410)
    """410: the resourceVersion is too old for the server's history; list again."""


class Conflict(KubeApiError, runtime_errors.ConflictError):  # noqa: N818
    """409: somebody wrote the object first (stale resourceVersion, failed precondition)."""


class AlreadyExists(Conflict):
    """409 on create: an object of that name exists."""


class Retryable(KubeApiError, runtime_errors.RetryableError):  # noqa: N818
    """A transient failure (network, timeout, 429, 5xx); the same call may succeed."""


class Permanent(KubeApiError, runtime_errors.PermanentError):  # noqa: N818
    """A 4xx other than 404/409/410/422/429: the request itself is refused."""


class NotFound(Permanent, runtime_errors.NotFound):
    """404: no such object (or no such API on this server)."""


class Invalid(Permanent):
    """422: the object breaks the API's rules; ``causes`` name the fields."""

    def __init__(
        self, message: str, *, causes: tuple[Cause, ...] = (), reason: str = "Invalid"
    ) -> None:
        super().__init__(message, status=422, reason=reason)
        self.causes = causes


def _status_body(body: bytes) -> dict[str, Any]:
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return {}
    return decoded if isinstance(decoded, dict) else {}


def error_from_status(status: int, body: bytes | dict[str, Any], *, what: str) -> KubeApiError:
    """The error for an HTTP ``status`` whose body is ``body`` (a Status object, usually).

    ``what`` names the request (``GET resourceclaims ns/name``) for the message.
    """
    data = body if isinstance(body, dict) else _status_body(body)
    reason = str(data.get("reason") or "")
    message = str(data.get("message") or "").strip()
    text = f"{what}: {status} {reason}".rstrip() + (f": {message}" if message else "")
    if status == 410:
        return Gone(text, status=status, reason=reason)
    if status == 409:
        cls = AlreadyExists if reason == "AlreadyExists" else Conflict
        return cls(text, status=status, reason=reason)
    if status == 404:
        return NotFound(text, status=status, reason=reason)
    if status == 422:
        details = data.get("details")
        raw_causes = details.get("causes") if isinstance(details, dict) else None
        causes = tuple(
            Cause(
                field=str(c.get("field") or ""),
                message=str(c.get("message") or ""),
                reason=str(c.get("reason") or ""),
            )
            for c in (raw_causes if isinstance(raw_causes, list) else [])
            if isinstance(c, dict)
        )
        return Invalid(text, causes=causes, reason=reason or "Invalid")
    if status in RETRYABLE_STATUSES or status >= 500:
        return Retryable(text, status=status, reason=reason)
    return Permanent(text, status=status, reason=reason)


def error_from_exception(exc: BaseException, *, what: str) -> KubeApiError:
    """The error for a client-side failure: network and timeouts are retryable."""
    if isinstance(exc, KubeApiError):
        return exc
    text = f"{what}: {type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.ClientError | OSError | asyncio.TimeoutError | ConnectionError):
        return Retryable(text)
    return Permanent(text)
