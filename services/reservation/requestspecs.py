"""A claim's requests and constraints, normalised for the search. Pure.

Upstream's pre-checks live here (:func:`normalise`): disabled gates (capacity requests
and ``distinctAttribute`` need ``DRAConsumableCapacity``, ``firstAvailable`` needs
``DRAPrioritizedList``, ``adminAccess`` needs ``DRAAdminAccess`` and a namespace
labelled for it), a missing or disabled class, a capacity request on a whole-device
class, an empty constraint and more than :data:`MAX_DEVICES_PER_CLAIM` devices all
raise :class:`InvalidClaimError`, which the allocator turns into
:class:`~services.reservation.outcomes.Invalid`.

What passes becomes one :class:`RequestSpec` per ``exactly`` request or
``firstAvailable`` subrequest (its class's mode and placement policy resolved, its CEL
selectors as strings) and one :class:`Constraint` per constraint: the shapes the
depth-first search (:mod:`services.reservation.searching`) works on, with the
:class:`Pick` it records per device slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from events.inventory import Inventory
from events.model import (
    ALLOCATION_MODE_ALL,
    ALLOCATION_MODE_EXACT_COUNT,
    DeviceConstraint,
    DeviceRequest,
    ResourceClaim,
)
from events.quantities import Quantity
from events.selectors import AttributeValue
from events.tenancy import placement
from services.reservation.placement import FIRST_FIT

__all__ = [
    "MAX_DEVICES_PER_CLAIM",
    "Constraint",
    "InvalidClaimError",
    "Pick",
    "RequestSpec",
    "normalise",
]

MAX_DEVICES_PER_CLAIM = 32


class InvalidClaimError(Exception):
    """An upstream *error*, met before or during the search: the claim is
    :class:`~services.reservation.outcomes.Invalid`."""


@dataclass(slots=True)
class RequestSpec:
    """An ``exactly`` request or one ``firstAvailable`` subrequest, normalised."""

    parent: str
    result_name: str  # "req" or "req/sub"
    class_name: str
    selectors: tuple[str, ...]
    mode: str
    count: int
    admin: bool
    capacity: dict[str, Quantity]
    tolerations: list[dict[str, object]]
    whole: bool = False  # the class is in mode whole-device: every capacity's total
    placement: str = FIRST_FIT  # the class's placement policy (dracap.io/placement)

    def wanted(self, name: str, total: Quantity) -> Quantity | None:
        """The amount of capacity ``name`` asked for (``None``: the policy's default)."""
        return total if self.whole else self.capacity.get(name)


@dataclass(slots=True)
class Constraint:
    """A ``matchAttribute`` or ``distinctAttribute`` constraint and the values its picks
    have taken so far (undone on backtracking)."""

    requests: frozenset[str] | None  # None: all requests
    attribute: str
    distinct: bool
    values: list[AttributeValue] = field(default_factory=list)

    def applies(self, spec: RequestSpec) -> bool:
        return (
            self.requests is None
            or spec.parent in self.requests
            or spec.result_name in self.requests
        )


@dataclass(slots=True)
class Pick:
    """One device slot filled by the search: the device, what it consumes, whether as a
    share, and the constraint values it added."""

    spec: RequestSpec
    device: int
    consumed: dict[str, Quantity]
    share: bool
    applied: list[Constraint] = field(default_factory=list)


def normalise(
    inventory: Inventory, claim: ResourceClaim, admin_allowed: bool
) -> tuple[list[list[RequestSpec]], list[Constraint]]:
    gates = inventory.gates
    devices = claim.spec.devices
    requests: list[DeviceRequest] = (devices.requests if devices else None) or []
    specs: list[list[RequestSpec]] = []
    for req in requests:
        if req.first_available:
            if not gates.prioritized_list:
                raise InvalidClaimError(
                    f"request {req.name}: firstAvailable needs the DRAPrioritizedList feature gate"
                )
            options = [
                _spec(
                    inventory,
                    req.name,
                    f"{req.name}/{sub.name}",
                    sub.device_class_name,
                    sub.selectors,
                    sub.allocation_mode,
                    sub.count,
                    False,
                    sub.capacity.requests if sub.capacity else None,
                    sub.tolerations,
                )
                for sub in req.first_available
            ]
        elif req.exactly is not None:
            ex = req.exactly
            if ex.admin_access:
                if not gates.admin_access:
                    raise InvalidClaimError(
                        f"request {req.name}: adminAccess needs the DRAAdminAccess feature gate"
                    )
                if not admin_allowed:
                    raise InvalidClaimError(
                        f"request {req.name}: adminAccess is only allowed in namespaces "
                        "labelled resource.kubernetes.io/admin-access=true"
                    )
            options = [
                _spec(
                    inventory,
                    req.name,
                    req.name,
                    ex.device_class_name,
                    ex.selectors,
                    ex.allocation_mode,
                    ex.count,
                    bool(ex.admin_access),
                    ex.capacity.requests if ex.capacity else None,
                    ex.tolerations,
                )
            ]
        else:
            raise InvalidClaimError(f"request {req.name}: needs exactly or firstAvailable")
        specs.append(options)
    minimum = sum(
        min(o.count if o.mode == ALLOCATION_MODE_EXACT_COUNT else 1 for o in opts) for opts in specs
    )
    if minimum > MAX_DEVICES_PER_CLAIM:
        raise InvalidClaimError(
            f"claim needs at least {minimum} devices, more than the maximum of "
            f"{MAX_DEVICES_PER_CLAIM} allocation results"
        )
    constraints = []
    for i, c in enumerate((devices.constraints if devices else None) or []):
        constraints.append(_constraint(inventory, i, c))
    return specs, constraints


def _spec(
    inventory: Inventory,
    parent: str,
    result_name: str,
    class_name: str,
    selectors: Sequence[object] | None,
    mode: str | None,
    count: int | None,
    admin: bool,
    capacity: Mapping[str, Quantity] | None,
    tolerations: list[dict[str, object]] | None,
) -> RequestSpec:
    gates = inventory.gates
    if capacity and not gates.consumable_capacity:
        raise InvalidClaimError(
            f"request {result_name}: capacity requests need the DRAConsumableCapacity feature gate"
        )
    if class_name not in inventory.classes:
        raise InvalidClaimError(f"request {result_name}: device class {class_name} does not exist")
    class_mode = inventory.class_modes.get(class_name, "consumable")
    if class_mode == "disabled":
        raise InvalidClaimError(f"request {result_name}: device class {class_name} is disabled")
    if capacity and class_mode == "whole-device":
        raise InvalidClaimError(
            f"request {result_name}: capacity requests need the DRAConsumableCapacity "
            f"feature gate, which is off for device class {class_name} (whole-device)"
        )
    mode = mode or ALLOCATION_MODE_EXACT_COUNT
    if mode == ALLOCATION_MODE_EXACT_COUNT:
        count = 1 if count is None else count
        if count <= 0:
            raise InvalidClaimError(f"request {result_name}: count must be greater than 0")
        if count > MAX_DEVICES_PER_CLAIM:
            raise InvalidClaimError(
                f"request {result_name}: count {count} exceeds the maximum of "
                f"{MAX_DEVICES_PER_CLAIM} devices"
            )
    elif mode == ALLOCATION_MODE_ALL:
        count = 0
    else:
        raise InvalidClaimError(f"request {result_name}: unsupported allocation mode {mode!r}")
    expressions = tuple(
        s.cel.expression  # type: ignore[attr-defined]
        for s in selectors or []
        if getattr(s, "cel", None) is not None
    )
    return RequestSpec(
        parent,
        result_name,
        class_name,
        expressions,
        mode,
        count,
        admin,
        dict(capacity or {}),
        list(tolerations or []),
        class_mode == "whole-device",
        placement(inventory.classes[class_name]),
    )


def _constraint(inventory: Inventory, i: int, c: DeviceConstraint) -> Constraint:
    requests = frozenset(c.requests) if c.requests else None
    if c.distinct_attribute:
        if not inventory.gates.consumable_capacity:
            raise InvalidClaimError(
                f"constraints[{i}]: distinctAttribute needs the DRAConsumableCapacity feature gate"
            )
        return Constraint(requests, c.distinct_attribute, True)
    if c.match_attribute:
        return Constraint(requests, c.match_attribute, False)
    raise InvalidClaimError(
        f"constraints[{i}]: empty constraint: set matchAttribute or distinctAttribute"
    )
