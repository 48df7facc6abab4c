"""The agent's last line of defense at constant cost: the same answers as the scan it replaced.

:func:`~services.enforcement.decisions.overcommit` used to scan every limit the agent
enforces for each capacity of each new limit, and each message group copied them all.
It now reads sums that :class:`~services.enforcement.enforcing.Enforcing` keeps (and a
:class:`~services.enforcement.enforcing.Draft` on top of them for a group). Hypothesis
runs random applies, removals, re-applies and group drafts against that scan, kept here
as the reference, and every answer (the refusal's text included) must be the same; the
last test shows that a check never lists what the node enforces.
"""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from events.quantities import Quantity
from events.state import ClusterState, DeviceKey, DeviceState
from services.enforcement.decisions import overcommit
from services.enforcement.enforcers import ShareLimit
from services.enforcement.enforcing import Draft, Enforcing
from tests.unit.decision_fixtures import Unscannable

DRIVER, POOL = "gpu.dracap.io", "node-a"
DEVICES = ("gpu-0", "gpu-1", "gpu-2")
TOTALS = {"memory": Quantity.parse("40Gi"), "cores": Quantity.parse("8")}


def _state() -> ClusterState:
    state = ClusterState()
    for name in DEVICES[:2]:  # gpu-2 is not published: refused whatever it asks
        key = (DRIVER, POOL, name)
        state.devices[key] = DeviceState(driver=DRIVER, pool=POOL, name=name, total=dict(TOTALS))
    return state


def scan(state: ClusterState, enforcing: Mapping[str, ShareLimit], limit: ShareLimit) -> str | None:
    """The check as it was before (merge 4bf16f3): a scan of every limit in force."""
    if limit.admin_access or not limit.consumed:
        return None
    key: DeviceKey = (limit.driver, limit.pool, limit.device)
    where = "/".join(key)
    device = state.devices.get(key)
    if device is None:
        return f"refused: device {where} is not published"
    others = [
        other
        for share_id, other in enforcing.items()
        if share_id != limit.share_id
        and not other.admin_access
        and (other.driver, other.pool, other.device) == key
    ]
    for capacity, asked in sorted(limit.consumed.items()):
        total = device.total.get(capacity)
        if total is None:
            return f"refused: device {where} publishes no capacity {capacity!r}"
        held = [o.consumed[capacity] for o in others if capacity in o.consumed]
        enforced = Quantity(sum(q.nanos for q in held), total.format)
        if enforced.nanos + asked.nanos > total.nanos:
            wanted = Quantity(enforced.nanos + asked.nanos, total.format)
            return (
                f"refused: device {where} {capacity}: enforcing {enforced.canonical()} "
                f"({len(held)} share(s)) + asked {asked.canonical()} = {wanted.canonical()} "
                f"> total {total.canonical()}"
            )
    return None


_AMOUNTS = {
    "memory": st.sampled_from(["0", "5Gi", "10Gi", "20Gi", "30Gi", "40Gi", "41Gi"]),
    "cores": st.sampled_from(["1", "2", "4", "8"]),
    "vram": st.just("1Gi"),  # a capacity no device publishes
}


@st.composite
def limits(draw: st.DrawFn) -> ShareLimit:
    names = draw(st.sets(st.sampled_from(sorted(_AMOUNTS)), max_size=2))
    consumed = {name: Quantity.parse(draw(_AMOUNTS[name])) for name in sorted(names)}
    return ShareLimit(
        share_id=draw(st.sampled_from([f"s{i}" for i in range(6)])),
        driver=DRIVER,
        pool=POOL,
        device=draw(st.sampled_from(DEVICES)),
        consumed=consumed,
        admin_access=draw(st.booleans()),
    )


_STEP = st.tuples(st.sampled_from(["add", "discard", "check", "draft"]), limits())


@settings(max_examples=400, deadline=None)
@given(st.lists(_STEP, max_size=40))
def test_the_kept_sums_answer_as_the_scan_did(steps: list[tuple[str, ShareLimit]]) -> None:
    state = _state()
    reference: dict[str, ShareLimit] = {}
    kept = Enforcing()
    drafted: dict[str, ShareLimit] | None = None  # the reference copy a group made
    draft: Draft | None = None
    for op, limit in steps:
        if op == "draft":  # a group starts: later steps change the draft only
            drafted, draft = dict(reference), kept.draft()
        elif op == "add":
            if draft is not None and drafted is not None:
                drafted[limit.share_id] = limit
                draft.add(limit)
            else:
                reference[limit.share_id] = limit
                kept.add(limit)
        elif op == "discard":
            if draft is not None and drafted is not None:
                drafted.pop(limit.share_id, None)
                draft.discard(limit.share_id)
            else:
                reference.pop(limit.share_id, None)
                kept.discard(limit.share_id)
        current = drafted if drafted is not None else reference
        tally = draft if draft is not None else kept
        assert overcommit(state, tally, limit) == scan(state, current, limit)
    assert dict(kept) == reference


def _memory(share_id: str, amount: Quantity) -> ShareLimit:
    consumed = {"memory": amount}
    return ShareLimit(
        share_id=share_id, driver=DRIVER, pool=POOL, device="gpu-0", consumed=consumed
    )


GPU0 = (DRIVER, POOL, "gpu-0")


def test_a_draft_leaves_the_limits_in_force_unchanged() -> None:
    a = _memory("a", Quantity.parse("30Gi"))
    kept = Enforcing([a])
    draft = kept.draft()
    draft.discard("a")
    assert "a" not in draft and draft.held(GPU0, "memory") == (0, 0)
    assert kept["a"] == a and kept.held(GPU0, "memory") == (30 * 2**30 * 10**9, 1)


def test_the_check_never_lists_what_the_node_enforces() -> None:
    # the cost, without timing anything: 20,000 limits in force on the device, and the
    # check and a group's draft read kept sums only (listing them would raise)
    state = _state()
    one = Quantity(1, TOTALS["memory"].format)
    kept = Unscannable(_memory(f"held-{i}", one) for i in range(20_000))
    asked = _memory("new", Quantity.parse("1Gi"))
    draft = kept.draft()
    assert overcommit(state, draft, asked) is None
    draft.add(asked)
    assert draft.held(GPU0, "memory") == (20_000 + 2**30 * 10**9, 20_001)
