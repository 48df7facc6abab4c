"""The nats-server a service reached, and a warning when it is one too old for dracap.

A broker run from ``dracap auth init``'s files lets each service user reply to the
requests it receives (``allow_responses``, :mod:`services.runtime.bus.replies`), and
nats-server keeps a record of each such request for the reply window. nats-server
before 2.10.25 walks all of a connection's records on every request once it holds
more than 4,096 (nats-server issue 6058, fixed by its pull request 6064): the Debian
2.9.10 measured here spent 63 µs per request on the first 10,000 and 984 µs on the last
of 60,000. A busy service's broker then spends more on each request the more it
answered within the window — slower, never wrong.

So a service that logs in with a credential (a broker with such users) and reaches an
older server logs one warning naming the server and the version to use, then runs on:
the defect costs speed, and refusing to start would turn an upgrade into an outage.
The warning comes once per server address and version in a process (``dracap up``'s
services share one), at the first connection and after a reconnect to another server
of a cluster. An open server (``--insecure``: no users, no reply permissions) is not
judged, nor a server whose version nats-py cannot read.
"""

from __future__ import annotations

import logging
from typing import Final

from nats.aio.client import Client

from services.runtime.bus.replies import REPLY_WINDOW_S

__all__ = ["OLDEST_ADVISED", "check_server", "server_version", "too_old"]

#: The oldest nats-server without issue 6058 (its fix, pull request 6064, came in 2.10.25).
OLDEST_ADVISED: Final = (2, 10, 25)

_log = logging.getLogger(__name__)
_warned: set[tuple[str, tuple[int, int, int]]] = set()


def server_version(nc: Client) -> tuple[int, int, int] | None:
    """The version the server connected to states (major, minor, patch); None when it
    states none that reads as one."""
    stated = nc.connected_server_version
    try:
        version = (stated.major, stated.minor, stated.patch)
    except ValueError:  # not a semantic version
        return None
    return None if version == (0, 0, 0) else version  # nats-py's "0.0.0-unknown"


def too_old(version: tuple[int, int, int] | None) -> bool:
    """Whether a server of ``version`` has nats-server issue 6058 (unknown: not judged)."""
    return version is not None and version < OLDEST_ADVISED


def check_server(nc: Client) -> bool:
    """Warn (once per server address and version in this process) when the server
    ``nc`` is connected to is older than :data:`OLDEST_ADVISED`; returns whether it is."""
    version = server_version(nc)
    if not too_old(version):
        return False
    assert version is not None
    where = nc.connected_url  # host and port only: a URL may carry a user's password
    url = f"nats://{where.hostname}:{where.port}" if where is not None else "?"
    if (url, version) not in _warned:
        _warned.add((url, version))
        _log.warning(
            "NATS %s: nats-server %s is older than %s: it spends more on each request the "
            "more requests a service answered in the last %d s (nats-server issue 6058); "
            "upgrade the broker (docs/security.md)",
            url,
            ".".join(map(str, version)),
            ".".join(map(str, OLDEST_ADVISED)),
            REPLY_WINDOW_S,
        )
    return True
