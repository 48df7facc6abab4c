"""The published devices, indexed: pools, devices, node visibility, selector results.

Admission (the largest amount a class's devices grant), the capacity gauges (the
devices a class selects) and the allocator (everything else) all need the same view
of the DeviceClasses and ResourceSlices the log holds, with the same CEL semantics. It
is pure, so it lives with the contract; :func:`build_inventory` derives it from the
fold's :class:`~events.state.ClusterState`.

Built once from DeviceClasses and ResourceSlices and then shared by every decision,
so nothing here is recomputed per claim:

* Pools are gathered per (driver, pool name); only the slices of the highest
  generation count. A pool is *incomplete* when it has fewer or more slices than its
  ``resourceSliceCount`` and *invalid* when a device name repeats inside it.
* Pools are ordered lexicographically by (driver, pool) so that decisions are
  reproducible (upstream 1.34/1.35 iterates a Go map, i.e. in no defined order;
  1.36 sorts). Within a pool, slices keep input order and devices keep spec order.
* Each device gets a dense integer index in that order; allocated state and the
  search work on indices, never on names.
* Selector results are memoised per (device, expression): device attributes never
  change for a given inventory, so a CEL program runs at most once per device.
* A tenant's selector may spend at most :attr:`Inventory.inline_budget` cost units
  over one candidate set here (:meth:`Inventory.filter`); an expression that needs
  more is *heavy*: its results must come from elsewhere (the reservation service
  evaluates it in a worker process and records them with
  :meth:`Inventory.record_results`); so is a long expression this process has not
  compiled yet (parsing it would cost the decision as much). Until they are in,
  :meth:`Inventory.filter` raises :class:`SelectorsPending` and lists what is missing
  in :attr:`Inventory.wanted`. Without a budget (``dracap allocate``, admission) every
  selector is evaluated here.
* A device is *isolated* (:meth:`Inventory.isolated`) when a class annotated
  ``dracap.io/shared-across-namespaces: deny`` selects it (:mod:`events.tenancy`):
  the allocator then gives it to one namespace at a time, whichever class a request
  names. Computed once per device, from the memoised class selectors.
* A ``RequestPolicyChanged`` event changes a capacity's request policy in the fold
  without a new slice, so :func:`build_inventory` hands the slices over with every
  device's *current* policies (:func:`current_slices`); otherwise the allocator would
  round amounts under a policy the fold no longer accepts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import msgspec
import semver

from events.catalog import ENFORCEMENT_LEVELS
from events.errors import EventsError, SelectorCostExceeded, SelectorError
from events.features import DEFAULT_GATES, FeatureGates
from events.model import (
    CapacityRequestPolicy,
    Device,
    DeviceCapacity,
    DeviceClass,
    NodeSelector,
    NodeSelectorRequirement,
    ResourceSlice,
)
from events.quantities import Quantity
from events.selectors import (
    INLINE_COMPILE_CHARS,
    MAX_COST,
    AttributeValue,
    DeviceView,
    Selector,
    compile_selector,
    is_compiled,
)
from events.state import ClusterState, DeviceKey
from events.tenancy import shared_across_namespaces

__all__ = [
    "CapacityInfo",
    "DeviceEntry",
    "Inventory",
    "Pool",
    "SelectorResult",
    "SelectorsPending",
    "build_inventory",
    "current_slices",
    "node_selector_matches",
]

SelectorResult = bool | SelectorError


class SelectorsPending(EventsError):  # noqa: N818 (a state, not a failure)
    """A heavy selector's results are not in yet (see the module docstring)."""

    def __init__(self, expression: str) -> None:
        super().__init__(f"selector {expression[:80]!r} is being evaluated")
        self.expression = expression


@dataclass(slots=True)
class CapacityInfo:
    """One capacity of one device, as published."""

    name: str
    total: Quantity
    policy: CapacityRequestPolicy | None


@dataclass(slots=True)
class DeviceEntry:
    """One device of the inventory with everything a decision needs about it."""

    index: int
    key: DeviceKey
    device: Device
    slice: ResourceSlice
    pool_index: int
    capacities: dict[str, CapacityInfo]
    multi: bool
    attributes: dict[str, AttributeValue] = field(default_factory=dict)
    attribute_error: str | None = None
    _view: DeviceView | None = None

    @property
    def driver(self) -> str:
        return self.key[0]

    def attribute(self, qualified: str) -> AttributeValue | None:
        """A fully qualified attribute, falling back to the bare id in the driver's domain."""
        value = self.attributes.get(qualified)
        if value is not None:
            return value
        domain, _, ident = qualified.rpartition("/")
        if domain == self.driver:
            return self.attributes.get(ident)
        return None

    def view(self) -> DeviceView:
        """What CEL sees of this device (built on first use)."""
        if self._view is None:
            self._view = _device_view(self)
        return self._view


@dataclass(slots=True)
class Pool:
    driver: str
    name: str
    generation: int
    slices: list[ResourceSlice]
    complete: bool
    invalid_reason: str | None
    devices: list[int] = field(default_factory=list)


def _split(name: str, driver: str) -> tuple[str, str]:
    domain, _, ident = name.rpartition("/")
    return (domain or driver, ident)


def _attribute_value(device: Device, name: str) -> AttributeValue:
    attr = (device.attributes or {})[name]
    if attr.int_ is not None:
        return attr.int_
    if attr.bool_ is not None:
        return attr.bool_
    if attr.string is not None:
        return attr.string
    if attr.version is not None:
        return semver.Version.parse(attr.version)
    raise ValueError(f"attribute {name!r} has no value")


def _device_view(entry: DeviceEntry) -> DeviceView:
    if entry.attribute_error is not None:
        raise SelectorError("<device attributes>", entry.attribute_error)
    attributes: dict[str, dict[str, AttributeValue]] = {}
    for name, value in entry.attributes.items():
        domain, ident = _split(name, entry.driver)
        attributes.setdefault(domain, {})[ident] = value
    capacity: dict[str, dict[str, Quantity]] = {}
    for name, info in entry.capacities.items():
        domain, ident = _split(name, entry.driver)
        capacity.setdefault(domain, {})[ident] = info.total
    return DeviceView(
        driver=entry.driver,
        attributes=attributes,
        capacity=capacity,
        allow_multiple_allocations=bool(entry.device.allow_multiple_allocations),
    )


# --- node selection --------------------------------------------------------------------------


def _requirement_matches(req: NodeSelectorRequirement, values: Mapping[str, str]) -> bool:
    present = req.key in values
    actual = values.get(req.key)
    wanted = req.values or []
    match req.operator:
        case "In":
            return present and actual in wanted
        case "NotIn":
            return not present or actual not in wanted
        case "Exists":
            return present
        case "DoesNotExist":
            return not present
        case "Gt" | "Lt":
            if not present or len(wanted) != 1:
                return False
            try:
                have, limit = int(actual or ""), int(wanted[0])
            except ValueError:
                return False
            return have > limit if req.operator == "Gt" else have < limit
    return False


def node_selector_matches(
    selector: NodeSelector, node: str, labels: Mapping[str, str] | None = None
) -> bool:
    """Kubernetes NodeSelector semantics: terms are ORed, requirements within a term ANDed."""
    node_labels = {"kubernetes.io/hostname": node, **(labels or {})}
    fields = {"metadata.name": node}
    for term in selector.node_selector_terms:
        exprs = term.match_expressions or []
        field_reqs = term.match_fields or []
        if not exprs and not field_reqs:
            continue
        if all(_requirement_matches(r, node_labels) for r in exprs) and all(
            _requirement_matches(r, fields) for r in field_reqs
        ):
            return True
    return False


# --- the inventory -------------------------------------------------------------------------


class Inventory:
    """DeviceClasses and ResourceSlices indexed for allocation decisions."""

    def __init__(
        self,
        classes: Iterable[DeviceClass],
        slices: Iterable[ResourceSlice],
        *,
        gates: FeatureGates = DEFAULT_GATES,
        node_labels: Mapping[str, Mapping[str, str]] | None = None,
        inline_budget: int | None = None,
        class_modes: Mapping[str, str] | None = None,
        lost_nodes: Mapping[str, str] | None = None,
        min_enforcement: Mapping[str, str] | None = None,
        node_enforcement: Mapping[str, str] | None = None,
        unhealthy: Mapping[DeviceKey, str] | None = None,
    ) -> None:
        self.gates = gates
        #: nodes whose agent lost its lease or that were fenced, with the taint's text:
        #: no new share lands on their devices (whatever the request tolerates)
        self.lost_nodes: dict[str, str] = dict(lost_nodes or {})
        #: each class's minimum enforcement level, where it is above ``none``, and the
        #: level each node's agent offers (a node no agent leased offers ``none``)
        self.min_enforcement: dict[str, str] = {
            k: v for k, v in (min_enforcement or {}).items() if v != "none"
        }
        self.node_enforcement: dict[str, str] = dict(node_enforcement or {})
        #: devices their node agent reported failing, with why: no new share lands there
        self.unhealthy: dict[DeviceKey, str] = dict(unhealthy or {})
        #: the mode of each class that is not ``consumable`` (``ClassModeSet``)
        self.class_modes: dict[str, str] = {
            k: v for k, v in (class_modes or {}).items() if v != "consumable"
        }
        #: cost units a tenant's selector may spend here per candidate set (None: any)
        self.inline_budget = inline_budget
        #: heavy expressions whose results are missing, with the devices that lack them
        self.wanted: dict[str, set[int]] = {}
        self._heavy: set[str] = set()
        self.classes: dict[str, DeviceClass] = {c.metadata.name: c for c in classes}
        self.node_labels: dict[str, Mapping[str, str]] = dict(node_labels or {})
        self.pools: list[Pool] = []
        self.devices: list[DeviceEntry] = []
        self.by_key: dict[DeviceKey, int] = {}
        self._selector_cache: dict[tuple[int, str], SelectorResult] = {}
        self._visible_cache: dict[str | None, tuple[int, ...]] = {}
        self._nodes: list[str] | None = None
        #: the classes that keep their devices to one namespace at a time
        self.denying: list[DeviceClass] = [
            c for c in self.classes.values() if not shared_across_namespaces(c)
        ]
        self._isolated: dict[int, bool] = {}
        self._build(list(slices))

    # construction
    def _build(self, slices: Sequence[ResourceSlice]) -> None:
        grouped: dict[tuple[str, str], list[ResourceSlice]] = {}
        for s in slices:
            grouped.setdefault((s.spec.driver, s.spec.pool.name), []).append(s)
        for driver, name in sorted(grouped):
            members = grouped[(driver, name)]
            generation = max(s.spec.pool.generation for s in members)
            current = [s for s in members if s.spec.pool.generation == generation]
            expected = current[0].spec.pool.resource_slice_count
            complete = len(current) == expected and all(
                s.spec.pool.resource_slice_count == expected for s in current
            )
            pool = Pool(driver, name, generation, current, complete, None)
            pool_index = len(self.pools)
            self.pools.append(pool)
            seen: set[str] = set()
            for s in current:
                for device in s.spec.devices or []:
                    if device.name in seen:
                        pool.invalid_reason = (
                            f"pool {driver}/{name}: device name {device.name!r} is not unique"
                        )
                        continue
                    seen.add(device.name)
                    pool.devices.append(self._add_device(device, s, pool_index))

    def _add_device(self, device: Device, slice_: ResourceSlice, pool_index: int) -> int:
        index = len(self.devices)
        key = (slice_.spec.driver, slice_.spec.pool.name, device.name)
        capacities = {
            name: CapacityInfo(name, cap.value, cap.request_policy)
            for name, cap in (device.capacity or {}).items()
        }
        multi = bool(device.allow_multiple_allocations) and self.gates.consumable_capacity
        entry = DeviceEntry(index, key, device, slice_, pool_index, capacities, multi)
        for name in device.attributes or {}:
            try:
                entry.attributes[name] = _attribute_value(device, name)
            except ValueError as exc:
                entry.attribute_error = f"device {device.name}: {exc}"
        self.devices.append(entry)
        self.by_key[key] = index
        return index

    # queries
    def lost(self, entry: DeviceEntry) -> str | None:
        """The node-lost taint of ``entry``'s node, if its node is lost (else ``None``)."""
        node = entry.device.node_name or entry.slice.spec.node_name
        return self.lost_nodes.get(node) if node else None

    def below_minimum(self, entry: DeviceEntry, class_name: str) -> str | None:
        """Why ``entry``'s node is below ``class_name``'s minimum enforcement (else None)."""
        wanted = self.min_enforcement.get(class_name)
        if wanted is None:
            return None
        node = entry.device.node_name or entry.slice.spec.node_name or ""
        offered = self.node_enforcement.get(node, "none")
        if _RANK.get(offered, 0) >= _RANK.get(wanted, 0):
            return None
        return f"node {node or '(none)'} enforces {offered}, class {class_name} needs {wanted}"

    def nodes(self) -> list[str]:
        """Every node named by a slice or by the node labels given, sorted."""
        if self._nodes is None:
            self._nodes = self._node_names()
        return self._nodes

    def _node_names(self) -> list[str]:
        names = set(self.node_labels)
        for pool in self.pools:
            for s in pool.slices:
                if s.spec.node_name:
                    names.add(s.spec.node_name)
                for device in s.spec.devices or []:
                    if device.node_name:
                        names.add(device.node_name)
        return sorted(names)

    def _slice_visible(self, s: ResourceSlice, device: Device, node: str | None) -> bool:
        spec = s.spec
        if spec.all_nodes:
            return True
        if spec.per_device_node_selection:
            if device.all_nodes:
                return True
            if node is None:
                return False
            if device.node_name:
                return device.node_name == node
            if device.node_selector is not None:
                return node_selector_matches(device.node_selector, node, self.node_labels.get(node))
            return False
        if node is None:
            return False
        if spec.node_name:
            return spec.node_name == node
        if spec.node_selector is not None:
            return node_selector_matches(spec.node_selector, node, self.node_labels.get(node))
        return False

    def visible_devices(self, node: str | None) -> tuple[int, ...]:
        """Indices of the devices reachable from ``node``, in allocation order."""
        cached = self._visible_cache.get(node)
        if cached is None:
            cached = tuple(
                index
                for pool in self.pools
                for index in pool.devices
                if self._slice_visible(self.devices[index].slice, self.devices[index].device, node)
            )
            self._visible_cache[node] = cached
        return cached

    def visible_pools(self, node: str | None) -> list[Pool]:
        """Pools with at least one slice (or device) reachable from ``node``."""
        return [
            pool
            for pool in self.pools
            if any(
                self._slice_visible(s, d, node) for s in pool.slices for d in s.spec.devices or []
            )
        ]

    def selector_result(self, index: int, expression: str) -> SelectorResult:
        """Memoised outcome of one CEL selector on one device (evaluated here)."""
        key = (index, expression)
        cached = self._selector_cache.get(key)
        if cached is None:
            try:
                cached = self._compile(expression).matches(self.devices[index].view())
            except SelectorError as exc:
                cached = SelectorError(expression, exc.message)
            self._selector_cache[key] = cached
        return cached

    def class_matches(self, dclass: DeviceClass, index: int) -> bool:
        """Whether every selector of ``dclass`` matches device ``index`` (an error: no)."""
        return all(
            self.selector_result(index, s.cel.expression) is True
            for s in dclass.spec.selectors or []
            if s.cel is not None
        )

    def isolated(self, index: int) -> bool:
        """Whether a class that denies sharing across namespaces selects device ``index``."""
        if not self.denying:
            return False
        known = self._isolated.get(index)
        if known is None:
            known = self._isolated[index] = any(self.class_matches(c, index) for c in self.denying)
        return known

    def _compile(self, expression: str) -> Selector:
        return compile_selector(expression, consumable_capacity=self.gates.consumable_capacity)

    def filter(
        self, expression: str, indices: Sequence[int], *, trusted: bool
    ) -> dict[int, SelectorResult]:
        """The outcome of ``expression`` on each of ``indices`` (see the module docstring).

        ``trusted`` (a DeviceClass's selector, written by the operator) is evaluated
        here whatever it costs; a tenant's selector within :attr:`inline_budget`.
        Raises :class:`SelectorsPending` when a heavy expression lacks results.
        """
        cache = self._selector_cache
        out: dict[int, SelectorResult] = {}
        missing: list[int] = []
        for index in indices:
            known = cache.get((index, expression))
            if known is None:
                missing.append(index)
            else:
                out[index] = known
        budget = None if trusted else self.inline_budget
        if not missing or budget is None:
            out.update((index, self.selector_result(index, expression)) for index in missing)
            return out
        left = missing
        if expression not in self._heavy and not self._too_long(expression):
            try:
                selector = self._compile(expression)
            except SelectorError:  # every device gets the compile error
                out.update((index, self.selector_result(index, expression)) for index in missing)
                return out
            left = self._spend(selector, missing, budget, out)
        if left:
            self._heavy.add(expression)
            self.wanted.setdefault(expression, set()).update(left)
            raise SelectorsPending(expression)
        return out

    def _too_long(self, expression: str) -> bool:
        """A tenant's long expression not compiled yet is compiled with its evaluation."""
        flag = self.gates.consumable_capacity
        return len(expression) > INLINE_COMPILE_CHARS and not is_compiled(
            expression, consumable_capacity=flag
        )

    def _spend(
        self, selector: Selector, indices: list[int], budget: int, out: dict[int, SelectorResult]
    ) -> list[int]:
        """Evaluate here until ``budget`` units are spent; returns the devices left over."""
        if selector.estimated_cost > budget:
            return indices
        for position, index in enumerate(indices):
            limit = min(budget, MAX_COST)
            result: SelectorResult
            try:
                result, spent = selector.evaluate(self.devices[index].view(), cost_limit=limit)
            except SelectorCostExceeded as exc:
                if exc.limit >= MAX_COST:
                    result, spent = SelectorError(selector.expression, exc.message), limit
                else:
                    return indices[position:]
            except SelectorError as exc:
                result, spent = SelectorError(selector.expression, exc.message), 0
            self._selector_cache[(index, selector.expression)] = out[index] = result
            budget -= spent
        return []

    def record_results(self, expression: str, results: Mapping[int, SelectorResult]) -> None:
        """Results of a heavy expression computed elsewhere."""
        for index, result in results.items():
            self._selector_cache[(index, expression)] = result
        wanted = self.wanted.get(expression)
        if wanted is not None:
            wanted.difference_update(results)
            if not wanted:
                del self.wanted[expression]


# --- from the fold ---------------------------------------------------------------------


def _current_device(state: ClusterState, driver: str, pool: str, device: Device) -> Device:
    dev = state.devices.get((driver, pool, device.name))
    if dev is None or not device.capacity:
        return device
    capacity: dict[str, DeviceCapacity] = {}
    changed = False
    for name, cap in device.capacity.items():
        policy = dev.policies.get(name, cap.request_policy)
        if name in dev.capacity_policy_versions and policy != cap.request_policy:
            cap = msgspec.structs.replace(cap, request_policy=policy)
            changed = True
        capacity[name] = cap
    return msgspec.structs.replace(device, capacity=capacity) if changed else device


def current_slices(state: ClusterState) -> list[ResourceSlice]:
    """The published slices, each device carrying the request policies in force now."""
    out: list[ResourceSlice] = []
    for rslice in state.slices.values():
        spec = rslice.spec
        devices = spec.devices or []
        current = [_current_device(state, spec.driver, spec.pool.name, d) for d in devices]
        if any(a is not b for a, b in zip(current, devices, strict=True)):
            spec = msgspec.structs.replace(spec, devices=current)
            rslice = msgspec.structs.replace(rslice, spec=spec)
        out.append(rslice)
    return out


def build_inventory(
    state: ClusterState, gates: FeatureGates = DEFAULT_GATES, *, inline_budget: int | None = None
) -> Inventory:
    """The allocator's inventory for the classes and slices of ``state``."""
    classes = [c.device_class for c in state.classes.values()]
    modes = {name: c.mode for name, c in state.classes.items()}
    return Inventory(
        classes,
        current_slices(state),
        gates=gates,
        inline_budget=inline_budget,
        class_modes=modes,
        lost_nodes=lost_nodes(state),
        min_enforcement={name: c.min_enforcement for name, c in state.classes.items()},
        node_enforcement={
            name: node.enforcement for name, node in state.nodes.items() if node.leased_epoch
        },
        unhealthy={k: d.unhealthy for k, d in state.devices.items() if d.unhealthy is not None},
    )


_RANK: Final[dict[str, int]] = {level: i for i, level in enumerate(ENFORCEMENT_LEVELS)}

#: The taint dracap puts on the devices of a node it lost (docs/reclamation.md).
NODE_LOST_TAINT: Final = "dracap.io/node-lost"


def lost_nodes(state: ClusterState) -> dict[str, str]:
    """Nodes whose lease expired or that were fenced, each with its taint's text."""
    return {
        name: f"{NODE_LOST_TAINT}={node.lease}:NoSchedule (node {name}: {node.reason})"
        for name, node in state.nodes.items()
        if node.lease != "live"
    }
