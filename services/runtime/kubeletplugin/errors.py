"""The typed errors of the kubelet transport (a branch of :mod:`services.runtime.ground.errors`)::

    KubeletPluginError                       root (a RuntimeServiceError)
    ├── PluginConfigError (PermanentError)   a bad driver name, directory or timeout
    │   └── SocketPathTooLong                a socket path over the 108-byte sun_path limit
    ├── ClaimFailure                         one claim of a call failed; its text is the
    │   │                                    claim's ``error`` in the reply, never raised
    │   ├── HandlerRaised (RetryableError)   the handler raised for this claim
    │   ├── DeadlineExceeded (RetryableError)  the call's deadline passed first
    │   └── ResultMissing (RetryableError)   the handler returned no entry for the claim
    ├── RegistrationRefused (PermanentError) the kubelet side refused a plugin's GetInfo
    ├── PluginUnavailable (RetryableError)   a gRPC call could not reach the plugin, or
    │                                        timed out
    └── PluginCallFailed (PermanentError)    a gRPC call failed otherwise

Claim failures are retryable: the kubelet calls again for a claim whose entry carries
an error, and the driver's prepare and unprepare are idempotent.
"""

from __future__ import annotations

import grpc

from services.runtime.ground.errors import PermanentError, RetryableError, RuntimeServiceError

__all__ = [
    "ClaimFailure",
    "DeadlineExceeded",
    "HandlerRaised",
    "KubeletPluginError",
    "PluginCallFailed",
    "PluginConfigError",
    "PluginUnavailable",
    "RegistrationRefused",
    "ResultMissing",
    "SocketPathTooLong",
    "map_rpc_error",
]


class KubeletPluginError(RuntimeServiceError):
    """Root of the kubelet transport's errors."""


class PluginConfigError(KubeletPluginError, PermanentError, ValueError):
    """The plugin cannot be set up as asked; the message names the setting and the rule."""


class SocketPathTooLong(PluginConfigError):  # noqa: N818 (a condition, like NotFound)
    """A Unix socket path does not fit ``sun_path`` (107 bytes and a NUL)."""

    def __init__(self, path: str, length: int, limit: int) -> None:
        super().__init__(
            f"socket path {path} is {length} bytes; a Unix socket path must be at most "
            f"{limit} bytes (sun_path is 108 bytes with its NUL): use a shorter directory"
        )
        self.path = path


class ClaimFailure(KubeletPluginError):  # noqa: N818 (what happened to a claim)
    """Why the transport answered one claim with an error; ``uid`` names the claim."""

    def __init__(self, message: str, *, uid: str) -> None:
        super().__init__(message)
        self.uid = uid


class HandlerRaised(ClaimFailure, RetryableError):  # noqa: N818
    """The driver handler raised while handling this claim."""


class DeadlineExceeded(ClaimFailure, RetryableError):  # noqa: N818
    """The call's deadline passed before the handler answered for this claim."""


class ResultMissing(ClaimFailure, RetryableError):  # noqa: N818
    """The handler returned, but without an entry for this claim."""


class RegistrationRefused(KubeletPluginError, PermanentError):  # noqa: N818
    """A plugin's registration answer is not acceptable (type, name, endpoint, versions)."""


class PluginUnavailable(KubeletPluginError, RetryableError):  # noqa: N818
    """The plugin's socket did not answer, or the call ran out of time."""


class PluginCallFailed(KubeletPluginError, PermanentError):  # noqa: N818
    """The plugin answered a call with an error status other than unavailability."""


_RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
    }
)


def map_rpc_error(exc: grpc.aio.AioRpcError, *, method: str) -> KubeletPluginError:
    """The transport error for a failed gRPC call, by its status code."""
    text = f"{method}: {exc.code().name}: {exc.details()}"
    if exc.code() in _RETRYABLE_CODES:
        return PluginUnavailable(text)
    return PluginCallFailed(text)
