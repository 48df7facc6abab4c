"""The fold's state: what the event log holds, folded (:class:`ClusterState`). Pure.

Only the fold (:mod:`events.fold`) changes a state, one step per event; every reader
reads it. The comparison and snapshot codec of a state are :mod:`events.statecodec`.
This module holds the shapes and the few methods that read them, nothing that moves a
claim or a share.

:class:`ClusterState` is a tree of *mutable* msgspec Structs. Mutability is a
deliberate trade: replay must fold well over 100k events/s in pure Python, so a
step updates a few dict entries in place instead of copying anything, and its
cost does not depend on how many shares exist. Only the fold's steps mutate it.
Because the tree is made of Structs, ``==`` compares two states field by field,
:func:`~events.statecodec.to_builtins` gives a deterministic plain-data form, and
:func:`~events.statecodec.snapshot_encode` /
:func:`~events.statecodec.snapshot_decode` store it as JSON (msgpack's 64-bit
integers cannot hold the nanos of a device above ~18 GiB; JSON integers are unbounded).

* devices, keyed by ``(driver, pool, device)``: totals per capacity
  (``Quantity``), consumed per capacity as exact integer nanos (admin shares
  excluded), ``allow_multiple_allocations``, the dedicated holder, and request
  policies with their versions;
* shares, keyed by ShareID, with their state, device, consumed amounts, policy
  snapshot, claim and node; released shares stay (that is what makes a duplicate
  release recognisable);
* claims, keyed by ``(namespace, name)``, with phase, allocation version and
  result, and share ids; of the manifest only what decisions read
  (:class:`~events.claimspecs.ClaimSpec`), of the result all but its opaque
  configuration: both stay whole in the log, so a claim's memory does not grow with
  what no decision reads; device classes, slices, pools, nodes;
* what each namespace may do (``NamespaceAccessSet``), and how many live claims it
  has (``live_claims``, the quota's count: an index the steps keep, rebuilt from the
  claims when a snapshot is read, left out of :func:`~events.statecodec.to_builtins`).
  Which namespace holds a share is its claim's (``ShareState.claim``).
"""

from __future__ import annotations

import datetime
from typing import Final, Literal, TypeAlias, TypeVar

import msgspec

from events.claimspecs import ClaimSpec
from events.model import AllocationResult, CapacityRequestPolicy, DeviceClass, ResourceSlice
from events.quantities import Quantity

__all__ = [
    "LIVE_SHARE_STATES",
    "REUSABLE_PHASES",
    "TERMINAL_PHASES",
    "ClaimKey",
    "ClaimPhase",
    "ClaimState",
    "ClusterState",
    "DeviceClassState",
    "DeviceKey",
    "DeviceState",
    "NamespaceState",
    "NodeState",
    "PhaseChange",
    "PolicyRecord",
    "PoolState",
    "ShareChange",
    "ShareState",
    "ShareStatus",
    "TrackedDict",
]

DeviceKey: TypeAlias = tuple[str, str, str]
ClaimKey: TypeAlias = tuple[str, str]
ClaimPhase: TypeAlias = Literal[
    "submitted",
    "admitted",
    "rejected",
    "unschedulable",
    "allocated",
    "retrying",
    "ready",
    "stalled",
    "failed",
    "releasing",
    "released",
    "withdrawn",
]
ShareStatus: TypeAlias = Literal["reserved", "bound", "ready", "unknown", "releasing", "released"]

#: Share states that hold capacity.
LIVE_SHARE_STATES: Final = frozenset({"reserved", "bound", "ready", "unknown", "releasing"})
#: Claim phases that no event of the services moves a claim out of: only the tenant's
#: next apply or delete does. A watcher waiting for Ready can stop at any of them.
TERMINAL_PHASES: Final = frozenset({"rejected", "withdrawn", "released", "failed"})
#: Terminal phases after which the claim's name may be applied again with another spec
#: (a failed claim is deleted first: it may still hold its shares).
REUSABLE_PHASES: Final = TERMINAL_PHASES - {"failed"}


_K = TypeVar("_K")
_V = TypeVar("_V")


class TrackedDict(dict[_K, _V]):
    """A dict the garbage collector never stops tracking, for the fold's big maps keyed
    by tuples (claims, devices, pools).

    CPython untracks a plain dict at a collection when none of its keys and values
    needs tracking — a map of ``gc=False`` Structs under ``(namespace, name)`` keys, once
    its key tuples have been untracked themselves — and tracks it again, in the youngest
    generation, as soon as a fresh (still tracked) tuple is inserted as a key: the next
    young, middle and full collections each walk the whole map (1.9 ms per young one at
    100,000 claims), and a full collection untracks it again. A process that folds one
    claim after another paid that at nearly every collection, a cost that grew with
    what is live (docs/services.md, "A dict the collector walks again after every full
    collection"). CPython only untracks exact dicts: a subclass stays tracked, so the
    first full collection leaves it in the oldest generation and
    ``services.runtime.ground.gctuning.freeze_survivors`` freezes it there for good;
    inserting keys moves it nowhere. A process that freezes nothing walks it at full
    collections only."""

    __slots__ = ()


# --- state --------------------------------------------------------------------------------


class PhaseChange(msgspec.Struct, frozen=True, gc=False):
    """A claim's phase before the last folded event and after it (``before`` None: the
    event made the claim)."""

    before: ClaimPhase | None
    after: ClaimPhase


class ShareChange(msgspec.Struct, frozen=True, gc=False):
    """A share's state before the last folded event and after it (``before`` None: the
    event reserved it): held (``reserved`` on), ``unknown``, ``released``."""

    before: ShareStatus | None
    after: ShareStatus


class PolicyRecord(msgspec.Struct, kw_only=True):
    """A capacity's request policy from ``version`` on (``None``: no policy)."""

    version: int
    policy: CapacityRequestPolicy | None


class DeviceState(msgspec.Struct, kw_only=True):
    """One published device and what is held on it."""

    driver: str
    pool: str
    name: str
    slice: str | None = None
    node: str | None = None
    present: bool = True
    allow_multiple_allocations: bool = False
    total: dict[str, Quantity] = {}
    consumed_nanos: dict[str, int] = {}
    policy_version: int = 1
    policies: dict[str, CapacityRequestPolicy | None] = {}
    capacity_policy_versions: dict[str, int] = {}
    policy_history: dict[str, list[PolicyRecord]] = {}
    exclusive_holder: ClaimKey | None = None
    exclusive_share: str | None = None
    live_shared: int = 0
    #: why the node agent reported the device failing (``None``: healthy)
    unhealthy: str | None = None

    def consumed(self) -> dict[str, Quantity]:
        """Consumed amount per capacity, as quantities in the total's format."""
        out: dict[str, Quantity] = {}
        for name, total in self.total.items():
            out[name] = Quantity(self.consumed_nanos.get(name, 0), total.format)
        return out

    def free(self, capacity: str) -> Quantity:
        """Total minus consumed of one capacity."""
        total = self.total[capacity]
        return Quantity(total.nanos - self.consumed_nanos.get(capacity, 0), total.format)

    def policy_at(self, capacity: str, version: int) -> CapacityRequestPolicy | None:
        """The request policy of ``capacity`` in force at policy ``version``."""
        if version >= self.policy_version:
            return self.policies.get(capacity)
        found: CapacityRequestPolicy | None = None
        for record in self.policy_history.get(capacity, ()):
            if record.version > version:
                break
            found = record.policy
        return found


class ShareState(msgspec.Struct, kw_only=True, gc=False):
    """One reserved device result (a ShareID), live or released."""

    share_id: str
    state: ShareStatus
    claim: ClaimKey
    request: str
    allocation_version: int
    driver: str
    pool: str
    device: str
    node: str | None
    shared: bool
    admin_access: bool
    consumed: dict[str, Quantity]
    policy_version: int
    reserved_at: int = 0
    released_at: int | None = None
    prior_state: ShareStatus | None = None
    limit_level: str | None = None
    actual: dict[str, Quantity] | None = None
    limit_removed: bool = False
    last_error: str | None = None
    used: bool = False  #: its agent saw it in use (``ShareUsed``)
    #: a retryable failure of its limit: tries so far, since when, and the next try
    attempts: int = 0
    failing_since: datetime.datetime | None = None
    retry_at: datetime.datetime | None = None

    @property
    def device_key(self) -> DeviceKey:
        """``(driver, pool, device)``."""
        return (self.driver, self.pool, self.device)

    @property
    def live(self) -> bool:
        """Whether the share still holds capacity."""
        return self.state != "released"


class ClaimState(msgspec.Struct, kw_only=True, gc=False):
    """A ResourceClaim's lifecycle.

    Of the manifest it keeps what decisions read (``spec``, :mod:`events.claimspecs`),
    and of the allocation everything but ``devices.config``: opaque configuration no
    decision reads, which would make every claim cost its size in every process. Both
    stay whole in the log (the latest ``ClaimSubmitted`` of the claim's stream, the
    ``AllocationBound`` at ``bound_position``), from where ``claim get`` reads them.
    """

    namespace: str
    name: str
    phase: ClaimPhase
    spec: ClaimSpec | None = None  #: of the latest ``ClaimSubmitted``
    allocation_version: int = 0
    #: the current allocation without ``devices.config`` (``allocation_configs`` entries)
    allocation: AllocationResult | None = None
    node: str | None = None
    share_ids: list[str] = []
    reason: str | None = None
    #: consumers that reserved the claim (``status.reservedFor``), in order
    reserved_for: list[str] = []
    ready_position: int = 0  #: where its current allocation became ready (0: not yet)
    bound_position: int = 0  #: where its current allocation was bound (0: none yet)
    #: who allocates it (``ClaimSubmitted.source``) and, for a claim mirrored from
    #: Kubernetes, the ResourceClaim's ``metadata.uid``
    source: str = "dracap"
    uid: str | None = None
    #: entries of the allocation's ``devices.config``, kept in the log only
    allocation_configs: int = 0

    def class_of(self, request: str) -> str | None:
        """The DeviceClass name of result request ``request`` (``req`` or ``req/sub``) of
        the submitted spec (``None``: unknown)."""
        return self.spec.class_of(request) if self.spec is not None else None


class DeviceClassState(msgspec.Struct, kw_only=True):
    """An applied DeviceClass, how its changes roll out and how new claims of it are decided."""

    device_class: DeviceClass
    rollout: str
    mode: str = "consumable"  #: the latest ``ClassModeSet`` (re-applying keeps it)
    min_enforcement: str = "none"  #: likewise


class PoolState(msgspec.Struct, kw_only=True):
    """A resource pool: the slices that publish it."""

    driver: str
    name: str
    generation: int
    resource_slice_count: int
    slices: list[str] = []


class NodeState(msgspec.Struct, kw_only=True):
    """A node agent's lease and the live shares placed on the node.

    ``lease``: ``live`` (an agent holds lease ``lease_epoch``, or none ever did),
    ``expired`` (the lease ran out: the node's shares are unknown, its devices tainted)
    or ``fenced`` (an operator or the fence hook declared it off at ``fenced_epoch``).
    ``boot_id``, ``ttl_ms`` and ``leased_epoch`` are those of the latest lease; ``reason``
    says why the node is expired or fenced. The store keeps the newest of
    ``expired_epoch`` and ``fenced_epoch`` in ``node_epochs`` and the latest lease in
    ``node_leases`` (``dracap replay verify`` compares both).
    """

    name: str
    lease: Literal["live", "expired", "fenced"] = "live"
    lease_epoch: int = 0
    fenced_epoch: int = 0
    live_shares: set[str] = set()
    boot_id: str = ""
    ttl_ms: int = 0
    reason: str | None = None
    leased_epoch: int = 0  #: the newest lease acquired (``node_leases.epoch``)
    enforcement: str = "none"  #: the level the agent of the latest lease offers
    expired_epoch: int = 0  #: the newest lease recorded as expired


class NamespaceState(msgspec.Struct, kw_only=True):
    """What a namespace may do (its latest ``NamespaceAccessSet``, field for field)."""

    classes: list[str] = []
    admin_access: bool = False
    opaque_config_classes: list[str] = []
    max_claims: int | None = None
    max_requests_per_claim: int | None = None


class ClusterState(msgspec.Struct, kw_only=True, eq=False):
    """Everything the log says, folded. Change it only through :func:`events.fold.apply`.

    Two states are equal when they hold the same fold: ``phases_before`` and
    ``shares_before``, the journal of the last event folded, are not compared."""

    position: int = 0
    classes: dict[str, DeviceClassState] = {}
    slices: dict[str, ResourceSlice] = {}
    #: the maps keyed by tuples are always :class:`TrackedDict` (``__post_init__`` makes
    #: one of whatever a caller passes; that class says why)
    pools: dict[tuple[str, str], PoolState] = msgspec.field(default_factory=TrackedDict)
    devices: dict[DeviceKey, DeviceState] = msgspec.field(default_factory=TrackedDict)
    claims: dict[ClaimKey, ClaimState] = msgspec.field(default_factory=TrackedDict)
    shares: dict[str, ShareState] = {}
    nodes: dict[str, NodeState] = {}
    namespaces: dict[str, NamespaceState] = {}
    dead_letters: int = 0
    #: the events the fold's driver refused (:mod:`events.folding`): position -> reason;
    #: each was skipped, the state left as it was before it
    refused: dict[int, str] = {}
    #: live claims (phase not in :data:`REUSABLE_PHASES`) per namespace: an index of
    #: ``claims`` kept by the fold's steps (``events.fold._set_phase``), not stored in snapshots
    live_claims: dict[str, int] = {}
    #: the claims the last folded event moved, each with its phase before the event
    #: (None: the event made the claim); :meth:`phase_changes` says which of them end in
    #: another phase. The fold's driver empties it before each event and the steps fill
    #: it (``events.fold._set_phase``): what "a claim's phase changed" means is said there
    #: once, for every reader (the report's panels, ...). Not stored in snapshots, not
    #: compared.
    phases_before: dict[ClaimKey, ClaimPhase | None] = {}
    #: the shares the last folded event moved, each with its state before the event
    #: (None: the event reserved it); :meth:`share_changes` says which of them end in
    #: another state. Kept like ``phases_before`` (``events.fold._set_share``): a share
    #: held, Unknown, known again or released is said there once. Not stored, not compared.
    shares_before: dict[str, ShareStatus | None] = {}

    def __post_init__(self) -> None:
        for name in _TRACKED:
            mapping = getattr(self, name)
            if type(mapping) is not TrackedDict:
                setattr(self, name, TrackedDict(mapping))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterState):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in _FOLDED)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def phase_changes(self) -> dict[ClaimKey, PhaseChange]:
        """The claims whose phase the last folded event changed, and how."""
        claims = self.claims
        return {
            key: PhaseChange(before, after)
            for key, before in self.phases_before.items()
            if (after := claims[key].phase) != before
        }

    def share_changes(self) -> dict[str, ShareChange]:
        """The shares whose state the last folded event changed, and how."""
        shares = self.shares
        return {
            share_id: ShareChange(before, after)
            for share_id, before in self.shares_before.items()
            if (after := shares[share_id].state) != before
        }

    def device(self, driver: str, pool: str, name: str) -> DeviceState | None:
        """The device ``driver/pool/name``, if known."""
        return self.devices.get((driver, pool, name))

    def claim(self, namespace: str, name: str) -> ClaimState | None:
        """The claim ``namespace/name``, if known."""
        return self.claims.get((namespace, name))

    def live_claim_count(self, namespace: str) -> int:
        """Claims of ``namespace`` in a live phase (not rejected, withdrawn or released)."""
        return self.live_claims.get(namespace, 0)


#: the maps keyed by tuples that a state keeps as :class:`TrackedDict`
_TRACKED: Final = ("pools", "devices", "claims")
#: the fields :meth:`ClusterState.__eq__` compares: all but the last event's journal
_JOURNAL: Final = frozenset({"phases_before", "shares_before"})
_FOLDED: Final = tuple(f for f in ClusterState.__struct_fields__ if f not in _JOURNAL)
