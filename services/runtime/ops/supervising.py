"""Supervision of the embedded servers of ``dracap up``: restart what dies, or give up.

``dracap up`` without server URLs runs PostgreSQL and nats-server itself
(:mod:`services.runtime.ops.embedded`), so it is also the one that must notice when one of
them dies and bring it back. :class:`Watchdog` does that, as one asyncio task:

* **Watching.** Every :data:`WATCH_INTERVAL_S` it asks each server whether its process
  still runs (``alive()``: a ``poll()`` of nats-server, ``postmaster.pid`` and a
  signal 0 for PostgreSQL — no I/O against the servers themselves; whether they
  *answer* is :mod:`services.runtime.ops.health`'s question).
* **Restarting.** A server that died is started again on the same port, so the URLs
  the services and ``connection.json`` hold stay valid: NATS clients reconnect by
  themselves (and re-subscribe; pull consumers send new pull requests once the old
  ones expire), asyncpg pools replace closed connections on the next acquire, and
  JetStream finds its stream and durable consumers in the same store. Nothing above
  the servers is rebuilt.
* **Back-off and limit** (:class:`RestartPolicy`): the *n*-th restart within the
  window waits ``first_delay_s * 2**(n-1)`` (at most ``max_delay_s``); a failed start
  counts as a restart and is tried again after the next delay. More than ``limit``
  restarts of one server within ``window_s`` — or any, with ``limit`` 0 — and the
  watchdog gives up: :meth:`Watchdog.run` raises :class:`RestartLimitError`, whose message is the
  one line ``dracap up`` prints before it exits with status 1.
* **One line per change.** ``embedded nats: killed by SIGKILL; restarting it (1 of 5
  within 600 s)``, then ``embedded nats: running again (down 1.2 s)`` — or one such
  line per failed start; never a traceback. Each start is counted in
  ``dracap_embedded_server_restarts_total{server}``.

A restart in progress is not interrupted by ``stop`` (a server half started would be
left behind); the watchdog returns after it, and ``dracap up`` stops the servers last.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import subprocess
import time
from collections.abc import Sequence
from typing import Final, NoReturn

import msgspec

from services.runtime.ground.metrics import EMBEDDED_SERVER_RESTARTS
from services.runtime.ground.waiting import wait_for
from services.runtime.ops.embedded import EmbeddedError, EmbeddedServer

__all__ = ["WATCH_INTERVAL_S", "RestartLimitError", "RestartPolicy", "Watchdog"]

log = logging.getLogger("dracap.supervising")

WATCH_INTERVAL_S: Final = 0.25


class RestartLimitError(EmbeddedError):
    """A server died more often than :class:`RestartPolicy` allows; the message says which."""


class RestartPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How often, and how soon, a dead server is started again."""

    limit: int = 5  #: restarts of one server allowed within ``window_s`` (0: never)
    window_s: float = 600.0
    first_delay_s: float = 0.5
    max_delay_s: float = 8.0

    def delay(self, earlier: int) -> float:
        """The wait before a restart that follows ``earlier`` restarts within the window."""
        return min(self.first_delay_s * 2.0**earlier, self.max_delay_s)


class Watchdog:
    """Keeps the embedded servers running (see the module docstring)."""

    def __init__(
        self,
        servers: Sequence[EmbeddedServer],
        policy: RestartPolicy = RestartPolicy(),  # noqa: B008 (frozen)
        *,
        interval: float = WATCH_INTERVAL_S,
    ) -> None:
        self.servers = tuple(servers)
        self.policy = policy
        self._interval = interval
        self._starts: dict[str, collections.deque[float]] = {
            s.name: collections.deque() for s in self.servers
        }
        self.down: dict[str, str] = {}  #: servers being restarted, with why they went
        self.restarts: dict[str, int] = {s.name: 0 for s in self.servers}  #: starts so far
        self.gave_up: str | None = None  #: why the watchdog gave up (then it has returned)
        for server in self.servers:
            EMBEDDED_SERVER_RESTARTS.labels(server=server.name)  # the series exists at 0

    async def run(self, stop: asyncio.Event) -> None:
        """Watch until ``stop`` is set; :class:`RestartLimitError` past the policy's limit."""
        while not await _stopped(stop, self._interval):
            for server in self.servers:
                if not server.alive():
                    await self._revive(server, stop)

    async def _revive(self, server: EmbeddedServer, stop: asyncio.Event) -> None:
        """Start ``server`` again until it runs, ``stop`` is set, or the limit is reached."""
        why = server.down_reason()
        went = time.monotonic()
        self.down[server.name] = why
        while True:
            earlier = self._recent_starts(server.name)
            if earlier >= self.policy.limit:
                self._give_up(server, why, earlier)
            log.warning(
                "embedded %s: %s; restarting it (%d of %d within %.0f s)",
                server.name,
                why,
                earlier + 1,
                self.policy.limit,
                self.policy.window_s,
            )
            if await _stopped(stop, self.policy.delay(earlier)):
                return
            failure = await self._start(server)
            if failure is None:
                break
            why = f"did not start again: {failure}"
        del self.down[server.name]
        log.info("embedded %s: running again (down %.1f s)", server.name, time.monotonic() - went)

    async def _start(self, server: EmbeddedServer) -> str | None:
        """One start of ``server`` (counted); None when it runs, else why not (one line)."""
        self._starts[server.name].append(time.monotonic())
        self.restarts[server.name] += 1
        EMBEDDED_SERVER_RESTARTS.labels(server=server.name).inc()
        try:
            await asyncio.to_thread(server.start)
        except (EmbeddedError, OSError, subprocess.SubprocessError) as exc:
            return " ".join(str(exc).split())
        return None

    def _recent_starts(self, name: str) -> int:
        """Starts of ``name`` within the policy's window (older ones are forgotten)."""
        starts, since = self._starts[name], time.monotonic() - self.policy.window_s
        while starts and starts[0] < since:
            starts.popleft()
        return len(starts)

    def _give_up(self, server: EmbeddedServer, why: str, earlier: int) -> NoReturn:
        """Raise :class:`RestartLimitError` with the one line ``dracap up`` ends with."""
        if self.policy.limit == 0:
            tail = "restarts are off"
        else:
            tail = f"gave up after {earlier} restarts within {self.policy.window_s:.0f} s"
        self.gave_up = f"embedded {server.name}: {why}; {tail} (its log: {server.log})"
        raise RestartLimitError(self.gave_up)


async def _stopped(stop: asyncio.Event, delay: float) -> bool:
    """Wait up to ``delay`` for ``stop``; whether it is set."""
    with contextlib.suppress(TimeoutError):
        await wait_for(stop.wait(), delay)
    return stop.is_set()
