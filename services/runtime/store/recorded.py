"""What the log holds of a claim beyond what the fold keeps: its manifest, its allocation whole.

The fold keeps of a claim what decisions read (:class:`events.claimspecs.ClaimSpec`) and
its allocation without ``devices.config`` (:class:`events.state.ClaimState`), so that a
claim's memory does not grow with opaque configuration in every process. The few
readers that show or copy the rest read it here, from the log, when asked:

* :func:`manifests`: each claim's ResourceClaim as submitted — the newest
  ``ClaimSubmitted`` on the claim's stream at or before the position of the state that
  asks, which is the one that state folded last (the fold's step for it never refuses
  one). ``dracap claim get`` shows it; the reservation service copies its
  configuration into the allocations it binds;
* :func:`allocations`: each claim's current allocation whole — the ``AllocationBound``
  at its ``bound_position`` — for the claims whose allocation has a configuration
  (``ClaimState.allocation_configs``); the others' allocation is whole in the fold.

One query each, whatever the number of claims asked about; a read costs what it
touches. A stored event that does not decode is left out (the caller then shows what
the fold has), as every reader of the log skips it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Final

import asyncpg

from events.catalog import EVENT_TYPES, AllocationBound, ClaimSubmitted
from events.envelopes import claim_stream
from events.model import AllocationResult, ResourceClaim
from events.state import ClaimKey, ClaimState
from services.runtime.store.eventstore import Connection
from services.runtime.store.rows import POSITION, SELECT, STREAM, decoded

__all__ = ["allocations", "manifests"]

_SUBMITTED: Final = next(tag for tag, cls in EVENT_TYPES.items() if cls is ClaimSubmitted)
_MANIFESTS: Final = (
    "SELECT DISTINCT ON (stream) "
    + SELECT.removeprefix("SELECT ")
    + " WHERE stream = ANY($1::text[]) AND type = $2 AND position <= $3"
    " ORDER BY stream, stream_version DESC"
)
_AT_POSITIONS: Final = f"{SELECT} WHERE position = ANY($1::bigint[])"

Reader = Connection | asyncpg.Pool


async def manifests(
    connection: Reader, keys: Collection[ClaimKey], at: int
) -> dict[ClaimKey, ResourceClaim]:
    """The manifest of each claim of ``keys`` as the state at position ``at`` folded it."""
    if not keys:
        return {}
    streams = {claim_stream(*key): key for key in keys}
    rows = await connection.fetch(_MANIFESTS, list(streams), _SUBMITTED, at)
    out: dict[ClaimKey, ResourceClaim] = {}
    for row in rows:
        event = decoded(row)  # a refused row (events.folding) is no manifest
        if isinstance(event, ClaimSubmitted):
            out[streams[row[STREAM]]] = event.claim
    return out


async def allocations(
    connection: Reader, claims: Iterable[ClaimState]
) -> dict[int, AllocationResult]:
    """The whole allocation of each of ``claims`` that the fold keeps without its
    configuration, by the position it was bound at (``ClaimState.bound_position``)."""
    positions = [c.bound_position for c in claims if c.allocation_configs and c.bound_position]
    if not positions:
        return {}
    out: dict[int, AllocationResult] = {}
    for row in await connection.fetch(_AT_POSITIONS, positions):
        event = decoded(row)
        if isinstance(event, AllocationBound):
            out[row[POSITION]] = event.allocation
    return out
