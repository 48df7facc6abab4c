"""What a restarting node agent must do: three views of the node's limits, one plan.

When the agent starts it compares

* the **log** (the fold of the event log, :class:`~events.fold.ClusterState`): which
  shares of this node are live and which of them are ``ready`` (their ``LimitApplied``
  is recorded, with the amounts that were in force);
* the **kernel** (``Enforcer.observe()``): which shares have a limit in force now, with
  the amounts read back;
* the **checkpoint** (:mod:`services.enforcement.checkpointing`): which operations the
  previous run started, finished, or was taking away;

and :func:`plan_reconcile` (pure) says what to do about each share:

* ``kept``: a share the log owns whose limit is in force with the amounts the log
  recorded. It is **not** applied again: no enforcer call, no second ``LimitApplied``.
* ``reapply``: a ``ready`` share whose limit is missing from the kernel (a reboot, a
  daemon that died, a hand-deleted class) or in force with other amounts: the limit is
  put back (``apply`` is idempotent and changes in place). No event but the report: the
  claim already is ``Ready``.
* ``orphans``: a limit in force that no live share of this node owns (a release the
  agent carried out in the kernel but never recorded, a share of a claim that failed,
  something a previous deployment left): removed.
* ``stale``: a checkpoint entry no live share owns and the kernel does not show (an
  apply cut short before it reached the kernel, a daemon's leftover directories):
  ``remove`` is called once more, idempotently, and the entry is dropped.

Shares the log owns but has not made ready (``reserved``/``bound``: their
``AllocationBound`` is still being handled, or will be redelivered) are left to the
consumer: if their limit is already in the kernel it is kept, otherwise the consumer
applies it and records the (first) ``LimitApplied``. ``releasing`` and ``unknown``
shares are owned too (never removed as orphans) but not put back: the release
consumer, or the reclamation service, decides their fate. Shares whose limit level is
``none`` (admin access, the :class:`~services.enforcement.enforcers.NoneEnforcer`)
have nothing in force to find, so they are neither reapplied nor reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from events.fold import ClaimState, ClusterState, ShareState
from events.quantities import Quantity
from services.enforcement.checkpointing import CheckpointEntry
from services.enforcement.enforcers import AppliedLimit

__all__ = ["OWNED_STATES", "ReconcilePlan", "owned_shares", "plan_reconcile"]

#: Share states whose limit belongs on the node (never removed as an orphan).
OWNED_STATES: Final = frozenset({"reserved", "bound", "ready", "unknown", "releasing"})


@dataclass
class ReconcilePlan:
    """ShareIDs per outcome (each sorted), and the shares to put back."""

    kept: list[str] = field(default_factory=list)
    reapply: list[ShareState] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)

    @property
    def reapply_ids(self) -> list[str]:
        """The ShareIDs of :attr:`reapply`."""
        return [s.share_id for s in self.reapply]


def owned_shares(state: ClusterState, node: str) -> dict[str, ShareState]:
    """The shares of ``node`` whose limit belongs on it (see the module docstring)."""
    out: dict[str, ShareState] = {}
    for share_id, share in state.shares.items():
        if share.node != node or share.state not in OWNED_STATES:
            continue
        if _failed(state.claims.get(share.claim), share):
            continue
        out[share_id] = share
    return out


def _failed(claim: ClaimState | None, share: ShareState) -> bool:
    """Whether the share's allocation failed for good (a permanent ``LimitFailed``)."""
    return (
        claim is not None
        and claim.phase == "failed"
        and claim.allocation_version == share.allocation_version
    )


def _same(a: Mapping[str, Quantity], b: Mapping[str, Quantity]) -> bool:
    return a.keys() == b.keys() and all(a[k].nanos == b[k].nanos for k in a)


def plan_reconcile(
    state: ClusterState,
    node: str,
    observed: Mapping[str, AppliedLimit],
    entries: Mapping[str, CheckpointEntry],
) -> ReconcilePlan:
    """Compare log, kernel and checkpoint (see the module docstring)."""
    owned = owned_shares(state, node)
    plan = ReconcilePlan()
    for share_id in sorted(owned):
        share = owned[share_id]
        in_force = observed.get(share_id)
        if share.state == "ready":
            if share.limit_level == "none" or share.admin_access:
                continue
            recorded = share.actual or {}
            if in_force is not None and _same(in_force.actual, recorded):
                plan.kept.append(share_id)
            else:
                plan.reapply.append(share)
        elif in_force is not None:
            plan.kept.append(share_id)
    plan.orphans = sorted(set(observed) - set(owned))
    plan.stale = sorted(set(entries) - set(owned) - set(observed))
    return plan
