"""Placement policies: which eligible device each policy takes, on small hand-made cases.

Eligibility never depends on the policy: these tests pick between devices that all fit
(or show that a device that does not fit is never taken, however it ranks).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.errors import ValidationError
from events.manifests import load_documents
from events.quantities import Quantity
from events.tenancy import PLACEMENT, PLACEMENTS
from services.reservation.allocating import Allocator
from services.reservation.candidates import UNUSABLE, FreeIndex
from services.reservation.outcomes import Allocated, Grant, Unschedulable
from services.reservation.placement import fragmentation, value_order
from tests.unit.allocator_fixtures import (
    allocator,
    claim,
    decide,
    device,
    device_class,
    picked,
    request,
    slice_,
)

GI = 1024**3


def _fleet(policy: str, totals: list[str], used: dict[int, list[str]] | None = None) -> Allocator:
    """An allocator over devices gpu-0.. of ``totals``; ``used[i]``: shares on gpu-i."""
    devices = [device(f"gpu-{i}", {"memory": total}) for i, total in enumerate(totals)]
    alloc = allocator([slice_(devices)], [device_class(annotations={PLACEMENT: policy})])
    for i, sizes in (used or {}).items():
        for size in sizes:
            _place(alloc, i, size)
    return alloc


def _place(alloc: Allocator, index: int, size: str) -> None:
    """Commit a share of ``size`` on gpu-``index`` (as if decided earlier)."""
    alloc.add_grants(
        [
            Grant(
                request="r",
                device=alloc.inventory.devices[index].key,
                share_id=f"pre-{next(_ids)}",
                admin_access=False,
                consumed={"memory": Quantity.parse(size)},
                namespace="tenant-a",
            )
        ]
    )


_ids = itertools.count()


def _pick(alloc: Allocator, size: str = "10Gi") -> str:
    out = decide(alloc, claim(request(capacity={"memory": size})), node="node-a")
    return picked(out)[0][1]


# gpu-0: 40Gi with 10Gi used (30 free); gpu-1: 12Gi; gpu-2: 20Gi; gpu-3: 40Gi empty.
TOTALS = ["40Gi", "12Gi", "20Gi", "40Gi"]
USED = {0: ["10Gi"]}


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("first-fit", "gpu-0"),  # upstream: the first device that fits
        ("binpack", "gpu-1"),  # least left after the share: 2Gi
        ("spread", "gpu-3"),  # the emptiest: 40Gi free
        # every size seen is 10Gi: leaving 2Gi strands it (frag +2Gi); leaving 10Gi, 20Gi
        # or 30Gi strands nothing; of those, the least left: gpu-2 (10Gi left)
        ("fragmentation-aware", "gpu-2"),
    ],
)
def test_each_policy_takes_its_device(policy: str, expected: str) -> None:
    alloc = _fleet(policy, TOTALS, USED)
    assert _pick(alloc) == expected


def test_no_annotation_is_first_fit() -> None:
    devices = [device(f"gpu-{i}", {"memory": t}) for i, t in enumerate(TOTALS)]
    alloc = allocator([slice_(devices)])
    _place(alloc, 0, "10Gi")
    assert _pick(alloc) == "gpu-0"


@pytest.mark.parametrize("policy", PLACEMENTS)
def test_ties_go_to_the_first_device_in_upstream_order(policy: str) -> None:
    alloc = _fleet(policy, ["40Gi", "40Gi", "40Gi"])
    assert _pick(alloc) == "gpu-0"


@pytest.mark.parametrize("policy", PLACEMENTS)
def test_a_device_too_full_is_never_taken_however_it_ranks(policy: str) -> None:
    # gpu-0 has 8Gi free: binpack would love it, but 10Gi does not fit
    alloc = _fleet(policy, ["40Gi", "40Gi"], {0: ["32Gi"], 1: ["20Gi"]})
    assert _pick(alloc) == "gpu-1"
    out = decide(alloc, claim(request(capacity={"memory": "25Gi"})), node="node-a")
    assert isinstance(out, Unschedulable)


@pytest.mark.parametrize("policy", ["binpack", "spread", "fragmentation-aware"])
def test_a_request_policy_refusing_the_amount_makes_the_device_ineligible(policy: str) -> None:
    # gpu-0 ranks first for binpack (12Gi) but only takes 4Gi or 8Gi; gpu-1 is the emptiest
    # but refuses 10Gi too; gpu-2 is the only device that may take it
    only_small = {"validValues": ["4Gi", "8Gi"]}
    devices = [
        device("gpu-0", {"memory": ("12Gi", only_small)}),
        device("gpu-1", {"memory": ("80Gi", only_small)}),
        device("gpu-2", {"memory": "40Gi"}),
    ]
    alloc = allocator([slice_(devices)], [device_class(annotations={PLACEMENT: policy})])
    assert _pick(alloc) == "gpu-2"


@pytest.mark.parametrize("policy", PLACEMENTS)
def test_exclusive_holds_and_selectors_keep_devices_out(policy: str) -> None:
    devices = [
        device("gpu-0", {"memory": "40Gi"}, attributes={"tier": "gold"}),
        device("gpu-1", {"memory": "12Gi"}, attributes={"tier": "silver"}),
        device("gpu-2", {"memory": "80Gi"}, attributes={"tier": "silver"}),
    ]
    alloc = allocator([slice_(devices)], [device_class(annotations={PLACEMENT: policy})])
    silver = 'device.attributes["gpu.test.io"].tier == "silver"'
    out = decide(
        alloc, claim(request(capacity={"memory": "10Gi"}, selectors=[silver])), node="node-a"
    )
    assert picked(out)[0][1] in {"gpu-1", "gpu-2"}
    expected = {"binpack": "gpu-1", "spread": "gpu-2"}.get(policy)
    if expected:
        assert picked(out)[0][1] == expected


def test_binpack_fills_one_device_before_the_next_and_spread_levels_them() -> None:
    packed = _fleet("binpack", ["40Gi", "40Gi"])
    assert [_pick(packed, "10Gi") for _ in range(4)] == ["gpu-0"] * 4
    spread = _fleet("spread", ["40Gi", "40Gi"])
    assert [_pick(spread, "10Gi") for _ in range(4)] == ["gpu-0", "gpu-1", "gpu-0", "gpu-1"]


def test_a_released_share_moves_its_device_back_in_the_ranking() -> None:
    alloc = _fleet("spread", ["40Gi", "40Gi"])
    first = decide(alloc, claim(request(capacity={"memory": "30Gi"})), node="node-a")
    assert isinstance(first, Allocated)
    assert _pick(alloc, "5Gi") == "gpu-1"  # gpu-0 has 10Gi free, gpu-1 40Gi
    alloc.release(first)
    assert _pick(alloc, "5Gi") == "gpu-0"  # 40Gi free again; 35Gi on gpu-1


def test_a_count_of_two_under_binpack_may_share_one_device() -> None:
    alloc = _fleet("binpack", ["40Gi", "20Gi"])
    out = decide(alloc, claim(request(capacity={"memory": "10Gi"}, count=2)), node="node-a")
    assert [p[1] for p in picked(out)] == ["gpu-1", "gpu-1"]


def test_whole_device_classes_ignore_the_placement() -> None:
    devices = [device(f"gpu-{i}", {"memory": t}) for i, t in enumerate(["40Gi", "12Gi"])]
    alloc = allocator(
        [slice_(devices)],
        [device_class(annotations={PLACEMENT: "binpack"})],
        class_modes={"gpu.test.io": "whole-device"},
    )
    out = decide(alloc, claim(request()), node="node-a")
    assert picked(out)[0][1] == "gpu-0"


def test_an_unknown_placement_is_refused_naming_the_annotation() -> None:
    text = """
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: gpu
  annotations:
    dracap.io/placement: best-fit
spec: {}
"""
    with pytest.raises(ValidationError) as caught:
        load_documents(text, "classes.yaml")
    assert "metadata.annotations[dracap.io/placement]" in str(caught.value)
    assert "first-fit, binpack, spread, fragmentation-aware" in str(caught.value)


# --- the ordering functions --------------------------------------------------------------


def test_value_order_per_policy() -> None:
    values = [2, 5, 10, 20, 30]
    assert value_order("binpack", values, 5) == [5, 10, 20, 30]
    assert value_order("spread", values, 5) == [30, 20, 10, 5]
    assert value_order("spread", values, 100) == []
    # sizes all 10: leaving 0 (from 10) or >= 10 strands nothing; 5 -> leaves 0 best
    assert value_order("fragmentation-aware", values, 10, {10: 3}) == [10, 20, 30]


def test_fragmentation_is_free_capacity_times_the_chance_the_next_request_is_larger() -> None:
    assert fragmentation(0, {10: 1}, 10) == 0
    assert fragmentation(5, {10: 1}, 10) == 5  # every size is larger than 5
    assert fragmentation(15, {10: 1, 20: 1}, 10) == 15 * 1 / 3  # only 20 of 10,20,10


def test_free_index_follows_moves() -> None:
    index = FreeIndex([40, UNUSABLE, 10, 40])
    assert index.values == [10, 40]
    assert index.groups == {10: [2], 40: [0, 3]}
    index.move(3, 40, 10)
    index.move(1, UNUSABLE, 40)
    assert index.groups == {10: [2, 3], 40: [0, 1]}
    index.move(0, 40, UNUSABLE)
    index.move(1, 40, 5)
    assert index.values == [5, 10]
    assert index.groups == {5: [1], 10: [2, 3]}


@settings(max_examples=60, deadline=None)
@given(
    used=st.lists(st.integers(min_value=0, max_value=8), min_size=2, max_size=8),
    want=st.integers(min_value=1, max_value=8),
)
def test_every_policy_takes_an_eligible_device_and_the_one_it_ranks_best(
    used: list[int], want: int
) -> None:
    """Devices of 8Gi with ``used[i]`` Gi taken; a request of ``want`` Gi."""
    free = [8 - u for u in used]
    fits = [i for i, f in enumerate(free) if f >= want]
    for policy in PLACEMENTS:
        alloc = _fleet(policy, ["8Gi"] * len(used))
        for i, u in enumerate(used):
            if u:
                _place(alloc, i, f"{u}Gi")
        out = decide(alloc, claim(request(capacity={"memory": f"{want}Gi"})), node="node-a")
        if not fits:
            assert isinstance(out, Unschedulable), policy
            continue
        chosen = int(picked(out)[0][1].split("-")[1])
        assert chosen in fits, policy
        if policy == "first-fit":
            assert chosen == fits[0]
        elif policy == "binpack":
            assert chosen == min(fits, key=lambda i: (free[i], i))
        elif policy == "spread":
            assert chosen == min(fits, key=lambda i: (-free[i], i))
