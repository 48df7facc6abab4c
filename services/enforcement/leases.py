"""Node leases in the database, as the enforcement service keeps them for the node agents.

A node agent writes only under its node's lease (migration 0007, ``docs/reclamation.md``),
but it no longer reaches the database: it asks the enforcement service, which does what
the agent's own login did before, for any number of nodes over one connection pool:

* :func:`acquire` appends ``NodeLeaseAcquired(node, epoch, boot_id, ttl_ms)`` with
  ``epoch`` one more than the newest epoch the node had (a lease, an expiry or a
  fence), actor ``agent:<node>#<epoch>``. The store's ``acquire`` guard checks that
  number under the log's head lock; two agents of one node racing both read the same
  number, one wins, the other's append conflicts and it reads again.
* renewals are the store's: :meth:`~services.runtime.store.eventstore.EventStore.renew_leases`
  extends every lease of a tick in **one statement** (migration 0011's
  ``dracap_renew_leases(text[], bigint[])``): each ``(node, epoch)`` that is current,
  unexpired and not fenced moves its expiry by its own ttl on the database's clock; the
  answer names the nodes renewed, every other one is *lost* (expired, fenced or
  superseded) and is never revived. Heartbeats are not events.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from events.actors import Actor
from events.catalog import EnforcementLevel, NodeLeaseAcquired
from events.envelopes import lease_stream
from services.runtime.ground.errors import ConflictError, RetryableError
from services.runtime.store.eventstore import EventStore

__all__ = ["ACQUIRE_ATTEMPTS", "NEWEST_EPOCH", "acquire"]

log = logging.getLogger("dracap.enforcement")

NEWEST_EPOCH: Final = (
    "SELECT greatest(coalesce((SELECT epoch FROM node_leases WHERE node = $1), 0),"
    " coalesce((SELECT epoch FROM node_epochs WHERE node = $1), 0))"
)
#: Races lost in a row before :func:`acquire` gives up (the agent asks again).
ACQUIRE_ATTEMPTS: Final = 8


async def acquire(
    store: EventStore,
    node: str,
    *,
    boot_id: str,
    ttl_ms: int,
    enforcement: EnforcementLevel = "none",
) -> tuple[int, int]:
    """Take ``node``'s next lease: its epoch and the position of its ``NodeLeaseAcquired``.

    A race lost to another agent of the node is tried again, at most
    :data:`ACQUIRE_ATTEMPTS` times (then :class:`ConflictError`).
    """
    delay = 0.02
    for attempt in range(ACQUIRE_ATTEMPTS):
        newest = int(await store.pool.fetchval(NEWEST_EPOCH, node) or 0)
        epoch = newest + 1
        event = NodeLeaseAcquired(
            node=node, epoch=epoch, boot_id=boot_id, ttl_ms=ttl_ms, enforcement=enforcement
        )
        try:
            stored = await store.append(
                lease_stream(node), None, [event], actor=str(Actor.agent(node, epoch))
            )
        except ConflictError as exc:
            if attempt == ACQUIRE_ATTEMPTS - 1:
                raise
            log.info("lease of node %s: %s; trying again", node, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
            continue
        log.info("node %s: lease of epoch %d taken (boot %s)", node, epoch, boot_id)
        return epoch, stored[-1].position
    raise RetryableError(f"lease of node {node}: not taken")  # pragma: no cover
