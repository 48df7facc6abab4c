"""The restart plan: kept, reapplied, orphaned and stale shares (no kernel, no log)."""

from __future__ import annotations

import datetime

import msgspec

from events.quantities import Quantity
from events.state import ClaimState, ClusterState, ShareState
from services.enforcement.checkpointing import CheckpointEntry
from services.enforcement.enforcers import AppliedLimit, ShareLimit
from services.enforcement.reconciling import plan_reconcile, plan_return

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


def _unknown(share_id: str, prior: str, *, level: str | None = "hard") -> ShareState:
    share = _share(share_id, "unknown")
    share.prior_state = prior  # type: ignore[assignment]
    share.limit_level = level
    return share


def _return_state() -> ClusterState:
    state = ClusterState()
    for share in [
        _unknown("enforced", "ready"),
        _unknown("gone", "ready"),
        _unknown("pending", "bound", level=None),
        _unknown("no-limit", "ready", level="none"),
        _unknown("deleted", "ready"),
        _share("ready", "ready"),
        _unknown("elsewhere", "ready"),
    ]:
        state.shares[share.share_id] = share
    state.shares["elsewhere"].node = "node-b"
    for share in state.shares.values():
        phase = "releasing" if share.share_id == "deleted" else "ready"
        state.claims[share.claim] = ClaimState(
            namespace="ns", name=share.share_id, phase=phase, allocation_version=1
        )
    return state


def test_a_returning_agent_confirms_what_it_enforces_and_releases_the_rest() -> None:
    hard = AppliedLimit(level="hard", actual=dict(BW))
    observed = {"enforced": hard, "deleted": hard, "ready": hard}
    plan = plan_return(_return_state(), NODE, rebooted=None, observed=observed, entries={})
    assert plan.confirm == ["enforced", "no-limit", "pending"]
    assert [s.share_id for s in plan.release] == ["deleted", "gone"]
    assert plan.remove == ["deleted"], "a deleted claim's limit comes down first"
    assert list(plan.fail) == ["gone"] and "no longer in force" in plan.fail["gone"]


def test_without_the_kernel_the_checkpoint_says_what_is_enforced() -> None:
    done = msgspec.structs.replace(_entry("gone"), phase="completed")
    plan = plan_return(_return_state(), NODE, rebooted=None, observed=None, entries={"gone": done})
    assert plan.confirm == ["gone", "no-limit", "pending"]
    assert list(plan.fail) == ["enforced"], "no completed entry: not known to be in force"


def test_after_a_reboot_every_unknown_share_is_released_and_its_claim_failed() -> None:
    hard = AppliedLimit(level="hard", actual=dict(BW))
    why = "node node-a rebooted (boot id a -> b): its limits are gone"
    plan = plan_return(_return_state(), NODE, rebooted=why, observed={"enforced": hard}, entries={})
    released = [s.share_id for s in plan.release]
    assert released == ["deleted", "enforced", "gone", "no-limit", "pending"]
    assert plan.confirm == [] and plan.remove == []
    assert set(plan.fail) == set(released) and set(plan.fail.values()) == {why}
