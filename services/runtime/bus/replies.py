"""Replies of any size over NATS request/reply: parts the server accepts, put back together.

A NATS server refuses any message larger than its ``max_payload`` (1 MiB unless
configured). Most API replies are far smaller, but a list is not: the claims of a big
namespace, the devices of a cluster, 10,000 audit records (about 4.5 MB). Such a reply
used to be dropped by the server, and the requester waited for its timeout.

The rule, in one place:

* a reply that fits in ``max_payload - HEADROOM`` bytes goes as **one message**,
  exactly as before, so any NATS client (``nats req``) reads it;
* a larger one goes as **parts**, in order, to the request's reply subject, each with
  the header ``Dracap-Reply-Part: <i>/<n>`` (1-based) and at most the budget bytes;
  :class:`Assembly` on the requester's side joins them (the CLI's
  :class:`~services.runtime.bus.apiclient.ApiClient`);
* a reply of more than :data:`MAX_REPLY_PARTS` parts is not sent: the requester gets the
  ``too_large`` error instead, naming the rule (narrow the query: a namespace, a
  filter, ``--limit``). The broker's permissions let a service send at most that many
  messages per request, within :data:`REPLY_WINDOW_S` of its arrival
  (``allow_responses: {max: MAX_REPLY_PARTS, expires: "30s"}``,
  :mod:`services.brokerauth`).

Why the window: nats-server keeps, per service connection, a record of every request
it delivered there until the reply has used up ``max`` messages or ``expires`` has
passed. A request answered in one message uses one of 64, so without ``expires`` its
record stays for the life of the connection: the broker's memory grew by some 200
bytes per request (the claims API's every apply, the enforcement service's every
agent report, view and heartbeat), and its collector walked all of them. With the
window the records are those of the last 30 s. Every requester gives up sooner (the
API client's and the agents' 10 s), so a reply the window refuses is one nobody waits
for. Older nats-servers (2.9.10 measured; 2.10.25 is without it) also walk all the
records on each request once there are more than 4,096 (nats-server issue 6058): there
the window bounds that walk, but a busy service still pays it (docs/security.md).

Messages of one connection reach a subscriber in the order they were published, so
parts arrive in order; :class:`Assembly` still checks every index and count and
refuses anything else (a forged or mixed-up part) rather than join it.
"""

from __future__ import annotations

import re
from typing import Final

from services.runtime.ground.errors import PermanentError

__all__ = [
    "HEADROOM",
    "MAX_REPLY_PARTS",
    "PART_HEADER",
    "REPLY_WINDOW_S",
    "Assembly",
    "ReplyPartError",
    "split",
]

#: The header of each part of a reply sent in parts.
PART_HEADER: Final = "Dracap-Reply-Part"
#: The most parts one reply may have (and the broker lets a service send per request).
MAX_REPLY_PARTS: Final = 64
#: How long after a request arrives the broker lets a service reply to it (seconds):
#: above every requester's timeout, and the bound on the broker's record of requests.
REPLY_WINDOW_S: Final = 30
#: Bytes of ``max_payload`` left for a part's headers.
HEADROOM: Final = 1024

_PART: Final = re.compile(r"([0-9]{1,4})/([0-9]{1,4})")


def split(data: bytes, max_payload: int) -> list[tuple[bytes, dict[str, str] | None]] | None:
    """The messages that carry ``data`` (payload, headers); ``None`` when it would take
    more than :data:`MAX_REPLY_PARTS`."""
    budget = max(max_payload - HEADROOM, 1)
    if len(data) <= budget:
        return [(data, None)]
    count = -(-len(data) // budget)
    if count > MAX_REPLY_PARTS:
        return None
    return [
        (data[i * budget : (i + 1) * budget], {PART_HEADER: f"{i + 1}/{count}"})
        for i in range(count)
    ]


class ReplyPartError(PermanentError):
    """A message that is not the next part of the reply being put together."""


class Assembly:
    """Joins the messages of one reply (see the module docstring)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._count = 0

    def add(self, data: bytes, headers: dict[str, str] | None) -> bytes | None:
        """Take the next message; the whole reply once it is complete, else ``None``."""
        part = (headers or {}).get(PART_HEADER)
        if part is None:
            if self._parts:
                raise ReplyPartError(f"a whole reply arrived after part {len(self._parts)}")
            return data
        found = _PART.fullmatch(part)
        if found is None:
            raise ReplyPartError(f"{PART_HEADER} {part!r} is not <index>/<count>")
        index, count = int(found[1]), int(found[2])
        if not 2 <= count <= MAX_REPLY_PARTS:
            raise ReplyPartError(f"{PART_HEADER} {part!r}: 2 to {MAX_REPLY_PARTS} parts")
        if self._count and count != self._count:
            raise ReplyPartError(f"{PART_HEADER} {part!r}: the reply has {self._count} parts")
        if index != len(self._parts) + 1:
            raise ReplyPartError(f"{PART_HEADER} {part!r}: expected part {len(self._parts) + 1}")
        self._count = count
        self._parts.append(data)
        if index < count:
            return None
        return b"".join(self._parts)
