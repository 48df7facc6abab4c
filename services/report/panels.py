"""The data of ``dracap report``: the Grafana dashboard's panels, computed from the log.

The dashboard (``deploy/grafana/dracap.json``) reads Prometheus; a report has none, so
it folds the event log (the database, or an exported file) and derives each panel's
series from the same definitions the services' metrics use:

* capacity allocated / total and stranded / total per class and capacity:
  :func:`~services.runtime.ops.gauges.allocated_ratios` and
  :func:`~services.runtime.ops.gauges.stranded_ratios` of the folded state;
* claims by outcome: each claim's phase change (admitted, rejected, allocated, ready,
  released, …: the outcomes of ``dracap_claims_total``); rejections by the rule of their
  ``ClaimRejected`` (a refusal that never reached the log — a manifest that does not
  parse — is not there);
* capacity held per tenant, class and capacity: :func:`~services.runtime.ops.holdings.
  held_by_tenant`, the rule of ``dracap_capacity_held``;
* scheduling latency (the decision's time), the wait for capacity, enforcement and
  convergence latency, decisions (the rejection rate per class), node recovery,
  unconverged claims, claims waiting for capacity and Unknown shares with their ages: a
  :class:`~services.runtime.ops.slos.SloFold`, the one definition behind
  ``dracap_scheduling_latency_seconds``, ``dracap_capacity_wait_seconds``,
  ``dracap_claim_convergence_seconds`` and the other SLO series (:attr:`Report.spans`
  sums each kind of span per class, as those histograms' ``_count`` and ``_sum`` do);
* dead letters: the log's ``MessageDeadLettered`` per consumer;
* relay lag is not in the log (only the running relay knows it): its panel says so.

The window (``since`` .. ``until``, by default the first and last event recorded) is
cut into ``buckets`` steps. Gauges are sampled at each step's end (the state after every
event recorded until then); rates and percentiles are over the events and spans that
ended within the step. The whole log is folded from position 0 (what was pending before
the window started is pending in it); a window not given in full costs a first pass
that reads only the times.
"""

from __future__ import annotations

import datetime
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any, Final

import msgspec

from events.catalog import (
    ClaimRejected,
    Event,
)
from events.errors import InvariantViolation
from events.folding import Refusal, decode, fold_event, refuse
from events.quantities import Format
from events.state import ClusterState
from events.transitions import (
    ClaimBound,
    ClaimDecided,
    ClaimEntered,
    MessageDropped,
    NodeLost,
    ShareUnknown,
    Transition,
    meaning,
)
from services.replay.history import ReplayBrokenError
from services.replay.sources import LogSource
from services.replay.verify import note_refused
from services.runtime.ops.gauges import allocated_ratios, class_members, stranded_ratios
from services.runtime.ops.holdings import held_by_tenant
from services.runtime.ops.slos import Pending, SloFold
from services.runtime.store.livestate import INVENTORY_EVENTS
from services.runtime.store.rows import PAYLOAD, POSITION, SCHEMA_VERSION, TYPE

__all__ = ["Panel", "Report", "ReportError", "Series", "build_report"]

RECORDED_AT: Final = 10
#: The most lines one panel draws (the largest at the end; the rest are named as left out).
MAX_LINES: Final = 12
MAX_BARS: Final = 24  #: the most devices the per-device panel shows
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_NUMBER = re.compile(r"\d+(\.\d+)?")


def _pending_grows(transitions: tuple[Transition, ...]) -> bool:
    """Whether more claims may be unconverged or waiting, or shares unknown, after these."""
    for t in transitions:
        match t:
            case ClaimEntered() | ClaimBound() | NodeLost() | ShareUnknown():
                return True
            case ClaimDecided(outcome="unschedulable"):
                return True
    return False


#: What :meth:`_Fold._peak` follows: a name and the field of ``Pending`` it reads.
_PEAKS: Final = (("unconverged", "claims"), ("waiting", "waiting"), ("unknown", "unknown"))


class ReportError(Exception):
    """The log or the window holds no event to report on (a log that does not fold
    raises :class:`~services.replay.history.ReplayBrokenError`)."""


class Series(msgspec.Struct, kw_only=True):
    """One line of a panel: times in seconds from the window's start."""

    label: str
    times: list[float] = []
    values: list[float] = []
    style: str = "line"  #: line, dashed or points


class Panel(msgspec.Struct, kw_only=True):
    """One panel of the dashboard, as data."""

    title: str
    unit: str  #: the y axis's label
    series: list[Series] = []
    right: list[Series] = []  #: a second y axis (the ages next to counts)
    right_unit: str = ""
    note: str = ""  #: said in the panel (nothing to draw, what was left out)
    bars: dict[str, float] = {}  #: horizontal bars instead of lines (label -> value)


class Report(msgspec.Struct, kw_only=True):
    start: datetime.datetime
    end: datetime.datetime
    step: float  #: seconds
    positions: tuple[int, int]  #: the first and last position recorded in the window
    events: int  #: events recorded in the window
    panels: list[Panel]
    #: spans that ended in the window: kind (scheduling, capacity_wait, convergence,
    #: enforcement) -> class -> (how many, their sum in seconds)
    spans: dict[str, dict[str, tuple[int, float]]] = {}
    #: decisions recorded in the window: outcome (admitted, rejected, unschedulable) ->
    #: class -> how many (what ``dracap_claim_decisions_total`` counts)
    decisions: dict[str, dict[str, int]] = {}


def _time_of(value: Any) -> datetime.datetime:
    if isinstance(value, datetime.datetime):
        return value
    return datetime.datetime.fromisoformat(value)


def rule_of(event: ClaimRejected) -> str:
    """The rule that refused, without the names and numbers that differ per claim."""
    text = _NUMBER.sub("N", _QUOTED.sub("…", event.rule))
    return text if len(text) <= 60 else text[:59] + "…"


def _scale(state: ClusterState, capacity: str) -> tuple[float, str]:
    """Nanos per display unit of ``capacity``, and the unit (GiB for binary quantities)."""
    for device in state.devices.values():
        total = device.total.get(capacity)
        if total is not None:
            if total.format == Format.BINARY_SI:
                return 2**30 * 1e9, "GiB"
            return 1e18, "G"
    return 1e9, ""


class _Fold:
    """The state, the SLO fold and every panel's raw points, fed one event at a time."""

    def __init__(self, start: datetime.datetime) -> None:
        self.start = start
        self.state = ClusterState()
        self.slos = SloFold()
        self.members: dict[str, list[Any]] | None = None
        #: gauges: name -> label -> (time, value) points
        self.gauges: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(
            lambda: defaultdict(list)
        )
        #: counts: name -> label -> bucket -> count
        self.counts: dict[str, dict[str, dict[int, float]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(float))
        )
        #: spans: kind -> class -> bucket -> seconds
        self.spans: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(list))
        )
        #: decisions: outcome -> class -> bucket -> count
        self.decisions: dict[str, dict[str, dict[int, float]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(float))
        )
        self.recoveries: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.sampled: list[float] = []  #: the times of the samples so far
        #: the most claims unconverged / shares unknown: name -> class -> bucket -> count
        self.peaks: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))

    def feed(
        self, event: Event, position: int, at: datetime.datetime, bucket: int | None
    ) -> Refusal | None:
        """Fold ``event``, recorded ``at``; count it in ``bucket`` (``None``: before the
        window). An event the fold refuses is skipped: its refusal is returned."""
        transitions = meaning(event)
        try:
            refusal = fold_event(self.state, event, position)
        except InvariantViolation as exc:
            raise ReplayBrokenError(exc.position, str(exc)) from None
        if refusal is not None:
            return refusal  # skipped, as every reader skips it (events.folding)
        if type(event) in INVENTORY_EVENTS:
            self.members = None
        seen = self.slos.observe(self.state, event, at)
        if bucket is None:
            return None
        counts = self.counts
        for change in self.state.phase_changes().values():  # the fold's own journal
            counts["outcome"][change.after][bucket] += 1
        if _pending_grows(transitions):  # the peaks of a step follow these
            self._peak(bucket)
        if isinstance(event, ClaimRejected):  # the rule it names (not a transition's)
            counts["rejection"][rule_of(event)][bucket] += 1
        for t in transitions:
            if isinstance(t, MessageDropped):
                counts["dead"][t.consumer][bucket] += 1
        for o in seen:
            if o.kind == "decision":
                self.decisions[o.outcome][o.label][bucket] += 1
            elif o.kind == "recovery":
                self.recoveries[o.label].append(((at - self.start).total_seconds(), o.value))
            else:
                self.spans[o.kind][o.label][bucket].append(o.value)
        return None

    def sample(self, at: datetime.datetime, bucket: int) -> None:
        """Take every gauge's value now, at time ``at``, the end of ``bucket``."""
        state, t = self.state, (at - self.start).total_seconds()
        if self.members is None:
            self.members = class_members(state)
        for (cls, capacity), ratio in allocated_ratios(state, self.members).items():
            self.gauges["allocated"][f"{cls} {capacity}"].append((t, ratio))
        for (cls, capacity), ratio in stranded_ratios(state, self.members).items():
            self.gauges["stranded"][f"{cls} {capacity}"].append((t, ratio))
        held = {
            f"{namespace} {cls or '(no class)'} {capacity}": float(nanos)
            for (namespace, cls, capacity), nanos in held_by_tenant(state).items()
        }
        tenants = self.gauges["held"]
        for label, nanos in held.items():
            if label not in tenants:  # held nothing until now
                tenants[label] = [(earlier, 0.0) for earlier in self.sampled]
            tenants[label].append((t, nanos))
        for label, points in tenants.items():
            if label not in held:
                points.append((t, 0.0))
        self.sampled.append(t)
        pending = self._peak(bucket)
        for name, field in _PEAKS:
            by_class = getattr(pending, field)
            ages = self.gauges[f"{name}_age"]
            for cls, times in by_class.items():
                ages[cls].append((t, (at - min(times)).total_seconds()))
            for cls, points in ages.items():
                if cls not in by_class and points[-1][0] != t:
                    points.append((t, 0.0))

    def _peak(self, bucket: int) -> Pending:
        """What is pending now, counted into ``bucket``'s peaks."""
        pending = self.slos.pending(self.state)
        for name, field in _PEAKS:
            for cls, times in getattr(pending, field).items():
                peaks = self.peaks[name][cls]
                peaks[bucket] = max(peaks.get(bucket, 0.0), float(len(times)))
        return pending


async def _window(source: LogSource) -> tuple[datetime.datetime, datetime.datetime] | None:
    """The first and last time recorded in the log (``None``: empty)."""
    first: datetime.datetime | None = None
    last: datetime.datetime | None = None
    async for page in source.rows(0):
        if first is None and page:
            first = _time_of(page[0][RECORDED_AT])
        for row in page:
            at = _time_of(row[RECORDED_AT])
            last = at if last is None or at > last else last
    return (first, last) if first is not None and last is not None else None


async def build_report(
    source: LogSource,
    *,
    since: datetime.datetime | None = None,
    until: datetime.datetime | None = None,
    buckets: int = 60,
) -> Report:
    """Fold ``source`` and compute every panel over the window (module docstring)."""
    if since is None or until is None:
        window = await _window(source)
        if window is None:
            raise ReportError("the log is empty: nothing to report")
        since, until = since or window[0], until or window[1]
    if until <= since:
        until = since + datetime.timedelta(seconds=1)
    step = (until - since).total_seconds() / buckets
    fold = _Fold(since)
    next_sample, k, events, positions = since, 0, 0, [0, 0]
    async for page in source.rows(0):
        for row in page:
            at = _time_of(row[RECORDED_AT])
            if at > until:
                continue  # read on: a file's checksum covers it all
            while at > next_sample and k <= buckets:
                fold.sample(next_sample, k)
                k += 1
                next_sample = since + datetime.timedelta(seconds=step * k)
            event = decode(row[PAYLOAD], row[TYPE], row[SCHEMA_VERSION], row[POSITION])
            in_window = at >= since
            if isinstance(event, Refusal):
                note_refused(refuse(fold.state, event), row)
                continue
            refused = fold.feed(event, row[POSITION], at, max(k, 1) if in_window else None)
            if refused is not None:
                note_refused(refused, row)
                continue
            if in_window:
                events += 1
                positions = [positions[0] or row[POSITION], row[POSITION]]
    if not events:
        raise ReportError(
            f"no event was recorded between {since.isoformat()} and {until.isoformat()}"
        )
    while k <= buckets:
        fold.sample(next_sample, k)
        k += 1
        next_sample = since + datetime.timedelta(seconds=step * k)
    return Report(
        start=since,
        end=until,
        step=step,
        positions=(positions[0], positions[1]),
        events=events,
        panels=_panels(fold, step, buckets),
        spans={
            kind: {
                cls: (
                    sum(len(v) for v in by_bucket.values()),
                    sum(sum(v) for v in by_bucket.values()),
                )
                for cls, by_bucket in by_class.items()
            }
            for kind, by_class in fold.spans.items()
        },
        decisions={
            outcome: {cls: int(sum(by_bucket.values())) for cls, by_bucket in by_class.items()}
            for outcome, by_class in fold.decisions.items()
        },
    )


# --- from the fold's points to the dashboard's panels ---------------------------------------


def _lines(
    points: dict[str, list[tuple[float, float]]], style: str = "line", scale: float = 1.0
) -> tuple[list[Series], str]:
    """One series per label, the :data:`MAX_LINES` with the largest peak; a note on the rest."""
    ranked = sorted(points.items(), key=lambda kv: -max((v for _, v in kv[1]), default=0.0))
    kept = ranked[:MAX_LINES]
    out = [
        Series(
            label=label,
            times=[t for t, _ in pts],
            values=[v / scale for _, v in pts],
            style=style,
        )
        for label, pts in sorted(kept)
    ]
    left = len(ranked) - len(kept)
    return out, (f"{left} smaller series left out" if left else "")


def _rates(
    by_label: dict[str, dict[int, float]], step: float, buckets: int
) -> dict[str, list[tuple[float, float]]]:
    """Per-second rates per bucket (its end), every bucket of the window."""
    return {
        label: [(b * step, counts.get(b, 0.0) / step) for b in range(1, buckets + 1)]
        for label, counts in by_label.items()
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _latency(fold: _Fold, kind: str, title: str, step: float, quantiles: Iterable[float]) -> Panel:
    series: list[Series] = []
    for cls, by_bucket in sorted(fold.spans[kind].items()):
        for q in quantiles:
            pts = [(b * step, _quantile(v, q)) for b, v in sorted(by_bucket.items()) if v]
            style = "line" if q >= 0.99 else "dashed"
            series.append(
                Series(
                    label=f"{cls or '(no class)'} p{round(q * 100)}",
                    times=[t for t, _ in pts],
                    values=[v for _, v in pts],
                    style=style,
                )
            )
    return Panel(title=title, unit="seconds", series=series)


def _ratio_by_class(fold: _Fold, step: float) -> dict[str, list[tuple[float, float]]]:
    counts = fold.decisions
    classes = set(counts["admitted"]) | set(counts["rejected"]) | set(counts["unschedulable"])
    out: dict[str, list[tuple[float, float]]] = {}
    for cls in classes:
        buckets = set(counts["admitted"][cls]) | set(counts["rejected"][cls])
        buckets |= set(counts["unschedulable"][cls])
        pts = []
        for b in sorted(buckets):
            refused = counts["rejected"][cls].get(b, 0.0) + counts["unschedulable"][cls].get(b, 0.0)
            decided = counts["admitted"][cls].get(b, 0.0) + counts["rejected"][cls].get(b, 0.0)
            pts.append((b * step, refused / max(decided, 1.0)))
        out[cls or "(no class)"] = pts
    return out


def _panel(title: str, unit: str, points: dict[str, list[tuple[float, float]]], **kw: Any) -> Panel:
    scale = kw.pop("scale", 1.0)
    style = kw.pop("style", "line")
    series, note = _lines(points, style, scale)
    return Panel(title=title, unit=unit, series=series, note=note, **kw)


def _pending(fold: _Fold, name: str, what: str, unit: str, step: float, buckets: int) -> Panel:
    """The most ``name`` pending in each step, and the oldest's age at its end (dashed)."""
    peaks = fold.peaks.get(name, {})
    most = {
        cls: [(k * step, by_k.get(k, 0.0)) for k in range(buckets + 1)]
        for cls, by_k in peaks.items()
    }
    panel = _panel(f"{what} (most in each step), and the oldest's age", unit, most)
    panel.right, _ = _lines(fold.gauges[f"{name}_age"], "dashed")
    panel.right_unit = "oldest's age at the step's end (s), dashed"
    return panel


def _panels(fold: _Fold, step: float, buckets: int) -> list[Panel]:
    """The dashboard's panels, in its order (the titles say what the dashboard's say)."""
    g, counts, state = fold.gauges, fold.counts, fold.state
    held_by_capacity: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(dict)
    for label, pts in g["held"].items():
        held_by_capacity[label.rsplit(" ", 1)[1]][label] = pts
    held: dict[str, list[tuple[float, float]]] = {}
    for capacity, lines in held_by_capacity.items():
        nanos, unit = _scale(state, capacity)
        for label, pts in lines.items():
            held[f"{label} ({unit})" if unit else label] = [(t, v / nanos) for t, v in pts]
    unconverged = _pending(fold, "unconverged", "Claims not converged", "claims", step, buckets)
    waiting = _pending(fold, "waiting", "Claims waiting for capacity", "claims", step, buckets)
    unknown = _pending(fold, "unknown", "Unknown shares", "shares", step, buckets)
    recovery = Panel(
        title="Node recovery after a lost lease (each recovery)",
        unit="seconds",
        series=[
            Series(label=o, times=[t for t, _ in p], values=[v for _, v in p], style="points")
            for o, p in sorted(fold.recoveries.items())
        ],
    )
    dead = {
        c: [(b * step, float(n)) for b, n in sorted(v.items())] for c, v in counts["dead"].items()
    }
    return [
        _panel("Capacity allocated / total, per class and capacity", "ratio", g["allocated"]),
        _panel("Capacity held per tenant and class", "held (units in the legend)", held),
        _panel(
            "Claims by outcome (per second)", "per second", _rates(counts["outcome"], step, buckets)
        ),
        _panel(
            "Rejections by rule (per second)",
            "per second",
            _rates(counts["rejection"], step, buckets),
        ),
        _latency(
            fold,
            "scheduling",
            "Scheduling latency (the decision) p50 / p99, per class",
            step,
            (0.5, 0.99),
        ),
        _latency(
            fold, "capacity_wait", "Waiting for capacity p50 / p99, per class", step, (0.5, 0.99)
        ),
        _latency(
            fold, "enforcement", "Enforcement latency p50 / p99, per class", step, (0.5, 0.99)
        ),
        _latency(
            fold,
            "convergence",
            "Convergence (submitted, or capacity found -> Ready) p99, per class",
            step,
            (0.99,),
        ),
        unconverged,
        waiting,
        unknown,
        recovery,
        Panel(
            title="Relay lag (events not yet on the bus)",
            unit="events",
            note="not in the log: only the running relay knows it\n(dracap_relay_lag_events)",
        ),
        _panel("Dead letters (per step)", "messages", dead, style="points"),
        _panel(
            "Stranded capacity (free, below every device's smallest grant) / total",
            "ratio",
            g["stranded"],
        ),
        _panel(
            "Rejected or unschedulable / decided, per class (capacity rejection rate)",
            "ratio",
            _ratio_by_class(fold, step),
            style="points",
        ),
        _devices(state),
        _summary(state),
    ]


def _devices(state: ClusterState) -> Panel:
    """Allocated / total of each present device at the window's end (the per-class rule
    of :func:`~services.runtime.ops.gauges.allocated_ratios`, applied to one device)."""
    members: dict[str, list[Any]] = {}
    totals: dict[str, str] = {}
    for key, device in state.devices.items():
        if device.present:
            name = f"{device.node or device.pool}/{device.name}"
            members[name] = [key]
            for capacity, amount in device.total.items():
                totals[f"{name} {capacity}"] = str(amount)
    ratios = {
        f"{n} {c} of {totals[f'{n} {c}']}": r
        for (n, c), r in allocated_ratios(state, members).items()
    }
    ranked = sorted(ratios.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_BARS]
    left = len(ratios) - len(ranked)
    return Panel(
        title="Allocated / total per device, at the window's end",
        unit="ratio",
        bars=dict(sorted(ranked)),
        note=f"{left} less allocated devices left out" if left else ("" if ratios else "no device"),
    )


def _summary(state: ClusterState) -> Panel:
    """What the log holds at the window's end, in words."""
    phases = Counter(c.phase for c in state.claims.values())
    leases = Counter(n.lease for n in state.nodes.values())
    live = sum(1 for s in state.shares.values() if s.live)
    lines = [
        f"claims: {sum(phases.values())}"
        + "".join(f"\n  {phase}: {n}" for phase, n in sorted(phases.items())),
        f"live shares: {live}",
        f"devices: {sum(1 for d in state.devices.values() if d.present)}, "
        f"classes: {len(state.classes)}",
        "nodes: " + (", ".join(f"{n} {lease}" for lease, n in sorted(leases.items())) or "none"),
    ]
    return Panel(title="At the window's end", unit="", note="\n".join(lines))
