"""The node agent's lease: taken with an event, renewed without one, lost for good.

A node agent writes only while it holds its node's lease (migration 0007,
``docs/reclamation.md``). It asks for everything over NATS
(:class:`~services.enforcement.asking.ControlPlane`); the enforcement service does the
database's part (:mod:`services.enforcement.leases`):

* :meth:`NodeLease.acquire` asks for the node's next lease: the service appends
  ``NodeLeaseAcquired(node, epoch, boot_id, ttl_ms)`` with ``epoch`` one more than the
  newest epoch the node had (a lease, an expiry or a fence) and answers the epoch and
  the boot id of the lease before. The event is the agent's first write under the new
  epoch.
* :meth:`NodeLease.renew` sends a heartbeat every ``ttl / 3``; the service renews the
  beats of many nodes in one statement. No event. It answers "lost" once the lease
  expired, was fenced or a newer lease exists: the lease is then *lost*, and this object
  never renews it again. A whole ttl without an answer saying "held" (NATS or the
  service away, answers too late) is a lost lease too: it cannot still be held.
* :attr:`NodeLease.actor` is ``agent:<node>#<epoch>``: every report names its epoch, and
  the service (and the store) refuse one whose epoch is stale.

The agent runs :meth:`NodeLease.keep` beside its consumer: on a lost lease it stops
taking new work, takes the next lease, reconciles (confirms what it still enforces,
releases what it does not), and only then goes on. A heartbeat that gets no answer (the
service or NATS away) is an outage: it is tried at the next tick, and if the outage
outlasts the ttl the lease runs out at the database — the node's shares go Unknown and
fencing works exactly as when an agent lost its database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from events.actors import Actor
from events.catalog import EnforcementLevel
from services.enforcement.asking import ControlPlane
from services.runtime.ground.clock import SYSTEM, Clock
from services.runtime.ground.errors import ConflictError, RetryableError

__all__ = ["DEFAULT_TTL_S", "NodeLease"]

log = logging.getLogger("dracap.agent")

#: Lease time to live unless configured (``dracap agent --lease-ttl``).
DEFAULT_TTL_S: Final = 10.0


class NodeLease:
    """The lease of one node's agent (see the module docstring)."""

    def __init__(
        self,
        plane: ControlPlane,
        node: str,
        *,
        boot_id: str,
        ttl_s: float = DEFAULT_TTL_S,
        enforcement: EnforcementLevel = "none",
        clock: Clock = SYSTEM,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("the lease time to live must be positive")
        self.plane = plane
        self.node = node
        self.boot_id = boot_id
        self.ttl_s = ttl_s
        self.enforcement: EnforcementLevel = enforcement
        self.clock = clock  #: the clock of the renewals and back-offs
        self.epoch: int | None = None  #: the epoch held (None: none yet)
        #: the boot id of the node's lease before the one held ("": none)
        self.previous_boot_id = ""
        #: set while the lease is held and the agent may take work
        self.held = asyncio.Event()

    @property
    def actor(self) -> str:
        """``agent:<node>#<epoch>`` (``agent:<node>`` before the first lease)."""
        return str(Actor.agent(self.node, self.epoch))

    async def acquire(self) -> int:
        """Take the node's next lease (retrying races and outages); its epoch."""
        delay = 0.05
        while True:
            try:
                leased = await self.plane.lease(self.boot_id, self.ttl_s, self.enforcement)
            except (ConflictError, RetryableError) as exc:
                log.info("lease of node %s: %s; trying again", self.node, exc)
                await self.clock.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            self.epoch = leased.epoch
            self.previous_boot_id = leased.previous_boot_id
            log.info(
                "node %s: lease of epoch %d taken (boot %s)", self.node, leased.epoch, self.boot_id
            )
            return leased.epoch

    async def renew(self) -> bool:
        """Extend the lease held; False when it is lost (expired, fenced or superseded).

        The answer comes after the service's next renewal statement: it is waited for up
        to half the ttl (a heartbeat answered late still renewed the lease)."""
        if self.epoch is None:
            return False
        return await self.plane.heartbeat(self.epoch, timeout=max(self.ttl_s / 2, 0.5))

    async def keep(self, stop: asyncio.Event, on_lost: Callable[[], Awaitable[None]]) -> None:
        """Renew every ``ttl / 3`` until ``stop``; on a lost lease, call ``on_lost``.

        ``on_lost`` takes the next lease and reconciles; a renewal that fails on an
        outage is tried again at the next tick (the lease may still be valid). After a
        whole ttl without an answer saying "held" the lease cannot be held any more: it
        is lost, whether or not an answer saying so ever comes.
        """
        interval = self.ttl_s / 3
        held_at = self.clock.monotonic()
        while not stop.is_set():
            if await self.clock.wait(stop, interval):
                return
            try:
                renewed = await self.renew()
            except Exception as exc:  # an outage: the next tick tries again
                if self.clock.monotonic() - held_at <= self.ttl_s:
                    log.warning("lease of node %s not renewed: %s", self.node, exc)
                    continue
                log.warning("lease of node %s not renewed for a whole ttl: %s", self.node, exc)
                renewed = False
            if renewed:
                held_at = self.clock.monotonic()
                continue
            log.warning("node %s: lease of epoch %s is lost", self.node, self.epoch)
            await self.lost(on_lost)
            held_at = self.clock.monotonic()

    async def lost(self, on_lost: Callable[[], Awaitable[None]]) -> None:
        """Stop taking work and run ``on_lost`` (again after a failure) until it succeeds.

        ``on_lost`` takes the next lease, then reconciles, which may take longer than a
        ttl (many limits to read and put back, or a report of the old epoch still in
        flight that the reconcile waits for): the new lease is renewed meanwhile, so it
        does not expire before the agent holds it."""
        self.held.clear()
        delay = 0.1
        while True:
            try:
                await self._renewing(asyncio.ensure_future(on_lost()), self.epoch)
            except Exception as exc:
                log.error("node %s: could not take its lease back: %s", self.node, exc)
                await self.clock.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            self.held.set()
            return

    async def _renewing(self, work: asyncio.Future[None], lost_epoch: int | None) -> None:
        """Wait for ``work``, renewing every ``ttl / 3`` a lease taken since ``lost_epoch``
        (a failed renewal is left to :meth:`keep`'s next tick once ``work`` is done)."""
        interval = self.ttl_s / 3
        finished = asyncio.Event()
        work.add_done_callback(lambda _: finished.set())
        try:
            while True:
                if await self.clock.wait(finished, interval):
                    return work.result()
                if self.epoch is not None and self.epoch != lost_epoch:
                    with contextlib.suppress(Exception):
                        await self.renew()
        finally:
            if not work.done():
                work.cancel()
