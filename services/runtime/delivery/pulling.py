"""Pulling from a durable JetStream consumer: requests kept outstanding, messages as they come.

:class:`Puller` keeps pull requests outstanding on a private inbox (``batch`` messages,
expiring after ``expires``; a new request goes out when fewer than half a batch are
still asked for), so messages flow in as the stream gets them and a lone message is
taken at once — nats-py's ``fetch(n)`` would hold it until ``n`` had arrived or the
request expired. Each request has a reply subject of its own under the inbox, on which
its end status (expired, no messages) comes; a request is renewed shortly before it
expires, whether or not its end status ever comes, so there is always one at the
server.

How much the open requests may still bring is counted from below, never guessed: a
pulled message keeps its own subject, so nobody can tell which request brought it, and
nats-server hands a burst round robin to every request waiting (not to the oldest
first). So a request that is about to expire counts for nothing, and every message
received since the oldest request still counted was sent counts against the counted
ones. (Crediting each message to the oldest request let one the server no longer had
— its way back lost, see below, or its end status never come — take the credit for
what its renewal brought: the renewal looked unused though the server had filled it,
so nothing was asked for until it expired, with messages waiting; under load the same
happened again at every renewal, a stall of ``expires`` each time.)

A request must not wait longer than :data:`MAX_EXPIRES_S`: across the broker's
accounts the way back for a request's answers is kept only so long after the last one
(``response_threshold``, :data:`services.brokerauth.JS_RESPONSE_THRESHOLD`, which is
derived from it). A request that outlived it would stay at the server with nobody to
answer: the messages it is given are lost until the ack wait brings them back (30 s),
and its end status never comes.

A request is also lost, without a word, with the nats-server of a cluster that the
client was connected to: the consumer's leader drops a waiting request whose reply
subject lost its interest. Counted on until its expiry, it stalled the consumer that
long after a server was killed (a node agent's 20 s request: 13-20 s; issue 29). So
every request still counted is forgotten once the connection is back on another server
(nats-py's count of reconnects moved), and a new one goes out at once. (A request the
server still held would cost one batch more in flight, no more.) A request on a
connection that stayed is not lost when the consumer's leader dies: the leader elected
next serves it (nats-server 2.10 and later; seen with 2.15).

A request nobody receives (nats-server answers ``503``: the durable does not exist, a
broker that lost its store, or a clustered consumer between two leaders) sets
:attr:`Puller.missing` for its consumer to act on (create the durable again if it owns
it, or say so once) and no request goes out for a while after it: a quarter of a second
after the first, twice as long after each one more, at most :data:`MISSING_WAIT_S` (or
``expires``, if shorter). One ``expires`` each time, as before, kept a node agent from
asking for 20 s when its first request after a server's loss met the election of the
consumer's new leader (a few seconds).

It publishes only the consumer's next-message subject (under the API prefix of the
connection's JetStream context: ``JS.API`` across the broker's imports,
:data:`~services.runtime.bus.credentials.JS_API_PREFIX`) and subscribes only to its own
inbox: all a credential needs to take messages from a consumer someone else created
(a node agent's, :mod:`services.enforcement.consumer`). The service consumers
(:mod:`services.runtime.delivery.consuming`) pull with it too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import time
from typing import Final

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import Header

from services.runtime.ground.waiting import wait_for

__all__ = ["MAX_EXPIRES_S", "MISSING_WAIT_S", "PULL_SUBJECT", "Puller"]

#: JetStream's pull API, under an API prefix (``$JS.API`` is the default, no domain).
PULL_SUBJECT: Final = "{prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
#: A pull request about to expire is renewed this long before: the next one is already
#: at the server when it ends (its end status may never come — seen with nats-server
#: 2.10 — and messages must not wait for the poll interval meanwhile).
_RENEW_S: Final = 0.1
#: Status codes that end a pull request: no messages, request timeout, conflict.
_REQUEST_ENDED: Final = frozenset({"404", "408", "409"})
#: The status of a pull request nobody received: the durable does not exist.
_NO_RESPONDERS: Final = "503"
#: The longest wait before asking again after requests that nobody received.
MISSING_WAIT_S: Final = 2.0
#: ... and the first such wait.
_MISSING_FIRST_S: Final = 0.25
#: The longest a pull request may wait at the server (module docstring): the node
#: agents' (:data:`services.enforcement.consumer.PULL_EXPIRES_S`) is the longest.
MAX_EXPIRES_S: Final = 20.0


class Puller:
    """Pull requests kept outstanding on a private inbox (see the module docstring)."""

    def __init__(
        self,
        nc: Client,
        stream: str,
        durable: str,
        *,
        batch: int,
        expires: float,
        prefix: str = "$JS.API",
    ) -> None:
        if not 0 < expires <= MAX_EXPIRES_S:
            raise ValueError(f"a pull request expires after 0 to {MAX_EXPIRES_S} s, not {expires}")
        self._nc = nc
        self._subject = PULL_SUBJECT.format(prefix=prefix, stream=stream, durable=durable)
        self._batch = batch
        self._expires = expires
        #: per request still open, oldest first, by its reply token: (when the server
        #: expires it, messages received before it was sent)
        self._open: dict[str, tuple[float, int]] = {}
        self._received = 0  # messages received so far
        self._asked = 0  # requests sent (each gets its own reply subject)
        self._inbox = nc.new_inbox()
        self._sub: Subscription | None = None
        self._ready: collections.deque[Msg] = collections.deque()
        self._arrival = asyncio.Event()
        #: a request found nobody to answer it: the durable is missing (taken by the consumer)
        self.missing = False
        self._quiet_until = 0.0  # no request before then (the durable was missing)
        self._quiet_s = 0.0  # the last such wait (0: the last request was received)
        self._reconnects = self._reconnect_count()

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(f"{self._inbox}.*", cb=self._arrived)

    async def _arrived(self, msg: Msg) -> None:
        status = (msg.headers or {}).get(Header.STATUS.value) if not msg.data else None
        if status is None:  # a message: it keeps its own subject (which request? unknown)
            self._received += 1
            self._ready.append(msg)
            self._quiet_s = 0.0
        elif status in _REQUEST_ENDED:  # a status comes on the request's reply subject
            self._open.pop(msg.subject.rpartition(".")[2], None)
            self._quiet_s = 0.0
        elif status == _NO_RESPONDERS:  # nobody took it: ask again after a while
            self._open.pop(msg.subject.rpartition(".")[2], None)
            self.missing = True
            longest = min(MISSING_WAIT_S, self._expires)
            self._quiet_s = min(longest, 2 * self._quiet_s or _MISSING_FIRST_S)
            self._quiet_until = time.monotonic() + self._quiet_s
        self._arrival.set()

    async def _ask(self) -> None:
        now = time.monotonic()
        if now < self._quiet_until:
            return
        for token in [t for t, (expiry, _) in self._open.items() if expiry < now]:
            del self._open[token]  # expired at the server, and its end status never came
        reconnects = self._reconnect_count()
        if reconnects != self._reconnects:  # back on another server: its requests are gone
            self._reconnects = reconnects
            self._open.clear()
        if self._room(now) > self._batch // 2:
            return
        expires_ns = int(self._expires * 1e9)
        request = json.dumps({"batch": self._batch, "expires": expires_ns}).encode()
        token = str(self._asked)
        self._asked += 1
        self._open[token] = (now + self._expires, self._received)
        await self._nc.publish(self._subject, request, reply=f"{self._inbox}.{token}")

    def _reconnect_count(self) -> int:
        stats = getattr(self._nc, "stats", None)  # nats-py's counters
        return int(stats.get("reconnects", 0)) if isinstance(stats, dict) else 0

    def _room(self, now: float) -> int:
        """The fewest messages the requests not about to expire can still bring: whatever
        request the server gave each message to (module docstring)."""
        counted = [since for expiry, since in self._open.values() if expiry - _RENEW_S > now]
        if not counted:
            return 0
        return len(counted) * self._batch - (self._received - min(counted))

    def _renew_in(self) -> float:
        """Seconds until the next request not yet renewed is due (inf: none)."""
        now = time.monotonic()
        due = (expiry - _RENEW_S for expiry, _ in self._open.values() if expiry - _RENEW_S > now)
        return min(due, default=math.inf) - now

    async def next(self, timeout: float, most: int) -> list[Msg]:  # noqa: ASYNC109
        """The messages that have arrived (waiting up to ``timeout`` for the first)."""
        deadline = time.monotonic() + timeout
        while True:
            # cleared before looking, never after: a message that arrives while the
            # request below is being sent must not wait for the timeout
            self._arrival.clear()
            if self._ready:
                break
            await self._ask()
            if self._ready:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            with contextlib.suppress(TimeoutError):  # woken to renew a request in time
                await wait_for(self._arrival.wait(), min(left, self._renew_in()))
        ready = self._ready
        out = [ready.popleft() for _ in range(min(most, len(ready)))]
        await self._ask()  # keep the flow going while this group is handled
        return out

    @property
    def waiting(self) -> int:
        """Messages that have arrived and wait to be taken."""
        return len(self._ready)

    async def stop(self) -> list[Msg]:
        """Stop receiving; returns the messages that had arrived but were not taken."""
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()
        left, self._ready = list(self._ready), collections.deque()
        return left
