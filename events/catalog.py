"""The event catalog: every fact dracap can record, as one closed tagged union.

"What can happen" lives in this file. Every event is a frozen, keyword-only
``msgspec.Struct`` with an explicit tag string in the ``"type"`` field, and
:data:`Event` is the union of all of them. Events travel inside an
:class:`~events.envelopes.Envelope` that carries the bookkeeping (stream, version,
global position, actor, correlation) the fold and the store need but the decision logic
does not (:mod:`events.envelopes`, with each event's stream). How an event is written
as JSON and read back, strictly or tolerantly and through the upcasters, is
:mod:`events.eventcodec`.

Evolution rules (the log is never rewritten)
--------------------------------------------
1. Adding a field is allowed only with a default. Old payloads decode unchanged
   and :data:`SCHEMA_VERSIONS` does not move.
2. A field is never renamed, retyped or given new meaning. Such a change is a
   *breaking* change: the event's schema version goes up by one (its class
   attribute ``SCHEMA_VERSION`` and :data:`SCHEMA_VERSIONS`), and an upcaster
   ``(tag, old_version) -> payload of old_version + 1`` is registered in
   :data:`~events.eventcodec.UPCASTERS`. Reading applies the chain of upcasters; stored rows keep
   the version they were written with, forever.
3. Upcasters are pure and deterministic (no clock, no randomness, no state):
   replaying the same log must give the same state on every machine.
4. A tag is never reused for a different event; a removed event keeps its tag
   reserved, and its class stays here as long as the log may contain it.
5. A payload whose version is newer than this code knows is an error, not a
   guess.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Mapping
from typing import ClassVar, Final, Literal, TypeAlias

import msgspec

from events.model import (
    AllocationResult,
    CapacityRequestPolicy,
    DeviceClass,
    ResourceClaim,
    ResourceSlice,
)
from events.quantities import Quantity

__all__ = [
    "CLASS_MODES",
    "ENFORCEMENT_LEVELS",
    "EVENT_TYPES",
    "POLICY_VERSION_UNRECORDED",
    "SCHEMA_VERSIONS",
    "SHARE_ID_NAMESPACE",
    "AllocationBound",
    "AppendRefused",
    "CapacityReleased",
    "CapacityReserved",
    "ClaimAdmitted",
    "ClaimRejected",
    "ClaimReserved",
    "ClaimStalled",
    "ClaimSubmitted",
    "ClaimUnreserved",
    "ClaimUnschedulable",
    "ClaimWithdrawn",
    "ClassMode",
    "ClassModeSet",
    "DeviceClassApplied",
    "DeviceClassRemoved",
    "DeviceHealthChanged",
    "EnforcementCheckpointSetAside",
    "EnforcementLevel",
    "EnforcementReconciled",
    "Event",
    "LimitApplied",
    "LimitFailed",
    "LimitRemoved",
    "MessageDeadLettered",
    "NamespaceAccessSet",
    "NodeFenced",
    "NodeLeaseAcquired",
    "NodeLeaseExpired",
    "ReleaseRequested",
    "RequestPolicyChanged",
    "ResourceSlicePublished",
    "ResourceSliceWithdrawn",
    "ShareConfirmed",
    "ShareMarkedUnknown",
    "ShareUsed",
    "schema_version_of",
    "tag_of",
]

Rollout: TypeAlias = Literal["immediate", "new-claims-only"]
#: How new claims of a DeviceClass are decided (``ClassModeSet``; default consumable).
ClassMode: TypeAlias = Literal["consumable", "whole-device", "disabled"]
CLASS_MODES: Final[tuple[ClassMode, ...]] = ("consumable", "whole-device", "disabled")
EnforcementLevel: TypeAlias = Literal["hard", "soft", "none"]
#: Enforcement levels from the weakest up (a class's minimum compares by this order).
ENFORCEMENT_LEVELS: Final[tuple[EnforcementLevel, ...]] = ("none", "soft", "hard")

#: ``policy_version`` of a reservation written before versions were recorded.
POLICY_VERSION_UNRECORDED: Final = 0

#: Namespace of the UUIDv5 share ids that upcasters derive for old dedicated results.
SHARE_ID_NAMESPACE: Final = uuid.UUID("6f1c7a52-4d0b-5d6e-9a51-2c3b8e0f7d14")


class _EventBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", gc=False):
    """Common configuration of every event: frozen, keyword-only, tagged by ``type``."""

    SCHEMA_VERSION: ClassVar[int] = 1


# --- inventory ----------------------------------------------------------------------------


class DeviceClassApplied(
    _EventBase, frozen=True, kw_only=True, tag="inventory.device_class_applied"
):
    """A DeviceClass was created or updated."""

    device_class: DeviceClass
    rollout: Rollout


class DeviceClassRemoved(
    _EventBase, frozen=True, kw_only=True, tag="inventory.device_class_removed"
):
    """A DeviceClass was deleted: new claims naming it are refused, existing ones keep
    their allocations."""

    name: str


class ClassModeSet(_EventBase, frozen=True, kw_only=True, tag="inventory.class_mode_set"):
    """An administrator set how new claims of a DeviceClass are decided.

    ``consumable``: shares (the default); ``whole-device``: one claim per device, as
    with the DRAConsumableCapacity gate off for this class; ``disabled``: no new claims.
    ``min_enforcement``: the least enforcement level a node's agent must offer for a new
    share of the class to be placed there (added later; default ``none``: any node).
    Allocations made earlier are never changed.
    """

    name: str
    mode: ClassMode
    min_enforcement: EnforcementLevel = "none"


class ResourceSlicePublished(
    _EventBase, frozen=True, kw_only=True, tag="inventory.resource_slice_published"
):
    """A node agent (or operator) published or replaced a ResourceSlice."""

    slice: ResourceSlice


class ResourceSliceWithdrawn(
    _EventBase, frozen=True, kw_only=True, tag="inventory.resource_slice_withdrawn"
):
    """A ResourceSlice was deleted; its devices are no longer allocatable."""

    name: str


class RequestPolicyChanged(
    _EventBase, frozen=True, kw_only=True, tag="inventory.request_policy_changed"
):
    """The request policy of one device capacity changed (``None`` removes it).

    ``policy_version`` comes from the device's single policy sequence and must be
    greater than the device's current ``policy_version`` in the fold.
    """

    driver: str
    pool: str
    device: str
    capacity: str
    policy: CapacityRequestPolicy | None
    policy_version: int


# --- claims -------------------------------------------------------------------------------


class ClaimSubmitted(_EventBase, frozen=True, kw_only=True, tag="claims.submitted"):
    """A tenant submitted (or resubmitted) a ResourceClaim.

    ``source`` says who allocates it: ``dracap`` (the reservation service, standalone)
    or ``kubernetes`` (kube-scheduler allocated it; the Kubernetes bridge mirrored the
    claim, with its ``metadata.uid`` and ``status.allocation``, into the log, and its
    limits are applied when the kubelet prepares it).
    """

    claim: ResourceClaim
    source: Literal["dracap", "kubernetes"] = "dracap"


class ClaimAdmitted(_EventBase, frozen=True, kw_only=True, tag="claims.admitted"):
    """Admission accepted the claim; it may now be allocated."""

    namespace: str
    name: str


class ClaimRejected(_EventBase, frozen=True, kw_only=True, tag="claims.rejected"):
    """Admission refused the claim; ``field``/``rule`` say why.

    ``reason`` adds what the rule alone does not say (the amounts, what the namespace
    may use); empty when nothing. (Events recorded before that held the whole message,
    field and rule included; :attr:`summary` shows them as they were.)
    """

    namespace: str
    name: str
    field: str
    rule: str
    reason: str

    @property
    def summary(self) -> str:
        """The claim's reason as the fold and the projections record it."""
        return f"{self.field}: {self.rule}" + (f": {self.reason}" if self.reason else "")


# --- reservation --------------------------------------------------------------------------


class CapacityReserved(_EventBase, frozen=True, kw_only=True, tag="reservation.capacity_reserved"):
    """Capacity of one device was reserved for one request result of a claim.

    Written on the device stream; ``share_id`` is always set (also for dedicated
    devices); ``shared`` says whether the device allows multiple allocations;
    admin shares never count as consumption. ``policy_version`` is the device's
    policy version the allocator decided under.
    """

    SCHEMA_VERSION: ClassVar[int] = 2

    namespace: str
    name: str
    allocation_version: int
    request: str
    driver: str
    pool: str
    device: str
    node: str | None
    share_id: str
    shared: bool
    admin_access: bool
    consumed: dict[str, Quantity]
    policy_version: int


class ClaimUnschedulable(
    _EventBase, frozen=True, kw_only=True, tag="reservation.claim_unschedulable"
):
    """No allocation fits the claim now; it waits for inventory or releases."""

    namespace: str
    name: str
    reason: str


class AllocationBound(_EventBase, frozen=True, kw_only=True, tag="reservation.allocation_bound"):
    """All reservations of an allocation are in place; the claim is allocated."""

    namespace: str
    name: str
    allocation_version: int
    node: str | None
    allocation: AllocationResult
    share_ids: list[str]


# --- enforcement --------------------------------------------------------------------------


class LimitApplied(_EventBase, frozen=True, kw_only=True, tag="enforcement.limit_applied"):
    """The node agent applied (and verified) the limit of a share."""

    share_id: str
    node: str
    level: EnforcementLevel
    actual: dict[str, Quantity]


class LimitFailed(_EventBase, frozen=True, kw_only=True, tag="enforcement.limit_failed"):
    """The node agent could not apply the limit of a share.

    A retryable failure says when the agent tries again (``retry_at``), since when the
    share has been failing (``failing_since``) and which try this was (``attempt``,
    from 1); the claim is ``retrying`` until a try succeeds or the class's retry window
    runs out (then a final ``retryable=False``). The three were added later (defaults:
    none, none, 0).
    """

    share_id: str
    node: str
    retryable: bool
    reason: str
    retry_at: datetime.datetime | None = None
    failing_since: datetime.datetime | None = None
    attempt: int = 0


class LimitRemoved(_EventBase, frozen=True, kw_only=True, tag="enforcement.limit_removed"):
    """The node agent removed the limit of a share (it no longer runs)."""

    share_id: str
    node: str


class EnforcementReconciled(_EventBase, frozen=True, kw_only=True, tag="enforcement.reconciled"):
    """The node agent, starting, made the node's limits match the log (ShareIDs per outcome).

    ``reapplied``: ready shares whose limit was missing (or different) and was put back;
    ``removed_orphans``: limits in force that no live share of the node owns, removed;
    ``kept``: shares whose limit was already in force, left untouched; ``failed``: ready
    shares whose limit could not be put back (the reason is in the agent's log).
    """

    node: str
    reapplied: list[str] = []
    removed_orphans: list[str] = []
    kept: list[str] = []
    failed: list[str] = []


class DeviceHealthChanged(
    _EventBase, frozen=True, kw_only=True, tag="reclamation.device_health_changed"
):
    """The node agent found a device of its node failing, or well again.

    ``reason`` says what failed (the enforcer's read-back, discovery no longer finding
    the device); an unhealthy device takes no new share, and the claims holding shares
    on it show the condition. Tagged in the ``reclamation`` category, whose events wake
    the reservation service: a device well again may serve waiting claims.
    """

    node: str
    driver: str
    pool: str
    device: str
    healthy: bool
    reason: str = ""


class ShareUsed(_EventBase, frozen=True, kw_only=True, tag="enforcement.share_used"):
    """The node agent saw the share in use (``evidence``: traffic through its tc class):
    its claim has started. Reported once per share."""

    share_id: str
    node: str
    evidence: str


class EnforcementCheckpointSetAside(
    _EventBase, frozen=True, kw_only=True, tag="enforcement.checkpoint_set_aside"
):
    """The node agent could not use its checkpoint file and rebuilt it from kernel and log.

    ``reason``: ``unreadable``, ``corrupt``, ``checksum-mismatch`` or ``foreign-version``;
    ``moved_to``: where the file was moved (``None``: it could not be moved).
    """

    node: str
    path: str
    reason: str
    detail: str = ""
    moved_to: str | None = None


# --- reclamation --------------------------------------------------------------------------


class ReleaseRequested(_EventBase, frozen=True, kw_only=True, tag="reclamation.release_requested"):
    """The claim's allocation ``allocation_version`` is to be released.

    ``reason``: why, when it is not the tenant's delete (a claim not started in time);
    added later (default empty).
    """

    namespace: str
    name: str
    allocation_version: int
    node: str | None = None  # where the allocation lives, so that agent's subject carries it
    reason: str = ""


class ClaimStalled(_EventBase, frozen=True, kw_only=True, tag="reclamation.claim_stalled"):
    """A Ready claim was not used within its class's timeout and its class says: keep it,
    show it. It holds its capacity; a consumer's reservation or seen use makes it Ready."""

    namespace: str
    name: str
    allocation_version: int
    reason: str


class CapacityReleased(_EventBase, frozen=True, kw_only=True, tag="reclamation.capacity_released"):
    """The capacity of a share was given back (device stream); idempotent by version."""

    share_id: str
    driver: str
    pool: str
    device: str
    allocation_version: int
    consumed: dict[str, Quantity]
    admin_access: bool


class NodeLeaseAcquired(
    _EventBase, frozen=True, kw_only=True, tag="reclamation.node_lease_acquired"
):
    """A node agent took a new lease of its node, numbered ``epoch``, during ``boot_id``.

    ``epoch`` is one more than any lease or fence of the node before (the store's guard
    refuses anything else); ``boot_id`` is the node's kernel boot id (or what the agent
    was told to use); ``ttl_ms`` is how long a renewal keeps the lease; ``enforcement``
    the level its enforcer offers (a class's minimum is checked against it).
    """

    node: str
    epoch: int
    boot_id: str
    ttl_ms: int
    enforcement: EnforcementLevel = "none"


class NodeLeaseExpired(_EventBase, frozen=True, kw_only=True, tag="reclamation.node_lease_expired"):
    """The node agent's lease of ``epoch`` expired; its shares become unknown."""

    node: str
    epoch: int


class ShareMarkedUnknown(
    _EventBase, frozen=True, kw_only=True, tag="reclamation.share_marked_unknown"
):
    """One share's state is unknown (its agent stopped reporting)."""

    share_id: str
    node: str


class NodeFenced(_EventBase, frozen=True, kw_only=True, tag="reclamation.node_fenced"):
    """The node was fenced at ``epoch``: nothing of it runs; its shares are released.

    ``reason``: what the operator (or the fence hook) said; added later (default empty).
    """

    node: str
    epoch: int
    reason: str = ""


class ShareConfirmed(_EventBase, frozen=True, kw_only=True, tag="reclamation.share_confirmed"):
    """The node agent came back and confirmed an unknown share still runs."""

    share_id: str
    node: str


class AppendRefused(_EventBase, frozen=True, kw_only=True, tag="reclamation.append_refused"):
    """The event store refused an append of a node agent whose lease ``epoch`` is stale.

    Written by the store itself (``dracap_append_guarded``, migration 0007) instead of
    the refused events, under the same lock, so the refusal is in the log exactly once.
    ``current_epoch``: the node's lease epoch at that moment; ``types``: the tags of the
    events that were refused.
    """

    node: str
    epoch: int
    current_epoch: int
    types: list[str] = []


# --- administration and operations -------------------------------------------------------


class NamespaceAccessSet(_EventBase, frozen=True, kw_only=True, tag="admin.namespace_access_set"):
    """What a namespace may do; the whole record, replacing the one before.

    ``classes``: the DeviceClasses it may use (``"*"``: all); ``admin_access``: whether
    adminAccess; ``opaque_config_classes``: the classes whose requests may carry opaque
    driver configuration (``"*"``: all); ``max_claims``: live claims at once (``None``:
    no quota); ``max_requests_per_claim``: requests per claim (``None``: upstream's 32).
    The last three were added later (defaults: none, no quota, 32).
    """

    namespace: str
    classes: list[str]
    admin_access: bool = False
    opaque_config_classes: list[str] = []
    max_claims: int | None = None
    max_requests_per_claim: int | None = None


class ClaimReserved(_EventBase, frozen=True, kw_only=True, tag="claims.reserved"):
    """A consumer (``pod/<namespace>/<name>``) reserved the claim: ``status.reservedFor``."""

    namespace: str
    name: str
    consumer: str


class ClaimUnreserved(_EventBase, frozen=True, kw_only=True, tag="claims.unreserved"):
    """A consumer gave its reservation of the claim up."""

    namespace: str
    name: str
    consumer: str


class ClaimWithdrawn(_EventBase, frozen=True, kw_only=True, tag="claims.withdrawn"):
    """A claim without a live allocation was deleted by its tenant."""

    namespace: str
    name: str


class MessageDeadLettered(
    _EventBase, frozen=True, kw_only=True, tag="runtime.message_dead_lettered"
):
    """A consumer gave up on a message after its maximum deliveries."""

    consumer: str
    event_id: str
    position: int
    deliveries: int
    reason: str


Event: TypeAlias = (
    DeviceClassApplied
    | DeviceClassRemoved
    | ClassModeSet
    | ResourceSlicePublished
    | ResourceSliceWithdrawn
    | RequestPolicyChanged
    | ClaimSubmitted
    | ClaimAdmitted
    | ClaimRejected
    | CapacityReserved
    | ClaimUnschedulable
    | AllocationBound
    | LimitApplied
    | LimitFailed
    | LimitRemoved
    | EnforcementReconciled
    | EnforcementCheckpointSetAside
    | DeviceHealthChanged
    | ShareUsed
    | ReleaseRequested
    | ClaimStalled
    | CapacityReleased
    | NodeLeaseAcquired
    | NodeLeaseExpired
    | ShareMarkedUnknown
    | NodeFenced
    | ShareConfirmed
    | AppendRefused
    | NamespaceAccessSet
    | ClaimReserved
    | ClaimUnreserved
    | ClaimWithdrawn
    | MessageDeadLettered
)

_EVENT_CLASSES: Final[tuple[type[Event], ...]] = (
    DeviceClassApplied,
    DeviceClassRemoved,
    ClassModeSet,
    ResourceSlicePublished,
    ResourceSliceWithdrawn,
    RequestPolicyChanged,
    ClaimSubmitted,
    ClaimAdmitted,
    ClaimRejected,
    CapacityReserved,
    ClaimUnschedulable,
    AllocationBound,
    LimitApplied,
    LimitFailed,
    LimitRemoved,
    EnforcementReconciled,
    EnforcementCheckpointSetAside,
    DeviceHealthChanged,
    ShareUsed,
    ReleaseRequested,
    ClaimStalled,
    CapacityReleased,
    NodeLeaseAcquired,
    NodeLeaseExpired,
    ShareMarkedUnknown,
    NodeFenced,
    ShareConfirmed,
    AppendRefused,
    NamespaceAccessSet,
    ClaimReserved,
    ClaimUnreserved,
    ClaimWithdrawn,
    MessageDeadLettered,
)


def _tag(cls: type[Event]) -> str:
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


#: Event class by tag.
EVENT_TYPES: Final[Mapping[str, type[Event]]] = {_tag(c): c for c in _EVENT_CLASSES}
#: Current schema version by tag.
SCHEMA_VERSIONS: Final[Mapping[str, int]] = {_tag(c): c.SCHEMA_VERSION for c in _EVENT_CLASSES}
_TAG_BY_CLASS: Final[Mapping[type, str]] = {c: _tag(c) for c in _EVENT_CLASSES}


def tag_of(event: Event) -> str:
    """The tag string (``"type"``) of ``event``."""
    return _TAG_BY_CLASS[type(event)]


def schema_version_of(event: Event) -> int:
    """The schema version this code writes ``event`` with."""
    return type(event).SCHEMA_VERSION
