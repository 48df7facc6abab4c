"""Service-level metrics read off the log as it is folded: convergence and node loss.

Like :mod:`services.runtime.gauges`, nothing here is counted by a service: a
:class:`SloTracker` listens to a :class:`~services.runtime.livestate.LiveState` and
derives, from each envelope's ``recorded_at`` and the folded state,

* ``dracap_claim_convergence_seconds{class}`` (histogram): from a claim's
  ``ClaimSubmitted`` to the event that made it Ready (the status converged: its limits
  are applied), by the DeviceClass of its first request;
* ``dracap_unconverged_claims{class}`` and
  ``dracap_unconverged_claim_oldest_age_seconds{class}`` (gauges, computed when scraped):
  claims submitted and neither Ready nor finished (rejected, withdrawn, released,
  failed), and the age of the oldest;
* ``dracap_unknown_shares{class}`` and ``dracap_unknown_share_oldest_age_seconds{class}``
  (gauges, computed when scraped): shares whose node lost its lease, and how long the
  oldest has been unknown — an alert on it is the fence deadline;
* ``dracap_node_recovery_seconds{outcome}`` (histogram): from a node's
  ``NodeLeaseExpired`` to its recovery, ``returned`` (a new lease) or ``fenced``.

The tracker keeps one timestamp per unconverged claim and per unknown share, so its
memory follows what is pending, not the log's length. A tracker started on a long log
learns the times of what is pending while the log is folded (``LiveState`` replays it
through its listeners only from where the tracker subscribed: what was pending before
shows from its next change).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Iterable
from typing import Final

from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from events.catalog import (
    ClaimSubmitted,
    Envelope,
    NodeFenced,
    NodeLeaseAcquired,
    NodeLeaseExpired,
    ShareMarkedUnknown,
)
from events.fold import TERMINAL_PHASES, ClaimKey, ClusterState
from services.runtime.livestate import LiveState
from services.runtime.metrics import REGISTRY

__all__ = ["CONVERGENCE", "GAUGE_NAMES", "NODE_RECOVERY", "SloTracker", "first_class"]

#: The gauges a started tracker serves (computed at each scrape).
GAUGE_NAMES: Final = (
    "dracap_unconverged_claims",
    "dracap_unconverged_claim_oldest_age_seconds",
    "dracap_unknown_shares",
    "dracap_unknown_share_oldest_age_seconds",
)

CONVERGENCE: Final = Histogram(
    "dracap_claim_convergence_seconds",
    "From a claim's submission to its Ready status (limits applied), by DeviceClass.",
    ["class"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
    registry=REGISTRY,
)
NODE_RECOVERY: Final = Histogram(
    "dracap_node_recovery_seconds",
    "From a node's lease expiry to its recovery: returned (a new lease) or fenced.",
    ["outcome"],
    buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
    registry=REGISTRY,
)
log = logging.getLogger("dracap.slos")
_DONE: Final = TERMINAL_PHASES | {"ready", "stalled"}


def first_class(state: ClusterState, key: ClaimKey) -> str:
    """The DeviceClass of a claim's first request ("" when it names none)."""
    claim = state.claims.get(key)
    if claim is None or claim.claim is None or claim.claim.spec.devices is None:
        return ""
    for request in claim.claim.spec.devices.requests or ():
        if request.exactly is not None:
            return request.exactly.device_class_name
        for sub in request.first_available or ():
            return sub.device_class_name
    return ""


class SloTracker(Collector):
    """Derives the service-level metrics of the module docstring from the live state."""

    def __init__(
        self, live: LiveState, *, now: Callable[[], datetime.datetime] | None = None
    ) -> None:
        self.live = live
        self._now = now or (lambda: datetime.datetime.now(datetime.UTC))
        #: unconverged claims: submitted at, class
        self.pending: dict[ClaimKey, tuple[datetime.datetime, str]] = {}
        #: unknown shares: unknown since
        self.unknown: dict[str, datetime.datetime] = {}
        self.expired_at: dict[str, datetime.datetime] = {}  #: lost nodes: expired at
        self._unsubscribe: Callable[[], None] | None = None
        self._registered = False

    def start(self) -> None:
        """Listen to the live state and serve the gauges from the registry."""
        if self._unsubscribe is None:
            self._unsubscribe = self.live.subscribe(self.observe)
            try:
                REGISTRY.register(self)
                self._registered = True
            except ValueError:  # another tracker of this process serves the gauges
                log.warning("the SLO gauges are served by another tracker of this process")

    def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._registered:
            REGISTRY.unregister(self)
            self._registered = False

    def observe(self, env: Envelope) -> None:
        """Fold one envelope's meaning for the metrics (``live.state`` already has it)."""
        state, event, at = self.live.state, env.event, env.recorded_at
        if isinstance(event, ClaimSubmitted):
            key = (event.claim.metadata.namespace or "", event.claim.metadata.name)
            self.pending.setdefault(key, (at, first_class(state, key)))
        elif isinstance(event, (NodeLeaseExpired, ShareMarkedUnknown)):
            if isinstance(event, NodeLeaseExpired):
                self.expired_at.setdefault(event.node, at)
            node = state.nodes.get(event.node)
            for share_id in node.live_shares if node is not None else ():
                if state.shares[share_id].state == "unknown":
                    self.unknown.setdefault(share_id, at)
        elif isinstance(event, (NodeLeaseAcquired, NodeFenced)):
            since = self.expired_at.pop(event.node, None)
            if since is not None:
                outcome = "fenced" if isinstance(event, NodeFenced) else "returned"
                NODE_RECOVERY.labels(outcome=outcome).observe((at - since).total_seconds())
        self._settle(state, env)

    def _settle(self, state: ClusterState, env: Envelope) -> None:
        """Close what ``env`` finished: only the claims and shares it names (one lookup
        per event on the hot path), everything pending after a node-wide event."""
        event, at = env.event, env.recorded_at
        share_id = getattr(event, "share_id", None)
        keys: Iterable[ClaimKey]
        shares: Iterable[str]
        if isinstance(event, (NodeFenced, NodeLeaseAcquired)):
            keys, shares = list(self.pending), list(self.unknown)
        elif isinstance(share_id, str):
            share = state.shares.get(share_id)
            keys, shares = ([share.claim] if share is not None else []), [share_id]
        else:
            namespace, name = getattr(event, "namespace", None), getattr(event, "name", None)
            keys = (
                [(namespace, name)] if isinstance(namespace, str) and isinstance(name, str) else []
            )
            shares = []
        for key in keys:
            if key in self.pending and _phase(state, key) in _DONE:
                submitted, cls = self.pending.pop(key)
                if _phase(state, key) in ("ready", "stalled"):
                    seconds = (at - submitted).total_seconds()
                    CONVERGENCE.labels(**{"class": cls}).observe(seconds)
        for unknown in shares:
            if unknown in self.unknown and _share_state(state, unknown) != "unknown":
                del self.unknown[unknown]

    def collect(self) -> Iterable[Metric]:
        """The gauges, computed now (a scrape)."""
        now, state = self._now(), self.live.state
        count = GaugeMetricFamily(
            GAUGE_NAMES[0],
            "Claims submitted and neither Ready nor finished, by DeviceClass.",
            labels=["class"],
        )
        oldest = GaugeMetricFamily(
            GAUGE_NAMES[1],
            "Age of the oldest claim submitted and neither Ready nor finished.",
            labels=["class"],
        )
        for cls, times in _by_class(self.pending.values()).items():
            count.add_metric([cls], len(times))
            oldest.add_metric([cls], (now - min(times)).total_seconds())
        unknown = GaugeMetricFamily(
            GAUGE_NAMES[2],
            "Shares whose node lost its lease (capacity held until fenced or confirmed).",
            labels=["class"],
        )
        unknown_age = GaugeMetricFamily(
            GAUGE_NAMES[3],
            "How long the oldest unknown share has been unknown.",
            labels=["class"],
        )
        shares = [
            (since, first_class(state, state.shares[s].claim))
            for s, since in self.unknown.items()
            if s in state.shares
        ]
        for cls, times in _by_class(shares).items():
            unknown.add_metric([cls], len(times))
            unknown_age.add_metric([cls], (now - min(times)).total_seconds())
        yield from (count, oldest, unknown, unknown_age)


def _phase(state: ClusterState, key: ClaimKey) -> str:
    claim = state.claims.get(key)
    return claim.phase if claim is not None else "withdrawn"


def _share_state(state: ClusterState, share_id: str) -> str:
    share = state.shares.get(share_id)
    return share.state if share is not None else "released"


def _by_class(
    items: Iterable[tuple[datetime.datetime, str]],
) -> dict[str, list[datetime.datetime]]:
    out: dict[str, list[datetime.datetime]] = {}
    for when, cls in items:
        out.setdefault(cls, []).append(when)
    return out
