"""Metrics derived from the live state, not counted by a service.

``dracap_capacity_allocated_ratio{class,capacity}`` is a property of the cluster as the
log describes it, so no service increments it: :class:`CapacityGauges` listens to a
:class:`~services.runtime.store.livestate.LiveState` and recomputes the gauge from the fold
(:class:`events.state.ClusterState`) whenever an event changed what is allocated or
what exists:

* a share held, a share released and a node fenced (``ShareHeld``, ``ShareReleased``,
  ``NodeFencedOff``: :mod:`events.transitions`) move the consumed amounts;
* the inventory's changes (classes, slices, request policies, nodes, health:
  ``INVENTORY_CHANGES``) change which devices a class selects and their totals.

For every DeviceClass and every capacity its devices publish, the value is the sum of
the consumed amounts over the sum of the totals of the devices the class's CEL
selectors match (the same selection admission and the allocator use). A device held
exclusively (a dedicated allocation) counts as fully allocated: nobody else can use
any of it. A class that selects no device with a capacity has no series; a removed
class's series are removed.

Changes are coalesced and cost what they touch: the listener notes the devices an
event changes (a reservation's or release's device, every device of a fenced node) and
schedules one update on the event loop, which takes out those devices' old amounts from
the sums of their classes and puts their new ones in (integer nanos, so the ratio is
exactly the one a recomputation from scratch gives: :func:`allocated_ratios`,
:func:`stranded_ratios`), whatever the number of devices and shares. Class membership
(the CEL selectors), and with it every sum, is recomputed only after an inventory
event.

:func:`~services.runtime.ops.series.initialise_series` (re-exported here) creates the
label sets known when a process starts at 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

from prometheus_client import Gauge

from events.envelopes import Envelope
from events.features import DEFAULT_GATES, FeatureGates
from events.inventory import build_inventory
from events.model import CapacityRequestPolicy
from events.state import ClusterState, DeviceKey
from events.transitions import NodeFencedOff, ShareHeld, ShareReleased, first, meaning
from services.runtime.ground.metrics import CAPACITY_ALLOCATED_RATIO, CAPACITY_STRANDED_RATIO
from services.runtime.ops.series import CLAIM_OUTCOMES, initialise_series
from services.runtime.store.livestate import INVENTORY_EVENTS, LiveState

__all__ = [
    "CLAIM_OUTCOMES",
    "CapacityGauges",
    "allocated_ratios",
    "class_members",
    "device_amounts",
    "initialise_series",
    "smallest_grant",
    "stranded_ratios",
]

log = logging.getLogger("dracap.gauges")


Ratios = dict[tuple[str, str], float]
#: per capacity of one device: (allocated, total, stranded) nanos
Amounts = dict[str, tuple[int, int, int]]


def class_members(
    state: ClusterState, gates: FeatureGates = DEFAULT_GATES
) -> dict[str, list[DeviceKey]]:
    """For every DeviceClass of ``state``: the devices its selectors match.

    A selector that fails on a device (a CEL runtime error) does not match it, as in
    admission and the allocator.
    """
    inventory = build_inventory(state, gates)
    out: dict[str, list[DeviceKey]] = {}
    for name, device_class in inventory.classes.items():
        expressions = [
            s.cel.expression for s in device_class.spec.selectors or [] if s.cel is not None
        ]
        out[name] = [
            entry.key
            for entry in inventory.devices
            if all(inventory.selector_result(entry.index, e) is True for e in expressions)
        ]
    return out


def smallest_grant(policy: CapacityRequestPolicy | None) -> int:
    """The fewest nanos a share of a capacity under ``policy`` can hold (0: any amount)."""
    if policy is None:
        return 0
    if policy.valid_values:
        return min(v.nanos for v in policy.valid_values)
    if policy.valid_range is not None:
        return policy.valid_range.min.nanos
    return 0


def device_amounts(state: ClusterState, key: DeviceKey) -> Amounts:
    """What one device adds to the sums of its classes (see :func:`allocated_ratios` and
    :func:`stranded_ratios`, which it follows rule for rule); ``{}`` when not present."""
    dev = state.devices.get(key)
    if dev is None or not dev.present:
        return {}
    held = dev.exclusive_share is not None
    out: Amounts = {}
    for capacity, amount in dev.total.items():
        if amount.nanos <= 0:
            continue
        consumed = dev.consumed_nanos.get(capacity, 0)
        used = amount.nanos if held else consumed
        free = amount.nanos - consumed
        unusable = dev.allow_multiple_allocations and 0 < free < smallest_grant(
            dev.policies.get(capacity)
        )
        out[capacity] = (min(max(used, 0), amount.nanos), amount.nanos, free if unusable else 0)
    return out


def stranded_ratios(state: ClusterState, members: dict[str, list[DeviceKey]]) -> Ratios:
    """``{(class, capacity): stranded / total}``: free capacity of a shared device below
    its smallest grant (no share can ever take it) over the class's total. A dedicated
    device strands nothing (it is taken whole or not at all)."""
    out: Ratios = {}
    for class_name, keys in members.items():
        stranded: dict[str, int] = {}
        total: dict[str, int] = {}
        for key in keys:
            dev = state.devices.get(key)
            if dev is None or not dev.present:
                continue
            for capacity, amount in dev.total.items():
                if amount.nanos <= 0:
                    continue
                total[capacity] = total.get(capacity, 0) + amount.nanos
                free = amount.nanos - dev.consumed_nanos.get(capacity, 0)
                least = smallest_grant(dev.policies.get(capacity))
                unusable = dev.allow_multiple_allocations and 0 < free < least
                stranded[capacity] = stranded.get(capacity, 0) + (free if unusable else 0)
        for capacity, whole in total.items():
            out[(class_name, capacity)] = stranded[capacity] / whole
    return out


def allocated_ratios(state: ClusterState, members: dict[str, list[DeviceKey]]) -> Ratios:
    """``{(class, capacity): allocated / total}`` over the present devices of each class."""
    out: Ratios = {}
    for class_name, keys in members.items():
        allocated: dict[str, int] = {}
        total: dict[str, int] = {}
        for key in keys:
            dev = state.devices.get(key)
            if dev is None or not dev.present:
                continue
            held = dev.exclusive_share is not None
            for capacity, amount in dev.total.items():
                if amount.nanos <= 0:
                    continue
                used = amount.nanos if held else dev.consumed_nanos.get(capacity, 0)
                total[capacity] = total.get(capacity, 0) + amount.nanos
                allocated[capacity] = allocated.get(capacity, 0) + min(max(used, 0), amount.nanos)
        for capacity, whole in total.items():
            out[(class_name, capacity)] = allocated[capacity] / whole
    return out


class CapacityGauges:
    """Keeps ``dracap_capacity_allocated_ratio`` equal to what ``live.state`` says."""

    def __init__(
        self,
        live: LiveState,
        *,
        gauge: Gauge = CAPACITY_ALLOCATED_RATIO,
        gates: FeatureGates = DEFAULT_GATES,
    ) -> None:
        self.live = live
        self.gauge = gauge
        self.gates = gates
        self.refreshes = 0  #: updates so far (from scratch or of the devices touched)
        self.rebuilds = 0  #: of which from scratch (after an inventory event)
        self._members: dict[str, list[DeviceKey]] | None = None
        self._classes_of: dict[DeviceKey, list[str]] = {}
        self._devices_of: dict[str, list[DeviceKey]] = {}  # node -> its devices
        self._amounts: dict[DeviceKey, Amounts] = {}
        self._sums: dict[tuple[str, str], list[int]] = {}  # (class, capacity) -> 3 sums
        self._dirty: set[DeviceKey] = set()
        self._series: set[tuple[str, str]] = set()
        self._scheduled = False
        self._unsubscribe: Callable[[], None] | None = None

    def start(self) -> None:
        """Listen to the live state and set the gauge from its current state now."""
        if self._unsubscribe is None:
            self._unsubscribe = self.live.subscribe(self._changed)
            self.live.on_replaced(lambda _state: self._rebuilt())
        self._rebuilt()

    def _rebuilt(self) -> None:
        self._members = None
        self.refresh()

    def stop(self) -> None:
        """Stop listening (the series keep their last values)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def _changed(self, envelope: Envelope) -> None:
        event = envelope.event
        if type(event) in INVENTORY_EVENTS:
            self._members = None
        else:
            change = first(meaning(event), (ShareHeld, ShareReleased, NodeFencedOff))
            match change:
                case ShareHeld():
                    self._dirty.add((change.driver, change.pool, change.device))
                case ShareReleased():
                    share = self.live.state.shares.get(change.share_id)
                    if share is not None:
                        self._dirty.add(share.device_key)
                case NodeFencedOff():
                    self._dirty.update(self._devices_of.get(change.node, ()))
                case _:
                    return
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # folded outside a loop (a synchronous caller): do it now
            self.refresh()
            return
        self._scheduled = True
        loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        try:
            self.refresh()
        except Exception:  # a metric must never break the service that hosts it
            log.exception("could not recompute the capacity gauges")

    def refresh(self) -> None:
        """Bring every series up to ``live.state``: from scratch after an inventory event,
        else the devices touched since the last update."""
        state = self.live.state
        if self._members is None:
            self._rebuild(state)
        else:
            touched: set[tuple[str, str]] = set()
            for key in self._dirty:
                touched |= self._update(state, key)
            self._publish(touched)
        self._dirty.clear()
        self.refreshes += 1

    def _rebuild(self, state: ClusterState) -> None:
        members = self._members = class_members(state, self.gates)
        self._classes_of = {}
        for class_name, keys in members.items():
            for key in keys:
                self._classes_of.setdefault(key, []).append(class_name)
        self._devices_of = {}
        for key, dev in state.devices.items():
            if dev.node is not None:
                self._devices_of.setdefault(dev.node, []).append(key)
        self._amounts, self._sums = {}, {}
        for key in self._classes_of:
            self._update(state, key)
        for labels in self._series - self._sums.keys():
            self.gauge.remove(*labels)
            with contextlib.suppress(KeyError):
                CAPACITY_STRANDED_RATIO.remove(*labels)
        self._series = set(self._sums)
        self._publish(self._series)
        self.rebuilds += 1

    def _update(self, state: ClusterState, key: DeviceKey) -> set[tuple[str, str]]:
        """Replace ``key``'s amounts in its classes' sums; the series that changed."""
        classes = self._classes_of.get(key, ())
        if not classes:
            return set()
        old = self._amounts.pop(key, {})
        new = device_amounts(state, key)
        if new:
            self._amounts[key] = new
        touched: set[tuple[str, str]] = set()
        for class_name in classes:
            for capacity in old.keys() | new.keys():
                was, now = old.get(capacity, (0, 0, 0)), new.get(capacity, (0, 0, 0))
                sums = self._sums.setdefault((class_name, capacity), [0, 0, 0])
                for i in range(3):
                    sums[i] += now[i] - was[i]
                touched.add((class_name, capacity))
        return touched

    def _publish(self, labels: Iterable[tuple[str, str]]) -> None:
        for class_name, capacity in labels:
            allocated, total, stranded = self._sums[(class_name, capacity)]
            if not total:
                continue  # no present device of the class has it (now)
            self.gauge.labels(class_name, capacity).set(allocated / total)
            CAPACITY_STRANDED_RATIO.labels(class_name, capacity).set(stranded / total)
