"""What each event means, said once: typed transitions that consumers dispatch on.

An event says what happened (``reclamation.node_fenced`` at epoch 7); a consumer wants
to know what changed for it (every share of the node is released, the node is off).
Before this module each consumer (audit, billing, the SLO tracker, ...) worked that out
with its own ``isinstance`` chain, and the copies drifted. :func:`meaning` is the one
place: the table :data:`MEANINGS` maps each event class to a function returning the
event's transitions, in order. A consumer matches on the transition types it cares
about (``match t: case ShareHeld(): ...``) and ignores the rest, so a new event is one
row of the table (and the fold); a consumer changes only for a new *kind* of change.

The transitions are frozen :mod:`msgspec` Structs, built from the event's own fields;
:func:`meaning` is pure and cheap (one dict lookup and one small Struct per transition).

One staleness rule: an expiry or a fence of a node whose epoch is older than the node's
newest lease or fence changes nothing (:func:`stale`). The fold, audit and billing all
ask it, through :class:`NodeEpochs` where they keep a node's epochs themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias, TypeVar

import msgspec

from events.catalog import (
    AllocationBound,
    AppendRefused,
    CapacityReleased,
    CapacityReserved,
    ClaimAdmitted,
    ClaimRejected,
    ClaimReserved,
    ClaimStalled,
    ClaimSubmitted,
    ClaimUnreserved,
    ClaimUnschedulable,
    ClaimWithdrawn,
    ClassModeSet,
    DeviceClassApplied,
    DeviceClassRemoved,
    DeviceHealthChanged,
    EnforcementCheckpointSetAside,
    EnforcementReconciled,
    Event,
    LimitApplied,
    LimitFailed,
    LimitRemoved,
    MessageDeadLettered,
    NamespaceAccessSet,
    NodeFenced,
    NodeLeaseAcquired,
    NodeLeaseExpired,
    ReleaseRequested,
    RequestPolicyChanged,
    ResourceSlicePublished,
    ResourceSliceWithdrawn,
    ShareConfirmed,
    ShareMarkedUnknown,
    ShareUsed,
)
from events.quantities import Quantity

if TYPE_CHECKING:
    from events.state import ClusterState

__all__ = [
    "INVENTORY_CHANGES",
    "KINDS",
    "MEANINGS",
    "AccessChanged",
    "ClaimBound",
    "ClaimDecided",
    "ClaimEntered",
    "ClaimReleasing",
    "ClassDefined",
    "ClassModeChanged",
    "ClassRemoved",
    "DeviceHealth",
    "LimitsRemoved",
    "LimitsSettled",
    "MessageDropped",
    "NodeEpochs",
    "NodeFencedOff",
    "NodeLost",
    "NodeOutcome",
    "NodeReturned",
    "PolicyChanged",
    "ShareHeld",
    "ShareKnownAgain",
    "ShareReleased",
    "ShareUnknown",
    "SliceChanged",
    "Transition",
    "counted",
    "events_meaning",
    "first",
    "meaning",
    "stale",
]

_K = TypeVar("_K")

Outcome: TypeAlias = Literal["admitted", "rejected", "unschedulable", "withdrawn"]


class _T(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Common configuration of every transition."""


# --- claims -------------------------------------------------------------------------------


class ClaimEntered(_T, frozen=True, kw_only=True):
    """A claim was submitted (or resubmitted): it waits for a decision."""

    namespace: str
    name: str


class ClaimDecided(_T, frozen=True, kw_only=True):
    """A claim was decided: admitted, rejected, unschedulable (for now) or withdrawn."""

    namespace: str
    name: str
    outcome: Outcome


class ClaimBound(_T, frozen=True, kw_only=True):
    """Every share of the claim's allocation is in place: the claim is allocated."""

    namespace: str
    name: str
    node: str | None
    share_ids: tuple[str, ...]


class ClaimReleasing(_T, frozen=True, kw_only=True):
    """A claim's release was asked: the agent of ``node`` removes its limits, then its
    shares give their capacity back."""

    namespace: str
    name: str
    node: str | None


# --- shares -------------------------------------------------------------------------------


class ShareHeld(_T, frozen=True, kw_only=True):
    """A share of a device was reserved for one request of a claim (with its amounts)."""

    share_id: str
    namespace: str
    claim: str
    request: str
    driver: str
    pool: str
    device: str
    node: str | None
    amounts: Mapping[str, Quantity]
    admin: bool
    policy_version: int


class ShareReleased(_T, frozen=True, kw_only=True):
    """The share's capacity was given back."""

    share_id: str


class ShareUnknown(_T, frozen=True, kw_only=True):
    """One share's state is unknown (its agent stopped reporting)."""

    share_id: str
    node: str


class ShareKnownAgain(_T, frozen=True, kw_only=True):
    """An unknown share was confirmed running by its agent."""

    share_id: str
    node: str


class LimitsSettled(_T, frozen=True, kw_only=True):
    """The agent's attempt at a share's limit ended: applied, or failed (maybe to retry)."""

    share_id: str
    node: str
    applied: bool
    retryable: bool = False


class LimitsRemoved(_T, frozen=True, kw_only=True):
    """The agent removed a share's limit."""

    share_id: str
    node: str


# --- nodes and devices --------------------------------------------------------------------


class NodeReturned(_T, frozen=True, kw_only=True):
    """An agent took a new lease of its node, numbered ``epoch``."""

    node: str
    epoch: int


class NodeLost(_T, frozen=True, kw_only=True):
    """The node's lease of ``epoch`` expired: its held shares become unknown (unless stale)."""

    node: str
    epoch: int


class NodeFencedOff(_T, frozen=True, kw_only=True):
    """The node was fenced at ``epoch``: its shares are released (unless stale)."""

    node: str
    epoch: int


class DeviceHealth(_T, frozen=True, kw_only=True):
    """A device of a node became unhealthy, or well again."""

    node: str
    driver: str
    pool: str
    device: str
    healthy: bool


# --- classes and the runtime --------------------------------------------------------------


class ClassDefined(_T, frozen=True, kw_only=True):
    """A DeviceClass was applied (new, or changed)."""

    name: str


class ClassRemoved(_T, frozen=True, kw_only=True):
    """A DeviceClass was deleted."""

    name: str


class ClassModeChanged(_T, frozen=True, kw_only=True):
    """A DeviceClass's mode (consumable, whole-device, disabled) or enforcement floor was set."""

    name: str


class SliceChanged(_T, frozen=True, kw_only=True):
    """A ResourceSlice was published (new, or changed) or withdrawn."""

    name: str
    withdrawn: bool


class PolicyChanged(_T, frozen=True, kw_only=True):
    """A device capacity's request policy changed; ``policy_version`` is its new version."""

    driver: str
    pool: str
    device: str
    capacity: str
    policy_version: int


class AccessChanged(_T, frozen=True, kw_only=True):
    """What a namespace may use (classes, adminAccess, quotas) was set."""

    namespace: str


class MessageDropped(_T, frozen=True, kw_only=True):
    """A consumer gave a message up after its maximum deliveries."""

    consumer: str
    event_id: str


Transition: TypeAlias = (
    ClaimEntered
    | ClaimDecided
    | ClaimBound
    | ClaimReleasing
    | ShareHeld
    | ShareReleased
    | ShareUnknown
    | ShareKnownAgain
    | LimitsSettled
    | LimitsRemoved
    | NodeReturned
    | NodeLost
    | NodeFencedOff
    | DeviceHealth
    | ClassDefined
    | ClassRemoved
    | ClassModeChanged
    | SliceChanged
    | PolicyChanged
    | AccessChanged
    | MessageDropped
)

NodeChange: TypeAlias = NodeReturned | NodeLost | NodeFencedOff


# --- the table ----------------------------------------------------------------------------


def _submitted(ev: ClaimSubmitted) -> tuple[Transition, ...]:
    return (ClaimEntered(namespace=ev.claim.metadata.namespace or "", name=ev.claim.metadata.name),)


def _decided(outcome: Outcome) -> Callable[[Any], tuple[Transition, ...]]:
    def decided(ev: Any) -> tuple[Transition, ...]:
        return (ClaimDecided(namespace=ev.namespace, name=ev.name, outcome=outcome),)

    return decided


def _reserved(ev: CapacityReserved) -> tuple[Transition, ...]:
    return (
        ShareHeld(
            share_id=ev.share_id,
            namespace=ev.namespace,
            claim=ev.name,
            request=ev.request,
            driver=ev.driver,
            pool=ev.pool,
            device=ev.device,
            node=ev.node,
            amounts=ev.consumed,
            admin=ev.admin_access,
            policy_version=ev.policy_version,
        ),
    )


def _bound(ev: AllocationBound) -> tuple[Transition, ...]:
    return (
        ClaimBound(
            namespace=ev.namespace, name=ev.name, node=ev.node, share_ids=tuple(ev.share_ids)
        ),
    )


def _applied(ev: LimitApplied) -> tuple[Transition, ...]:
    return (LimitsSettled(share_id=ev.share_id, node=ev.node, applied=True),)


def _failed(ev: LimitFailed) -> tuple[Transition, ...]:
    return (
        LimitsSettled(share_id=ev.share_id, node=ev.node, applied=False, retryable=ev.retryable),
    )


def _policy(ev: RequestPolicyChanged) -> tuple[Transition, ...]:
    return (
        PolicyChanged(
            driver=ev.driver,
            pool=ev.pool,
            device=ev.device,
            capacity=ev.capacity,
            policy_version=ev.policy_version,
        ),
    )


def _nothing(ev: Any) -> tuple[Transition, ...]:
    return ()


_Meaning: TypeAlias = Callable[[Any], tuple[Transition, ...]]
_Kinds: TypeAlias = tuple[type[Transition], ...]

#: Each event class: the function giving an event's transitions, and the kinds of
#: transition it can give (so a reader can pick the event classes that matter to it once,
#: at import: :func:`events_meaning`; ``tests/unit/test_transitions.py`` holds the two to
#: each other on a sample of every class).
_TABLE: Final[Mapping[type[Any], tuple[_Meaning, _Kinds]]] = {
    DeviceClassApplied: (
        lambda ev: (ClassDefined(name=ev.device_class.metadata.name),),
        (ClassDefined,),
    ),
    DeviceClassRemoved: (lambda ev: (ClassRemoved(name=ev.name),), (ClassRemoved,)),
    ClassModeSet: (lambda ev: (ClassModeChanged(name=ev.name),), (ClassModeChanged,)),
    ResourceSlicePublished: (
        lambda ev: (SliceChanged(name=ev.slice.metadata.name, withdrawn=False),),
        (SliceChanged,),
    ),
    ResourceSliceWithdrawn: (
        lambda ev: (SliceChanged(name=ev.name, withdrawn=True),),
        (SliceChanged,),
    ),
    RequestPolicyChanged: (_policy, (PolicyChanged,)),
    ClaimSubmitted: (_submitted, (ClaimEntered,)),
    ClaimAdmitted: (_decided("admitted"), (ClaimDecided,)),
    ClaimRejected: (_decided("rejected"), (ClaimDecided,)),
    ClaimUnschedulable: (_decided("unschedulable"), (ClaimDecided,)),
    ClaimWithdrawn: (_decided("withdrawn"), (ClaimDecided,)),
    ClaimReserved: (_nothing, ()),
    ClaimUnreserved: (_nothing, ()),
    CapacityReserved: (_reserved, (ShareHeld,)),
    AllocationBound: (_bound, (ClaimBound,)),
    LimitApplied: (_applied, (LimitsSettled,)),
    LimitFailed: (_failed, (LimitsSettled,)),
    LimitRemoved: (
        lambda ev: (LimitsRemoved(share_id=ev.share_id, node=ev.node),),
        (LimitsRemoved,),
    ),
    EnforcementReconciled: (_nothing, ()),
    EnforcementCheckpointSetAside: (_nothing, ()),
    ShareUsed: (_nothing, ()),
    DeviceHealthChanged: (
        lambda ev: (
            DeviceHealth(
                node=ev.node, driver=ev.driver, pool=ev.pool, device=ev.device, healthy=ev.healthy
            ),
        ),
        (DeviceHealth,),
    ),
    CapacityReleased: (lambda ev: (ShareReleased(share_id=ev.share_id),), (ShareReleased,)),
    NodeLeaseAcquired: (lambda ev: (NodeReturned(node=ev.node, epoch=ev.epoch),), (NodeReturned,)),
    NodeLeaseExpired: (lambda ev: (NodeLost(node=ev.node, epoch=ev.epoch),), (NodeLost,)),
    NodeFenced: (lambda ev: (NodeFencedOff(node=ev.node, epoch=ev.epoch),), (NodeFencedOff,)),
    ShareMarkedUnknown: (
        lambda ev: (ShareUnknown(share_id=ev.share_id, node=ev.node),),
        (ShareUnknown,),
    ),
    ShareConfirmed: (
        lambda ev: (ShareKnownAgain(share_id=ev.share_id, node=ev.node),),
        (ShareKnownAgain,),
    ),
    ReleaseRequested: (
        lambda ev: (ClaimReleasing(namespace=ev.namespace, name=ev.name, node=ev.node),),
        (ClaimReleasing,),
    ),
    ClaimStalled: (_nothing, ()),
    AppendRefused: (_nothing, ()),
    NamespaceAccessSet: (lambda ev: (AccessChanged(namespace=ev.namespace),), (AccessChanged,)),
    MessageDeadLettered: (
        lambda ev: (MessageDropped(consumer=ev.consumer, event_id=ev.event_id),),
        (MessageDropped,),
    ),
}

#: Each event class -> the function giving its transitions, in order.
MEANINGS: Final[Mapping[type[Any], _Meaning]] = {cls: row[0] for cls, row in _TABLE.items()}
#: Each event class -> the kinds of transition it can stand for (``()``: none).
KINDS: Final[Mapping[type[Any], _Kinds]] = {cls: row[1] for cls, row in _TABLE.items()}

#: What the allocator's inventory is built from: classes and their modes, slices,
#: request policies, nodes (a lost node's devices are tainted:
#: :func:`events.inventory.lost_nodes`) and device health (an unhealthy device takes no
#: new share). A reader that caches anything built from the inventory drops it on these.
INVENTORY_CHANGES: Final[_Kinds] = (
    ClassDefined,
    ClassRemoved,
    ClassModeChanged,
    SliceChanged,
    PolicyChanged,
    NodeReturned,
    NodeLost,
    NodeFencedOff,
    DeviceHealth,
)


def events_meaning(*kinds: type[Transition]) -> frozenset[type[Any]]:
    """The event classes that can stand for a transition of one of ``kinds``: a reader
    picks, once, the events that matter to it (catalog events are final: ``type(event)
    in`` the set is the test, cheaper than asking :func:`meaning` on a hot path)."""
    return frozenset(cls for cls, can in KINDS.items() if any(k in can for k in kinds))


#: The last event asked about and its meaning: the listeners of a live state ask, one
#: after the other, about the same event (a strong reference: the identity stays valid;
#: events are frozen, so its meaning cannot change).
_last: tuple[object, tuple[Transition, ...]] = (None, ())


def meaning(event: Event) -> tuple[Transition, ...]:
    """The transitions ``event`` stands for, in order (empty: it changes nothing here)."""
    global _last
    last = _last
    if last[0] is event:
        return last[1]
    transitions = MEANINGS[type(event)](event)
    _last = (event, transitions)
    return transitions


def first(transitions: Iterable[Transition], kind: type[_K] | tuple[type[_K], ...]) -> _K | None:
    """The first of ``transitions`` of type ``kind`` (or of one of the types of a tuple;
    ``None``: none)."""
    for t in transitions:
        if isinstance(t, kind):
            return t
    return None


# --- one staleness rule -------------------------------------------------------------------


def stale(epoch: int, lease_epoch: int, fenced_epoch: int) -> bool:
    """Whether an expiry or fence at ``epoch`` changes nothing: older than the node's
    newest lease (acquired or expired) or fence."""
    return epoch < lease_epoch or epoch < fenced_epoch


def counted(state: ClusterState, transitions: tuple[Transition, ...]) -> tuple[Transition, ...]:
    """``transitions`` less a stale expiry or fence, read off ``state`` *after* the fold
    applied their event (the fold left the node as it was for a stale one, so the rule
    gives the same answer after as before). For a reader that holds the fold: what the
    event changed, not only what it said; the same tuple when it has no node change."""
    for t in transitions:
        if isinstance(t, NodeLost | NodeFencedOff):
            break
    else:
        return transitions
    return tuple(t for t in transitions if not _stale_in(state, t))


def _stale_in(state: ClusterState, t: Transition) -> bool:
    if not isinstance(t, NodeLost | NodeFencedOff):
        return False
    node = state.nodes.get(t.node)
    return node is not None and stale(t.epoch, node.lease_epoch, node.fenced_epoch)


class NodeEpochs(msgspec.Struct, frozen=True, kw_only=True):
    """A node's newest lease epoch (acquired or expired) and fence epoch."""

    node: str
    lease_epoch: int = 0
    fenced_epoch: int = 0

    def stale(self, epoch: int) -> bool:
        """Whether an expiry or fence at ``epoch`` changes nothing (:func:`stale`)."""
        return stale(epoch, self.lease_epoch, self.fenced_epoch)

    def outcome(self, change: NodeChange) -> NodeOutcome | None:
        """What ``change`` does: the epochs after it and what becomes of the node's live
        shares (kept: a new lease; unknown: an expiry; released: a fence); ``None``: a
        stale expiry or fence, nothing changes."""
        after = self.after(change)
        if after is None:
            return None
        if isinstance(change, NodeReturned):
            return NodeOutcome(epochs=after, shares="kept")
        return NodeOutcome(
            epochs=after, shares="released" if isinstance(change, NodeFencedOff) else "unknown"
        )

    def after(self, change: NodeChange) -> NodeEpochs | None:
        """The epochs after ``change``; ``None``: a stale expiry or fence, nothing changes."""
        if isinstance(change, NodeReturned):
            return msgspec.structs.replace(self, lease_epoch=max(self.lease_epoch, change.epoch))
        if self.stale(change.epoch):
            return None
        fenced = isinstance(change, NodeFencedOff)
        return msgspec.structs.replace(
            self,
            lease_epoch=max(self.lease_epoch, change.epoch),
            fenced_epoch=max(self.fenced_epoch, change.epoch) if fenced else self.fenced_epoch,
        )


class NodeOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What a node change that counts does (:meth:`NodeEpochs.outcome`)."""

    epochs: NodeEpochs
    shares: Literal["kept", "unknown", "released"]
