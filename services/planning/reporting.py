"""Tables and JSON for ``dracap simulate`` and ``dracap plan``.

Fractions print as decimals with two places (``0.97``), stranded capacity as a percentage
of total capacity with two places, times in seconds (queueing) or microseconds
(decisions). JSON carries every field of :class:`~services.planning.simulating.SimResult`
and :class:`~services.planning.capacity.CapacityPlan`, bytes as integers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec

from services.planning.capacity import CapacityPlan
from services.planning.simulating import SimResult
from services.planning.traces import TraceClaim, format_bytes
from services.runtime.ground.printable import table

__all__ = ["plan_table", "result_rows", "table", "to_json", "trace_summary"]

SIM_HEADER: Final = (
    "MODE/POLICY",
    "ALLOC@1ST",
    "ALLOC SAT",
    "ALLOC MEAN",
    "STRANDED%",
    "REFUSED",
    "REJECTED",
    "WAITING",
    "WAIT P50",
    "WAIT P99",
    "DEVICES NEEDED",
    "DECISION µs",
)


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}s"


def result_rows(results: Sequence[SimResult]) -> list[list[str]]:
    """One row per simulation (:data:`SIM_HEADER`)."""
    rows = []
    for r in results:
        stranded = r.stranded_saturated if r.stranded_saturated is not None else r.stranded_mean
        rows.append(
            [
                r.label,
                _fraction(r.allocated_at_first_refusal),
                _fraction(r.allocated_saturated),
                _fraction(r.allocated_mean),
                f"{stranded * 100:.2f}",
                f"{r.refused_on_arrival} ({r.refusal_rate:.1%})",
                f"{r.rejected} ({r.rejection_rate:.1%})",
                str(r.waiting),
                _seconds(r.queue_p50_s),
                _seconds(r.queue_p99_s),
                "-" if r.devices_needed is None else str(r.devices_needed),
                f"{r.decision_us_mean:.0f} (p99 {r.decision_us_p99:.0f})",
            ]
        )
    return rows


def trace_summary(trace: Sequence[TraceClaim], source: str) -> dict[str, Any]:
    """What a trace holds: claims, span, median and mean size, durations."""
    sizes = sorted(c.size for c in trace)
    durations = [c.duration for c in trace if c.duration is not None]
    return {
        "source": source,
        "claims": len(trace),
        "span_s": trace[-1].arrival - trace[0].arrival if trace else 0.0,
        "median_size": sizes[(len(sizes) - 1) // 2] if sizes else 0,
        "mean_size": sum(sizes) / len(sizes) if sizes else 0.0,
        "largest_size": sizes[-1] if sizes else 0,
        "mean_duration_s": sum(durations) / len(durations) if durations else None,
        "never_leave": len(trace) - len(durations),
    }


def _gib(size: float) -> str:
    return format_bytes(int(size)) if size % 2**30 == 0 else f"{size / 2**30:.1f}Gi"


def describe_trace(summary: dict[str, Any]) -> str:
    duration = summary["mean_duration_s"]
    held = f"mean duration {duration:,.0f}s" if duration is not None else "claims never leave"
    return (
        f"trace {summary['source']}: {summary['claims']:,} claims over "
        f"{summary['span_s']:,.0f}s, median size {_gib(summary['median_size'])}, "
        f"mean {_gib(summary['mean_size'])}, largest {_gib(summary['largest_size'])}, {held}"
    )


def plan_table(plan: CapacityPlan) -> str:
    """The plan's steps: what each takes away and what remains."""
    rows = [
        [
            s.step,
            "-" if i == 0 else f"-{format_bytes(s.deduction)}",
            format_bytes(s.remaining),
            s.detail,
        ]
        for i, s in enumerate(plan.steps)
    ]
    text = table(("STEP", "TAKES", "REMAINS", "HOW"), rows)
    text += f"\nschedulable: {format_bytes(plan.schedulable)}"
    text += f" ({plan.devices} devices on {plan.nodes} nodes)"
    if plan.in_use is not None:
        text += f"\nin use now: {format_bytes(plan.in_use)}"
    return text


def to_json(data: Any) -> str:
    """Indented JSON of msgspec structs and plain data."""
    return msgspec.json.format(msgspec.json.encode(data), indent=2).decode()
