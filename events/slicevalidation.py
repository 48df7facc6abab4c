"""The rules of a ResourceSlice: devices, attributes, capacities and request policies. Pure.

:func:`validate_resource_slice` checks a slice as the API server would (node
selection, device names, gated fields, attributes, capacities and their request
policies: ``validValues``, ``validRange`` and its step); :func:`validate_capacity_policy`
checks one capacity's request policy by the same rules, for the admin API's
``policies.set``. The shared field rules are :mod:`events.fieldchecks`.
"""

from __future__ import annotations

from collections.abc import Iterable

from events import model
from events.features import DEFAULT_GATES, FeatureGates
from events.fieldchecks import (
    ATTRIBUTE_VALUE_MAX_LENGTH,
    ATTRIBUTES_AND_CAPACITY_MAX,
    BINDING_CONDITIONS_MAX,
    DEVICES_MAX,
    TAINTS_MAX,
    VALID_VALUES_MAX,
    Checker,
    check_api_version,
    check_metadata,
    check_node_selector,
    is_semver,
    keyed,
    split_qualified_name,
)
from events.quantities import Quantity

__all__ = ["validate_capacity_policy", "validate_resource_slice"]


def validate_resource_slice(obj: model.ResourceSlice, gates: FeatureGates = DEFAULT_GATES) -> None:
    """Check a ResourceSlice: driver, pool, node selection and every device."""
    c = Checker(model.object_ref(obj), gates)
    check_api_version(c, obj.api_version)
    check_metadata(c, obj.metadata, namespaced=False, label_name=False)
    spec = obj.spec
    c.driver("spec.driver", spec.driver)
    c.pool_name("spec.pool.name", spec.pool.name)
    if spec.pool.generation < 0:
        c.fail("spec.pool.generation", "must be greater than or equal to 0")
    if spec.pool.resource_slice_count <= 0:
        c.fail("spec.pool.resourceSliceCount", "must be greater than 0")
    _slice_node_selection(c, spec)
    c.gated(
        "spec.sharedCounters",
        spec.shared_counters,
        gates.partitionable_devices,
        "DRAPartitionableDevices",
    )
    c.at_most("spec.devices", spec.devices, DEVICES_MAX)
    seen: set[str] = set()
    for i, device in enumerate(spec.devices or ()):
        path = f"spec.devices[{i}]"
        if device.name in seen:
            c.fail(f"{path}.name", f"duplicate device name {device.name!r} in the pool")
        seen.add(device.name)
        _device(c, path, device, spec)


def _slice_node_selection(c: Checker, spec: model.ResourceSliceSpec) -> None:
    set_ = [
        name
        for name, value in (
            ("nodeName", spec.node_name),
            ("nodeSelector", spec.node_selector),
            ("allNodes", spec.all_nodes or None),
            ("perDeviceNodeSelection", spec.per_device_node_selection or None),
        )
        if value is not None
    ]
    if len(set_) != 1:
        rule = "exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection"
        c.fail("spec", f"{rule} must be set, got {len(set_)}: {', '.join(set_) or 'none'}")
    if spec.node_name is not None:
        c.dns_subdomain("spec.nodeName", spec.node_name)
    if spec.node_selector is not None:
        if len(spec.node_selector.node_selector_terms) != 1:
            c.fail("spec.nodeSelector.nodeSelectorTerms", "must have exactly one term")
        check_node_selector(c, "spec.nodeSelector", spec.node_selector)
    c.gated(
        "spec.perDeviceNodeSelection",
        spec.per_device_node_selection,
        c.gates.partitionable_devices,
        "DRAPartitionableDevices",
    )


def _device(c: Checker, path: str, device: model.Device, spec: model.ResourceSliceSpec) -> None:
    c.dns_label(f"{path}.name", device.name)
    _device_gated_fields(c, path, device, spec)
    attributes = device.attributes or {}
    capacity = device.capacity or {}
    if len(attributes) + len(capacity) > ATTRIBUTES_AND_CAPACITY_MAX:
        c.fail(
            path,
            f"attributes and capacity together must have at most "
            f"{ATTRIBUTES_AND_CAPACITY_MAX} entries, got {len(attributes) + len(capacity)}",
        )
    _unique_qualified_names(c, f"{path}.attributes", attributes, spec.driver)
    for name, attribute in attributes.items():
        _attribute(c, keyed(f"{path}.attributes", name), attribute)
    _unique_qualified_names(c, f"{path}.capacity", capacity, spec.driver)
    for name, cap in capacity.items():
        _capacity(c, keyed(f"{path}.capacity", name), cap, bool(device.allow_multiple_allocations))


def _device_gated_fields(
    c: Checker, path: str, device: model.Device, spec: model.ResourceSliceSpec
) -> None:
    g = c.gates
    c.gated(
        f"{path}.allowMultipleAllocations",
        device.allow_multiple_allocations,
        g.consumable_capacity,
        "DRAConsumableCapacity",
    )
    partitionable = (
        ("consumesCounters", device.consumes_counters),
        ("nodeName", device.node_name),
        ("nodeSelector", device.node_selector),
        ("allNodes", device.all_nodes),
    )
    for name, value in partitionable:
        c.gated(f"{path}.{name}", value, g.partitionable_devices, "DRAPartitionableDevices")
    c.gated(f"{path}.taints", device.taints, g.device_taints, "DRADeviceTaints")
    c.at_most(f"{path}.taints", device.taints, TAINTS_MAX)
    binding = (
        ("bindsToNode", device.binds_to_node),
        ("bindingConditions", device.binding_conditions),
        ("bindingFailureConditions", device.binding_failure_conditions),
    )
    for name, flag in binding:
        c.gated(f"{path}.{name}", flag, g.device_binding_conditions, "DRADeviceBindingConditions")
    c.at_most(f"{path}.bindingConditions", device.binding_conditions, BINDING_CONDITIONS_MAX)
    c.at_most(
        f"{path}.bindingFailureConditions",
        device.binding_failure_conditions,
        BINDING_CONDITIONS_MAX,
    )
    per_device = [v for v in (device.node_name, device.node_selector, device.all_nodes) if v]
    if spec.per_device_node_selection and len(per_device) != 1:
        c.fail(
            path,
            "exactly one of nodeName, nodeSelector, allNodes must be set "
            "when the slice uses perDeviceNodeSelection",
        )
    if not spec.per_device_node_selection and per_device:
        c.fail(path, "nodeName, nodeSelector and allNodes need perDeviceNodeSelection on the slice")


def _unique_qualified_names(c: Checker, path: str, names: Iterable[str], driver: str) -> None:
    seen: dict[tuple[str, str], str] = {}
    for name in names:
        c.qualified_name(keyed(path, name), name)
        full = split_qualified_name(name, driver)
        if full in seen:
            c.fail(keyed(path, name), f"duplicate of {seen[full]!r} (same domain and id)")
        seen[full] = name


def _attribute(c: Checker, path: str, attribute: model.DeviceAttribute) -> None:
    values = (attribute.int_, attribute.bool_, attribute.string, attribute.version)
    if sum(v is not None for v in values) != 1:
        c.fail(path, "exactly one of int, bool, string or version must be set")
    if attribute.string is not None and len(attribute.string) > ATTRIBUTE_VALUE_MAX_LENGTH:
        c.fail(f"{path}.string", f"must be at most {ATTRIBUTE_VALUE_MAX_LENGTH} characters")
    if attribute.version is not None:
        if len(attribute.version) > ATTRIBUTE_VALUE_MAX_LENGTH:
            c.fail(f"{path}.version", f"must be at most {ATTRIBUTE_VALUE_MAX_LENGTH} characters")
        if not is_semver(attribute.version):
            c.fail(f"{path}.version", "must be a semantic version (semver 2.0.0)")


def _capacity(c: Checker, path: str, cap: model.DeviceCapacity, multiple: bool) -> None:
    c.not_negative(f"{path}.value", cap.value)
    policy = cap.request_policy
    if policy is None:
        return
    c.gated(f"{path}.requestPolicy", policy, c.gates.consumable_capacity, "DRAConsumableCapacity")
    if not multiple:
        c.fail(f"{path}.requestPolicy", "forbidden: allowMultipleAllocations must be true")
    path = f"{path}.requestPolicy"
    if policy.valid_values is not None and policy.valid_range is not None:
        c.fail(path, "validValues and validRange are mutually exclusive")
    if policy.default is not None:
        c.not_negative(f"{path}.default", policy.default)
    if policy.valid_values is not None:
        _valid_values(c, path, policy.default, policy.valid_values, cap.value)
    if policy.valid_range is not None:
        _valid_range(c, path, policy.default, policy.valid_range, cap.value)


def _valid_values(
    c: Checker, path: str, default: Quantity | None, values: list[Quantity], capacity: Quantity
) -> None:
    field = f"{path}.validValues"
    if not values:
        c.fail(field, "must have at least one entry")
    c.at_most(field, values, VALID_VALUES_MAX)
    for i, value in enumerate(values):
        c.not_negative(f"{field}[{i}]", value)
        if i and value == values[i - 1]:
            c.fail(f"{field}[{i}]", f"duplicate value {value.canonical()}")
        if i and value < values[i - 1]:
            c.fail(f"{field}[{i}]", "must be sorted in ascending order")
        if value > capacity:
            c.fail(f"{field}[{i}]", f"must be less than or equal to the capacity value {capacity}")
    if default is None:
        c.fail(f"{path}.default", "required when validValues is set")
    if default not in values:
        c.fail(f"{path}.default", "must be one of validValues")


def _valid_range(
    c: Checker,
    path: str,
    default: Quantity | None,
    rng: model.CapacityRequestPolicyRange,
    capacity: Quantity,
) -> None:
    field = f"{path}.validRange"
    c.not_negative(f"{field}.min", rng.min)
    if default is None:
        c.fail(f"{path}.default", "required when validRange is set")
    if rng.min > capacity:
        c.fail(f"{field}.min", f"must be less than or equal to the capacity value {capacity}")
    if default < rng.min:
        c.fail(f"{path}.default", "must be greater than or equal to validRange.min")
    if rng.max is not None:
        if rng.max < rng.min:
            c.fail(f"{field}.max", "must be greater than or equal to validRange.min")
        if rng.max > capacity:
            c.fail(f"{field}.max", f"must be less than or equal to the capacity value {capacity}")
        if default > rng.max:
            c.fail(f"{path}.default", "must be less than or equal to validRange.max")
    if rng.step is not None:
        _valid_range_step(c, path, default, rng, rng.step, capacity)


def _valid_range_step(
    c: Checker,
    path: str,
    default: Quantity,
    rng: model.CapacityRequestPolicyRange,
    step: Quantity,
    capacity: Quantity,
) -> None:
    field = f"{path}.validRange"
    if step.sign() <= 0:
        c.fail(f"{field}.step", "must be greater than 0")
    if rng.min + step > capacity:
        c.fail(f"{field}.step", "validRange.min + step must not exceed the capacity value")
    # Upstream compares the integer Value() (rounded up) of each operand.
    step_value, min_value = step.value(), rng.min.value()
    if (default.value() - min_value) % step_value:
        c.fail(f"{path}.default", "default - validRange.min must be a multiple of step")
    if rng.max is not None and (rng.max.value() - min_value) % step_value:
        c.fail(f"{field}.max", "validRange.max - validRange.min must be a multiple of step")


def validate_capacity_policy(
    ref: str,
    path: str,
    capacity: model.DeviceCapacity,
    multiple: bool,
    gates: FeatureGates = DEFAULT_GATES,
) -> None:
    """Check one capacity's request policy by the rules a ResourceSlice's must meet.

    ``path`` is the field path of the capacity (``policy`` errors name
    ``{path}.requestPolicy...``); ``multiple``: whether the device allows multiple
    allocations (a policy is forbidden otherwise).
    """
    _capacity(Checker(ref, gates), path, capacity, multiple)
