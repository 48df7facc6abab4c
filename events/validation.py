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

Decisions where the API is silent are listed in ``docs/validation.md``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

import msgspec

from events import model
from events.errors import ValidationError
from events.features import DEFAULT_GATES, FeatureGates
from events.quantities import Quantity
from events.selectors import selector_problem

__all__ = [
    "ALLOCATION_CONFIG_MAX",
    "ATTRIBUTES_AND_CAPACITY_MAX",
    "CEL_EXPRESSION_MAX_LENGTH",
    "CONFIG_MAX",
    "CONSTRAINTS_MAX",
    "DEVICES_MAX",
    "FIRST_AVAILABLE_MAX",
    "OPAQUE_PARAMETERS_MAX_BYTES",
    "REQUESTS_MAX",
    "RESULTS_MAX",
    "SELECTORS_MAX",
    "VALID_VALUES_MAX",
    "is_c_identifier",
    "is_dns_label",
    "is_dns_subdomain",
    "is_fully_qualified_name",
    "is_qualified_name",
    "is_semver",
    "split_qualified_name",
    "validate",
    "validate_device_class",
    "validate_namespace",
    "validate_resource_claim",
    "validate_resource_slice",
]

# --- limits (Kubernetes 1.34, resource.k8s.io/v1) ----------------------------------------

DEVICES_MAX = 128
ATTRIBUTES_AND_CAPACITY_MAX = 32
ATTRIBUTE_VALUE_MAX_LENGTH = 64
QUALIFIED_ID_MAX_LENGTH = 32
DOMAIN_MAX_LENGTH = 63
DRIVER_NAME_MAX_LENGTH = 63
POOL_NAME_MAX_LENGTH = 253
DNS_LABEL_MAX_LENGTH = 63
DNS_SUBDOMAIN_MAX_LENGTH = 253
REQUESTS_MAX = 32
RESULTS_MAX = 32
SELECTORS_MAX = 32
CONSTRAINTS_MAX = 32
CONFIG_MAX = 32
ALLOCATION_CONFIG_MAX = 64
FIRST_AVAILABLE_MAX = 8
TOLERATIONS_MAX = 16
TAINTS_MAX = 4
BINDING_CONDITIONS_MAX = 4
RESERVED_FOR_MAX = 256
VALID_VALUES_MAX = 10
CEL_EXPRESSION_MAX_LENGTH = 10 * 1024
OPAQUE_PARAMETERS_MAX_BYTES = 10 * 1024
LABEL_VALUE_MAX_LENGTH = 63

ALLOCATION_MODES = (model.ALLOCATION_MODE_EXACT_COUNT, model.ALLOCATION_MODE_ALL)
CONFIG_SOURCES = ("FromClass", "FromClaim")
NODE_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")

# --- name formats ------------------------------------------------------------------------

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# Semantic Versioning 2.0.0 (https://semver.org/#backusnaur-form-grammar).
_NUMERIC = r"(0|[1-9][0-9]*)"
_PRE_ID = r"(0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*)"
_SEMVER = re.compile(
    rf"{_NUMERIC}\.{_NUMERIC}\.{_NUMERIC}"
    rf"(-{_PRE_ID}(\.{_PRE_ID})*)?"
    r"(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?"
)

DNS_LABEL_RULE = (
    "must be a DNS label: at most 63 lowercase alphanumerics or '-', alphanumeric at both ends"
)
DNS_SUBDOMAIN_RULE = (
    "must be a DNS subdomain: at most 253 lowercase alphanumerics, '-' or '.', "
    "alphanumeric at both ends of every label"
)
QUALIFIED_NAME_RULE = (
    "must be a C identifier of at most 32 characters, optionally prefixed by a DNS "
    "subdomain of at most 63 characters and '/'"
)


def is_dns_label(name: str) -> bool:
    """RFC 1123 label: at most 63 lowercase alphanumerics or ``-``."""
    return len(name) <= DNS_LABEL_MAX_LENGTH and _DNS_LABEL.fullmatch(name) is not None


def is_dns_subdomain(name: str, max_length: int = DNS_SUBDOMAIN_MAX_LENGTH) -> bool:
    """RFC 1123 subdomain: dot-separated labels, at most ``max_length`` characters."""
    return len(name) <= max_length and _DNS_SUBDOMAIN.fullmatch(name) is not None


def is_c_identifier(name: str) -> bool:
    """``[A-Za-z_][A-Za-z0-9_]*`` of at most 32 characters (the id of a QualifiedName)."""
    return len(name) <= QUALIFIED_ID_MAX_LENGTH and _C_IDENTIFIER.fullmatch(name) is not None


def is_qualified_name(name: str) -> bool:
    """``<id>`` or ``<domain>/<id>``: a device attribute or capacity name."""
    domain, sep, ident = name.rpartition("/")
    if sep and not is_dns_subdomain(domain, DOMAIN_MAX_LENGTH):
        return False
    return is_c_identifier(ident)


def is_fully_qualified_name(name: str) -> bool:
    """``<domain>/<id>``: a QualifiedName whose domain is spelled out."""
    return "/" in name and is_qualified_name(name)


def is_semver(text: str) -> bool:
    """A Semantic Versioning 2.0.0 version (no leading ``v``)."""
    return _SEMVER.fullmatch(text) is not None


def split_qualified_name(name: str, driver: str) -> tuple[str, str]:
    """``(domain, id)`` of a QualifiedName; a name without a domain belongs to ``driver``."""
    domain, sep, ident = name.rpartition("/")
    return (domain, ident) if sep else (driver, name)


# --- plumbing ------------------------------------------------------------------------------

Sized = Sequence[Any] | Mapping[str, Any]


class _Checker:
    """Carries the object reference and the gates through the checks of one object."""

    def __init__(self, ref: str, gates: FeatureGates) -> None:
        self.ref = ref
        self.gates = gates

    def fail(self, field: str, rule: str) -> NoReturn:
        raise ValidationError(self.ref, field, rule)

    def gated(self, field: str, value: object, enabled: bool, gate: str) -> None:
        if value is not None and not enabled:
            self.fail(field, f"forbidden: requires feature gate {gate}")

    def at_most(self, field: str, items: Sized | None, limit: int) -> None:
        if items is not None and len(items) > limit:
            self.fail(field, f"must have at most {limit} entries, got {len(items)}")

    def dns_label(self, field: str, name: str) -> None:
        if not name:
            self.fail(field, "required")
        if not is_dns_label(name):
            self.fail(field, DNS_LABEL_RULE)

    def dns_subdomain(self, field: str, name: str, max_length: int = 253) -> None:
        if not name:
            self.fail(field, "required")
        if len(name) > max_length:
            self.fail(field, f"must be at most {max_length} characters")
        if not is_dns_subdomain(name, max_length):
            self.fail(field, DNS_SUBDOMAIN_RULE)

    def driver(self, field: str, name: str) -> None:
        self.dns_subdomain(field, name, DRIVER_NAME_MAX_LENGTH)

    def pool_name(self, field: str, name: str) -> None:
        if not name:
            self.fail(field, "required")
        if len(name) > POOL_NAME_MAX_LENGTH:
            self.fail(field, f"must be at most {POOL_NAME_MAX_LENGTH} characters")
        if not all(is_dns_subdomain(part) for part in name.split("/")):
            self.fail(field, "must be one or more DNS subdomains separated by '/'")

    def qualified_name(self, field: str, name: str) -> None:
        if not name:
            self.fail(field, "required")
        if not is_qualified_name(name):
            self.fail(field, QUALIFIED_NAME_RULE)

    def fully_qualified_name(self, field: str, name: str) -> None:
        self.qualified_name(field, name)
        if "/" not in name:
            self.fail(field, "must be a fully qualified name: a domain is required")

    def not_negative(self, field: str, quantity: Quantity) -> None:
        if quantity.sign() < 0:
            self.fail(field, "must not be negative")


def _key(path: str, key: str) -> str:
    return f"{path}[{key}]"


# --- metadata ------------------------------------------------------------------------------


def _metadata(c: _Checker, meta: model.ObjectMeta, *, namespaced: bool, label_name: bool) -> None:
    if not meta.name:
        c.fail("metadata.name", "required")
    if label_name:
        c.dns_label("metadata.name", meta.name)
    else:
        c.dns_subdomain("metadata.name", meta.name)
    if namespaced:
        if not meta.namespace:
            c.fail("metadata.namespace", "required")
        c.dns_label("metadata.namespace", meta.namespace)
    elif meta.namespace:
        c.fail("metadata.namespace", "must not be set: the object is cluster-scoped")
    if meta.generation is not None and meta.generation < 0:
        c.fail("metadata.generation", "must be greater than or equal to 0")
    for key, value in (meta.labels or {}).items():
        _label(c, _key("metadata.labels", key), key, value)


def _label(c: _Checker, field: str, key: str, value: str) -> None:
    prefix, sep, name = key.rpartition("/")
    if sep and not is_dns_subdomain(prefix):
        c.fail(field, "the prefix of a label key must be a DNS subdomain")
    if len(name) > LABEL_VALUE_MAX_LENGTH or not _LABEL_NAME.fullmatch(name):
        c.fail(field, "a label key must be a name of at most 63 alphanumerics, '-', '_' or '.'")
    if value and (len(value) > LABEL_VALUE_MAX_LENGTH or not _LABEL_NAME.fullmatch(value)):
        c.fail(field, "a label value must be empty or at most 63 alphanumerics, '-', '_' or '.'")


def _api_version(c: _Checker, api_version: str) -> None:
    if api_version != model.API_VERSION:
        c.fail("apiVersion", f"must be {model.API_VERSION}")


# --- shared pieces -------------------------------------------------------------------------


def _selectors(c: _Checker, field: str, selectors: list[model.DeviceSelector] | None) -> None:
    c.at_most(field, selectors, SELECTORS_MAX)
    for i, selector in enumerate(selectors or ()):
        if selector.cel is None:
            c.fail(f"{field}[{i}].cel", "required")
        _cel(c, f"{field}[{i}].cel.expression", selector.cel.expression)


def _cel(c: _Checker, field: str, expression: str) -> None:
    if not expression.strip():
        c.fail(field, "required")
    size = len(expression.encode())
    if size > CEL_EXPRESSION_MAX_LENGTH:
        c.fail(field, f"must be at most {CEL_EXPRESSION_MAX_LENGTH} bytes, got {size}")
    problem = selector_problem(expression, consumable_capacity=c.gates.consumable_capacity)
    if problem is not None:
        c.fail(field, problem)


def _opaque(c: _Checker, field: str, opaque: model.OpaqueDeviceConfiguration | None) -> None:
    if opaque is None:
        c.fail(field, "required: exactly one configuration type (opaque)")
    c.driver(f"{field}.driver", opaque.driver)
    if not isinstance(opaque.parameters, dict):
        c.fail(f"{field}.parameters", "must be a JSON object")
    size = len(msgspec.json.encode(opaque.parameters))
    if size > OPAQUE_PARAMETERS_MAX_BYTES:
        c.fail(f"{field}.parameters", f"must be at most {OPAQUE_PARAMETERS_MAX_BYTES} bytes")


def _node_selector(c: _Checker, field: str, selector: model.NodeSelector) -> None:
    if not selector.node_selector_terms:
        c.fail(f"{field}.nodeSelectorTerms", "must have at least one term")
    for i, term in enumerate(selector.node_selector_terms):
        path = f"{field}.nodeSelectorTerms[{i}]"
        for j, req in enumerate(term.match_expressions or ()):
            _node_requirement(c, f"{path}.matchExpressions[{j}]", req, fields=False)
        for j, req in enumerate(term.match_fields or ()):
            _node_requirement(c, f"{path}.matchFields[{j}]", req, fields=True)


def _node_requirement(
    c: _Checker, field: str, req: model.NodeSelectorRequirement, *, fields: bool
) -> None:
    if not req.key:
        c.fail(f"{field}.key", "required")
    if fields and req.key != "metadata.name":
        c.fail(f"{field}.key", "must be metadata.name")
    if req.operator not in NODE_SELECTOR_OPERATORS:
        c.fail(f"{field}.operator", f"must be one of {', '.join(NODE_SELECTOR_OPERATORS)}")
    values = req.values or []
    if req.operator in ("In", "NotIn") and not values:
        c.fail(f"{field}.values", f"must be non-empty with operator {req.operator}")
    if req.operator in ("Exists", "DoesNotExist") and values:
        c.fail(f"{field}.values", f"must be empty with operator {req.operator}")
    if req.operator in ("Gt", "Lt") and (len(values) != 1 or not values[0].lstrip("-").isdigit()):
        c.fail(f"{field}.values", f"must be a single integer with operator {req.operator}")


# --- DeviceClass ---------------------------------------------------------------------------


def validate_device_class(obj: model.DeviceClass, gates: FeatureGates = DEFAULT_GATES) -> None:
    """Check a DeviceClass: name, selectors, opaque configs, gated fields."""
    c = _Checker(model.object_ref(obj), gates)
    _api_version(c, obj.api_version)
    _metadata(c, obj.metadata, namespaced=False, label_name=False)
    _selectors(c, "spec.selectors", obj.spec.selectors)
    c.at_most("spec.config", obj.spec.config, CONFIG_MAX)
    for i, config in enumerate(obj.spec.config or ()):
        _opaque(c, f"spec.config[{i}].opaque", config.opaque)
    c.gated(
        "spec.extendedResourceName",
        obj.spec.extended_resource_name,
        gates.extended_resource,
        "DRAExtendedResource",
    )


# --- ResourceSlice -------------------------------------------------------------------------


def validate_resource_slice(obj: model.ResourceSlice, gates: FeatureGates = DEFAULT_GATES) -> None:
    """Check a ResourceSlice: driver, pool, node selection and every device."""
    c = _Checker(model.object_ref(obj), gates)
    _api_version(c, obj.api_version)
    _metadata(c, obj.metadata, namespaced=False, label_name=False)
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


def _slice_node_selection(c: _Checker, spec: model.ResourceSliceSpec) -> None:
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
        _node_selector(c, "spec.nodeSelector", spec.node_selector)
    c.gated(
        "spec.perDeviceNodeSelection",
        spec.per_device_node_selection,
        c.gates.partitionable_devices,
        "DRAPartitionableDevices",
    )


def _device(c: _Checker, path: str, device: model.Device, spec: model.ResourceSliceSpec) -> None:
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
        _attribute(c, _key(f"{path}.attributes", name), attribute)
    _unique_qualified_names(c, f"{path}.capacity", capacity, spec.driver)
    for name, cap in capacity.items():
        _capacity(c, _key(f"{path}.capacity", name), cap, bool(device.allow_multiple_allocations))


def _device_gated_fields(
    c: _Checker, path: str, device: model.Device, spec: model.ResourceSliceSpec
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


def _unique_qualified_names(c: _Checker, path: str, names: Iterable[str], driver: str) -> None:
    seen: dict[tuple[str, str], str] = {}
    for name in names:
        c.qualified_name(_key(path, name), name)
        full = split_qualified_name(name, driver)
        if full in seen:
            c.fail(_key(path, name), f"duplicate of {seen[full]!r} (same domain and id)")
        seen[full] = name


def _attribute(c: _Checker, path: str, attribute: model.DeviceAttribute) -> None:
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


def _capacity(c: _Checker, path: str, cap: model.DeviceCapacity, multiple: bool) -> None:
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
    c: _Checker, path: str, default: Quantity | None, values: list[Quantity], capacity: Quantity
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
    c: _Checker,
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
    c: _Checker,
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


# --- ResourceClaim -------------------------------------------------------------------------


def validate_resource_claim(obj: model.ResourceClaim, gates: FeatureGates = DEFAULT_GATES) -> None:
    """Check a ResourceClaim: requests, constraints, config and ``status.allocation``."""
    c = _Checker(model.object_ref(obj), gates)
    _api_version(c, obj.api_version)
    _metadata(c, obj.metadata, namespaced=True, label_name=False)
    devices = obj.spec.devices or model.DeviceClaim()
    refs = _claim_requests(c, "spec.devices.requests", devices.requests or [])
    c.at_most("spec.devices.constraints", devices.constraints, CONSTRAINTS_MAX)
    for i, constraint in enumerate(devices.constraints or ()):
        _constraint(c, f"spec.devices.constraints[{i}]", constraint, refs)
    c.at_most("spec.devices.config", devices.config, CONFIG_MAX)
    for i, config in enumerate(devices.config or ()):
        _request_refs(c, f"spec.devices.config[{i}].requests", config.requests, refs)
        _opaque(c, f"spec.devices.config[{i}].opaque", config.opaque)
    if obj.status is not None:
        _status(c, obj.status, refs)


def _claim_requests(c: _Checker, field: str, requests: list[model.DeviceRequest]) -> set[str]:
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


def _exact_request(c: _Checker, path: str, request: model.ExactDeviceRequest) -> None:
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


def _first_available(c: _Checker, path: str, request: model.DeviceRequest) -> set[str]:
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
    c: _Checker,
    path: str,
    class_name: str,
    selectors: list[model.DeviceSelector] | None,
    mode: str | None,
    count: int | None,
    tolerations: list[model.JSON] | None,
    capacity: model.CapacityRequirements | None,
) -> None:
    c.dns_subdomain(f"{path}.deviceClassName", class_name)
    _selectors(c, f"{path}.selectors", selectors)
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


def _capacity_amounts(c: _Checker, path: str, amounts: Mapping[str, Quantity] | None) -> None:
    for name, amount in (amounts or {}).items():
        c.qualified_name(_key(path, name), name)
        c.not_negative(_key(path, name), amount)


def _request_refs(c: _Checker, path: str, names: list[str] | None, refs: set[str]) -> None:
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


def _constraint(c: _Checker, path: str, constraint: model.DeviceConstraint, refs: set[str]) -> None:
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


def _status(c: _Checker, status: model.ResourceClaimStatus, refs: set[str]) -> None:
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
        _node_selector(c, f"{path}.nodeSelector", allocation.node_selector)
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
        _opaque(c, f"{cpath}.opaque", config.opaque)


def _result(
    c: _Checker, path: str, result: model.DeviceRequestAllocationResult, refs: set[str]
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
    if result.share_id is not None and not _UUID.fullmatch(result.share_id):
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
    c = _Checker(model.object_ref(obj), gates)
    _metadata(c, obj.metadata, namespaced=False, label_name=True)


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


# --- a request policy on its own (the admin API's policies.set) ---------------------------------


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
    _capacity(_Checker(ref, gates), path, capacity, multiple)
