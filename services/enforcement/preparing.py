"""What a kubelet prepare of a claim mirrored from Kubernetes finds in the log (pure).

The kubelet names a claim by namespace, name and UID. :func:`judge_prepare` reads the
folded log and says one of:

* ``wait``: the log holds no claim of that name and UID mirrored from Kubernetes yet (the
  bridge has not seen the allocation), or this node's lease is being taken back (a share
  is ``unknown``); the kubelet's call waits a bounded time, then fails and is retried;
* ``refused``: dracap refused the allocation (it would break the ledger's invariants),
  the claim failed (its limit cannot be applied), its allocation was released, or none of
  its shares is on this node — with the reason the kubelet shows in the Pod's events;
* ``enforce``: some of this node's shares are ``bound``: their limits are applied now
  (:func:`~services.enforcement.decisions.enforce_claim`, the same rules as for a
  standalone claim's ``AllocationBound``, the last-line-of-defense check included);
* ``retrying``: a limit failed and waits for its next try; the prepare fails with the
  reason and the kubelet tries again;
* ``prepared``: every share of this node is ``ready``; the prepare answers with them,
  the same answer every time it is asked (idempotent).
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from events.state import ClusterState

__all__ = ["PrepareVerdict", "judge_prepare"]

Verdict = Literal["wait", "refused", "enforce", "retrying", "prepared"]

_GONE: Final = frozenset({"releasing", "released", "withdrawn"})


class PrepareVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """What the log says about preparing one claim on one node."""

    verdict: Verdict
    reason: str = ""
    share_ids: tuple[str, ...] = ()  #: the claim's shares on this node, in allocation order


def judge_prepare(
    state: ClusterState, node: str, namespace: str, name: str, uid: str
) -> PrepareVerdict:
    """The verdict for preparing ``namespace/name`` (UID ``uid``) on ``node``."""
    claim = state.claims.get((namespace, name))
    if claim is None or claim.source != "kubernetes" or claim.uid != uid:
        return PrepareVerdict(
            verdict="wait", reason=f"claim {namespace}/{name} (uid {uid}) is not mirrored yet"
        )
    phase = claim.phase
    if phase == "rejected":
        return PrepareVerdict(verdict="refused", reason=claim.reason or "refused by dracap")
    if phase == "failed":
        return PrepareVerdict(verdict="refused", reason=claim.reason or "its limit failed")
    if phase in _GONE:
        return PrepareVerdict(
            verdict="refused",
            reason=f"the allocation was released in dracap ({phase}"
            + (f": {claim.reason}" if claim.reason else "")
            + "); Kubernetes must allocate the claim anew",
        )
    if phase not in ("allocated", "retrying", "ready", "stalled"):
        return PrepareVerdict(verdict="wait", reason=f"the claim is {phase}")
    mine = tuple(
        sid
        for sid in claim.share_ids
        if (share := state.shares.get(sid)) is not None and share.node in (None, node)
    )
    if not mine:
        return PrepareVerdict(
            verdict="refused",
            reason=f"none of the claim's devices is on node {node} (allocated on {claim.node})",
        )
    states = [state.shares[sid].state for sid in mine]
    if "unknown" in states:
        return PrepareVerdict(
            verdict="wait", reason=f"node {node} is taking its lease back", share_ids=mine
        )
    if all(s == "ready" for s in states):
        return PrepareVerdict(verdict="prepared", share_ids=mine)
    if phase == "retrying":
        return PrepareVerdict(verdict="retrying", reason=claim.reason or "", share_ids=mine)
    return PrepareVerdict(verdict="enforce", share_ids=mine)
