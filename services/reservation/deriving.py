"""The allocator's grants, derived from the fold. Pure: no I/O.

The allocator (:mod:`services.reservation.allocating`) works on an
:class:`~events.inventory.Inventory` (DeviceClasses and ResourceSlices, built from the
fold by :func:`events.inventory.build_inventory`) and an
:class:`~services.reservation.allocating.AllocatedState` (what is taken), which a
service fills from the fold's shares:

* :func:`grant_of` / :func:`live_grants`: one allocator grant per live share (states
  that hold capacity, ``unknown`` and ``releasing`` included). Dedicated devices are
  exclusive holds (no share id for the allocator), admin shares consume nothing; each
  grant names its claim's namespace (devices of a class that denies sharing across
  namespaces hold one namespace at a time).

The reservation service computes them once and then adds or removes single grants as
shares come and go.
"""

from __future__ import annotations

from collections.abc import Iterator

from events.state import LIVE_SHARE_STATES, ClusterState, ShareState
from services.reservation.outcomes import Grant

__all__ = ["grant_of", "live_grants"]


def grant_of(share: ShareState) -> Grant:
    """What one share takes, as the allocator counts it."""
    return Grant(
        request=share.request,
        device=share.device_key,
        share_id=share.share_id if share.shared else None,
        admin_access=share.admin_access,
        consumed=dict(share.consumed) if share.shared else {},
        namespace=share.claim[0],
    )


def live_grants(state: ClusterState) -> Iterator[tuple[str, Grant]]:
    """``(share id, grant)`` of every share that holds capacity."""
    for share_id, share in state.shares.items():
        if share.state in LIVE_SHARE_STATES:
            yield share_id, grant_of(share)
