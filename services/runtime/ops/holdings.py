"""Capacity each tenant holds now: ``dracap_capacity_held{namespace,class,capacity}``.

What a tenant holds is a property of the log, so no service counts it: the rule is one
function, :func:`share_holding` — a live share (reserved, bound, ready, Unknown,
releasing: its capacity is not free) of a claim that is not an administrator's
(``adminAccess`` shares hold nothing a tenant is billed for) holds its consumed amounts
for the claim's namespace, under the DeviceClass its request asked for (the class label:
a class the log defines, else ""). ``dracap report`` draws its tenant panel from
:func:`held_by_tenant` of the folded state and the dashboard's from the gauge below, so
the two say the same thing; billing (``dracap_usage_unit_seconds_total``) integrates the
same amounts over time, but only when a stretch closes — a tenant holding 70 Gi for an
hour shows nothing there until the share is released, and the gauge now.

:class:`HeldCapacity` serves the gauge from a live state and costs what an event touches:
it keeps each live share's holding and the sums per (namespace, class, capacity), and an
event updates only the shares whose state it changed, as the fold's journal says
(:meth:`~events.state.ClusterState.share_changes`: a reservation, a release, every share
a fence releases), or everything after an event that changes which classes exist (or a
live state that replaced its state). The value is in the capacity's base unit
(bytes of ``memory``, bit/s of ``bandwidth``); a label set that held something and holds
nothing now reads 0 instead of vanishing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, NamedTuple

from prometheus_client.core import GaugeMetricFamily, Metric

from events.envelopes import Envelope
from events.state import ClusterState, ShareState
from events.transitions import ClassDefined, ClassRemoved, meaning
from services.runtime.ops.slos import LiveCollector, share_class
from services.runtime.store.livestate import LiveState

__all__ = ["GAUGE", "HeldCapacity", "Holding", "held_by_tenant", "share_holding"]

GAUGE: Final = "dracap_capacity_held"
_NANOS: Final = 1e9

Key = tuple[str, str, str]  #: namespace, class, capacity


class Holding(NamedTuple):
    """What one share holds: its tenant, its class and nanos per capacity."""

    namespace: str
    device_class: str
    amounts: dict[str, int]
    node: str | None


def share_holding(state: ClusterState, share: ShareState) -> Holding | None:
    """What ``share`` holds for its tenant now (None: nothing; the module docstring)."""
    if not share.live or share.admin_access:
        return None
    cls = share_class(state, share)
    amounts = {capacity: q.nanos for capacity, q in share.consumed.items()}
    return Holding(share.claim[0], cls if cls in state.classes else "", amounts, share.node)


def held_by_tenant(state: ClusterState) -> dict[Key, int]:
    """Nanos held per (namespace, class, capacity) in ``state``, from every share."""
    held: dict[Key, int] = {}
    for share in state.shares.values():
        holding = share_holding(state, share)
        if holding is not None:
            for capacity, nanos in holding.amounts.items():
                key = (holding.namespace, holding.device_class, capacity)
                held[key] = held.get(key, 0) + nanos
    return held


class HeldCapacity(LiveCollector):
    """Serves ``dracap_capacity_held`` from a live state (module docstring)."""

    def __init__(self, live: LiveState) -> None:
        super().__init__(live)
        self._shares: dict[str, Holding] = {}
        self._sums: dict[Key, int] = {}

    def start(self) -> None:
        """Take the live state's holdings now, listen to it and serve the gauge."""
        if self._unsubscribe is None:
            self.rebuild()
            self.attach(self._changed, GAUGE)
            self.live.on_replaced(lambda _state: self.rebuild())

    def rebuild(self) -> None:
        """Every holding again, from the live state (the sums seen stay, at 0 if gone)."""
        self._shares = {}
        self._sums = dict.fromkeys(self._sums, 0)
        for share_id in self.live.state.shares:
            self._update(share_id)

    def _changed(self, envelope: Envelope) -> None:
        for t in meaning(envelope.event):
            match t:
                case ClassDefined() | ClassRemoved():
                    self.rebuild()  # which classes exist: every label may change
                    return
        for share_id in self.live.state.share_changes():  # the fold's journal of the event
            self._update(share_id)

    def _update(self, share_id: str) -> None:
        old = self._shares.pop(share_id, None)
        if old is not None:
            self._add(old, -1)
        share = self.live.state.shares.get(share_id)
        new = share_holding(self.live.state, share) if share is not None else None
        if new is not None:
            self._shares[share_id] = new
            self._add(new, 1)

    def _add(self, holding: Holding, sign: int) -> None:
        for capacity, nanos in holding.amounts.items():
            key = (holding.namespace, holding.device_class, capacity)
            self._sums[key] = self._sums.get(key, 0) + sign * nanos

    def collect(self) -> Iterable[Metric]:
        gauge = GaugeMetricFamily(
            GAUGE,
            "Capacity live shares hold now per namespace, DeviceClass and capacity, in the "
            "capacity's base unit (bytes of memory, bit/s of bandwidth); admin shares apart.",
            labels=["namespace", "class", "capacity"],
        )
        for (namespace, cls, capacity), nanos in sorted(self._sums.items()):
            gauge.add_metric([namespace, cls, capacity], nanos / _NANOS)
        yield gauge
