"""Collector pauses with a large fold in memory: full collections walk what is live.

``python -m benchmarks.gcpause --events 1000000 --runs 3`` folds the first ``--events``
events of ``benchmarks/eventlog.py``'s history (as ``benchmarks/memory.py`` does for a
snapshot), tunes the collector as a service process does, then makes ``--churn`` short-
lived tracked objects of the shape a service makes per message (a few thousand in
flight at a time), and reports, per generation, how many collections ran, the longest
pause and their sum, and the wall time of the churn. Each run is its own process, with
the survivors of full collections frozen (``freeze``: :func:`services.runtime.ground.gctuning.
freeze_survivors`, what ``dracap up`` and the service commands do) and without
(``plain``), alternating; the figures are in ``docs/services.md`` (Growth).

``--grow`` measures the other case: the fold grows *while* the collector runs as in a
service (tuned, survivors frozen, the churn spread over the fill), the longest pause
per generation during the fill, then one full collection after it (docs/services.md,
"While the fold grows").
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.eventlog import history
from events.state import ClusterState
from services.replay.verify import fold_rows, paused_gc
from services.runtime.ground.gctuning import freeze_survivors, tune_for_long_lived_state


def folded(events: int) -> ClusterState:
    """The fold of the history's first ``events`` events (collector paused meanwhile)."""
    state = ClusterState()
    chunk: list[tuple[Any, ...]] = []
    with paused_gc():
        for row in history(events, 0):
            chunk.append(row)
            if len(chunk) == 50_000:
                fold_rows(state, chunk)
                chunk = []
        fold_rows(state, chunk)
    return state


def _recorder(pauses: list[tuple[int, float]]) -> Callable[[str, dict[str, Any]], None]:
    """A ``gc.callbacks`` entry that appends (generation, seconds) of each collection."""
    began = [0.0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - began[0]))

    return timed


def _per_generation(pauses: list[tuple[int, float]]) -> dict[str, tuple[int, float, float]]:
    """``gen0``..``gen2``: (collections, longest pause, sum of pauses) in seconds."""
    out: dict[str, tuple[int, float, float]] = {}
    for generation in (0, 1, 2):
        mine = [p for g, p in pauses if g == generation]
        out[f"gen{generation}"] = (len(mine), max(mine, default=0.0), sum(mine))
    return out


def _cells(result: dict[str, Any], sums: bool) -> str:
    """The per-generation columns of a report line (``sums``: with each sum of pauses)."""
    return "  ".join(
        f"gen{g} {n:>4} max {mx * 1000:7.1f} ms" + (f" sum {total * 1000:7.0f} ms" if sums else "")
        for g, (n, mx, total) in ((g, result[f"gen{g}"]) for g in (0, 1, 2))
    )


def grown(events: int, churn: int) -> dict[str, Any]:
    """``--grow``: the fold grows while the collector runs as in a service (tuned,
    survivors frozen), with the churn of ``churn`` objects spread over it; then one full
    collection, as the first to come after a fill: how long it walks."""
    tune_for_long_lived_state()
    pauses: list[tuple[int, float]] = []
    timed = _recorder(pauses)
    thaw = freeze_survivors()
    gc.callbacks.insert(0, timed)
    state = ClusterState()
    chunk: list[tuple[Any, ...]] = []
    in_flight: list[dict[str, Any]] = []
    per_row = max(1, churn // max(1, events))
    started = time.perf_counter()
    for i, row in enumerate(history(events, 0)):
        chunk.append(row)
        for j in range(per_row):
            in_flight.append({"claim": [i, j], "shares": {i}})
        if len(in_flight) > 20_000:
            del in_flight[:10_000]
        if len(chunk) == 1_000:
            fold_rows(state, chunk)
            chunk = []
    fold_rows(state, chunk)
    wall = time.perf_counter() - started
    before = time.perf_counter()
    gc.collect()
    after_fill = time.perf_counter() - before
    gc.callbacks.remove(timed)
    thaw()
    out: dict[str, Any] = {"claims": len(state.claims), "wall_s": wall, "full_after_s": after_fill}
    out.update(_per_generation(pauses))
    return out


def one_run(events: int, churn: int, freeze: bool) -> dict[str, Any]:
    """Fold, then churn; the collector's pauses per generation."""
    state = folded(events)
    tracked = len(gc.get_objects())
    tune_for_long_lived_state()
    gc.collect()
    pauses: list[tuple[int, float]] = []
    timed = _recorder(pauses)
    gc.callbacks.insert(0, timed)
    thaw = freeze_survivors() if freeze else None
    if freeze:
        gc.collect()  # a service's first full collection (its startup's survivors)
        pauses.clear()
    in_flight: list[dict[str, Any]] = []
    started = time.perf_counter()
    for i in range(churn):
        in_flight.append({"claim": [i], "shares": {i}})
        if len(in_flight) > 20_000:
            del in_flight[:10_000]
    wall = time.perf_counter() - started
    if thaw is not None:
        thaw()
    gc.callbacks.remove(timed)
    out: dict[str, Any] = {"claims": len(state.claims), "tracked": tracked, "wall_s": wall}
    out.update(_per_generation(pauses))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--churn", type=int, default=3_000_000, help="objects made")
    parser.add_argument("--runs", type=int, default=3, help="pairs of runs")
    parser.add_argument(
        "--grow",
        action="store_true",
        help="fold while the collector runs (survivors frozen), then time one full collection",
    )
    parser.add_argument("--one", choices=("plain", "freeze"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.grow:
        for run in range(args.runs):
            result = grown(args.events, args.churn)
            cells = _cells(result, sums=True)
            print(
                f"run {run + 1} grown to {result['claims']:,} claims in {result['wall_s']:.1f} s: "
                f"{cells}; the next full collection {result['full_after_s'] * 1000:.1f} ms",
                flush=True,
            )
        return
    if args.one:
        print(json.dumps(one_run(args.events, args.churn, args.one == "freeze")))
        return
    for run in range(args.runs):
        for mode in ("plain", "freeze"):
            command = [sys.executable, "-m", "benchmarks.gcpause", "--one", mode]
            command += ["--events", str(args.events), "--churn", str(args.churn)]
            result = json.loads(subprocess.run(command, check=True, capture_output=True).stdout)
            cells = _cells(result, sums=True)
            print(
                f"run {run + 1} {mode:<6} claims {result['claims']:,} tracked "
                f"{result['tracked']:,}: {cells}  churn {result['wall_s']:.2f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
