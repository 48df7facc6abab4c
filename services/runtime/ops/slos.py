"""Service-level metrics read off the log as it is folded, by DeviceClass: one home.

Nothing here is counted by a service. The rules live in :class:`SloFold`, which folds
each event's meaning for the SLOs next to the :class:`~events.state.ClusterState` that
already holds it (the envelope's ``recorded_at`` is the clock) and hands back
:class:`Observation` s. :class:`SloTracker` exports them as Prometheus series from a
live state; ``dracap report`` (:mod:`services.report.panels`) draws the same
observations from the log: the two cannot disagree, and
``tests/integration/test_slos.py`` and ``tests/integration/test_report.py`` check that they
do not on one log. What an event did comes from its transitions
(:func:`events.transitions.meaning`), what it finished from the fold's journal
(:meth:`~events.state.ClusterState.phase_changes`,
:meth:`~events.state.ClusterState.share_changes`): the fold says once which claims and
shares an event moved, and nothing here reads an event's fields.

Slow and full are told apart. A claim that does not fit when it is decided
(``ClaimUnschedulable``) is *waiting for capacity* until an allocation ends the wait:
that is the class being full, not the control plane being slow, so it is measured on
its own and kept out of the latency and convergence objectives.

* ``scheduling``: from a claim's ``ClaimAdmitted`` to its first decision
  (``AllocationBound`` or ``ClaimUnschedulable``): the decision's time, queueing in the
  reservation service included, waiting for capacity not;
* ``capacity_wait``: from a claim's ``ClaimUnschedulable`` to the ``AllocationBound``
  that ends its wait (a claim withdrawn while it waits is not observed);
* ``convergence``: from a claim's ``ClaimSubmitted`` — or, after a wait for capacity,
  from the allocation that ended it — to the event that made it Ready (its limits are
  applied), by the DeviceClass of its first request;
* ``enforcement``: from ``AllocationBound`` to its node agent's first ``LimitApplied`` /
  ``LimitFailed`` (the report's; Prometheus has the agent's own measure of that span,
  ``dracap_enforcement_latency_seconds``, observed when its append commits);
* ``decision``: each admission or scheduling decision, ``admitted`` / ``rejected``
  (``ClaimRejected``) / ``unschedulable`` (``ClaimUnschedulable``), by DeviceClass —
  the capacity rejection rate per class;
* ``recovery``: from a node's ``NodeLeaseExpired`` to its recovery, ``returned`` (a new
  lease) or ``fenced``.

:meth:`SloFold.pending` says what is pending now, each with the time it started, by
class: claims submitted and neither Ready nor finished (rejected, withdrawn, released,
failed) nor waiting for capacity; claims waiting for capacity; shares whose node lost its
lease.

A :class:`SloTracker` listens to a :class:`~services.runtime.store.livestate.LiveState`,
runs a :class:`SloFold` and exports it:

* ``dracap_scheduling_latency_seconds{class}``, ``dracap_capacity_wait_seconds{class}``,
  ``dracap_claim_convergence_seconds{class}`` and ``dracap_node_recovery_seconds{outcome}``
  (histograms; recovery has no class: a node holds devices of several);
* ``dracap_claim_decisions_total{class,outcome}`` (counter);
* ``dracap_unconverged_claims{class}``, ``dracap_unconverged_claim_oldest_age_seconds{class}``,
  ``dracap_capacity_waiting_claims{class}``,
  ``dracap_capacity_waiting_oldest_age_seconds{class}``, ``dracap_unknown_shares{class}``
  and ``dracap_unknown_share_oldest_age_seconds{class}`` (gauges, computed when scraped)
  — an alert on the last is the fence deadline, one on the waiting age says a class is
  full.

The class label is the name of a DeviceClass the log defines (:func:`known_class`), so a
tenant naming a class that does not exist adds no series. The fold keeps one timestamp
per pending claim and per unknown share, so its memory follows what is pending, not
the log's length. A tracker started on a long log learns the times of what is pending
while the log is folded (``LiveState`` replays it through its listeners only from where
the tracker subscribed: what was pending before shows from its next change).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Iterable
from typing import Final, NamedTuple

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from events.catalog import Event
from events.envelopes import Envelope
from events.state import TERMINAL_PHASES, ClaimKey, ClusterState, ShareState
from events.transitions import (
    ClaimBound,
    ClaimDecided,
    ClaimEntered,
    ClassDefined,
    LimitsSettled,
    NodeFencedOff,
    NodeLost,
    NodeReturned,
    counted,
    meaning,
)
from services.runtime.ground.metrics import REGISTRY, SCHEDULING_LATENCY
from services.runtime.store.livestate import LiveState

__all__ = [
    "CAPACITY_WAIT",
    "CONVERGENCE",
    "DECISIONS",
    "GAUGE_NAMES",
    "NODE_RECOVERY",
    "LiveCollector",
    "Observation",
    "Pending",
    "SloFold",
    "SloTracker",
    "first_class",
    "known_class",
    "share_class",
]

#: The gauges a started tracker serves (computed at each scrape).
GAUGE_NAMES: Final = (
    "dracap_unconverged_claims",
    "dracap_unconverged_claim_oldest_age_seconds",
    "dracap_unknown_shares",
    "dracap_unknown_share_oldest_age_seconds",
    "dracap_capacity_waiting_claims",
    "dracap_capacity_waiting_oldest_age_seconds",
)

CONVERGENCE: Final = Histogram(
    "dracap_claim_convergence_seconds",
    "From a claim's submission to its Ready status (limits applied), by DeviceClass.",
    ["class"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
    registry=REGISTRY,
)
CAPACITY_WAIT: Final = Histogram(
    "dracap_capacity_wait_seconds",
    "From a claim found unschedulable (no free capacity) to the allocation that ends its "
    "wait, by DeviceClass: the class being full, apart from the scheduling latency.",
    ["class"],
    buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400),
    registry=REGISTRY,
)
NODE_RECOVERY: Final = Histogram(
    "dracap_node_recovery_seconds",
    "From a node's lease expiry to its recovery: returned (a new lease) or fenced.",
    ["outcome"],
    buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
    registry=REGISTRY,
)
DECISIONS: Final = Counter(
    "dracap_claim_decisions_total",
    "Admission and scheduling decisions recorded in the log (admitted, rejected, "
    "unschedulable), by DeviceClass.",
    ["class", "outcome"],
    registry=REGISTRY,
)
DECISION_OUTCOMES: Final = ("admitted", "rejected", "unschedulable")
#: the outcomes of ``dracap_node_recovery_seconds``
RECOVERY_OUTCOMES: Final = ("returned", "fenced")
log = logging.getLogger("dracap.slos")
_DONE: Final = TERMINAL_PHASES | {"ready", "stalled"}


class Observation(NamedTuple):
    """One thing an event meant for the SLOs (see the module docstring)."""

    kind: str  #: convergence, decision, recovery, scheduling, capacity_wait or enforcement
    label: str  #: the DeviceClass ("" none); for recovery the outcome
    value: float  #: seconds; 1 for a decision
    outcome: str = ""  #: a decision's outcome; scheduling: allocated or unschedulable;
    #: enforcement: applied or failed


class Pending(NamedTuple):
    """What is pending now, by class: since when each claim or share has been."""

    claims: dict[str, list[datetime.datetime]]  #: unconverged (not waiting for capacity)
    unknown: dict[str, list[datetime.datetime]]
    waiting: dict[str, list[datetime.datetime]]  #: waiting for capacity


def first_class(state: ClusterState, key: ClaimKey) -> str:
    """The DeviceClass of a claim's first request ("" when it names none)."""
    claim = state.claims.get(key)
    names = claim.spec.classes() if claim is not None and claim.spec is not None else ()
    return names[0] if names else ""


def known_class(state: ClusterState, key: ClaimKey) -> str:
    """:func:`first_class` when the log defines that DeviceClass, else "" (a metric label:
    a name a tenant made up must not become a series)."""
    name = first_class(state, key)
    return name if name in state.classes else ""


def share_class(state: ClusterState, share: ShareState) -> str | None:
    """The DeviceClass the share's request asked for (``None``: not known)."""
    claim = state.claims.get(share.claim)
    return claim.class_of(share.request) if claim is not None else None


class SloFold:
    """The SLO bookkeeping of the module docstring, folded next to a ``ClusterState``."""

    def __init__(self) -> None:
        #: unconverged claims (not waiting): since (submitted, or their wait ended), class
        self.pending_claims: dict[ClaimKey, tuple[datetime.datetime, str]] = {}
        #: claims waiting for capacity: unschedulable since, class
        self.waiting: dict[ClaimKey, tuple[datetime.datetime, str]] = {}
        self.unknown: dict[str, datetime.datetime] = {}  #: unknown shares: unknown since
        self.expired_at: dict[str, datetime.datetime] = {}  #: lost nodes: expired at
        self.admitted: dict[ClaimKey, datetime.datetime] = {}  #: not decided yet
        self.bound: dict[ClaimKey, datetime.datetime] = {}  #: waiting for their agent

    def observe(
        self, state: ClusterState, event: Event, at: datetime.datetime
    ) -> list[Observation]:
        """Fold one event recorded ``at`` (``state`` already has it); what it meant.

        What the event says happened comes from its transitions
        (:func:`~events.transitions.meaning`); what it finished — a claim Ready or ended,
        a share Unknown, known again or released — from the fold's journal of the event
        (:meth:`~events.state.ClusterState.phase_changes`,
        :meth:`~events.state.ClusterState.share_changes`): nothing here reads the event
        itself."""
        out: list[Observation] = []
        for t in counted(state, meaning(event)):  # a stale expiry or fence: no span
            match t:
                case ClaimEntered():
                    key = (t.namespace, t.name)
                    self.pending_claims.setdefault(key, (at, known_class(state, key)))
                case ClaimDecided(outcome="admitted" | "rejected" | "unschedulable"):
                    key = (t.namespace, t.name)
                    cls = known_class(state, key)
                    out.append(Observation("decision", cls, 1.0, t.outcome))
                    self._decided(t.outcome, key, cls, at, out)
                case NodeLost():
                    self.expired_at.setdefault(t.node, at)
                case NodeReturned():
                    self._recovered(t.node, "returned", at, out)
                case NodeFencedOff():
                    self._recovered(t.node, "fenced", at, out)
                case ClaimBound():
                    key = (t.namespace, t.name)
                    self._decided("bound", key, known_class(state, key), at, out)
                case LimitsSettled():
                    share = state.shares.get(t.share_id)
                    if share is not None:
                        cls = known_class(state, share.claim)
                        self._enforced(t.applied, share.claim, cls, at, out)
        self._settle(state, at, out)
        return out

    def _recovered(
        self, node: str, outcome: str, at: datetime.datetime, out: list[Observation]
    ) -> None:
        since = self.expired_at.pop(node, None)
        if since is not None:
            out.append(Observation("recovery", outcome, (at - since).total_seconds()))

    def _decided(
        self, decision: str, key: ClaimKey, cls: str, at: datetime.datetime, out: list[Observation]
    ) -> None:
        """Scheduling, and waiting for capacity (see the module docstring); ``decision``:
        admitted, rejected, unschedulable or bound."""
        if decision == "admitted":
            self.admitted[key] = at
            return
        if decision == "rejected":
            return
        admitted = self.admitted.pop(key, None)
        if admitted is not None:  # the first decision
            outcome = "allocated" if decision == "bound" else "unschedulable"
            out.append(Observation("scheduling", cls, (at - admitted).total_seconds(), outcome))
        if decision == "unschedulable":
            if key not in self.waiting:
                self.pending_claims.pop(key, None)
                self.waiting[key] = (at, cls)
            return
        self.bound[key] = at
        waited = self.waiting.pop(key, None)
        if waited is not None:  # capacity came: the claim is the control plane's again
            out.append(Observation("capacity_wait", cls, (at - waited[0]).total_seconds()))
            self.pending_claims[key] = (at, cls)

    def _enforced(
        self, applied: bool, key: ClaimKey, cls: str, at: datetime.datetime, out: list[Observation]
    ) -> None:
        bound = self.bound.pop(key, None)
        if bound is not None:
            outcome = "applied" if applied else "failed"
            out.append(Observation("enforcement", cls, (at - bound).total_seconds(), outcome))

    def _settle(self, state: ClusterState, at: datetime.datetime, out: list[Observation]) -> None:
        """Close what the last folded event finished, as the fold's journal says: the
        claims whose phase it changed, the shares whose state it changed (a fence's every
        share and claim among them) — a few entries per event on the hot path."""
        for key, change in state.phase_changes().items():
            phase = change.after
            if phase in TERMINAL_PHASES:  # nothing more to wait for
                self.admitted.pop(key, None)
                self.bound.pop(key, None)
                self.waiting.pop(key, None)
            if phase in _DONE and key in self.pending_claims:
                since, cls = self.pending_claims.pop(key)
                if phase in ("ready", "stalled"):
                    out.append(Observation("convergence", cls, (at - since).total_seconds()))
        unknown = self.unknown
        for share_id, moved in state.share_changes().items():
            if moved.after == "unknown":  # its node lost its lease
                unknown.setdefault(share_id, at)
            elif moved.before == "unknown":  # confirmed, fenced or released
                unknown.pop(share_id, None)

    def pending(self, state: ClusterState) -> Pending:
        """Unconverged claims, claims waiting for capacity and unknown shares now, by class."""
        shares = [
            (since, known_class(state, state.shares[s].claim))
            for s, since in self.unknown.items()
            if s in state.shares
        ]
        return Pending(
            _by_class(self.pending_claims.values()),
            _by_class(shares),
            _by_class(self.waiting.values()),
        )


class LiveCollector(Collector):
    """A collector a live state's events keep current: listening and served from the
    registry between :meth:`attach` and :meth:`stop`, once per process."""

    def __init__(self, live: LiveState) -> None:
        self.live = live
        self._unsubscribe: Callable[[], None] | None = None
        self._registered = False

    def attach(self, listener: Callable[[Envelope], None], what: str) -> bool:
        """Listen with ``listener`` and serve ``what``; False when attached already."""
        if self._unsubscribe is not None:
            return False
        self._unsubscribe = self.live.subscribe(listener)
        try:
            REGISTRY.register(self)
            self._registered = True
        except ValueError:  # another tracker of this process serves them
            log.warning("%s are served by another tracker of this process", what)
        return True

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._registered:
            REGISTRY.unregister(self)
            self._registered = False


class SloTracker(LiveCollector):
    """Exports a :class:`SloFold` of the live state (see the module docstring)."""

    def __init__(
        self, live: LiveState, *, now: Callable[[], datetime.datetime] | None = None
    ) -> None:
        super().__init__(live)
        self.fold = SloFold()
        # ages count on the database's clock, as the recorded_at they start from
        self._now = now or live.store.clock.now

    def start(self) -> None:
        """Listen to the live state and serve the gauges from the registry."""
        if self.attach(self.observe, "the SLO gauges"):
            for cls in self.live.state.classes:  # every known class's series at 0
                _class_series(cls)

    def observe(self, env: Envelope) -> None:
        """Fold one envelope's meaning for the metrics (``live.state`` already has it)."""
        for t in meaning(env.event):
            match t:
                case ClassDefined():  # a new class's series at 0 too
                    _class_series(t.name)
        for seen in self.fold.observe(self.live.state, env.event, env.recorded_at):
            if seen.kind == "convergence":
                CONVERGENCE.labels(seen.label).observe(seen.value)
            elif seen.kind == "recovery":
                NODE_RECOVERY.labels(seen.label).observe(seen.value)
            elif seen.kind == "decision":
                DECISIONS.labels(seen.label, seen.outcome).inc()
            elif seen.kind == "scheduling":
                SCHEDULING_LATENCY.labels(seen.label).observe(seen.value)
            elif seen.kind == "capacity_wait":
                CAPACITY_WAIT.labels(seen.label).observe(seen.value)

    def collect(self) -> Iterable[Metric]:
        """The gauges, computed now (a scrape)."""
        now = self._now()
        pending = self.fold.pending(self.live.state)
        for cls in self.live.state.classes:  # a class with none reads 0, never vanishes
            for by_class in (pending.claims, pending.unknown, pending.waiting):
                by_class.setdefault(cls, [])
        for (count, oldest), by_class in zip(
            _GAUGES, (pending.claims, pending.unknown, pending.waiting), strict=True
        ):
            yield from _count_and_age(count, oldest, by_class, now)


#: each pair of gauges: (name, help) of the count and of the oldest's age
_GAUGES: Final = (
    (
        (GAUGE_NAMES[0], "Claims submitted and neither Ready nor finished nor waiting for "
         "capacity, by DeviceClass."),
        (GAUGE_NAMES[1], "Age of the oldest claim submitted and neither Ready nor finished."),
    ),
    (
        (GAUGE_NAMES[2], "Shares whose node lost its lease (capacity held until fenced or "
         "confirmed)."),
        (GAUGE_NAMES[3], "How long the oldest unknown share has been unknown."),
    ),
    (
        (GAUGE_NAMES[4], "Claims waiting for capacity (unschedulable until an allocation), "
         "by DeviceClass."),
        (GAUGE_NAMES[5], "How long the oldest claim waiting for capacity has waited."),
    ),
)  # fmt: skip


def _count_and_age(
    count: tuple[str, str],
    oldest: tuple[str, str],
    by_class: dict[str, list[datetime.datetime]],
    now: datetime.datetime,
) -> Iterable[Metric]:
    """How many per class, and the oldest's age (0 for a class with none)."""
    counted = GaugeMetricFamily(*count, labels=["class"])
    aged = GaugeMetricFamily(*oldest, labels=["class"])
    for cls, times in by_class.items():
        counted.add_metric([cls], len(times))
        aged.add_metric([cls], (now - min(times)).total_seconds() if times else 0.0)
    yield from (counted, aged)


def _class_series(cls: str) -> None:
    """A DeviceClass's decision counters and latency histograms, at 0."""
    for outcome in DECISION_OUTCOMES:
        DECISIONS.labels(cls, outcome)
    for histogram in (SCHEDULING_LATENCY, CAPACITY_WAIT, CONVERGENCE):
        histogram.labels(cls)


def _by_class(
    items: Iterable[tuple[datetime.datetime, str]],
) -> dict[str, list[datetime.datetime]]:
    out: dict[str, list[datetime.datetime]] = {}
    for when, cls in items:
        out.setdefault(cls, []).append(when)
    return out
