"""The capacity math of ``dracap plan``, step by step. Pure.

From the devices (each with a node and a total of one capacity) to what the fleet can
promise, each step saying what it takes away and what remains:

1. **raw** -- every device's total;
2. **at the target utilization** ``u`` -- raw x ``u`` (100 x 40Gi at 0.7: 2,800 GiB, the
   design's "schedulable" figure);
3. **driver overhead** ``o`` per device -- what the driver and contexts keep on every
   device, whatever the utilization: ``devices x o``;
4. **failure headroom** of ``H`` nodes -- the fleet must take the claims of ``H`` failed
   nodes: the ``H`` nodes with the most capacity (ties: the first named) give up what they
   had left after steps 2 and 3;
5. **fragmentation loss** ``f`` (when measured, :func:`fragmentation_loss`) -- the share
   of capacity left free but unusable by the next request, from simulating a trace on
   the same devices (less the overhead): remaining x ``f``.

Amounts are bytes (integers; a fraction of a byte is dropped).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from services.planning.traces import format_bytes

__all__ = ["CapacityPlan", "PlanStep", "plan_capacity"]


class PlanStep(msgspec.Struct, frozen=True, kw_only=True):
    """One step: what it is, what it took away and what remains (bytes)."""

    step: str
    detail: str
    deduction: int
    remaining: int


class CapacityPlan(msgspec.Struct, frozen=True, kw_only=True):
    """The steps from raw capacity to what the fleet can promise."""

    devices: int
    nodes: int
    steps: list[PlanStep]
    schedulable: int  # the last step's remaining
    in_use: int | None = None  # consumed now (``--live`` only)


def plan_capacity(
    devices: Sequence[tuple[str, int]],
    *,
    target: float,
    overhead: int = 0,
    headroom_nodes: int = 0,
    fragmentation: float | None = None,
    fragmentation_source: str = "",
    in_use: int | None = None,
) -> CapacityPlan:
    """The plan for ``devices`` (node, total bytes), as in the module doc."""
    raw = sum(total for _, total in devices)
    steps = [PlanStep(step="raw", detail=f"{len(devices)} devices", deduction=0, remaining=raw)]
    at_target = int(raw * target)
    steps.append(
        PlanStep(
            step=f"at the target utilization {target:.0%}",
            detail=f"raw x {target:g}",
            deduction=raw - at_target,
            remaining=at_target,
        )
    )
    remaining = at_target
    per_device = {i: int(total * target) - overhead for i, (_, total) in enumerate(devices)}
    if overhead:
        taken = min(remaining, overhead * len(devices))
        remaining -= taken
        steps.append(
            PlanStep(
                step="driver overhead",
                detail=f"{format_bytes(overhead)} x {len(devices)} devices",
                deduction=taken,
                remaining=remaining,
            )
        )
    nodes: dict[str, list[int]] = {}
    for i, (node, _) in enumerate(devices):
        nodes.setdefault(node, []).append(i)
    if headroom_nodes:
        order = sorted(
            nodes, key=lambda n: -sum(max(0, per_device[i]) for i in nodes[n])
        )  # stable: ties keep the order nodes were first named
        failed = order[:headroom_nodes]
        taken = min(remaining, sum(max(0, per_device[i]) for n in failed for i in nodes[n]))
        remaining -= taken
        count = sum(len(nodes[n]) for n in failed)
        steps.append(
            PlanStep(
                step=f"failure headroom: {len(failed)} nodes",
                detail=f"{count} devices of {', '.join(failed)}",
                deduction=taken,
                remaining=remaining,
            )
        )
    if fragmentation is not None:
        taken = int(remaining * fragmentation)
        remaining -= taken
        steps.append(
            PlanStep(
                step=f"fragmentation loss {fragmentation:.2%}",
                detail=fragmentation_source,
                deduction=taken,
                remaining=remaining,
            )
        )
    return CapacityPlan(
        devices=len(devices),
        nodes=len(nodes),
        steps=steps,
        schedulable=remaining,
        in_use=in_use,
    )
