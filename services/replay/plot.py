"""The PNG of ``dracap replay plot``: consumed capacity over time, stacked by tenant.

One panel: a stacked step area per tenant (namespace) of the capacity consumed in the
scope (a device, a node's devices, or the shares of a DeviceClass), the scope's total
as a black line above it, and hatched grey bands where some of the consumption was
Unknown (its node's lease expired and it was not fenced or confirmed yet). The x axis
is the time the events were recorded. matplotlib is an optional dependency; without it
the command is refused with one line (:func:`check_plotting`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from services.replay.history import Sample
from services.runtime.ground.plotting import label, require_matplotlib

__all__ = ["check_plotting", "plot_usage"]


def check_plotting() -> None:
    """Raise :class:`CommandError` (exit 2) when matplotlib cannot be imported."""
    require_matplotlib("replay plot")


def plot_usage(
    samples: Sequence[Sample], path: str | Path, *, title: str, capacity: str, unit: str
) -> None:
    """Write the figure of ``samples`` to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    tenants = sorted({t for s in samples for t in s.by_tenant})
    times = [float(mdates.date2num(s.time)) for s in samples]  # type: ignore[no-untyped-call]
    if samples:  # hold the last value to the right edge
        times.append(times[-1] + max((times[-1] - times[0]) * 0.03, 1 / 86400))
    fig, ax = plt.subplots(figsize=(11, 5))
    layers = [[s.by_tenant.get(t, 0.0) for s in samples] for t in tenants]
    if samples and tenants:
        layers = [[*layer, layer[-1]] for layer in layers]
        palette = matplotlib.colormaps["tab10"]
        ax.stackplot(
            times,
            layers,
            labels=[label(t) for t in tenants],
            step="post",
            colors=[palette(i % 10) for i in range(len(tenants))],
            alpha=0.85,
        )
    if samples:
        totals = [s.total for s in samples] + [samples[-1].total]
        ax.step(times, totals, where="post", color="black", linewidth=2, label="total")
    labelled = False
    start: float | None = None
    for i, s in enumerate(samples):
        end_of_run = s.unknown and (i + 1 == len(samples) or not samples[i + 1].unknown)
        if s.unknown and start is None:
            start = times[i]
        if end_of_run and start is not None:
            stop = times[i + 1]
            ax.axvspan(
                start,
                stop,
                facecolor="grey",
                alpha=0.3,
                hatch="//",
                label=None if labelled else "Unknown",
            )
            labelled, start = True, None
    ax.set_title(label(title))
    ax.set_xlabel("time recorded (UTC)")
    ax.set_ylabel(f"{capacity} consumed" + (f" ({unit})" if unit else ""))
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))  # type: ignore[no-untyped-call]
    fig.autofmt_xdate()
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="tenant")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
