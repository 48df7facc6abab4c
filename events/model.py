"""The ``resource.k8s.io/v1`` objects dracap reads and writes, as msgspec Structs.

The Structs mirror the Kubernetes 1.34 API shapes field for field (camelCase on the
wire, Python snake_case in code), so a manifest written for a real cluster decodes
here and what dracap encodes validates against the official schemas. They are plain
data: the API's rules live in :mod:`events.validation`, reading files in
:mod:`events.manifests`.

Design choices:

* Quantities are decoded into :class:`events.quantities.Quantity` at the edge (see
  :func:`decode_hook`) and encoded back in canonical form, as the API server does.
* Fields of gated features dracap does not implement (taints, tolerations, counters,
  binding conditions) are kept as opaque JSON so that decoding and re-encoding a
  manifest loses nothing, but the allocator never reads them.
* Unknown fields are ignored on decode, like a tolerant API client; validation rejects
  what matters.
"""

from __future__ import annotations

import datetime
from typing import Any, Literal, TypeVar

import msgspec

from events.quantities import Quantity

API_VERSION = "resource.k8s.io/v1"

JSON = dict[str, Any]

T = TypeVar("T")


class Base(msgspec.Struct, rename="camel", omit_defaults=True, kw_only=True, gc=False):
    """Common settings: camelCase names on the wire, defaults left out.

    ``gc=False``: the objects are data trees that never form a reference cycle, so the
    garbage collector need not track them (a service holds hundreds of thousands)."""


# --- metadata ---------------------------------------------------------------------------


class ObjectMeta(Base):
    name: str = ""
    generate_name: str | None = None
    namespace: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    uid: str | None = None
    resource_version: str | None = None
    generation: int | None = None
    creation_timestamp: datetime.datetime | None = None


class NodeSelectorRequirement(Base):
    key: str
    operator: str
    values: list[str] | None = None


class NodeSelectorTerm(Base):
    match_expressions: list[NodeSelectorRequirement] | None = None
    match_fields: list[NodeSelectorRequirement] | None = None


class NodeSelector(Base):
    node_selector_terms: list[NodeSelectorTerm]


# --- DeviceClass --------------------------------------------------------------------------


class CELDeviceSelector(Base):
    expression: str


class DeviceSelector(Base):
    cel: CELDeviceSelector | None = None


class OpaqueDeviceConfiguration(Base):
    driver: str
    parameters: Any


class DeviceClassConfiguration(Base):
    opaque: OpaqueDeviceConfiguration | None = None


class DeviceClassSpec(Base):
    selectors: list[DeviceSelector] | None = None
    config: list[DeviceClassConfiguration] | None = None
    extended_resource_name: str | None = None


class DeviceClass(Base, tag_field="kind", tag="DeviceClass", kw_only=True):
    api_version: str = API_VERSION
    metadata: ObjectMeta
    spec: DeviceClassSpec


# --- ResourceSlice ------------------------------------------------------------------------


class DeviceAttribute(Base):
    """Exactly one of the four values is set (checked by validation)."""

    int_: int | None = msgspec.field(default=None, name="int")
    bool_: bool | None = msgspec.field(default=None, name="bool")
    string: str | None = None
    version: str | None = None


class CapacityRequestPolicyRange(Base):
    min: Quantity
    max: Quantity | None = None
    step: Quantity | None = None


class CapacityRequestPolicy(Base):
    default: Quantity | None = None
    valid_values: list[Quantity] | None = None
    valid_range: CapacityRequestPolicyRange | None = None


class DeviceCapacity(Base):
    value: Quantity
    request_policy: CapacityRequestPolicy | None = None


class Device(Base):
    name: str
    attributes: dict[str, DeviceAttribute] | None = None
    capacity: dict[str, DeviceCapacity] | None = None
    allow_multiple_allocations: bool | None = None
    # Gated features dracap does not implement; kept verbatim.
    consumes_counters: list[JSON] | None = None
    node_name: str | None = None
    node_selector: NodeSelector | None = None
    all_nodes: bool | None = None
    taints: list[JSON] | None = None
    binds_to_node: bool | None = None
    binding_conditions: list[str] | None = None
    binding_failure_conditions: list[str] | None = None


class ResourcePool(Base):
    name: str
    generation: int
    resource_slice_count: int


class ResourceSliceSpec(Base):
    driver: str
    pool: ResourcePool
    node_name: str | None = None
    node_selector: NodeSelector | None = None
    all_nodes: bool | None = None
    per_device_node_selection: bool | None = None
    devices: list[Device] | None = None
    shared_counters: list[JSON] | None = None


class ResourceSlice(Base, tag_field="kind", tag="ResourceSlice", kw_only=True):
    api_version: str = API_VERSION
    metadata: ObjectMeta
    spec: ResourceSliceSpec


# --- ResourceClaim ------------------------------------------------------------------------

ALLOCATION_MODE_EXACT_COUNT = "ExactCount"
ALLOCATION_MODE_ALL = "All"


class CapacityRequirements(Base):
    requests: dict[str, Quantity] | None = None


class DeviceSubRequest(Base):
    name: str
    device_class_name: str
    selectors: list[DeviceSelector] | None = None
    allocation_mode: str | None = None
    count: int | None = None
    tolerations: list[JSON] | None = None
    capacity: CapacityRequirements | None = None


class ExactDeviceRequest(Base):
    device_class_name: str
    selectors: list[DeviceSelector] | None = None
    allocation_mode: str | None = None
    count: int | None = None
    admin_access: bool | None = None
    tolerations: list[JSON] | None = None
    capacity: CapacityRequirements | None = None


class DeviceRequest(Base):
    name: str
    exactly: ExactDeviceRequest | None = None
    first_available: list[DeviceSubRequest] | None = None


class DeviceConstraint(Base):
    requests: list[str] | None = None
    match_attribute: str | None = None
    distinct_attribute: str | None = None


class DeviceClaimConfiguration(Base):
    requests: list[str] | None = None
    opaque: OpaqueDeviceConfiguration | None = None


class DeviceClaim(Base):
    requests: list[DeviceRequest] | None = None
    constraints: list[DeviceConstraint] | None = None
    config: list[DeviceClaimConfiguration] | None = None


class ResourceClaimSpec(Base):
    devices: DeviceClaim | None = None


class DeviceRequestAllocationResult(Base):
    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool | None = None
    tolerations: list[JSON] | None = None
    binding_conditions: list[str] | None = None
    binding_failure_conditions: list[str] | None = None
    share_id: str | None = msgspec.field(default=None, name="shareID")
    consumed_capacity: dict[str, Quantity] | None = None


class DeviceAllocationConfiguration(Base):
    source: str
    requests: list[str] | None = None
    opaque: OpaqueDeviceConfiguration | None = None


class DeviceAllocationResult(Base):
    results: list[DeviceRequestAllocationResult] | None = None
    config: list[DeviceAllocationConfiguration] | None = None


class AllocationResult(Base):
    devices: DeviceAllocationResult | None = None
    node_selector: NodeSelector | None = None
    allocation_timestamp: datetime.datetime | None = None


class ResourceClaimConsumerReference(Base):
    resource: str
    name: str
    uid: str
    api_group: str | None = None


class ResourceClaimStatus(Base):
    allocation: AllocationResult | None = None
    reserved_for: list[ResourceClaimConsumerReference] | None = None
    devices: list[JSON] | None = None


class ResourceClaim(Base, tag_field="kind", tag="ResourceClaim", kw_only=True):
    api_version: str = API_VERSION
    metadata: ObjectMeta
    spec: ResourceClaimSpec
    status: ResourceClaimStatus | None = None


# --- core/v1 Namespace (only what admission reads) -----------------------------------------

ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"


class Namespace(Base, tag_field="kind", tag="Namespace", kw_only=True):
    api_version: Literal["v1"] = "v1"
    metadata: ObjectMeta

    @property
    def allows_admin_access(self) -> bool:
        """True when the namespace carries the admin-access label set to "true"."""
        return (self.metadata.labels or {}).get(ADMIN_ACCESS_LABEL) == "true"


Manifest = DeviceClass | ResourceSlice | ResourceClaim | Namespace

KINDS: dict[str, type[Manifest]] = {
    "DeviceClass": DeviceClass,
    "ResourceSlice": ResourceSlice,
    "ResourceClaim": ResourceClaim,
    "Namespace": Namespace,
}


# --- encoding hooks ---------------------------------------------------------------------


# Decoded quantities by their text. Replaying the log decodes the same few strings
# ("10Gi", "2G") millions of times; a plain dict lookup is the cheapest dec_hook path.
_QUANTITIES: dict[str, Quantity] = {}
_QUANTITIES_MAX = 65_536


def decode_hook(typ: type, obj: Any) -> Any:
    """msgspec ``dec_hook``: build quantities from strings or plain numbers."""
    if typ is Quantity:
        if type(obj) is str:
            cached = _QUANTITIES.get(obj)
            if cached is None:
                cached = Quantity.parse(obj)
                if len(_QUANTITIES) < _QUANTITIES_MAX:
                    _QUANTITIES[obj] = cached
            return cached
        if isinstance(obj, bool) or not isinstance(obj, str | int | float):
            raise TypeError(f"a quantity must be a string or a number, got {type(obj).__name__}")
        return Quantity.parse(str(obj))
    raise NotImplementedError(f"cannot decode {typ!r}")


def encode_hook(obj: Any) -> Any:
    """msgspec ``enc_hook``: quantities print in canonical form."""
    if isinstance(obj, Quantity):
        return obj.canonical()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def to_builtins(obj: Manifest | Base) -> JSON:
    """The Kubernetes JSON shape of ``obj`` (``kind`` and ``apiVersion`` included)."""
    out = msgspec.to_builtins(obj, enc_hook=encode_hook)
    assert isinstance(out, dict)
    api_version = getattr(obj, "api_version", None)
    if api_version is not None:
        # omit_defaults would drop the (default) apiVersion; Kubernetes requires it.
        head = {"apiVersion": api_version}
        if "kind" in out:
            head["kind"] = out.pop("kind")
        out = {**head, **out}
    return out


def encode_json(obj: Manifest | Base) -> bytes:
    """Kubernetes JSON for ``obj``."""
    return msgspec.json.encode(to_builtins(obj))


def convert(data: Any, typ: type[T]) -> T:
    """Build ``typ`` from decoded JSON/YAML data; raises ``msgspec.ValidationError``."""
    return msgspec.convert(data, type=typ, dec_hook=decode_hook)


def object_ref(obj: Manifest) -> str:
    """``Kind namespace/name`` (or ``Kind name`` for cluster-scoped objects)."""
    kind = type(obj).__name__
    meta = obj.metadata
    if meta.namespace:
        return f"{kind} {meta.namespace}/{meta.name}"
    return f"{kind} {meta.name}"


def describe_policy(policy: CapacityRequestPolicy | None) -> str:
    """A short human-readable form of a policy, for reasons and tables."""
    if policy is None:
        return "no policy"
    parts: list[str] = []
    if policy.default is not None:
        parts.append(f"default {policy.default}")
    if policy.valid_range is not None:
        rng = policy.valid_range
        parts.append(f"min {rng.min}")
        if rng.step is not None:
            parts.append(f"step {rng.step}")
        if rng.max is not None:
            parts.append(f"max {rng.max}")
    if policy.valid_values:
        parts.append("values " + "/".join(str(v) for v in policy.valid_values))
    return ", ".join(parts) or "empty policy"
