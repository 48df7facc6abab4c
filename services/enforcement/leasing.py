"""The node agent's lease: taken with an event, renewed without one, lost for good.

A node agent writes only while it holds its node's lease (migration 0007,
``docs/reclamation.md``):

* :meth:`NodeLease.acquire` appends ``NodeLeaseAcquired(node, epoch, boot_id, ttl_ms)``
  with ``epoch`` one more than the newest epoch the node had (a lease, an expiry or a
  fence). The store's ``acquire`` guard checks that number under the log's head lock
  and writes the lease row; two agents of one node racing both read the same number,
  one wins, the other gets a :class:`~services.runtime.errors.ConflictError` and
  reads again. The event is the agent's first write under the new epoch.
* :meth:`NodeLease.renew` moves the row's expiry by ``ttl`` (``dracap_renew_lease``),
  every ``ttl / 3``; it is no event. It fails once the lease expired, was fenced or a
  newer lease exists: the lease is then *lost*, and this object never renews it again.
* :attr:`NodeLease.actor` is ``agent:<node>#<epoch>``: every append of the agent names
  its epoch, and the store refuses (and records) one whose epoch is stale.

The agent runs :meth:`NodeLease.keep` beside its consumer: on a lost lease it stops
taking new work, takes the next lease, reconciles (confirms what it still enforces,
releases what it does not), and only then goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from events.actors import Actor
from events.catalog import EnforcementLevel, NodeLeaseAcquired, lease_stream
from services.runtime.errors import ConflictError, RetryableError
from services.runtime.eventstore import EventStore

__all__ = ["DEFAULT_TTL_S", "NodeLease"]

log = logging.getLogger("dracap.agent")

#: Lease time to live unless configured (``dracap agent --lease-ttl``).
DEFAULT_TTL_S: Final = 10.0
_NEWEST_EPOCH: Final = (
    "SELECT greatest(coalesce((SELECT epoch FROM node_leases WHERE node = $1), 0),"
    " coalesce((SELECT epoch FROM node_epochs WHERE node = $1), 0))"
)


class NodeLease:
    """The lease of one node's agent (see the module docstring)."""

    def __init__(
        self,
        store: EventStore,
        node: str,
        *,
        boot_id: str,
        ttl_s: float = DEFAULT_TTL_S,
        enforcement: EnforcementLevel = "none",
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("the lease time to live must be positive")
        self.store = store
        self.node = node
        self.boot_id = boot_id
        self.ttl_s = ttl_s
        self.enforcement: EnforcementLevel = enforcement
        self.epoch: int | None = None  #: the epoch held (None: none yet)
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
            newest = int(await self.store.pool.fetchval(_NEWEST_EPOCH, self.node) or 0)
            epoch = newest + 1
            event = NodeLeaseAcquired(
                node=self.node,
                epoch=epoch,
                boot_id=self.boot_id,
                ttl_ms=round(self.ttl_s * 1000),
                enforcement=self.enforcement,
            )
            try:
                await self.store.append(
                    lease_stream(self.node),
                    None,
                    [event],
                    actor=str(Actor.agent(self.node, epoch)),
                )
            except (ConflictError, RetryableError) as exc:
                log.info("lease of node %s: %s; trying again", self.node, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            self.epoch = epoch
            log.info("node %s: lease of epoch %d taken (boot %s)", self.node, epoch, self.boot_id)
            return epoch

    async def renew(self) -> bool:
        """Extend the lease held; False when it is lost (expired, fenced or superseded)."""
        if self.epoch is None:
            return False
        expires = await self.store.pool.fetchval(
            "SELECT dracap_renew_lease($1, $2)", self.node, self.epoch
        )
        return expires is not None

    async def keep(self, stop: asyncio.Event, on_lost: Callable[[], Awaitable[None]]) -> None:
        """Renew every ``ttl / 3`` until ``stop``; on a lost lease, call ``on_lost``.

        ``on_lost`` takes the next lease and reconciles; a renewal that fails on an
        outage is tried again at the next tick (the lease may still be valid).
        """
        interval = self.ttl_s / 3
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
                return
            except TimeoutError:
                pass
            try:
                renewed = await self.renew()
            except Exception as exc:  # an outage: the next tick tries again
                log.warning("lease of node %s not renewed: %s", self.node, exc)
                continue
            if not renewed:
                log.warning("node %s: lease of epoch %s is lost", self.node, self.epoch)
                await self.lost(on_lost)

    async def lost(self, on_lost: Callable[[], Awaitable[None]]) -> None:
        """Stop taking work and run ``on_lost`` (again after a failure) until it succeeds."""
        self.held.clear()
        delay = 0.1
        while True:
            try:
                await on_lost()
            except Exception as exc:
                log.error("node %s: could not take its lease back: %s", self.node, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            self.held.set()
            return
