"""The rules of the ``resource.k8s.io/v1`` API that dracap enforces on its inputs.

dracap accepts DeviceClasses, ResourceSlices, ResourceClaims and Namespaces from
operators, node agents and tenants; before any of them reaches the event log it must
pass the checks the Kubernetes 1.34 API server would run (``dra-semantics.md`` §2),
so that what dracap stores would also be accepted by a real cluster.

Design:

* :func:`validate` dispatches on the type of the object and raises the **first**
  problem it finds as :class:`~events.errors.ValidationError`, with the field path in
  Kubernetes notation (``spec.devices.requests[0].exactly.count``, map keys in
  brackets: ``capacity[memory]``) and a short rule. One precise error is what a CLI
  user or an admission response needs; the API server's habit of listing every error
  is not worth the complexity here.
* The checks walk the typed Structs of :mod:`events.model`; what the types already
  guarantee (a required field is present, a count is an int) is left to decoding.
* Fields of a feature gate that is off are rejected ("requires feature gate ...")
  instead of being dropped silently as the API server does, so a manifest never loses
  meaning on its way in.
* Quantities are compared exactly; the multiple-of-step checks of a ``validRange``
  use the integer ``Quantity.value()`` (rounded up), as upstream does.
* CEL expressions are measured (at most 10 Ki) and compiled, as upstream's validation
  does: a syntax error, an undeclared name or an estimated cost above the limit
  (:mod:`events.selectors`) is refused at the expression's field.

The field rules every kind shares are :mod:`events.fieldchecks`; a ResourceSlice's own
(devices, capacities, request policies) are :mod:`events.slicevalidation`.

Decisions where the API is silent are listed in ``docs/validation.md``.
"""

from __future__ import annotations

from collections.abc import Mapping

from events import model
from events.features import DEFAULT_GATES, FeatureGates
from events.fieldchecks import (
    ALLOCATION_CONFIG_MAX,
    ALLOCATION_MODES,
    BINDING_CONDITIONS_MAX,
    CONFIG_MAX,
    CONFIG_SOURCES,
    CONSTRAINTS_MAX,
    FIRST_AVAILABLE_MAX,
    REQUESTS_MAX,
    RESERVED_FOR_MAX,
    RESULTS_MAX,
    TOLERATIONS_MAX,
    UUID_PATTERN,
    Checker,
    check_api_version,
    check_metadata,
    check_node_selector,
    check_opaque,
    check_selectors,
    keyed,
)
from events.quantities import Quantity
from events.slicevalidation import validate_resource_slice

__all__ = [
    "validate",
    "validate_device_class",
    "validate_namespace",
    "validate_resource_claim",
]


# --- DeviceClass ---------------------------------------------------------------------------


def validate_device_class(obj: model.DeviceClass, gates: FeatureGates = DEFAULT_GATES) -> None:
    """Check a DeviceClass: name, selectors, opaque configs, gated fields."""
    c = Checker(model.object_ref(obj), gates)
    check_api_version(c, obj.api_version)
    check_metadata(c, obj.metadata, namespaced=False, label_name=False)
    check_selectors(c, "spec.selectors", obj.spec.selectors)
    c.at_most("spec.config", obj.spec.config, CONFIG_MAX)
    for i, config in enumerate(obj.spec.config or ()):
        check_opaque(c, f"spec.config[{i}].opaque", config.opaque)
    c.gated(
        "spec.extendedResourceName",
        obj.spec.extended_resource_name,
        gates.extended_resource,
        "DRAExtendedResource",
    )


# --- ResourceClaim -------------------------------------------------------------------------


def validate_resource_claim(obj: model.ResourceClaim, gates: FeatureGates = DEFAULT_GATES) -> None:
    """Check a ResourceClaim: requests, constraints, config and ``status.allocation``."""
    c = Checker(model.object_ref(obj), gates)
    check_api_version(c, obj.api_version)
    check_metadata(c, obj.metadata, namespaced=True, label_name=False)
    devices = obj.spec.devices or model.DeviceClaim()
    refs = _claim_requests(c, "spec.devices.requests", devices.requests or [])
    c.at_most("spec.devices.constraints", devices.constraints, CONSTRAINTS_MAX)
    for i, constraint in enumerate(devices.constraints or ()):
        _constraint(c, f"spec.devices.constraints[{i}]", constraint, refs)
    c.at_most("spec.devices.config", devices.config, CONFIG_MAX)
    for i, config in enumerate(devices.config or ()):
        _request_refs(c, f"spec.devices.config[{i}].requests", config.requests, refs)
        check_opaque(c, f"spec.devices.config[{i}].opaque", config.opaque)
    if obj.status is not None:
        _status(c, obj.status, refs)


def _claim_requests(c: Checker, field: str, requests: list[model.DeviceRequest]) -> set[str]:
    """Check the requests; return every valid reference (``req`` and ``req/sub``)."""
    c.at_most(field, requests, REQUESTS_MAX)
    refs: set[str] = set()
    for i, request in enumerate(requests):
        path = f"{field}[{i}]"
        c.dns_label(f"{path}.name", request.name)
        if request.name in refs:
            c.fail(f"{path}.name", f"duplicate request name {request.name!r}")
        refs.add(request.name)
        if (request.exactly is None) == (request.first_available is None):
            c.fail(path, "exactly one of exactly or firstAvailable must be set")
        if request.exactly is not None:
            _exact_request(c, f"{path}.exactly", request.exactly)
        else:
            refs |= _first_available(c, f"{path}.firstAvailable", request)
    return refs


def _exact_request(c: Checker, path: str, request: model.ExactDeviceRequest) -> None:
    _device_request_common(
        c,
        path,
        request.device_class_name,
        request.selectors,
        request.allocation_mode,
        request.count,
        request.tolerations,
        request.capacity,
    )
    c.gated(f"{path}.adminAccess", request.admin_access, c.gates.admin_access, "DRAAdminAccess")


def _first_available(c: Checker, path: str, request: model.DeviceRequest) -> set[str]:
    subs = request.first_available or []
    c.gated(path, subs, c.gates.prioritized_list, "DRAPrioritizedList")
    if not subs:
        c.fail(path, "must have at least one entry")
    c.at_most(path, subs, FIRST_AVAILABLE_MAX)
    names: set[str] = set()
    for j, sub in enumerate(subs):
        sub_path = f"{path}[{j}]"
        c.dns_label(f"{sub_path}.name", sub.name)
        if sub.name in names:
            c.fail(f"{sub_path}.name", f"duplicate subrequest name {sub.name!r}")
        names.add(sub.name)
        _device_request_common(
            c,
            sub_path,
            sub.device_class_name,
            sub.selectors,
            sub.allocation_mode,
            sub.count,
            sub.tolerations,
            sub.capacity,
        )
    return {f"{request.name}/{name}" for name in names}


def _device_request_common(
    c: Checker,
    path: str,
    class_name: str,
    selectors: list[model.DeviceSelector] | None,
    mode: str | None,
    count: int | None,
    tolerations: list[model.JSON] | None,
    capacity: model.CapacityRequirements | None,
) -> None:
    c.dns_subdomain(f"{path}.deviceClassName", class_name)
    check_selectors(c, f"{path}.selectors", selectors)
    mode = mode or model.ALLOCATION_MODE_EXACT_COUNT  # API defaulting
    if mode not in ALLOCATION_MODES:
        c.fail(f"{path}.allocationMode", f"must be one of {', '.join(ALLOCATION_MODES)}")
    if mode == model.ALLOCATION_MODE_EXACT_COUNT and count is not None and count <= 0:
        c.fail(f"{path}.count", "must be greater than 0 with allocationMode ExactCount")
    if mode == model.ALLOCATION_MODE_ALL and count is not None:
        c.fail(f"{path}.count", "must not be set with allocationMode All")
    c.gated(f"{path}.tolerations", tolerations, c.gates.device_taints, "DRADeviceTaints")
    c.at_most(f"{path}.tolerations", tolerations, TOLERATIONS_MAX)
    if capacity is not None:
        c.gated(f"{path}.capacity", capacity, c.gates.consumable_capacity, "DRAConsumableCapacity")
        _capacity_amounts(c, f"{path}.capacity.requests", capacity.requests)


def _capacity_amounts(c: Checker, path: str, amounts: Mapping[str, Quantity] | None) -> None:
    for name, amount in (amounts or {}).items():
        c.qualified_name(keyed(path, name), name)
        c.not_negative(keyed(path, name), amount)


def _request_refs(c: Checker, path: str, names: list[str] | None, refs: set[str]) -> None:
    seen: set[str] = set()
    for i, name in enumerate(names or ()):
        if name not in refs:
            c.fail(
                f"{path}[{i}]",
                f"{name!r} must name a request of the claim, or a request and one of its "
                "firstAvailable subrequests as <request>/<subrequest>",
            )
        if name in seen:
            c.fail(f"{path}[{i}]", f"duplicate value {name!r}")
        seen.add(name)


def _constraint(c: Checker, path: str, constraint: model.DeviceConstraint, refs: set[str]) -> None:
    _request_refs(c, f"{path}.requests", constraint.requests, refs)
    match, distinct = constraint.match_attribute, constraint.distinct_attribute
    if (match is None) == (distinct is None):
        c.fail(path, "exactly one of matchAttribute or distinctAttribute must be set")
    if match is not None:
        c.fully_qualified_name(f"{path}.matchAttribute", match)
    if distinct is not None:
        c.gated(
            f"{path}.distinctAttribute",
            distinct,
            c.gates.consumable_capacity,
            "DRAConsumableCapacity",
        )
        c.fully_qualified_name(f"{path}.distinctAttribute", distinct)


def _status(c: Checker, status: model.ResourceClaimStatus, refs: set[str]) -> None:
    c.at_most("status.reservedFor", status.reserved_for, RESERVED_FOR_MAX)
    c.gated("status.devices", status.devices, c.gates.device_status, "DRAResourceClaimDeviceStatus")
    allocation = status.allocation
    if allocation is None:
        return
    path = "status.allocation"
    c.gated(
        f"{path}.allocationTimestamp",
        allocation.allocation_timestamp,
        c.gates.device_binding_conditions,
        "DRADeviceBindingConditions",
    )
    if allocation.node_selector is not None:
        check_node_selector(c, f"{path}.nodeSelector", allocation.node_selector)
    devices = allocation.devices or model.DeviceAllocationResult()
    c.at_most(f"{path}.devices.results", devices.results, RESULTS_MAX)
    for i, result in enumerate(devices.results or ()):
        _result(c, f"{path}.devices.results[{i}]", result, refs)
    c.at_most(f"{path}.devices.config", devices.config, ALLOCATION_CONFIG_MAX)
    for i, config in enumerate(devices.config or ()):
        cpath = f"{path}.devices.config[{i}]"
        if config.source not in CONFIG_SOURCES:
            c.fail(f"{cpath}.source", f"must be one of {', '.join(CONFIG_SOURCES)}")
        _request_refs(c, f"{cpath}.requests", config.requests, refs)
        check_opaque(c, f"{cpath}.opaque", config.opaque)


def _result(
    c: Checker, path: str, result: model.DeviceRequestAllocationResult, refs: set[str]
) -> None:
    if result.request not in refs:
        c.fail(
            f"{path}.request",
            f"{result.request!r} must name a request of the claim or <request>/<subrequest>",
        )
    c.driver(f"{path}.driver", result.driver)
    c.pool_name(f"{path}.pool", result.pool)
    c.dns_label(f"{path}.device", result.device)
    g = c.gates
    c.gated(f"{path}.adminAccess", result.admin_access, g.admin_access, "DRAAdminAccess")
    c.gated(f"{path}.tolerations", result.tolerations, g.device_taints, "DRADeviceTaints")
    for name, value in (
        ("bindingConditions", result.binding_conditions),
        ("bindingFailureConditions", result.binding_failure_conditions),
    ):
        c.gated(f"{path}.{name}", value, g.device_binding_conditions, "DRADeviceBindingConditions")
        c.at_most(f"{path}.{name}", value, BINDING_CONDITIONS_MAX)
    c.gated(f"{path}.shareID", result.share_id, g.consumable_capacity, "DRAConsumableCapacity")
    if result.share_id is not None and not UUID_PATTERN.fullmatch(result.share_id):
        c.fail(f"{path}.shareID", "must be a UUID in normalized lowercase 36-character form")
    if result.consumed_capacity is not None:
        c.gated(
            f"{path}.consumedCapacity",
            result.consumed_capacity,
            g.consumable_capacity,
            "DRAConsumableCapacity",
        )
        if result.share_id is None:
            c.fail(f"{path}.consumedCapacity", "may only be set together with shareID")
        _capacity_amounts(c, f"{path}.consumedCapacity", result.consumed_capacity)


# --- Namespace -----------------------------------------------------------------------------


def validate_namespace(obj: model.Namespace, gates: FeatureGates = DEFAULT_GATES) -> None:
    """Check a Namespace: a DNS-label name and well-formed labels."""
    c = Checker(model.object_ref(obj), gates)
    check_metadata(c, obj.metadata, namespaced=False, label_name=True)


# --- dispatch ------------------------------------------------------------------------------


def validate(obj: model.Manifest, gates: FeatureGates = DEFAULT_GATES) -> None:
    """Raise :class:`ValidationError` for the first API rule ``obj`` breaks."""
    match obj:
        case model.DeviceClass():
            validate_device_class(obj, gates)
        case model.ResourceSlice():
            validate_resource_slice(obj, gates)
        case model.ResourceClaim():
            validate_resource_claim(obj, gates)
        case model.Namespace():
            validate_namespace(obj, gates)
        case _:
            raise TypeError(f"cannot validate {type(obj).__name__}")
