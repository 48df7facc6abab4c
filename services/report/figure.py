"""The PNG of ``dracap report``: the dashboard's panels in a grid, two per row.

Each :class:`~services.report.panels.Panel` is one axes: lines (solid, dashed) or points
over time, in seconds (minutes, hours for long windows) from the window's start, which
the figure's title gives in UTC; a second y axis on the right for the ages next to
counts; horizontal bars for the per-device panel; a panel with nothing to draw says so
(or says its note) in its middle. matplotlib is an optional dependency; without it the
command is refused with one line (:func:`check_plotting`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from services.report.panels import Panel, Report, Series
from services.runtime.ground.plotting import label, require_matplotlib

__all__ = ["check_plotting", "draw"]

_COLUMNS = 2


def check_plotting() -> None:
    """Raise :class:`CommandError` (exit 2) when matplotlib cannot be imported."""
    require_matplotlib("report")


def _time_unit(span: float) -> tuple[float, str]:
    if span <= 600:
        return 1.0, "s"
    if span <= 36_000:
        return 60.0, "min"
    return 3600.0, "h"


def draw(report: Report, path: str | Path, *, source: str) -> None:
    """Write the figure of ``report`` (read from ``source``) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-len(report.panels) // _COLUMNS)
    fig, axes = plt.subplots(rows, _COLUMNS, figsize=(16, 3.6 * rows + 0.8), squeeze=False)
    span = (report.end - report.start).total_seconds()
    divide, unit = _time_unit(span)
    for i, panel in enumerate(report.panels):
        ax = axes[i // _COLUMNS][i % _COLUMNS]
        if panel.bars:
            _bars(ax, panel)
        elif not panel.unit:  # words only
            ax.axis("off")
            ax.text(0.02, 0.92, panel.note, va="top", family="monospace", transform=ax.transAxes)
        else:
            _lines(ax, panel, divide, span)
            ax.set_xlabel(f"{unit} since {report.start:%H:%M:%S} UTC")
        ax.set_title(label(panel.title), fontsize=10, loc="left")
    for j in range(len(report.panels), rows * _COLUMNS):
        axes[j // _COLUMNS][j % _COLUMNS].set_visible(False)
    fig.suptitle(
        f"dracap report of {source}: {report.start:%Y-%m-%d %H:%M:%S} to "
        f"{report.end:%H:%M:%S} UTC, {report.events} events "
        f"(positions {report.positions[0]}..{report.positions[1]}), "
        f"steps of {report.step:.3g} s",
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (3.6 * rows + 0.8)))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80)
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency

    with Image.open(buffer) as image:  # a third of the size: plots need few colours
        image.convert("RGB").quantize(colors=128).save(str(path), optimize=True)


def _plot(ax: Any, series: Series, divide: float, color: Any) -> None:
    times = [t / divide for t in series.times]
    if series.style == "points":
        ax.plot(times, series.values, "o", markersize=4, label=label(series.label), color=color)
    else:
        linestyle = "--" if series.style == "dashed" else "-"
        ax.plot(
            times, series.values, linestyle, linewidth=1.4, label=label(series.label), color=color
        )


def _lines(ax: Any, panel: Panel, divide: float, span: float) -> None:
    import matplotlib

    palette = matplotlib.colormaps["tab10"]
    ax.set_xlim(0, span / divide)
    ax.grid(True, alpha=0.3)
    ax.set_ylabel(panel.unit)
    drawn = [s for s in panel.series if s.times]
    if not drawn and not panel.right:
        ax.text(
            0.5,
            0.5,
            panel.note or "no data in this window",
            ha="center",
            va="center",
            transform=ax.transAxes,
            color="dimgrey",
        )
        ax.set_yticks([])
        return
    colors = {s.label: palette(i % 10) for i, s in enumerate(drawn)}
    for series in drawn:
        _plot(ax, series, divide, colors[series.label])
    if panel.unit == "ratio":
        ax.set_ylim(0, 1.05)
    else:
        ax.set_ylim(bottom=0)
    if panel.right:
        twin = ax.twinx()
        for series in panel.right:
            color = colors.get(series.label, palette(len(colors) % 10))
            _plot(twin, series, divide, color)
        twin.set_ylabel(panel.right_unit)
        twin.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="best", framealpha=0.8)
    if panel.note:
        ax.text(0.99, 0.02, panel.note, ha="right", va="bottom", transform=ax.transAxes, fontsize=7)


def _bars(ax: Any, panel: Panel) -> None:
    names = list(panel.bars)
    values = [panel.bars[name] for name in names]
    labels = [label(name) for name in names]
    ax.barh(labels, [1.0] * len(labels), color="lightgrey", label="total")
    ax.barh(labels, values, color="tab:blue", label="allocated")
    ax.set_xlim(0, 1)
    ax.set_xlabel("allocated / total")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7, loc="lower right")
    if panel.note:
        ax.text(0.99, 0.02, panel.note, ha="right", va="bottom", transform=ax.transAxes, fontsize=7)
