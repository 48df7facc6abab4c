"""Why a claim is unschedulable: a failed search explained. Pure.

The search (:mod:`services.reservation.searching`) only says which request it failed
deepest on; :func:`explain` then scans that request's candidates once more and counts,
per reason, the devices that could not take it (in use, still held by shares, held by
another namespace under isolation, a capacity missing, a policy that forbids the
amount, not enough free, on a lost node, below the class's minimum enforcement,
unhealthy), naming the first of each. The scan is not free: the allocator runs it only
when no node fits, and not at all with ``explain=False``.
"""

from __future__ import annotations

from events.quantities import Quantity
from services.reservation.policy import consumed_amount, describe_policy, violates_policy
from services.reservation.requestspecs import RequestSpec
from services.reservation.searching import SEARCH_BUDGET, Search

__all__ = ["explain"]


def explain(search: Search) -> str:
    """Why ``search`` found no solution: its deepest failing request, and why no
    candidate could take it (or that it ran out of budget)."""
    where = f" on node {search.node}" if search.node else ""
    if search.depth_failed == -2:
        return f"search gave up after {SEARCH_BUDGET} device checks{where}"
    spec = search.failed_spec
    if spec is None:
        return f"no solution{where}"
    return f"request {spec.result_name}: " + _diagnose(search, spec) + where


def _diagnose(search: Search, spec: RequestSpec) -> str:
    """Why no device of the candidate list could take ``spec`` (a failure-path scan)."""
    inv = search.inv
    clist = search.a.candidates(search.node, spec)
    visible = len(inv.visible_devices(search.node))
    if not clist.devices:
        return f"none of the {visible} devices reachable matches class {spec.class_name}" + (
            " and the request's selectors" if spec.selectors else ""
        )
    in_use = still_shared = foreign = missing = policy = full = lost = weak = unhealthy = 0
    policy_detail = full_detail = missing_detail = lost_detail = weak_detail = ""
    unhealthy_detail = ""
    for index in clist.devices:
        entry = inv.devices[index]
        taint = inv.lost(entry) if inv.lost_nodes else None
        if taint is not None:
            lost += 1
            lost_detail = lost_detail or taint
            continue
        sick = inv.unhealthy.get(entry.key) if inv.unhealthy else None
        if sick is not None:
            unhealthy += 1
            unhealthy_detail = unhealthy_detail or f"{'/'.join(entry.key)}: {sick}"
            continue
        below = inv.below_minimum(entry, spec.class_name) if inv.min_enforcement else None
        if below is not None:
            weak += 1
            weak_detail = weak_detail or below
            continue
        if search.in_use(spec, index):
            if index in search.dedicated or entry.key in search.a.allocated.exclusive:
                in_use += 1
            else:
                still_shared += 1
            continue
        if search.foreign(spec, index):
            foreign += 1
            continue
        absent = [n for n in spec.capacity if n not in entry.capacities]
        if absent:
            missing += 1
            missing_detail = missing_detail or f"no capacity {absent[0]}"
            continue
        for name, info in entry.capacities.items():
            amount = consumed_amount(info.total, info.policy, spec.wanted(name, info.total))
            if violates_policy(amount, info.policy):
                policy += 1
                policy_detail = policy_detail or (
                    f"{name} {amount} is not allowed by the request policy "
                    f"({describe_policy(info.policy)})"
                )
                break
            free = info.total.nanos - search.a.allocated.consumed_nanos(entry.key, name)
            if amount.nanos > free:
                full += 1
                full_detail = full_detail or (
                    f"needs {amount} of {name}, largest free is "
                    f"{_largest_free(search, spec, clist.devices, name)}"
                )
                break
    parts = []
    if lost:
        parts.append(
            f"{lost} on a lost node, tainted {lost_detail}: their unknown shares keep "
            "the capacity until the node is fenced or its agent returns"
        )
    if unhealthy:
        parts.append(f"{unhealthy} reported unhealthy by their node agent ({unhealthy_detail})")
    if weak:
        parts.append(f"{weak} on nodes below the class's minimum enforcement ({weak_detail})")
    if in_use:
        parts.append(f"{in_use} in exclusive use")
    if still_shared:
        parts.append(
            f"{still_shared} still shared (dedicated now, in use until its live shares "
            "are released)"
        )
    if foreign:
        parts.append(
            f"{foreign} held by another namespace (not shared across namespaces: "
            "dracap.io/shared-across-namespaces=deny)"
        )
    if missing:
        parts.append(f"{missing} lack the capacity ({missing_detail})")
    if policy:
        parts.append(f"{policy} refuse the amount ({policy_detail})")
    if full:
        parts.append(f"{full} have too little free ({full_detail})")
    if not parts:
        parts.append("the claim's constraints cannot be met together")
    return f"{len(clist.devices)} devices of class {spec.class_name} match; " + ", ".join(parts)


def _largest_free(search: Search, spec: RequestSpec, devices: list[int], name: str) -> Quantity:
    best: Quantity | None = None
    for index in devices:
        entry = search.inv.devices[index]
        info = entry.capacities.get(name)
        if info is None or search.in_use(spec, index):
            continue
        free = info.total - Quantity(search.a.allocated.consumed_nanos(entry.key, name))
        if best is None or free > best:
            best = free
    return best if best is not None else Quantity(0)
