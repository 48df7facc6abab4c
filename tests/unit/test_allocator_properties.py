"""Property: whatever the inventory and the claim sequence, the allocator never
oversubscribes a device, never grants an amount its policy forbids, and never hands a
dedicated device to two claims at once (releases interleaved)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.quantities import Quantity
from services.reservation.outcomes import Allocated
from services.reservation.policy import violates_policy
from tests.unit.allocator_fixtures import allocator, claim, decide, device, request, slice_

POLICIES: list[Any] = [
    None,
    {"default": "2Gi", "validRange": {"min": "2Gi", "step": "2Gi", "max": "8Gi"}},
    {"default": "1Gi", "validRange": {"min": "1Gi"}},
    {"default": "1Gi", "validValues": ["1Gi", "3Gi", "4Gi"]},
    {"default": "3Gi"},
]

devices_st = st.lists(
    st.tuples(
        st.sampled_from([4, 8, 10, 16]),  # total GiB
        st.integers(0, len(POLICIES) - 1),
        st.booleans(),  # shared
        st.booleans(),  # has a second capacity "compute"
        st.integers(0, 2),  # attribute value for distinctAttribute
    ),
    min_size=1,
    max_size=6,
)

request_st = st.fixed_dictionaries(
    {
        "memory": st.one_of(st.none(), st.integers(0, 12 * 1024).map(lambda m: f"{m}Mi")),
        "compute": st.one_of(st.none(), st.integers(0, 120).map(str)),
        "count": st.integers(1, 3),
    }
)
action_st = st.one_of(
    st.tuples(st.just("claim"), st.lists(request_st, min_size=1, max_size=3), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 50), st.just(False)),
)


def _policy(index: int, total: int) -> Any:
    policy = POLICIES[index]
    if policy is None:
        return None
    if "validRange" in policy and "max" in policy["validRange"] and total < 8:
        return {"default": "2Gi", "validRange": {"min": "2Gi", "step": "2Gi", "max": f"{total}Gi"}}
    return policy


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(devices_st, st.lists(action_st, min_size=1, max_size=25))
def test_never_oversubscribes(specs: list[Any], actions: list[Any]) -> None:
    devs = []
    for i, (total, pol, shared, compute, attr) in enumerate(specs):
        capacity: dict[str, Any] = {
            "memory": (f"{total}Gi", _policy(pol, total) if shared else None)
        }
        if compute:
            capacity["compute"] = "100"
        devs.append(device(f"d{i}", capacity, shared=shared, attributes={"slot": attr}))
    alloc = allocator([slice_(devs)])
    totals = {
        ("gpu.test.io", "node-a-pool", d["name"]): {
            n: Quantity.parse(c["value"]) for n, c in d["capacity"].items()
        }
        for d in devs
    }
    policies = {
        ("gpu.test.io", "node-a-pool", d["name"]): d["capacity"]["memory"].get("requestPolicy")
        for d in devs
    }
    live: list[Allocated] = []
    for kind, payload, distinct in actions:
        if kind == "release":
            if live:
                alloc.release(live.pop(payload % len(live)))
            continue
        reqs = []
        for j, r in enumerate(payload):
            caps = {k: v for k, v in (("memory", r["memory"]), ("compute", r["compute"])) if v}
            reqs.append(request(f"r{j}", caps or None, count=r["count"]))
        constraints = [{"distinctAttribute": "gpu.test.io/slot"}] if distinct else []
        out = decide(alloc, claim(*reqs, constraints=constraints))
        if isinstance(out, Allocated):
            live.append(out)
            _check_policy(out, alloc, policies)
        _check_invariants(live, totals)


def _check_policy(out: Allocated, alloc: Any, policies: dict[Any, Any]) -> None:
    from events.model import CapacityRequestPolicy, convert

    for grant in out.grants:
        raw = policies[grant.device]
        policy = convert(raw, CapacityRequestPolicy) if raw else None
        if "memory" in grant.consumed:
            assert not violates_policy(grant.consumed["memory"], policy), (grant, raw)


def _check_invariants(live: list[Allocated], totals: dict[Any, dict[str, Quantity]]) -> None:
    used: dict[Any, dict[str, int]] = {}
    holders: dict[Any, set[str]] = {}
    shared_devices: set[Any] = set()
    for out in live:
        for grant in out.grants:
            if grant.share_id is None:
                holders.setdefault(grant.device, set()).add(out.claim)
                continue
            shared_devices.add(grant.device)
            per = used.setdefault(grant.device, {})
            for name, amount in grant.consumed.items():
                per[name] = per.get(name, 0) + amount.nanos
    for key, per in used.items():
        for name, nanos in per.items():
            assert nanos <= totals[key][name].nanos, (key, name, nanos)
    for key, claims in holders.items():
        count = sum(1 for out in live for g in out.grants if g.device == key and g.share_id is None)
        assert count == 1, (key, claims)
