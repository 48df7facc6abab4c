"""Admission: may this ResourceClaim enter the system? Pure: no I/O.

The tenant API (:mod:`services.claims.api`) hands every ``claims.apply`` request to
:func:`decide_apply` together with the current fold; the answer says what to record on
the claim's stream and what to reply. The rules, in the order they are checked (the
first one that fails decides, so a person gets one precise reason):

=================== ========== ===================================================== ========
rule (``kind``)     code       what                                                  recorded
=================== ========== ===================================================== ========
``size``            invalid    the request body is at most :data:`MAX_MANIFEST_BYTES` no
``parse``           invalid    YAML/JSON that decodes into exactly one ResourceClaim  no
                               (a quantity that does not parse is a decode error
                               naming its field)
``namespace``       invalid    ``metadata.namespace`` empty or equal to the subject's no
                               namespace; a tenant never writes another namespace
``name``            invalid    ``metadata.name`` is a DNS subdomain (it keys streams) no
``name-conflict``   conflict   no *live* claim of that name exists (live: anything   no
                               but rejected, withdrawn, released); re-applying the
                               same spec to a live claim is a no-op that succeeds
``quota``           rejected   the namespace holds fewer live claims than its        no
                               ``max_claims`` (counting the claims the caller is
                               admitting right now, ``admitting``)
``validation``      invalid    the ``resource.k8s.io/v1`` API rules                  yes
                               (:func:`events.validation.validate`)
``status``          invalid    ``status`` is dracap's to write, never the tenant's   yes
``too-many-         rejected   at most the namespace's ``max_requests_per_claim``    yes
requests``                     requests (the API's own limit, 32, is ``validation``)
``unknown-class``   rejected   every DeviceClass named exists                        yes
``class-access``    rejected   the namespace may use the class                       yes
``class-disabled``  rejected   no class named is in mode ``disabled``                yes
``whole-device``    rejected   no capacity request for a class in mode               yes
                               ``whole-device`` (as with DRAConsumableCapacity off)
``admin-access``    rejected   ``adminAccess`` only where the namespace allows it    yes
``opaque-config``   rejected   opaque driver configuration (``spec.devices.config``) yes
                               only for requests of classes the namespace may
                               configure (``opaque_config_classes``)
``above-maximum``   rejected   a capacity request is at most the largest amount some yes
                               device of the class grants (policy ``max``,
                               ``validValues`` or the total); the reason names it
=================== ========== ===================================================== ========

"Recorded" means ``ClaimSubmitted`` + ``ClaimRejected`` on the claim stream, so the
tenant can read the verdict with ``claims.get``; an admitted claim records
``ClaimSubmitted`` + ``ClaimAdmitted`` and nothing else. Requests that cannot be
attributed to a well-formed claim of the caller's namespace record nothing at all:
there is no claim to attach them to, and a mismatching namespace must not touch
another tenant's stream.

Class access: a namespace may use exactly the classes of its latest
``NamespaceAccessSet`` (``"*"``: every class). **Without such a record a namespace may
use no class** — deny by default, an administrator opens a namespace with the admin
endpoint ``namespaces.access``. ``adminAccess`` additionally needs the record's
``admin_access`` flag, opaque driver configuration the class in its
``opaque_config_classes`` (none by default: a driver's parameters are the operator's
business unless it says otherwise). A config entry applies to the requests it names
(all of them when it names none), so every class those requests may use must allow it.

Class modes (``ClassModeSet``, admin endpoint ``deviceclasses.mode``): a class in mode
``disabled`` takes no new claims; one in mode ``whole-device`` is decided as if the
DRAConsumableCapacity gate were off for it — capacity requests are refused here, and
the allocator gives each claim a device of its own. A removed class
(``DeviceClassRemoved``) is ``unknown-class``. Claims admitted or allocated before a
switch or a removal are never revisited.

The quota is not recorded: a tenant at its quota could otherwise still grow the log
(and every service's folded state) with one rejected claim per apply.

A request *below* a device's ``min`` is not an error (the allocator rounds it up), and
a request that no device can take *right now* is the reservation service's business
(``ClaimUnschedulable``); admission only refuses what can never fit the current
inventory. A class that selects no device yet, or whose devices lack the capacity,
is left to the allocator too: devices may still be published.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Final, Literal, TypeAlias

import msgspec

from events.catalog import ClaimAdmitted, ClaimRejected, ClaimSubmitted, Event
from events.claimspecs import claim_spec
from events.errors import ValidationError
from events.features import DEFAULT_GATES, FeatureGates
from events.fieldchecks import (
    DNS_LABEL_RULE,
    DNS_SUBDOMAIN_RULE,
    REQUESTS_MAX,
    is_dns_label,
    is_dns_subdomain,
)
from events.inventory import CapacityInfo, Inventory, build_inventory
from events.manifests import MAX_MANIFEST_BYTES, load_documents
from events.model import ResourceClaim, ResourceClaimStatus
from events.quantities import Quantity
from events.state import REUSABLE_PHASES, ClusterState, NamespaceState
from events.tenancy import (
    MAX_CLAIMS,
    MAX_REQUESTS_PER_CLAIM,
    OPAQUE_CONFIG_CLASSES,
    class_allowed,
)
from events.validation import validate as validate_manifest

__all__ = [
    "FOLD_RULES",
    "MAX_MANIFEST_BYTES",
    "REJECTION_REASONS",
    "ApplyDecision",
    "DeviceLimits",
    "Refusal",
    "admit",
    "class_names",
    "decide_apply",
    "evaluate",
    "quota_of",
    "read_claim",
    "refuse",
]

ErrorCode: TypeAlias = Literal["invalid", "rejected", "not_found", "conflict"]


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    """Why a request is refused: the reply's ``error`` plus the rule ``kind`` (a metric label).

    ``message`` says it all (field, rule and ``detail``); ``detail`` is what the field
    and rule do not say, recorded as ``ClaimRejected.reason``.
    """

    code: ErrorCode
    kind: str
    field: str | None
    rule: str | None
    message: str
    detail: str = ""


class ApplyDecision(msgspec.Struct, frozen=True, kw_only=True):
    """What one ``claims.apply`` leads to.

    ``events`` go to the claim stream (possibly none); ``refusal`` is the error to reply
    with (``None``: success); ``unchanged`` marks an idempotent re-apply.
    """

    namespace: str
    name: str | None = None
    events: tuple[Event, ...] = ()
    refusal: Refusal | None = None
    unchanged: bool = False


#: every ``kind`` admission refuses with: ``dracap_rejections_total{reason}`` (each at 0
#: from the start; tests/unit/test_admission.py checks the list against the code)
REJECTION_REASONS: Final = (
    "above-maximum", "admin-access", "class-access", "class-disabled", "name", "name-conflict",
    "namespace", "opaque-config", "parse", "quota", "size", "status", "too-many-requests",
    "unknown-class", "validation", "whole-device",
)  # fmt: skip


#: the rules that read the fold (the others read only the request): a refusal by one of
#: them on a fold that lacks another replica's write is decided again on the whole log
#: (:mod:`services.claims.apiwrites`)
FOLD_RULES: Final = frozenset(
    {
        "above-maximum", "admin-access", "class-access", "class-disabled", "name-conflict",
        "opaque-config", "quota", "too-many-requests", "unknown-class", "whole-device",
    }
)  # fmt: skip


def refuse(code: ErrorCode, kind: str, field: str | None, rule: str, detail: str = "") -> Refusal:
    """A refusal whose message reads ``field: rule (detail)``."""
    where = f"{field}: " if field else ""
    message = f"{where}{rule}" + (f" ({detail})" if detail else "")
    return Refusal(code=code, kind=kind, field=field, rule=rule, message=message, detail=detail)


# --- reading -------------------------------------------------------------------------------


def read_claim(data: bytes, namespace: str) -> ResourceClaim | Refusal:
    """The one ResourceClaim of a request body, in ``namespace``; or why not."""
    if not is_dns_label(namespace):
        return refuse("invalid", "namespace", "metadata.namespace", DNS_LABEL_RULE, namespace)
    if len(data) > MAX_MANIFEST_BYTES:
        return refuse(
            "invalid", "size", None, f"the manifest must be at most {MAX_MANIFEST_BYTES} bytes"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return refuse("invalid", "parse", None, "the manifest must be UTF-8 text", str(exc))
    try:
        objects = load_documents(text, "claims.apply", check=False)
    except ValidationError as exc:
        return refuse("invalid", "parse", exc.field, exc.rule, exc.obj)
    if len(objects) != 1:
        return refuse(
            "invalid", "parse", None, f"must hold exactly one ResourceClaim, got {len(objects)}"
        )
    claim = objects[0]
    if not isinstance(claim, ResourceClaim):
        return refuse(
            "invalid", "parse", "kind", f"must be ResourceClaim, got {type(claim).__name__}"
        )
    return _in_namespace(claim, namespace)


def _in_namespace(claim: ResourceClaim, namespace: str) -> ResourceClaim | Refusal:
    meta = claim.metadata
    if meta.namespace and meta.namespace != namespace:
        return refuse(
            "invalid",
            "namespace",
            "metadata.namespace",
            f"must be empty or {namespace!r}, the namespace of the request subject",
            f"the manifest says {meta.namespace!r}",
        )
    if not meta.name:
        return refuse("invalid", "name", "metadata.name", "required")
    if not is_dns_subdomain(meta.name):
        return refuse("invalid", "name", "metadata.name", DNS_SUBDOMAIN_RULE, meta.name)
    if meta.namespace != namespace:
        claim = msgspec.structs.replace(
            claim, metadata=msgspec.structs.replace(meta, namespace=namespace)
        )
    return claim


# --- device limits -------------------------------------------------------------------------


def _device_maximum(info: CapacityInfo) -> Quantity:
    """The largest amount of one capacity a single share of the device may consume."""
    total, policy = info.total, info.policy
    if policy is None:
        return total
    if policy.valid_range is not None:
        top = policy.valid_range.max
        return top if top is not None and top < total else total
    if policy.valid_values:
        fitting = [v for v in policy.valid_values if v <= total]
        return max(fitting) if fitting else Quantity(0)
    return total


class DeviceLimits:
    """Per (class, capacity): the largest amount any device of the class grants.

    Built over one inventory and memoised; build a new one when the inventory changes.
    """

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self._cache: dict[tuple[str, str], tuple[Quantity, str] | None] = {}

    def largest(self, class_name: str, capacity: str) -> tuple[Quantity, str] | None:
        """``(amount, device)`` of the most generous device, or ``None`` if none has it."""
        key = (class_name, capacity)
        if key not in self._cache:
            self._cache[key] = self._compute(class_name, capacity)
        return self._cache[key]

    def _compute(self, class_name: str, capacity: str) -> tuple[Quantity, str] | None:
        inv = self.inventory
        dclass = inv.classes.get(class_name)
        if dclass is None:
            return None
        best: tuple[Quantity, str] | None = None
        for entry in inv.devices:
            info = entry.capacities.get(capacity)
            if info is None:
                continue
            if not inv.class_matches(dclass, entry.index):
                continue
            amount = _device_maximum(info)
            if best is None or amount > best[0]:
                best = (amount, "/".join(entry.key))
        return best


# --- the rules ----------------------------------------------------------------------------


class _Request(msgspec.Struct, frozen=True):
    path: str
    class_name: str
    admin: bool
    capacity: dict[str, Quantity]


def _requests(claim: ResourceClaim) -> Iterator[list[_Request]]:
    """Per request of the claim, its alternatives (one, or the firstAvailable list)."""
    devices = claim.spec.devices
    for i, req in enumerate((devices.requests if devices else None) or []):
        path = f"spec.devices.requests[{i}]"
        if req.exactly is not None:
            ex = req.exactly
            capacity = dict((ex.capacity.requests if ex.capacity else None) or {})
            yield [
                _Request(f"{path}.exactly", ex.device_class_name, bool(ex.admin_access), capacity)
            ]
        else:
            yield [
                _Request(
                    f"{path}.firstAvailable[{j}]",
                    sub.device_class_name,
                    False,
                    dict((sub.capacity.requests if sub.capacity else None) or {}),
                )
                for j, sub in enumerate(req.first_available or [])
            ]


def _access(state: ClusterState, namespace: str, req: _Request) -> Refusal | None:
    field = f"{req.path}.deviceClassName"
    if req.class_name not in state.classes:
        return refuse(
            "rejected", "unknown-class", field, f"DeviceClass {req.class_name!r} does not exist"
        )
    record = state.namespaces.get(namespace)
    if record is None:
        return refuse(
            "rejected",
            "class-access",
            field,
            f"namespace {namespace!r} has no access to any DeviceClass",
            "namespaces may use no class until an administrator grants access "
            "(admin endpoint namespaces.access)",
        )
    if "*" not in record.classes and req.class_name not in record.classes:
        allowed = ", ".join(sorted(record.classes)) or "none"
        return refuse(
            "rejected",
            "class-access",
            field,
            f"namespace {namespace!r} may not use DeviceClass {req.class_name!r}",
            f"it may use: {allowed}",
        )
    refused = _mode(state, req)
    if refused is not None:
        return refused
    if req.admin and not record.admin_access:
        return refuse(
            "rejected",
            "admin-access",
            f"{req.path}.adminAccess",
            f"adminAccess is not allowed in namespace {namespace!r}",
        )
    return None


def _mode(state: ClusterState, req: _Request) -> Refusal | None:
    """The class's mode: ``disabled`` takes nothing new, ``whole-device`` no capacity requests."""
    mode = state.classes[req.class_name].mode
    if mode == "disabled":
        return refuse(
            "rejected",
            "class-disabled",
            f"{req.path}.deviceClassName",
            f"DeviceClass {req.class_name!r} is disabled: it takes no new claims",
            "an administrator set its mode (dracap class set-mode)",
        )
    if mode == "whole-device" and req.capacity:
        return refuse(
            "rejected",
            "whole-device",
            f"{req.path}.capacity.requests",
            f"DeviceClass {req.class_name!r} is in whole-device mode: capacity requests need "
            "the DRAConsumableCapacity feature gate, which is off for this class",
            "remove the capacity requests to get a whole device, or ask for mode consumable",
        )
    return None


def _too_many_requests(
    claim: ResourceClaim, namespace: str, record: NamespaceState | None
) -> Refusal | None:
    limit = record.max_requests_per_claim if record is not None else None
    devices = claim.spec.devices
    count = len((devices.requests if devices else None) or [])
    if limit is None or count <= limit:
        return None
    return refuse(
        "rejected",
        "too-many-requests",
        "spec.devices.requests",
        f"must have at most {limit} requests in namespace {namespace!r}",
        f"got {count}; the namespace's max_requests_per_claim (annotation "
        f"{MAX_REQUESTS_PER_CLAIM}); the API allows {REQUESTS_MAX}",
    )


def _classes_by_reference(claim: ResourceClaim) -> dict[str, list[str]]:
    """The classes each name a config may list (``req`` or ``req/sub``) may use."""
    devices = claim.spec.devices
    out: dict[str, list[str]] = {}
    for req in (devices.requests if devices else None) or []:
        if req.exactly is not None:
            out[req.name] = [req.exactly.device_class_name]
            continue
        subs = req.first_available or []
        out[req.name] = [sub.device_class_name for sub in subs]
        for sub in subs:
            out[f"{req.name}/{sub.name}"] = [sub.device_class_name]
    return out


def _opaque_config(
    claim: ResourceClaim, namespace: str, record: NamespaceState | None
) -> Refusal | None:
    """Opaque configuration only for requests of classes the namespace may configure."""
    devices = claim.spec.devices
    configs = (devices.config if devices else None) or []
    if not configs:
        return None
    allowed = record.opaque_config_classes if record is not None else []
    by_reference = _classes_by_reference(claim)
    top_level = [r.name for r in (devices.requests if devices else None) or []]
    for i, config in enumerate(configs):
        for reference in config.requests or top_level:
            for class_name in by_reference.get(reference, []):
                if class_allowed(allowed, class_name):
                    continue
                return refuse(
                    "rejected",
                    "opaque-config",
                    f"spec.devices.config[{i}].opaque",
                    f"opaque driver configuration is not allowed for DeviceClass "
                    f"{class_name!r} in namespace {namespace!r}",
                    f"request {reference}; the namespace may configure: "
                    f"{', '.join(allowed) or 'no class'} (annotation {OPAQUE_CONFIG_CLASSES})",
                )
    return None


def quota_of(state: ClusterState, namespace: str) -> int | None:
    """The namespace's quota of live claims (``max_claims``); ``None``: it has none."""
    record = state.namespaces.get(namespace)
    return record.max_claims if record is not None else None


def _over_quota(
    state: ClusterState, namespace: str, name: str, admitting: Collection[str]
) -> Refusal | None:
    """The quota: live claims plus the ones being admitted, before this one."""
    limit = quota_of(state, namespace)
    if limit is None:
        return None
    pending = 0
    for other in admitting:
        claim = state.claim(namespace, other)
        if other != name and (claim is None or claim.phase in REUSABLE_PHASES):
            pending += 1
    held = state.live_claim_count(namespace) + pending
    if held < limit:
        return None
    return refuse(
        "rejected",
        "quota",
        "metadata.namespace",
        f"namespace {namespace!r} may hold at most {limit} live claims (quota {MAX_CLAIMS})",
        f"it holds {held}; delete one first",
    )


def _above_maximum(req: _Request, limits: DeviceLimits) -> Refusal | None:
    for name, amount in req.capacity.items():
        best = limits.largest(req.class_name, name)
        if best is None or amount <= best[0]:
            continue
        top, device = best
        return refuse(
            "rejected",
            "above-maximum",
            f"{req.path}.capacity.requests[{name}]",
            f"must be at most {top}, the largest {name} any device of class "
            f"{req.class_name} grants",
            f"requested {amount}; {top} on {device}",
        )
    return None


def evaluate(
    state: ClusterState,
    namespace: str,
    claim: ResourceClaim,
    gates: FeatureGates = DEFAULT_GATES,
    *,
    limits: DeviceLimits | None = None,
) -> Refusal | None:
    """The first admission rule ``claim`` breaks (from ``validation`` on), or ``None``."""
    try:
        validate_manifest(claim, gates)
    except ValidationError as exc:
        return refuse("invalid", "validation", exc.field, exc.rule)
    if claim.status is not None and claim.status != ResourceClaimStatus():
        return refuse("invalid", "status", "status", "must not be set: dracap writes it")
    record = state.namespaces.get(namespace)
    refused = _too_many_requests(claim, namespace, record)
    if refused is not None:
        return refused
    alternatives = list(_requests(claim))
    for options in alternatives:
        for req in options:
            refused = _access(state, namespace, req)
            if refused is not None:
                return refused
    refused = _opaque_config(claim, namespace, record)
    if refused is not None:
        return refused
    if any(o.capacity for options in alternatives for o in options):
        limits = limits or DeviceLimits(build_inventory(state, gates))
        for options in alternatives:
            refusals = [_above_maximum(req, limits) for req in options]
            if all(r is not None for r in refusals):
                return refusals[0]
    return None


def admit(
    state: ClusterState,
    namespace: str,
    claim: ResourceClaim,
    gates: FeatureGates = DEFAULT_GATES,
    *,
    limits: DeviceLimits | None = None,
) -> ClaimAdmitted | ClaimRejected:
    """The admission event for a claim read from ``namespace`` (rules: module docstring)."""
    return _verdict(namespace, claim, evaluate(state, namespace, claim, gates, limits=limits))


def _verdict(
    namespace: str, claim: ResourceClaim, refused: Refusal | None
) -> ClaimAdmitted | ClaimRejected:
    name = claim.metadata.name
    if refused is None:
        return ClaimAdmitted(namespace=namespace, name=name)
    return ClaimRejected(
        namespace=namespace,
        name=name,
        field=refused.field or "<claim>",
        rule=refused.rule or refused.kind,
        reason=refused.detail,
    )


def decide_apply(
    state: ClusterState,
    namespace: str,
    data: bytes,
    gates: FeatureGates = DEFAULT_GATES,
    *,
    limits: DeviceLimits | None = None,
    admitting: Collection[str] = (),
) -> ApplyDecision:
    """Everything ``claims.apply`` decides: read, check the name, admit (module docstring).

    ``admitting``: names of this namespace's claims the caller has admitted but not yet
    seen in ``state`` (appends in flight); the quota counts them.
    """
    claim = read_claim(data, namespace)
    if isinstance(claim, Refusal):
        return ApplyDecision(namespace=namespace, refusal=claim)
    name = claim.metadata.name
    current = state.claim(namespace, name)
    if current is not None and current.phase not in REUSABLE_PHASES:
        if current.spec is not None and current.spec.same_spec(claim_spec(claim)):
            return ApplyDecision(namespace=namespace, name=name, unchanged=True)
        refusal = refuse(
            "conflict",
            "name-conflict",
            "metadata.name",
            f"a claim named {name!r} already exists in namespace {namespace!r} "
            f"(phase {current.phase}) with a different spec",
            "a claim's spec cannot change; delete it first",
        )
        return ApplyDecision(namespace=namespace, name=name, refusal=refusal)
    over = _over_quota(state, namespace, name, admitting)
    if over is not None:
        return ApplyDecision(namespace=namespace, name=name, refusal=over)
    refused = evaluate(state, namespace, claim, gates, limits=limits)
    events: tuple[Event, ...] = (ClaimSubmitted(claim=claim), _verdict(namespace, claim, refused))
    return ApplyDecision(namespace=namespace, name=name, events=events, refusal=refused)


def selector_expressions(claim: ResourceClaim) -> list[str]:
    """Every CEL expression of the claim's requests and their alternatives."""
    devices = claim.spec.devices
    expressions: list[str] = []
    for request in (devices.requests if devices else None) or []:
        selector_lists = [request.exactly.selectors] if request.exactly is not None else []
        selector_lists += [sub.selectors for sub in request.first_available or []]
        for selectors in selector_lists:
            expressions += [s.cel.expression for s in selectors or [] if s.cel is not None]
    return expressions


def class_names(claim: ResourceClaim) -> tuple[str, ...]:
    """The DeviceClasses the claim's requests and their alternatives name, sorted."""
    return tuple(sorted({r.class_name for alts in _requests(claim) for r in alts}))
