"""The claims API's writes besides ``claims.apply``, as pure decisions. No I/O.

Each function takes the folded state and a request already decoded and checked for
shape, and says what to record and what to answer; the API
(:mod:`services.claims.api`) asks the live state for a fresh view, calls the decision,
appends its events and replies.

Admin writes (``deviceclasses.apply``, ``slices.apply``, ``namespaces.access``) are
last-writer-wins: their events carry no expected version (each goes to its object's
own stream, :func:`events.envelopes.stream_of`), and objects equal to what the log
already holds are skipped, so re-applying an inventory records nothing.

* :func:`decide_classes`: ``DeviceClassApplied`` (rollout ``immediate``) for every
  class that is new or differs; the last of two objects with one name wins.
* :func:`decide_slices`: ``ResourceSlicePublished`` likewise — unless a new total is
  below what live shares hold on its device (:func:`below_allocated`): then nothing is
  recorded and the request is ``rejected`` naming device, capacity, the total asked
  and the amount allocated. The same refusal answers the capacity ledger's CHECK when
  a reservation won the race (:data:`LEDGER_REFUSED` when the state read afterwards
  no longer shows why).
* :func:`decide_policy` (``policies.set``): ``RequestPolicyChanged`` for one device
  capacity under the device's next policy version (current + 1), when the policy
  differs from the one in force; a device or capacity the state does not hold is
  ``not_found`` naming the field (``device`` / ``capacity``), a policy that breaks a rule
  a ResourceSlice's would break is ``invalid`` naming the field (``policy.validRange.min``)
  and the rule. Shares granted earlier keep the version (and so the policy) they were
  granted under; claims decided afterwards use the new one.
* :func:`decide_mode` (``deviceclasses.mode``): ``ClassModeSet`` when the class's mode
  (``consumable``, ``whole-device``, ``disabled``) differs from the one in force; a class
  the state does not hold is ``not_found`` naming ``name``, a mode outside
  :data:`events.catalog.CLASS_MODES` is ``invalid`` naming ``mode``. Allocations made
  earlier are never touched: only claims decided afterwards follow the new mode.
* :func:`decide_remove` (``deviceclasses.remove``): ``DeviceClassRemoved`` for a class
  the state holds (``not_found`` otherwise). Claims already allocated keep running; new
  claims naming the class are refused by admission (``unknown-class``).
* :func:`decide_access`: ``NamespaceAccessSet`` when anything of the namespace's
  record changes (classes, adminAccess, opaque-config classes, quota, requests per
  claim: :class:`events.tenancy.NamespacePolicy`). The request is the whole record:
  what it leaves out gets its default.

Delete (``claims.delete``, a tenant write with the claim stream's expected version):
:func:`decide_delete` gives an allocated (or ready, or failed but still holding) claim
``ReleaseRequested(node=...)``; a claim without live shares ``ClaimWithdrawn``; a claim
already releasing, withdrawn or released is left alone and its phase is the answer (a
second delete, concurrent or late, finds the caller's wish done); only a claim that
never existed is not found.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Final, NamedTuple

import msgspec

from events.catalog import (
    CLASS_MODES,
    ENFORCEMENT_LEVELS,
    ClaimReserved,
    ClaimUnreserved,
    ClaimWithdrawn,
    ClassModeSet,
    DeviceClassApplied,
    DeviceClassRemoved,
    Event,
    NamespaceAccessSet,
    NodeFenced,
    ReleaseRequested,
    RequestPolicyChanged,
    ResourceSlicePublished,
)
from events.errors import ValidationError
from events.features import DEFAULT_GATES, FeatureGates
from events.fieldchecks import is_dns_subdomain
from events.model import (
    CapacityRequestPolicy,
    CapacityRequestPolicyRange,
    DeviceCapacity,
    DeviceClass,
    ResourceSlice,
)
from events.quantities import Quantity
from events.slicevalidation import validate_capacity_policy
from events.state import ClaimState, ClusterState
from services.claims.admission import Refusal, refuse

__all__ = [
    "DELETED_PHASES",
    "LEDGER_REFUSED",
    "AdminWrite",
    "ClassMode",
    "ClassRemoval",
    "ConsumerRef",
    "Deletion",
    "PolicyChange",
    "PolicyPatch",
    "access_classes",
    "below_allocated",
    "consumer_ref",
    "consumer_uid",
    "decide_access",
    "decide_classes",
    "decide_delete",
    "decide_mode",
    "decide_policy",
    "decide_remove",
    "decide_slices",
    "ledger_refusal",
]

#: A delete of a claim in these phases has nothing left to do: it answers the phase.
DELETED_PHASES: Final = frozenset({"releasing", "withdrawn", "released"})
_HOLDING_PHASES: Final = frozenset({"allocated", "retrying", "ready", "stalled", "failed"})
#: Phases a consumer may reserve a claim in (upstream: an allocated claim).
_RESERVABLE_PHASES: Final = frozenset({"allocated", "retrying", "ready", "stalled"})
#: Consumers one claim may have (upstream's ResourceClaimReservedForMaxSize).
MAX_RESERVED_FOR: Final = 256
CONSUMER_RULE: Final = "must be pod/<the claim's namespace>/<pod name>"


class AdminWrite(msgspec.Struct, frozen=True, kw_only=True):
    """What an admin write records (``events``) and answers (names, or ``refusal``)."""

    events: tuple[Event, ...] = ()
    applied: tuple[str, ...] = ()  #: objects recorded
    unchanged: tuple[str, ...] = ()  #: objects equal to the log's, sorted
    refusal: Refusal | None = None


class Deletion(msgspec.Struct, frozen=True, kw_only=True):
    """What a delete records (``event``, or ``None``) and the phase it answers."""

    found: bool
    event: Event | None = None
    phase: str | None = None  #: the claim's phase once the event is recorded


def decide_classes(state: ClusterState, classes: Sequence[DeviceClass]) -> AdminWrite:
    """Record the DeviceClasses that differ from the log's."""
    latest = {c.metadata.name: c for c in classes}
    changed = [
        c
        for name, c in latest.items()
        if name not in state.classes or state.classes[name].device_class != c
    ]
    names = [c.metadata.name for c in changed]
    return AdminWrite(
        events=tuple(DeviceClassApplied(device_class=c, rollout="immediate") for c in changed),
        applied=tuple(names),
        unchanged=tuple(sorted(set(latest) - set(names))),
    )


class ClassMode(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A ``deviceclasses.mode`` request: how new claims of class ``name`` are decided.

    ``min_enforcement``: the least enforcement level a node must offer for new shares of
    the class (``None``: keep the one in force).
    """

    name: str
    mode: str
    min_enforcement: str | None = None


class ClassRemoval(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A ``deviceclasses.remove`` request."""

    name: str


def decide_mode(
    state: ClusterState, name: str, mode: str, min_enforcement: str | None = None
) -> AdminWrite:
    """Record a DeviceClass's new mode (and minimum enforcement), when it differs."""
    if mode not in CLASS_MODES:
        rule = f"must be one of: {', '.join(CLASS_MODES)}"
        return AdminWrite(refusal=refuse("invalid", "invalid-mode", "mode", rule, f"got {mode!r}"))
    if min_enforcement is not None and min_enforcement not in ENFORCEMENT_LEVELS:
        rule = f"must be one of: {', '.join(ENFORCEMENT_LEVELS)}"
        return AdminWrite(
            refusal=refuse(
                "invalid",
                "invalid-enforcement",
                "min_enforcement",
                rule,
                f"got {min_enforcement!r}",
            )
        )
    current = state.classes.get(name)
    if current is None:
        return AdminWrite(refusal=_unknown_class(name))
    level = current.min_enforcement if min_enforcement is None else min_enforcement
    if current.mode == mode and current.min_enforcement == level:
        return AdminWrite(unchanged=(name,))
    event = ClassModeSet(name=name, mode=mode, min_enforcement=level)  # type: ignore[arg-type]
    return AdminWrite(events=(event,), applied=(name,))


def decide_remove(state: ClusterState, name: str) -> AdminWrite:
    """Remove a DeviceClass; existing claims of it keep their allocations."""
    if name not in state.classes:
        return AdminWrite(refusal=_unknown_class(name))
    return AdminWrite(events=(DeviceClassRemoved(name=name),), applied=(name,))


def _not_found(kind: str, field: str, rule: str, detail: str) -> Refusal:
    """A ``not_found`` refusal whose message reads ``field: detail``."""
    return Refusal(
        code="not_found",
        kind=kind,
        field=field,
        rule=rule,
        message=f"{field}: {detail}",
        detail=detail,
    )


def _unknown_class(name: str) -> Refusal:
    detail = f"DeviceClass {name!r} does not exist"
    return _not_found("unknown-class", "name", "must name an applied DeviceClass", detail)


def decide_slices(state: ClusterState, slices: Sequence[ResourceSlice]) -> AdminWrite:
    """Record the ResourceSlices that differ from the log's, unless one shrinks below use."""
    latest = {s.metadata.name: s for s in slices}
    changed = [s for name, s in latest.items() if state.slices.get(name) != s]
    refusal = below_allocated(state, changed)
    if refusal is not None:
        return AdminWrite(refusal=refusal)
    names = [s.metadata.name for s in changed]
    return AdminWrite(
        events=tuple(ResourceSlicePublished(slice=s) for s in changed),
        applied=tuple(names),
        unchanged=tuple(sorted(set(latest) - set(names))),
    )


def access_classes(classes: Sequence[str]) -> list[str]:
    """A class list as ``namespaces.access`` records it: sorted, each once."""
    return sorted(set(classes))


def decide_access(
    state: ClusterState,
    namespace: str,
    classes: Sequence[str],
    admin_access: bool,
    *,
    opaque_config_classes: Sequence[str] = (),
    max_claims: int | None = None,
    max_requests_per_claim: int | None = None,
) -> AdminWrite:
    """Record the namespace's whole record if anything of it changes."""
    event = NamespaceAccessSet(
        namespace=namespace,
        classes=access_classes(classes),
        admin_access=admin_access,
        opaque_config_classes=access_classes(opaque_config_classes),
        max_claims=max_claims,
        max_requests_per_claim=max_requests_per_claim,
    )
    current = state.namespaces.get(namespace)
    if current is not None and (
        current.classes,
        current.admin_access,
        current.opaque_config_classes,
        current.max_claims,
        current.max_requests_per_claim,
    ) == (
        event.classes,
        event.admin_access,
        event.opaque_config_classes,
        event.max_claims,
        event.max_requests_per_claim,
    ):
        return AdminWrite(unchanged=(namespace,))
    return AdminWrite(events=(event,), applied=(namespace,))


class PolicyPatch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The fields of a request policy to change (``dracap policy set`` without
    ``--replace``); the others stay as the policy in force has them.

    ``values`` replaces a ``validRange`` and ``min`` / ``step`` / ``max`` replace
    ``validValues`` (a policy has one or the other). A ``default`` not given is kept,
    except that one below a new ``min`` is raised to it (a default below the minimum is
    never valid), and one not among new ``values`` becomes the first of them.
    """

    default: Quantity | None = None
    min: Quantity | None = None
    step: Quantity | None = None
    max: Quantity | None = None
    values: list[Quantity] | None = None


class PolicyChange(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A ``policies.set`` request: the new request policy of one device capacity.

    ``policy`` has the shape of a ResourceSlice's ``requestPolicy`` and replaces the
    policy in force (``None`` removes it); ``patch``, instead, changes only the fields it
    gives (:class:`PolicyPatch`).
    """

    driver: str
    pool: str
    device: str
    capacity: str
    policy: CapacityRequestPolicy | None = None
    patch: PolicyPatch | None = None


def patched(
    current: CapacityRequestPolicy | None, patch: PolicyPatch
) -> CapacityRequestPolicy | Refusal:
    """``current`` with the fields of ``patch`` (see :class:`PolicyPatch`)."""
    ranged = (patch.min, patch.step, patch.max)
    if patch.values is not None and any(v is not None for v in ranged):
        return _bad_patch(
            "patch.values", "validValues and validRange (min, step, max) exclude each other"
        )
    old = current or CapacityRequestPolicy()
    default = patch.default if patch.default is not None else old.default
    if patch.values is not None:
        if not patch.values:
            return _bad_patch("patch.values", "must name at least one value")
        if default is None or default not in patch.values:
            default = patch.default if patch.default is not None else patch.values[0]
        return CapacityRequestPolicy(default=default, valid_values=list(patch.values))
    if any(v is not None for v in ranged):
        rng = old.valid_range
        low = patch.min if patch.min is not None else rng.min if rng is not None else None
        if low is None:
            return _bad_patch("patch.min", "the capacity has no validRange yet: give its min")
        step = patch.step if patch.step is not None else rng.step if rng is not None else None
        high = patch.max if patch.max is not None else rng.max if rng is not None else None
        if patch.default is None and (default is None or default < low):
            default = low
        return CapacityRequestPolicy(
            default=default, valid_range=CapacityRequestPolicyRange(min=low, step=step, max=high)
        )
    if patch.default is None:
        return _bad_patch("patch", "give at least one of default, min, step, max, values")
    return msgspec.structs.replace(old, default=patch.default)


def _bad_patch(field: str, rule: str) -> Refusal:
    return refuse("invalid", "invalid-policy", field, rule)


def decide_policy(
    state: ClusterState, change: PolicyChange, gates: FeatureGates = DEFAULT_GATES
) -> AdminWrite:
    """Record a capacity's new request policy under the device's next policy version."""
    where = f"{change.driver}/{change.pool}/{change.device}"
    dev = state.device(change.driver, change.pool, change.device)
    if dev is None or not dev.present:
        return AdminWrite(refusal=_unknown_device("device", f"no published device {where}"))
    total = dev.total.get(change.capacity)
    if total is None:
        known = ", ".join(sorted(dev.total)) or "none"
        detail = f"device {where} has no capacity {change.capacity!r} (it has: {known})"
        return AdminWrite(refusal=_unknown_device("capacity", detail))
    policy = change.policy
    if change.patch is not None:
        if change.policy is not None:
            return AdminWrite(refusal=_bad_patch("patch", "give policy or patch, not both"))
        merged = patched(dev.policies.get(change.capacity), change.patch)
        if isinstance(merged, Refusal):
            return AdminWrite(refusal=merged)
        policy = merged
    capacity = DeviceCapacity(value=total, request_policy=policy)
    try:
        validate_capacity_policy(
            f"device {where}", "capacity", capacity, dev.allow_multiple_allocations, gates
        )
    except ValidationError as exc:
        return AdminWrite(refusal=_invalid_policy(exc))
    name = f"{where}/{change.capacity}"
    if change.capacity in dev.policies and dev.policies[change.capacity] == policy:
        return AdminWrite(unchanged=(name,))
    event = RequestPolicyChanged(
        driver=change.driver,
        pool=change.pool,
        device=change.device,
        capacity=change.capacity,
        policy=policy,
        policy_version=dev.policy_version + 1,
    )
    return AdminWrite(events=(event,), applied=(name,))


def _unknown_device(field: str, detail: str) -> Refusal:
    rule = "must name a published device and one of its capacities"
    return _not_found("unknown-device", field, rule, detail)


def _invalid_policy(exc: ValidationError) -> Refusal:
    field = "policy" + exc.field.removeprefix("capacity.requestPolicy")
    return Refusal(
        code="invalid",
        kind="invalid-policy",
        field=field,
        rule=exc.rule,
        message=f"{exc.obj}: {field}: {exc.rule}",
    )


def decide_delete(state: ClusterState, namespace: str, name: str) -> Deletion:
    """Release an allocated claim, withdraw any other (see the module docstring)."""
    claim = state.claim(namespace, name)
    if claim is None:
        return Deletion(found=False)
    if claim.phase in DELETED_PHASES:
        return Deletion(found=True, phase=claim.phase)
    if claim.phase in _HOLDING_PHASES and _holds(state, claim):
        event: Event = ReleaseRequested(
            namespace=claim.namespace,
            name=claim.name,
            allocation_version=claim.allocation_version,
            node=claim.node,
        )
        return Deletion(found=True, event=event, phase="releasing")
    return Deletion(
        found=True,
        event=ClaimWithdrawn(namespace=claim.namespace, name=claim.name),
        phase="withdrawn",
    )


class Reservation(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A ``claims.reserve`` / ``claims.unreserve`` request: ``consumer`` is ``pod/NS/NAME``,
    ``uid`` the consumer's own ``metadata.uid`` when it has one."""

    name: str
    consumer: str
    uid: str | None = None


class ConsumerRef(NamedTuple):
    """A ``reservedFor`` entry as the log records it: ``pod/NS/NAME``, or
    ``pod/NS/NAME/UID`` when the consumer gave its uid."""

    resource: str
    namespace: str
    name: str
    uid: str | None

    @property
    def key(self) -> str:
        """Who the consumer is, whatever its uid: one reservation per key."""
        return f"{self.resource}/{self.namespace}/{self.name}"


def consumer_ref(consumer: str) -> ConsumerRef:
    """The parts of a recorded ``reservedFor`` entry (see :class:`ConsumerRef`)."""
    parts = consumer.split("/", 3)
    if len(parts) < 3:  # not written by dracap; shown as it is
        return ConsumerRef(parts[0], "", parts[-1], None)
    return ConsumerRef(parts[0], parts[1], parts[2], parts[3] if len(parts) == 4 else None)


#: The namespace of the uids :func:`consumer_uid` derives (uuid5).
_CONSUMER_UIDS: Final = uuid.UUID("7d1f3c52-5a0e-4e8b-9a43-2f1b6c7d8e90")


def consumer_uid(claim_namespace: str, claim_name: str, ref: ConsumerRef) -> str:
    """The ``reservedFor[].uid`` of ``ref``: its own, else one derived from the claim and the
    consumer's name (the same at every read; a consumer in standalone mode has no object
    of its own to take a uid from)."""
    if ref.uid:
        return ref.uid
    return str(uuid.uuid5(_CONSUMER_UIDS, f"{claim_namespace}/{claim_name}/{ref.key}"))


def decide_reservation(
    state: ClusterState, namespace: str, request: Reservation, *, reserve: bool
) -> AdminWrite:
    """Add ``request.consumer`` to the claim's ``reservedFor`` (or take it away).

    Upstream's rules: the consumer lives in the claim's namespace, the claim is allocated,
    at most 256 consumers. Reserving twice, or giving up a reservation not held, is
    answered unchanged. A consumer is one entry whatever its uid: a pod of that name with
    another uid is refused until the first gives the reservation up (upstream keys
    entries by uid; one name at a time is what a standalone consumer can be sure of).
    """
    kind, _, rest = request.consumer.partition("/")
    pod_ns, _, pod = rest.partition("/")
    if kind not in ("pod", "pods") or pod_ns != namespace or not is_dns_subdomain(pod):
        return AdminWrite(
            refusal=refuse(
                "invalid", "invalid-consumer", "for", CONSUMER_RULE, f"got {request.consumer!r}"
            )
        )
    uid = None
    if request.uid is not None:
        try:
            uid = str(uuid.UUID(request.uid))
        except ValueError:
            rule = "must be the consumer's metadata.uid, a UUID"
            return AdminWrite(
                refusal=refuse("invalid", "invalid-consumer", "uid", rule, f"got {request.uid!r}")
            )
    key = f"pod/{namespace}/{pod}"
    claim = state.claim(namespace, request.name)
    if claim is None:
        detail = f"claim {namespace}/{request.name} does not exist"
        rule = "must name a claim of the namespace"
        return AdminWrite(refusal=_not_found("unknown-claim", "name", rule, detail))
    held = next((c for c in claim.reserved_for if consumer_ref(c).key == key), None)
    event: Event
    if not reserve:
        if held is None:
            return AdminWrite(unchanged=(key,))
        event = ClaimUnreserved(namespace=namespace, name=request.name, consumer=held)
        return AdminWrite(events=(event,), applied=(key,))
    if claim.phase not in _RESERVABLE_PHASES:
        rule = "must be allocated to be reserved"
        detail = f"claim {namespace}/{request.name} is {claim.phase}"
        return AdminWrite(refusal=refuse("rejected", "not-allocated", "name", rule, detail))
    if held is not None:
        had = consumer_ref(held).uid
        if uid is None or had is None or had == uid:
            return AdminWrite(unchanged=(key,))
        rule = "one reservation per consumer name: the other pod must give it up first"
        detail = f"{key} holds it with uid {had}"
        return AdminWrite(refusal=refuse("rejected", "reserved-by-another", "uid", rule, detail))
    if len(claim.reserved_for) >= MAX_RESERVED_FOR:
        rule = f"at most {MAX_RESERVED_FOR} consumers may reserve a claim"
        return AdminWrite(
            refusal=refuse(
                "rejected", "reserved-for-full", "for", rule, f"{len(claim.reserved_for)} already"
            )
        )
    consumer = key if uid is None else f"{key}/{uid}"
    event = ClaimReserved(namespace=namespace, name=request.name, consumer=consumer)
    return AdminWrite(events=(event,), applied=(key,))


def _holds(state: ClusterState, claim: ClaimState) -> bool:
    """Whether a share of ``claim`` still holds capacity."""
    return any(state.shares[s].live for s in claim.share_ids if s in state.shares)


def below_allocated(state: ClusterState, slices: Sequence[ResourceSlice]) -> Refusal | None:
    """The first capacity of ``slices`` whose new total is below what ``state`` has allocated.

    Allocated is what live, non-admin shares consume (the capacity ledger's
    ``allocated``); a device the slices do not list keeps its total and is not checked.
    """
    for rslice in slices:
        spec = rslice.spec
        for i, device in enumerate(spec.devices or ()):
            current = state.device(spec.driver, spec.pool.name, device.name)
            if current is None:
                continue
            for name, capacity in sorted((device.capacity or {}).items()):
                allocated = current.consumed_nanos.get(name, 0)
                if allocated > capacity.value.nanos:
                    held = Quantity(allocated, capacity.value.format)
                    return _below_allocated(rslice, i, name, capacity.value, held)
    return None


def ledger_refusal(state: ClusterState, write: AdminWrite) -> Refusal:
    """The answer when the capacity ledger refused ``write``, from the state read after it."""
    slices = [e.slice for e in write.events if isinstance(e, ResourceSlicePublished)]
    return below_allocated(state, slices) or LEDGER_REFUSED


def _below_allocated(
    rslice: ResourceSlice, index: int, capacity: str, asked: Quantity, held: Quantity
) -> Refusal:
    spec = rslice.spec
    device = f"{spec.driver}/{spec.pool.name}/{(spec.devices or [])[index].name}"
    field = f"spec.devices[{index}].capacity[{capacity}].value"
    rule = "must not be below what live shares hold on the device"
    detail = (
        f"device {device} {capacity}: total {asked} asked, {held} allocated; "
        "release or move the shares first"
    )
    return Refusal(
        code="rejected",
        kind="below-allocated",
        field=field,
        rule=rule,
        message=f"ResourceSlice {rslice.metadata.name}: {field}: {rule} ({detail})",
        detail=detail,
    )


#: The ledger refused new totals, yet the state read afterwards shows no device below
#: them (the reservation was released again in between): the same rejection, unnamed.
LEDGER_REFUSED: Final = Refusal(
    code="rejected",
    kind="below-allocated",
    field=None,
    rule="a new total must not be below what live shares hold on the device",
    message="the capacity ledger refused the new totals: a device would hold less than "
    "its live shares were allocated; read the devices and retry",
)


class NodeFence(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A ``nodes.fence`` request: declare ``node`` off, for ``reason``."""

    node: str
    reason: str


#: Longest fence reason recorded (it travels in the log and in every claim it fails).
MAX_FENCE_REASON: Final = 500


def decide_fence(state: ClusterState, request: NodeFence) -> AdminWrite:
    """Fence a node at its current epoch: its live shares are released with the event.

    Refused for a node the log has never seen (no lease, no share), for an empty or
    overlong reason, and answered unchanged for a node already fenced at its current
    epoch. The event's epoch is the newest the node had (its lease, or the one that
    expired), so every append of that epoch or an older one is refused from then on.
    """
    reason = request.reason.strip()
    if not reason or len(reason) > MAX_FENCE_REASON:
        rule = f"must say why, in 1 to {MAX_FENCE_REASON} characters"
        return AdminWrite(
            refusal=refuse(
                "invalid", "invalid-reason", "reason", rule, f"got {len(reason)} characters"
            )
        )
    node = state.nodes.get(request.node)
    if node is None:
        detail = f"node {request.node!r} never held a lease nor a share"
        rule = "must name a node the log knows"
        return AdminWrite(refusal=_not_found("unknown-node", "node", rule, detail))
    epoch = max(node.lease_epoch, node.fenced_epoch)
    if node.lease == "fenced" and node.fenced_epoch == epoch:
        return AdminWrite(unchanged=(request.node,))
    event = NodeFenced(node=request.node, epoch=epoch, reason=reason)
    return AdminWrite(events=(event,), applied=(request.node,))
