"""The restart plan: kept, reapplied, orphaned and stale shares (no kernel, no log)."""

from __future__ import annotations

import datetime

from events.fold import ClusterState, ShareState
from events.quantities import Quantity
from services.enforcement.checkpointing import CheckpointEntry
from services.enforcement.enforcers import AppliedLimit, ShareLimit
from services.enforcement.reconciling import plan_reconcile

NODE = "node-a"
BW = {"bandwidth": Quantity.parse("10M")}


def _share(share_id: str, state: str, node: str = NODE, level: str | None = "hard") -> ShareState:
    return ShareState(
        share_id=share_id,
        state=state,  # type: ignore[arg-type]
        claim=("ns", share_id),
        request="r",
        allocation_version=1,
        driver="d",
        pool="p",
        device="eth0",
        node=node,
        shared=True,
        admin_access=False,
        consumed=dict(BW),
        policy_version=1,
        limit_level=level if state == "ready" else None,
        actual=dict(BW) if state == "ready" else None,
    )


def _entry(share_id: str) -> CheckpointEntry:
    limit = ShareLimit(share_id=share_id, driver="d", pool="p", device="eth0", consumed=BW)
    now = datetime.datetime.now(datetime.UTC)
    return CheckpointEntry(share_id=share_id, phase="started", limit=limit, updated_at=now)


def test_plan_sorts_every_share_into_one_outcome() -> None:
    state = ClusterState()
    for share in [
        _share("kept", "ready"),
        _share("missing", "ready"),
        _share("changed", "ready"),
        _share("bound-in", "bound"),
        _share("bound-out", "bound"),
        _share("releasing", "releasing"),
        _share("none-level", "ready", level="none"),
        _share("released", "released"),
        _share("other-node", "ready", node="node-b"),
    ]:
        state.shares[share.share_id] = share
    hard = AppliedLimit(level="hard", actual=dict(BW))
    observed = {
        "kept": hard,
        "changed": AppliedLimit(level="hard", actual={"bandwidth": Quantity.parse("5M")}),
        "bound-in": hard,
        "releasing": hard,
        "released": hard,
        "orphan": hard,
    }
    entries = {s: _entry(s) for s in ("stale", "kept", "released")}
    plan = plan_reconcile(state, NODE, observed, entries)
    assert plan.kept == ["bound-in", "kept", "releasing"]
    assert plan.reapply_ids == ["changed", "missing"]
    assert plan.orphans == ["orphan", "released"]
    assert plan.stale == ["stale"]
