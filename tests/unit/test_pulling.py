"""Pull requests kept outstanding (services.runtime.delivery.pulling), against a model of the
server.

The model does what nats-server does with pull requests (checked against the real one in
tests/integration/test_pulling.py): the requests waiting are served round robin, one
message each in turn; a request that has had its batch ends without a word; one that
expires ends with a ``408``. It can also lose a request without a word (as a broker
did whose way back for the answers had gone: the response threshold of an import, seen
with the node agents' 20 s requests under a 10 s threshold). Time is the test's.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from nats.aio.msg import Msg

from services import brokerauth
from services.enforcement import consumer
from services.runtime.delivery import pulling
from services.runtime.delivery.pulling import MAX_EXPIRES_S, Puller


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _Server:
    """A durable pull consumer at the server, and the client connection of the puller."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.waiting: collections.deque[list[Any]] = collections.deque()  # [reply, left, expiry]
        self.stored = 0  # messages the stream holds that nobody was given yet
        self.given = 0
        self.lose_next = False  # the next request vanishes without a word
        self._deliver: Callable[[Msg], Awaitable[None]] | None = None

    # -- the client connection the Puller uses --------------------------------------

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def subscribe(self, subject: str, cb: Callable[[Msg], Awaitable[None]]) -> None:
        self._deliver = cb

    async def publish(self, subject: str, data: bytes, reply: str) -> None:
        asked = json.loads(data)
        request = [reply, asked["batch"], self.clock.now + asked["expires"] / 1e9]
        if self.lose_next:
            self.lose_next = False
            return
        self.waiting.append(request)
        await self._give()

    # -- the server -------------------------------------------------------------------

    async def store(self, count: int) -> None:
        self.stored += count
        await self._give()

    async def _give(self) -> None:
        assert self._deliver is not None
        while self.stored and self.waiting:
            request = self.waiting.popleft()
            self.stored -= 1
            request[1] -= 1
            self.given += 1
            await self._deliver(Msg(None, subject="events.x", data=b"%d" % self.given))  # type: ignore[arg-type]
            if request[1] > 0:
                self.waiting.append(request)  # round robin

    async def expire(self) -> None:
        assert self._deliver is not None
        for request in [r for r in self.waiting if r[2] <= self.clock.now]:
            self.waiting.remove(request)
            headers = {"Status": "408", "Nats-Pending-Messages": str(request[1])}
            await self._deliver(Msg(None, subject=request[0], data=b"", headers=headers))  # type: ignore[arg-type]

    def idle_with_messages(self) -> bool:
        """Messages stored, and no request waiting for them."""
        return bool(self.stored) and not self.waiting


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(pulling, "time", clock)
    return clock


async def test_a_renewal_filled_at_once_is_counted_full(clock: _Clock) -> None:
    server = _Server(clock)
    puller = Puller(server, "S", "d", batch=4, expires=20.0)  # type: ignore[arg-type]
    await puller.start()
    server.lose_next = True  # the first request is gone at the server, not in the books
    assert await puller.next(0, 4) == []
    await server.store(4)  # nobody is given them: none waits at the server
    clock.now += 20.0 - 0.05  # the first request is due for renewal: the next one goes out
    got = await puller.next(0, 4)
    assert len(got) == 4  # the renewal brought all four and is done at the server
    await server.store(1)
    assert await puller.next(0, 4) != []  # not after the renewal expires, 20 s later
    assert not server.idle_with_messages()


async def test_a_lost_request_holds_messages_back_once_at_most(clock: _Clock) -> None:
    """Bursts, a handler taking a few at a time, round robin at the server, and the first
    request lost: once that one has expired, whenever the puller has taken all it got, a
    request waits at the server."""
    server = _Server(clock)
    puller = Puller(server, "S", "d", batch=8, expires=20.0)  # type: ignore[arg-type]
    await puller.start()
    server.lose_next = True
    bursts = [3, 9, 1, 16, 7, 2, 12, 5, 8, 4, 11, 6]
    for step in range(2000):  # 100 s
        clock.now += 0.05
        await server.expire()
        if step % 3 == 0:
            await server.store(bursts[step % len(bursts)])
        await puller.next(0, 3 + step % 5)
        if puller.waiting == 0 and step * 0.05 > 20.0:
            assert not server.idle_with_messages(), f"at {step * 0.05:.2f} s"


def test_no_pull_request_outlives_the_brokers_way_back() -> None:
    threshold = brokerauth.JS_RESPONSE_THRESHOLD
    assert threshold.endswith("s")
    assert consumer.PULL_EXPIRES_S <= MAX_EXPIRES_S < float(threshold[:-1]) - 5
    with pytest.raises(ValueError, match="expires"):
        Puller(_Server(_Clock()), "S", "d", batch=4, expires=MAX_EXPIRES_S + 1)  # type: ignore[arg-type]
