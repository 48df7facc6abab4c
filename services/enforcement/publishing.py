"""Publishing the node's inventory: discovered devices -> ResourceSlices -> events.

:class:`Publisher` turns each scan's :class:`~services.enforcement.discovery.ScanResult`
into the ResourceSlices of the node's pools and says what changed since the last
publication, as catalog events (:meth:`Changes.events`: ``ResourceSlicePublished``
and ``ResourceSliceWithdrawn``) for the agent to append.

Shape of what is published (Kubernetes 1.34 rules, checked with
:func:`events.validation.validate` before anything leaves here):

* One pool per driver: ``poolName`` of the agent configuration, by default
  ``<node>-<driverShort>`` (``node-a-gpu`` for ``gpu.dracap.io``), with ``nodeName``
  set to the node. The pool's devices are sorted by name and cut into slices of at most
  128 devices named ``<node>-<driver>-<index>`` (a name longer than 253 characters is
  shortened and given a hash suffix); ``resourceSliceCount`` is the number of slices.
* Each device gets ``allowMultipleAllocations`` and, per capacity, a request policy
  from the first configured class that matches it
  (:meth:`~services.enforcement.discovery.AgentConfig.class_for`); the policy's ``max``
  and ``validValues`` are cut to the device's total. A device that still breaks an API
  rule (a default above a small device's total, a bad attribute in the static file) is
  left out and reported in :attr:`Changes.problems`, so one odd device never blocks
  the rest of the pool.

Generations. The pool generation is the version of the pool as a whole: the allocator
only uses the slices of a pool's highest generation. The publisher compares the slices
it would publish at the current generation with the last published ones; if they are
equal nothing is published (a rescan is free), otherwise every slice of the pool is
republished at generation + 1 and slices no longer needed (the pool shrank, or became
empty) are withdrawn, after the publications. The generation survives restarts because
the publisher starts from what was last published in the log (``previous``: the
ResourceSlices of the live state); it owns exactly the slices whose ``nodeName`` is its
node and whose pool is the one it would name for their driver, and leaves other slices
(an operator's, another node's) alone. A pool whose devices all disappeared is withdrawn
entirely; its generation is still remembered in memory, so if devices come back the
pool restarts above it.

:meth:`Publisher.plan` is pure; :meth:`Publisher.commit` records a plan as published
once the caller has appended its events (:meth:`Publisher.update` does both, for callers
that cannot fail in between).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from events.catalog import Event, ResourceSlicePublished, ResourceSliceWithdrawn
from events.errors import ValidationError
from events.features import DEFAULT_GATES, FeatureGates
from events.fieldchecks import DEVICES_MAX
from events.model import (
    CapacityRequestPolicy,
    CapacityRequestPolicyRange,
    Device,
    DeviceCapacity,
    ObjectMeta,
    ResourcePool,
    ResourceSlice,
    ResourceSliceSpec,
)
from events.quantities import Quantity
from events.validation import validate
from services.enforcement.discovery import (
    AgentConfig,
    DeviceClassConfig,
    DiscoveredDevice,
    PolicyConfig,
    ScanResult,
)

__all__ = [
    "Changes",
    "PoolChange",
    "Publisher",
    "build_device",
    "build_pool",
    "fit_policy",
    "pool_name",
    "slice_name",
]

PoolKey = tuple[str, str]  # (driver, pool)

log = logging.getLogger("dracap.inventory")

_NAME_MAX = 253


def pool_name(config: AgentConfig, driver: str) -> str:
    """The pool this node publishes ``driver``'s devices in (``AgentConfig.pool_for``)."""
    return config.pool_for(driver)


def slice_name(node: str, driver: str, index: int) -> str:
    """``<node>-<driver>-<index>``, shortened with a hash suffix beyond 253 characters."""
    name = f"{node}-{driver}-{index}"
    if len(name) <= _NAME_MAX:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{name[: _NAME_MAX - 11].rstrip('-.')}-{digest}"


def fit_policy(policy: PolicyConfig, total: Quantity) -> CapacityRequestPolicy:
    """``policy`` as the API spells it, with ``max`` and ``validValues`` cut to ``total``."""
    if policy.valid_values is not None:
        values = sorted({v for v in policy.valid_values if v <= total})
        return CapacityRequestPolicy(default=policy.default, valid_values=values)
    if policy.min is None:
        return CapacityRequestPolicy(default=policy.default)
    upper = policy.max
    if upper is not None and upper > total:
        upper = total
        if policy.step is not None and policy.step.sign() > 0 and total >= policy.min:
            steps = (total.nanos - policy.min.nanos) // policy.step.nanos
            upper = Quantity(policy.min.nanos + steps * policy.step.nanos, policy.min.format)
    rng = CapacityRequestPolicyRange(min=policy.min, max=upper, step=policy.step)
    return CapacityRequestPolicy(default=policy.default, valid_range=rng)


def build_device(found: DiscoveredDevice, cls: DeviceClassConfig | None) -> Device:
    """The API Device for ``found`` under the sharing rules of ``cls`` (None: exclusive)."""
    shared = cls is not None and cls.allow_multiple_allocations
    capacity: dict[str, DeviceCapacity] = {}
    for name, total in found.capacity.items():
        policy = cls.capacity.get(name) if cls is not None and shared else None
        capacity[name] = DeviceCapacity(
            value=total, request_policy=None if policy is None else fit_policy(policy, total)
        )
    return Device(
        name=found.name,
        attributes=dict(found.attributes) or None,
        capacity=capacity or None,
        allow_multiple_allocations=True if shared else None,
    )


def build_pool(
    config: AgentConfig, driver: str, devices: Sequence[Device], generation: int
) -> list[ResourceSlice]:
    """The slices of ``driver``'s pool at ``generation``: at most 128 devices each."""
    ordered = sorted(devices, key=lambda d: d.name)
    chunks = [ordered[i : i + DEVICES_MAX] for i in range(0, len(ordered), DEVICES_MAX)]
    pool = ResourcePool(
        name=pool_name(config, driver), generation=generation, resource_slice_count=len(chunks)
    )
    return [
        ResourceSlice(
            metadata=ObjectMeta(name=slice_name(config.node_name, driver, index)),
            spec=ResourceSliceSpec(
                driver=driver, pool=pool, node_name=config.node_name, devices=list(chunk)
            ),
        )
        for index, chunk in enumerate(chunks)
    ]


@dataclass(frozen=True)
class PoolChange:
    """A pool's new generation: slices to publish (in order), then names to withdraw."""

    driver: str
    pool: str
    generation: int
    published: tuple[ResourceSlice, ...]
    withdrawn: tuple[str, ...]

    def events(self) -> list[Event]:
        """``ResourceSlicePublished`` for each slice, then ``ResourceSliceWithdrawn``."""
        out: list[Event] = [ResourceSlicePublished(slice=s) for s in self.published]
        out += [ResourceSliceWithdrawn(name=name) for name in self.withdrawn]
        return out


@dataclass(frozen=True)
class Changes:
    """What one scan changed (``pools``) and which devices it left out (``problems``)."""

    pools: tuple[PoolChange, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        """Whether anything must be published or withdrawn."""
        return bool(self.pools)

    def events(self) -> list[Event]:
        """Every event to append, pool by pool (one slice stream each)."""
        return [event for change in self.pools for event in change.events()]


@dataclass
class _PoolState:
    generation: int = 0
    slices: dict[str, ResourceSlice] = field(default_factory=dict)


class Publisher:
    """The node's published pools; plans what each scan changes."""

    def __init__(
        self,
        config: AgentConfig,
        previous: Iterable[ResourceSlice] = (),
        gates: FeatureGates = DEFAULT_GATES,
    ) -> None:
        """Start from ``previous``: what the log holds (slices of other owners are ignored)."""
        self.config = config
        self.gates = gates
        self._pools: dict[PoolKey, _PoolState] = {}
        for s in previous:
            if s.spec.node_name != config.node_name:
                continue
            if s.spec.pool.name != pool_name(config, s.spec.driver):
                continue
            state = self._pools.setdefault((s.spec.driver, s.spec.pool.name), _PoolState())
            state.generation = max(state.generation, s.spec.pool.generation)
            state.slices[s.metadata.name] = s

    @property
    def published(self) -> list[ResourceSlice]:
        """The slices last published, by name."""
        slices = [s for state in self._pools.values() for s in state.slices.values()]
        return sorted(slices, key=lambda s: s.metadata.name)

    def generation(self, driver: str) -> int:
        """The last generation of ``driver``'s pool (0: never published)."""
        state = self._pools.get((driver, pool_name(self.config, driver)))
        return 0 if state is None else state.generation

    def plan(self, inventory: ScanResult) -> Changes:
        """What publishing ``inventory`` would change; nothing is recorded."""
        problems = list(inventory.problems)
        changes: list[PoolChange] = []
        drivers = set(inventory.devices) | {driver for driver, _ in self._pools}
        for driver in sorted(drivers):
            devices = self._devices(driver, inventory.devices.get(driver, []), problems)
            change = self._plan_pool(driver, devices)
            if change is not None:
                changes.append(change)
        return Changes(pools=tuple(changes), problems=tuple(problems))

    def commit(self, changes: Changes) -> None:
        """Record ``changes`` as published (after their events were appended)."""
        for change in changes.pools:
            state = self._pools.setdefault((change.driver, change.pool), _PoolState())
            state.generation = max(state.generation, change.generation)
            for name in change.withdrawn:
                state.slices.pop(name, None)
            state.slices.update({s.metadata.name: s for s in change.published})

    def update(self, inventory: ScanResult) -> Changes:
        """:meth:`plan` then :meth:`commit`."""
        changes = self.plan(inventory)
        self.commit(changes)
        return changes

    # -- internals ------------------------------------------------------------------------

    def _devices(
        self, driver: str, found: Sequence[DiscoveredDevice], problems: list[str]
    ) -> list[Device]:
        """API devices for ``found``, leaving out (and reporting) those that break a rule."""
        out: list[Device] = []
        for item in found:
            device = build_device(item, self.config.class_for(driver, item.name))
            try:
                validate(build_pool(self.config, driver, [device], 1)[0], self.gates)
            except ValidationError as exc:
                problem = f"{driver} device {item.name} ({item.source}) left out: {exc}"
                log.warning("inventory: %s", problem)
                problems.append(problem)
                continue
            out.append(device)
        return out

    def _plan_pool(self, driver: str, devices: list[Device]) -> PoolChange | None:
        key = (driver, pool_name(self.config, driver))
        state = self._pools.get(key, _PoolState())
        if not devices:
            if not state.slices:
                return None
            withdrawn = tuple(sorted(state.slices))
            return PoolChange(driver, key[1], state.generation + 1, (), withdrawn)
        current = build_pool(self.config, driver, devices, max(state.generation, 1))
        if {s.metadata.name: s for s in current} == state.slices:
            return None
        generation = state.generation + 1
        slices = build_pool(self.config, driver, devices, generation)
        for s in slices:
            validate(s, self.gates)
        names = {s.metadata.name for s in slices}
        withdrawn = tuple(sorted(set(state.slices) - names))
        return PoolChange(driver, key[1], generation, tuple(slices), withdrawn)
