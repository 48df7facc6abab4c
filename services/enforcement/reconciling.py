"""What a restarting node agent must do: three views of the node's limits, one plan.

When the agent starts it compares

* the **log** (the fold of the event log, :class:`~events.state.ClusterState`): which
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

A node that comes back after its lease expired finds some of its shares ``unknown``:
the control plane held their capacity while nobody could say whether their limits
still ran. :func:`plan_return` (pure) decides each of them before anything else:

* the node **rebooted** (the boot id of the new lease differs from the previous one):
  no limit survived, so every unknown share is *released*, its claim failed with that
  reason;
* the claim was deleted meanwhile (``releasing`` at the share's allocation, or the
  allocation is gone): *released*, its limit removed first if it is still in force;
* a share whose limit was not yet applied (it was ``reserved`` or ``bound``), or one
  with nothing to enforce (level ``none``, admin access), or whose limit the kernel
  still shows (the checkpoint, where the kernel cannot be read): *confirmed*;
* a ready share whose limit is gone: *released*, its claim failed ("no longer in force").

Shares the log owns but has not made ready (``reserved``/``bound``) are not part of the
plan: if their limit is already in the kernel it is kept; a ``bound`` one is applied
(again: ``apply`` is idempotent) and recorded after the plan, as its ``AllocationBound``
would have it (:func:`~services.enforcement.decisions.decide_bound`: that message may
have been taken while the share was ``unknown`` and acknowledged with nothing done),
even when the kernel cannot be read and the plan is skipped (its failure is then
recorded, and retried). A claim mirrored from Kubernetes has no such message: only the
kubelet's prepare applies and records its limits, so a limit in force for one of its
``reserved``/``bound`` shares (a prepare cut short between the kernel and its report, an
unprepare whose report did not land) is an orphan: removed, and applied again with its
record by the kubelet's next prepare. ``releasing`` and ``unknown`` shares are owned too
(never removed as orphans) but not put back: the release consumer, or the reclamation
service, decides their fate. Shares whose limit level is ``none`` (admin access, the
:class:`~services.enforcement.enforcers.NoneEnforcer`) have nothing in force to find, so
they are neither reapplied nor reported."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from events.quantities import Quantity
from events.state import ClaimState, ClusterState, ShareState
from services.enforcement.checkpointing import CheckpointEntry
from services.enforcement.enforcers import AppliedLimit

__all__ = [
    "OWNED_STATES",
    "ReconcilePlan",
    "ReturnPlan",
    "owned_shares",
    "plan_reconcile",
    "plan_return",
]

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
    unrecorded: list[str] = []
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
        elif in_force is not None and _unrecorded(state, share):
            unrecorded.append(share_id)
        elif in_force is not None:
            plan.kept.append(share_id)
    plan.orphans = sorted({*(set(observed) - set(owned)), *unrecorded})
    plan.stale = sorted(set(entries) - set(owned) - set(observed))
    return plan


def _unrecorded(state: ClusterState, share: ShareState) -> bool:
    """Whether a limit in force for ``share`` is one the log does not record as applied
    and nothing but a kubelet prepare would record: a share of a claim mirrored from
    Kubernetes, still ``reserved`` or ``bound`` (a prepare that stopped between the
    kernel and its report, or an unprepare whose report did not land). It is removed;
    the kubelet's next prepare applies and records it."""
    if share.state not in ("reserved", "bound"):
        return False
    claim = state.claims.get(share.claim)
    return claim is not None and claim.source == "kubernetes"


@dataclass
class ReturnPlan:
    """What a returning agent does with the unknown shares of its node (each sorted).

    ``confirm``: still enforced (or nothing to enforce); ``release``: give back, with
    ``fail`` the reason to fail the claim first (a share absent from it is released
    because its claim was deleted); ``remove``: limits in force to take down first.
    """

    confirm: list[str] = field(default_factory=list)
    release: list[ShareState] = field(default_factory=list)
    fail: dict[str, str] = field(default_factory=dict)
    remove: list[str] = field(default_factory=list)


def _deleted(claim: ClaimState | None, share: ShareState) -> bool:
    """Whether the share's claim no longer wants it (deleted, or allocated anew)."""
    return (
        claim is None
        or claim.allocation_version != share.allocation_version
        or claim.phase in ("releasing", "released", "withdrawn")
    )


def plan_return(
    state: ClusterState,
    node: str,
    *,
    rebooted: str | None,
    observed: Mapping[str, AppliedLimit] | None,
    entries: Mapping[str, CheckpointEntry],
) -> ReturnPlan:
    """Decide each unknown share of ``node`` (see the module docstring).

    ``rebooted``: why the limits are gone (the boot ids), or ``None`` for the same
    boot; ``observed``: the limits in force (``None``: the kernel could not be read,
    the checkpoint's completed entries stand in for it).
    """
    plan = ReturnPlan()
    for share_id in sorted(state.shares):
        share = state.shares[share_id]
        if share.node != node or share.state != "unknown":
            continue
        if observed is not None:
            in_force = share_id in observed
        else:
            entry = entries.get(share_id)
            in_force = entry is not None and entry.phase == "completed"
        if rebooted is not None:
            plan.fail[share_id] = rebooted
            plan.release.append(share)
        elif _deleted(state.claims.get(share.claim), share):
            plan.release.append(share)
            if in_force:
                plan.remove.append(share_id)
        elif (
            share.prior_state in ("reserved", "bound")
            or share.limit_level == "none"
            or share.admin_access
            or in_force
        ):
            plan.confirm.append(share_id)
        else:
            plan.fail[share_id] = f"the limit of share {share_id} was no longer in force"
            plan.release.append(share)
    return plan
