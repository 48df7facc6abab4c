"""Heartbeats of many nodes, renewed together: one statement per tick, whatever the fleet.

Every node agent beats every ``ttl / 3`` (``dracap agent --lease-ttl``). Renewing each
beat on its own would cost the database one statement per beat — 1,500 a second for
5,000 nodes with the default 10 s ttl. :class:`Renewals` collects the beats that
arrive during one tick (:data:`TICK_S`) and renews them all with
:meth:`~services.runtime.store.eventstore.EventStore.renew_leases` (``dracap_renew_leases``),
then answers each: held or lost. A replica of the enforcement service therefore sends
at most ``1 / TICK_S`` renewal statements
a second, and none while no agent beats; a beat waits at most one tick plus the
statement for its answer, well inside the ttl.

Two beats of one node in one tick (an agent that retried) are one renewal; a beat
naming an older epoch than another of the same tick is answered "lost" at once (only
the newest lease can be current). A statement that fails (the database away) fails
every beat of the tick with the same error: the agents try again at their next beat,
as they did when each renewed on its own, and their leases run out if the outage
lasts.

The ticks are counted on the service's :class:`~services.runtime.ground.clock.Clock`
(the context's): a test moves a fake one to end a tick.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from services.runtime.ground.clock import SYSTEM, Clock
from services.runtime.ground.metrics import LEASE_RENEWAL_STATEMENTS, LEASE_RENEWALS
from services.runtime.ground.waiting import first_of

__all__ = ["TICK_S", "Renewals"]

log = logging.getLogger("dracap.enforcement")

#: Seconds between two renewal statements (at most) of one replica.
TICK_S: Final = 0.25

Renew = Callable[[Mapping[str, int]], Awaitable[set[str]]]


class Renewals:
    """The beats of one tick and the task that renews them (see the module docstring)."""

    def __init__(self, renew: Renew, *, tick_s: float = TICK_S, clock: Clock = SYSTEM) -> None:
        self._renew = renew
        self.tick_s = tick_s
        self.clock = clock  #: the clock the ticks are counted on
        #: node -> (epoch, the beats waiting for that renewal)
        self._pending: dict[str, tuple[int, list[asyncio.Future[bool]]]] = {}
        self._arrived = asyncio.Event()
        self.statements = 0  #: renewal statements sent so far

    async def beat(self, node: str, epoch: int) -> bool:
        """Renew ``node``'s lease of ``epoch`` with this tick's others; whether it is held."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        waiting = self._pending.get(node)
        if waiting is None or epoch > waiting[0]:
            if waiting is not None:
                for superseded in waiting[1]:
                    superseded.set_result(False)
            self._pending[node] = (epoch, [future])
        elif epoch == waiting[0]:
            waiting[1].append(future)
        else:
            future.set_result(False)  # a newer epoch of this node beats in this tick
        self._arrived.set()
        return await future

    async def run(self, stop: asyncio.Event) -> None:
        """Renew the beats of each tick until ``stop``; the beats still waiting then fail.

        The first beat after a quiet spell waits for the end of its tick too, so the beats
        of a whole fleet, spread over their ttl, are one statement per tick.
        """
        try:
            while not stop.is_set():
                await self._wait_for_beats(stop)
                await self.clock.wait(stop, self.tick_s)
                if stop.is_set():
                    break
                await self.tick()
        finally:
            self._fail_pending(ConnectionError("the enforcement service is stopping"))

    async def _wait_for_beats(self, stop: asyncio.Event) -> None:
        while not self._pending and not stop.is_set():
            self._arrived.clear()
            await first_of(self._arrived.wait(), stop.wait())

    async def tick(self) -> None:
        """Renew the beats collected so far in one statement and answer them."""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        self.statements += 1
        LEASE_RENEWAL_STATEMENTS.inc()
        try:
            renewed = await self._renew({node: epoch for node, (epoch, _) in pending.items()})
        except Exception as exc:
            log.warning("renewing %d lease(s) failed: %s", len(pending), exc)
            for _, futures in pending.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(exc)
            return
        for node, (_, futures) in pending.items():
            held = node in renewed
            LEASE_RENEWALS.labels(outcome="held" if held else "lost").inc()
            for future in futures:
                if not future.done():
                    future.set_result(held)

    def _fail_pending(self, exc: BaseException) -> None:
        pending, self._pending = self._pending, {}
        for _, futures in pending.values():
            for future in futures:
                if not future.done():
                    future.set_exception(exc)
