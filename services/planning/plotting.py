"""The comparison PNG of ``dracap simulate --plot``: modes and policies side by side.

One row per scenario (a trace), three panels: the allocated fraction over time per
mode/policy; the allocated fraction at the first refusal, from the first refusal to the
last arrival, and over the whole trace (a run that never refused a claim has no bar for
the first two, marked "never refused"); the stranded fraction and the devices needed
(relative to the most any of them needs).
matplotlib is an optional dependency (``pip install 'dracap[plot]'``); without it
``--plot`` is refused with one line before anything is simulated.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.planning.simulating import SimResult
from services.runtime.ground.plotting import require_matplotlib

__all__ = ["check_plotting", "plot"]


def check_plotting() -> None:
    """Raise :class:`CommandError` (exit 2) when matplotlib cannot be imported."""
    require_matplotlib("--plot")


def plot(scenarios: Sequence[tuple[str, Sequence[SimResult]]], path: str | Path) -> None:
    """Write the comparison figure of ``scenarios`` ((title, results) each) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(scenarios)
    fig, axes = plt.subplots(rows, 3, figsize=(17, 4.6 * rows), squeeze=False)
    for row, (title, results) in enumerate(scenarios):
        _series(axes[row][0], title, results)
        _ratios(axes[row][1], results)
        _stranded(axes[row][2], results)
    fig.tight_layout()
    fig.savefig(str(path), dpi=90)
    plt.close(fig)


def _series(ax: Any, title: str, results: Sequence[SimResult]) -> None:
    for r in results:
        if r.series:
            ax.plot([s.t / 3600 for s in r.series], [s.allocated for s in r.series], label=r.label)
    ax.set_title(f"{title}: allocated over time")
    ax.set_xlabel("hours")
    ax.set_ylabel("allocated / total capacity")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center right")


def _ratios(ax: Any, results: Sequence[SimResult]) -> None:
    """Allocated fraction at the first refusal, after it, and over the whole trace.

    A run that never refused a claim has neither of the first two (no bar: "never
    refused", not 0): claims too large for any device or slice are rejected on arrival,
    which is not a refusal.
    """
    labels = [r.label for r in results]
    bars: list[tuple[str, list[float | None]]] = [
        ("at first refusal", [r.allocated_at_first_refusal for r in results]),
        ("first refusal to last arrival", [r.allocated_saturated for r in results]),
        ("whole trace (mean)", [r.allocated_mean for r in results]),
    ]
    width = 0.27
    for i, (label, values) in enumerate(bars):
        offset = (i - 1) * width
        xs = [x + offset for x in range(len(results))]
        ax.bar(xs, [v if v is not None else 0.0 for v in values], width, label=label)
        for x, value in zip(xs, values, strict=True):
            if value is None:
                ax.text(x, 0.02, "never refused", ha="center", va="bottom", rotation=90, fontsize=7)
            else:
                ax.text(x, value + 0.01, f"{value:.2f}", ha="center", fontsize=6)
    ax.axhline(0.95, color="grey", linestyle=":", linewidth=1)
    ax.set_xticks(list(range(len(results))), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("allocated / total capacity")
    ax.set_title("allocated fraction")
    ax.legend(fontsize=7, loc="lower left")


def _stranded(ax: Any, results: Sequence[SimResult]) -> None:
    labels = [r.label for r in results]
    stranded = [
        (r.stranded_saturated if r.stranded_saturated is not None else r.stranded_mean) * 100
        for r in results
    ]
    needed = [r.devices_needed for r in results]
    most = max((n for n in needed if n is not None), default=0)
    xs = range(len(results))
    label = "stranded % (saturated; else whole trace)"
    ax.bar([x - 0.2 for x in xs], stranded, 0.4, color="tab:red", label=label)
    for x, value in enumerate(stranded):
        ax.text(x - 0.2, value, f"{value:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("stranded % of capacity")
    ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
    ax.set_title("stranded capacity and devices needed")
    if most:
        twin = ax.twinx()
        heights = [n or 0 for n in needed]
        twin.bar([x + 0.2 for x in xs], heights, 0.4, color="tab:green", label="devices needed")
        for x, n in enumerate(needed):
            twin.text(x + 0.2, n or 0, str(n) if n else "-", ha="center", va="bottom", fontsize=7)
        twin.set_ylabel("devices needed (no refusal)")
        twin.set_ylim(0, most * 1.15)
        lines = ax.get_legend_handles_labels()
        extra = twin.get_legend_handles_labels()
        ax.legend(lines[0] + extra[0], lines[1] + extra[1], fontsize=8, loc="upper right")
    else:
        ax.legend(fontsize=8, loc="upper left")
