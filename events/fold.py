"""The state fold: what the event log means, and the invariants it must keep.

"What it means" lives in one table, ``_STEPS`` (at the end of this module): for
every class of the catalog's :data:`~events.catalog.Event` union, one *step*
``step(state, event, position)`` that checks the invariants the event touches and
then changes the state in place. :func:`apply` and :func:`apply_event` look the step
up by ``type(event)`` — a dict lookup rather than a ``match`` over two dozen class
patterns, because replay folds millions of events and the pattern chain cost more
than most steps do. Every step takes the same three arguments, whether it needs the
position or not, so the table holds the step functions themselves and
:func:`step_of` can hand one to a replay loop that dispatches by itself. A new event
type adds a class to the catalog, a step here and its row in the table.

The database checks three of these rules again inside every append (capacity, one
exclusive holder, a share released once, plus stale fences): :mod:`events.guards`
restates them per event, using this module's own predicates (:func:`counts_capacity`,
:func:`holds_device`), so they are written once.

Replaying the log from the start (or from a snapshot) through :func:`apply` gives the
live state; replaying up to position *p* gives the state at *p* (invariant 8).
Services never change a :class:`~events.state.ClusterState` themselves: they read it,
decide, and append events. What the state holds is :mod:`events.state`; how it is
compared and stored as a snapshot, :mod:`events.statecodec`.

Policy versions
---------------
Every device has one policy sequence, ``DeviceState.policy_version``. A slice
that changes the request policy of some capacities (or adds capacities) takes
the next number for them; ``RequestPolicyChanged`` carries the number its decider
expected (the device's next), and takes the next one after the device's current number
when a slice published in between already took it (two writers on two streams that no
expected version orders: the fold numbers, so the log always folds; last writer wins,
as for slices). A capacity's policy "at version v" is its latest
change numbered ``<= v``, so the single ``policy_version`` of a reservation
identifies the policy of every capacity it was granted under. A reservation
with :data:`~events.catalog.POLICY_VERSION_UNRECORDED` (upcast from v1) is
checked against, and records, the policy in force when it is replayed.

Invariants (``InvariantViolation(position, name, detail)``)
-----------------------------------------------------------
A step that would break one raises before mutating anything; so does a step that would
fail any other way (a look-up it needs is done before the first change). The fold's
driver (:mod:`events.folding`) relies on it: an event a step refuses is skipped by every
reader, and the state must be exactly what it was before it.

* ``capacity``: a reservation on a device that is not published, for a capacity
  the device does not have, or that would make consumed exceed the total;
* ``exclusive``: a dedicated device held by a second hold; a shared reservation
  while a dedicated hold exists, a dedicated one while shares are live; a share
  on a device that does not allow multiple allocations (or the reverse);
* ``identity``: a ShareID reserved twice; a release, bind or report for an
  unknown share; a release whose device or allocation version contradicts the
  share; a bind of another claim's share;
* ``policy``: consumed does not satisfy the policy snapshot (validValues, or
  min / max / step counted from min); a policy version that does not increase;
* ``readiness``: ``LimitApplied`` for a share that is not reserved or bound, or
  from another node. Claim readiness is derived: a claim becomes ``ready`` only
  when every non-admin share of its allocation (every share, for an admin-only
  claim) has had its limit applied — never from scheduling alone;
* ``fencing``: ``CapacityReleased`` for a share whose state is unknown while its
  node holds no new lease (it keeps its capacity until ``NodeFenced``, or until the
  agent of a newer lease confirms or releases it), a confirmation of a share that was
  already fenced, or a lease whose epoch is not newer than every lease and fence of
  its node before;
* ``order``: a stored envelope whose position does not increase.

Idempotent release: a ``CapacityReleased`` for a share already released with the
same allocation version is a no-op. Stale commands (a ``ReleaseRequested`` for an
older allocation, a fence or expiry of an older epoch) are no-ops too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final, TypeAlias

from events.catalog import (
    POLICY_VERSION_UNRECORDED,
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
from events.claimspecs import allocation_without_config, claim_spec
from events.envelopes import Envelope
from events.errors import InvariantViolation
from events.model import CapacityRequestPolicy
from events.quantities import Quantity
from events.state import (
    REUSABLE_PHASES,
    ClaimKey,
    ClaimPhase,
    ClaimState,
    ClusterState,
    DeviceClassState,
    DeviceState,
    NamespaceState,
    NodeState,
    PolicyRecord,
    PoolState,
    ShareState,
    ShareStatus,
)
from events.transitions import stale

__all__ = [
    "apply",
    "apply_event",
    "counts_capacity",
    "fold",
    "holds_device",
    "policy_violation",
    "step_of",
]

_LIVE_CLAIM_PHASES: Final = frozenset({"allocated", "retrying", "ready", "stalled", "releasing"})


def _new_claim(state: ClusterState, key: ClaimKey, phase: ClaimPhase) -> ClaimState:
    """A claim seen for the first time, in a live ``phase``."""
    claim = state.claims[key] = ClaimState(namespace=key[0], name=key[1], phase=phase)
    state.live_claims[key[0]] = state.live_claims.get(key[0], 0) + 1
    state.phases_before.setdefault(key, None)
    return claim


def _set_phase(state: ClusterState, claim: ClaimState, phase: ClaimPhase) -> None:
    """Move ``claim`` to ``phase``, keeping :attr:`ClusterState.live_claims` and
    :attr:`ClusterState.phases_before` current: every change of a claim's phase is made
    here (or by :func:`_new_claim`)."""
    before = claim.phase
    if before == phase:
        return
    state.phases_before.setdefault((claim.namespace, claim.name), before)
    was_live = before not in REUSABLE_PHASES
    claim.phase = phase
    if was_live != (phase not in REUSABLE_PHASES):
        counts = state.live_claims
        count = counts.get(claim.namespace, 0) + (-1 if was_live else 1)
        if count:
            counts[claim.namespace] = count
        else:  # as a snapshot rebuilds it: namespaces with live claims only
            del counts[claim.namespace]


def _set_share(state: ClusterState, share: ShareState, status: ShareStatus) -> None:
    """Move ``share`` to ``status``, keeping :attr:`ClusterState.shares_before` current:
    every change of a share's state after its reservation is made here."""
    before = share.state
    if before != status:
        state.shares_before.setdefault(share.share_id, before)
        share.state = status


# --- the fold -----------------------------------------------------------------------------


def fold(envelopes: Iterable[Envelope], state: ClusterState | None = None) -> ClusterState:
    """Fold ``envelopes`` in order into ``state`` (a new empty state by default)."""
    st = ClusterState() if state is None else state
    for envelope in envelopes:
        apply(st, envelope)
    return st


def apply(state: ClusterState, envelope: Envelope) -> ClusterState:
    """Fold one envelope into ``state`` (in place) and return it.

    Raises :class:`InvariantViolation` without changing ``state`` when the event
    would break an invariant.
    """
    return apply_event(state, envelope.event, envelope.position)


def apply_event(state: ClusterState, event: Event, position: int) -> ClusterState:
    """Fold one event stored at ``position`` (0: not stored) into ``state``.

    The same as :func:`apply` without an envelope, for replay loops that read rows.
    """
    if position and position <= state.position:
        raise InvariantViolation(position, "order", f"position {position} after {state.position}")
    if moved := state.phases_before:  # the journal of the event before
        moved.clear()
    if held := state.shares_before:
        held.clear()
    _STEPS[type(event)](state, event, position)
    if position:
        state.position = position
    return state


Step: TypeAlias = Callable[[ClusterState, Any, int], None]


def step_of(cls: type) -> Step:
    """The step :func:`apply_event` runs for events of class ``cls``.

    For replay loops that dispatch themselves: a step raises
    :class:`InvariantViolation` before changing anything, but it neither checks nor
    advances ``state.position`` — the caller does both, exactly as :func:`apply_event`.
    """
    return _STEPS[cls]


# --- reservation and release --------------------------------------------------------------


def policy_violation(policy: CapacityRequestPolicy, consumed: Quantity) -> str | None:
    """Why ``consumed`` breaks ``policy`` (dra-semantics §3.4), or ``None``.

    Stricter than upstream in one place: an amount below ``min`` is a violation,
    because a correct allocator always rounds it up to ``min``.
    """
    if policy.default is not None and consumed == policy.default:
        return None
    if policy.valid_values is not None:
        if consumed in policy.valid_values:
            return None
        values = ", ".join(v.canonical() for v in policy.valid_values)
        return f"{consumed.canonical()} is not one of validValues [{values}]"
    rng = policy.valid_range
    if rng is None:
        return None
    if consumed < rng.min:
        return f"{consumed.canonical()} is below min {rng.min.canonical()}"
    if rng.max is not None and consumed > rng.max:
        return f"{consumed.canonical()} is above max {rng.max.canonical()}"
    if rng.step is not None:
        step = rng.step.value()
        if step > 0 and (consumed.value() - rng.min.value()) % step:
            return (
                f"{consumed.canonical()} is not min {rng.min.canonical()} "
                f"plus a multiple of step {rng.step.canonical()}"
            )
    return None


def counts_capacity(ev: CapacityReserved) -> bool:
    """Whether a reservation consumes capacity: admin shares never do."""
    return not ev.admin_access


def holds_device(ev: CapacityReserved) -> bool:
    """Whether a reservation holds its device exclusively: a dedicated, non-admin one."""
    return not ev.shared and not ev.admin_access


def _reserve(state: ClusterState, ev: CapacityReserved, position: int) -> None:
    share_id = ev.share_id
    shares = state.shares
    if share_id in shares:
        raise InvariantViolation(position, "identity", f"share {share_id} reserved twice")
    key = (ev.driver, ev.pool, ev.device)
    dev = state.devices.get(key)
    if dev is None or not dev.present:
        raise InvariantViolation(position, "capacity", f"device {'/'.join(key)} is not published")
    claim_key = (ev.namespace, ev.name)
    claim = state.claims.get(claim_key)
    allocation_version = ev.allocation_version
    if claim is not None and allocation_version < claim.allocation_version:
        raise InvariantViolation(
            position,
            "identity",
            f"share {share_id}: allocation version {allocation_version} is older than "
            f"claim's {claim.allocation_version}",
        )
    version = ev.policy_version
    shared = ev.shared
    if counts_capacity(ev):
        if (
            shared != dev.allow_multiple_allocations
            or dev.exclusive_holder is not None
            or (not shared and dev.live_shared)
        ):
            _check_exclusive(dev, ev, claim_key, position)  # raises: the message is built there
        version = _check_consumption(dev, ev, position)
        consumed_nanos = dev.consumed_nanos
        for name, q in ev.consumed.items():
            consumed_nanos[name] = consumed_nanos.get(name, 0) + q.nanos
        if not holds_device(ev):
            dev.live_shared += 1
        else:
            dev.exclusive_holder = claim_key
            dev.exclusive_share = share_id
    elif version == POLICY_VERSION_UNRECORDED:
        version = dev.policy_version
    node = ev.node
    state.shares_before[share_id] = None
    shares[share_id] = ShareState(
        share_id=share_id,
        state="reserved",
        claim=claim_key,
        request=ev.request,
        allocation_version=allocation_version,
        driver=ev.driver,
        pool=ev.pool,
        device=ev.device,
        node=node,
        shared=shared,
        admin_access=ev.admin_access,
        consumed=ev.consumed,
        policy_version=version,
        reserved_at=position,
    )
    if node is not None:
        _node(state, node).live_shares.add(share_id)
    if claim is not None:
        if allocation_version != claim.allocation_version:
            claim.allocation_version = allocation_version
            claim.share_ids = [share_id]
        else:
            claim.share_ids.append(share_id)


def _check_exclusive(
    dev: DeviceState, ev: CapacityReserved, claim_key: ClaimKey, position: int
) -> None:
    where = f"device {ev.driver}/{ev.pool}/{ev.device}"
    if ev.shared != dev.allow_multiple_allocations:
        kind = "shared" if ev.shared else "dedicated"
        raise InvariantViolation(
            position,
            "exclusive",
            f"{where}: {kind} reservation but allowMultipleAllocations="
            f"{dev.allow_multiple_allocations}",
        )
    if dev.exclusive_holder is not None:
        holder = "/".join(dev.exclusive_holder)
        raise InvariantViolation(
            position,
            "exclusive",
            f"{where} is held by claim {holder} (share {dev.exclusive_share}); "
            f"claim {'/'.join(claim_key)} cannot reserve it",
        )
    if not ev.shared and dev.live_shared:
        raise InvariantViolation(
            position, "exclusive", f"{where} has {dev.live_shared} live shares"
        )


def _check_consumption(dev: DeviceState, ev: CapacityReserved, position: int) -> int:
    """Check policy and capacity of a reservation; return its resolved policy version."""
    version = ev.policy_version
    device_version = dev.policy_version
    if version == POLICY_VERSION_UNRECORDED:
        version = device_version
    elif version > device_version:
        raise InvariantViolation(
            position,
            "policy",
            f"share {ev.share_id}: policy version {version} is newer than the device's "
            f"{device_version}",
        )
    current = version == device_version
    totals = dev.total
    policies = dev.policies
    consumed_nanos = dev.consumed_nanos
    for name, q in ev.consumed.items():
        total = totals.get(name)
        if total is None:
            raise InvariantViolation(
                position,
                "capacity",
                f"device {ev.driver}/{ev.pool}/{ev.device} has no capacity {name!r}",
            )
        policy = policies.get(name) if current else dev.policy_at(name, version)
        if policy is not None:
            why = policy_violation(policy, q)
            if why is not None:
                raise InvariantViolation(
                    position, "policy", f"share {ev.share_id}: {name}: {why} (v{version})"
                )
        if consumed_nanos.get(name, 0) + q.nanos > total.nanos:
            used = Quantity(consumed_nanos.get(name, 0), total.format).canonical()
            raise InvariantViolation(
                position,
                "capacity",
                f"device {ev.driver}/{ev.pool}/{ev.device} {name}: {used} consumed + "
                f"{q.canonical()} > total {total.canonical()}",
            )
    return version


def _release(state: ClusterState, ev: CapacityReleased, position: int) -> None:
    share = state.shares.get(ev.share_id)
    if share is None:
        raise InvariantViolation(position, "identity", f"release of unknown share {ev.share_id}")
    if share.allocation_version != ev.allocation_version:
        raise InvariantViolation(
            position,
            "identity",
            f"share {ev.share_id} belongs to allocation {share.allocation_version}, "
            f"release names {ev.allocation_version}",
        )
    if share.device != ev.device or share.pool != ev.pool or share.driver != ev.driver:
        raise InvariantViolation(
            position,
            "identity",
            f"share {ev.share_id} is on {share.driver}/{share.pool}/{share.device}, "
            f"release names {ev.driver}/{ev.pool}/{ev.device}",
        )
    status = share.state
    if status == "released":
        return  # idempotent: this allocation version was already released
    if status == "unknown" and not _vouched(state, share):
        raise InvariantViolation(
            position,
            "fencing",
            f"share {ev.share_id} is unknown; it keeps its capacity until fenced or confirmed",
        )
    consumed = ev.consumed
    if consumed and consumed != share.consumed:
        raise InvariantViolation(
            position, "identity", f"share {ev.share_id}: released amounts differ from reserved"
        )
    _free(state, share, position)
    claim = state.claims.get(share.claim)
    if (
        claim is not None
        and claim.allocation_version == share.allocation_version
        and claim.phase != "failed"
        and _all_released(state.shares, claim.share_ids)
    ):
        _set_phase(state, claim, "released")


def _free(state: ClusterState, share: ShareState, position: int) -> None:
    """Give a live share's capacity back and mark it released."""
    dev = state.devices[(share.driver, share.pool, share.device)]
    if not share.admin_access:
        consumed_nanos = dev.consumed_nanos
        for name, q in share.consumed.items():
            consumed_nanos[name] -= q.nanos
        if share.shared:
            dev.live_shared -= 1
        elif dev.exclusive_share == share.share_id:
            dev.exclusive_holder = None
            dev.exclusive_share = None
    _set_share(state, share, "released")
    share.released_at = position
    if share.node is not None:
        node = state.nodes.get(share.node)
        if node is not None:
            node.live_shares.discard(share.share_id)


def _all_released(shares: dict[str, ShareState], share_ids: list[str]) -> bool:
    """Whether every known share of ``share_ids`` is released."""
    for sid in share_ids:
        share = shares.get(sid)
        if share is not None and share.state != "released":
            return False
    return True


# --- binding and readiness ----------------------------------------------------------------


def _share_for(state: ClusterState, share_id: str, position: int) -> ShareState:
    share = state.shares.get(share_id)
    if share is None:
        raise InvariantViolation(position, "identity", f"unknown share {share_id}")
    return share


_BINDABLE: Final = frozenset({"reserved", "bound", "ready"})


def _bind(state: ClusterState, ev: AllocationBound, position: int) -> None:
    namespace, name, allocation_version = ev.namespace, ev.name, ev.allocation_version
    key = (namespace, name)
    known = state.shares
    share_ids = ev.share_ids
    shares: list[ShareState] = []
    for sid in share_ids:
        share = known.get(sid)
        if share is None:
            raise InvariantViolation(position, "identity", f"unknown share {sid}")
        shares.append(share)
    for share in shares:
        if share.claim != key or share.allocation_version != allocation_version:
            raise InvariantViolation(
                position,
                "identity",
                f"share {share.share_id} belongs to {'/'.join(share.claim)} allocation "
                f"{share.allocation_version}, not {'/'.join(key)} allocation "
                f"{allocation_version}",
            )
        if share.state not in _BINDABLE:
            raise InvariantViolation(
                position, "identity", f"share {share.share_id} is {share.state}, cannot bind"
            )
    claim = state.claims.get(key)
    if claim is None:
        claim = _new_claim(state, key, "allocated")
    for share in shares:
        if share.state == "reserved":
            _set_share(state, share, "bound")
    claim.allocation_version = allocation_version
    claim.allocation, claim.allocation_configs = allocation_without_config(ev.allocation)
    claim.node = ev.node
    claim.share_ids = list(share_ids)
    claim.reason = None
    claim.reserved_for = []
    claim.bound_position = position
    ready = bool(shares) and _all_ready(shares)
    claim.ready_position = position if ready else 0
    _set_phase(state, claim, "ready" if ready else "allocated")


def _limit_applied(state: ClusterState, ev: LimitApplied, position: int) -> None:
    share = state.shares.get(ev.share_id)
    if share is None:
        raise InvariantViolation(position, "identity", f"unknown share {ev.share_id}")
    status = share.state
    if status != "reserved" and status != "bound":
        raise InvariantViolation(
            position, "readiness", f"limit applied to share {ev.share_id} in state {status}"
        )
    node = share.node
    if node is not None and node != ev.node:
        raise InvariantViolation(
            position,
            "readiness",
            f"share {ev.share_id} is on node {node}, limit reported by {ev.node}",
        )
    claim = state.claims.get(share.claim)
    if claim is not None:  # every look-up before a change
        _known(state.shares, claim.share_ids)
    _set_share(state, share, "ready")
    share.limit_level = ev.level
    share.actual = ev.actual
    share.limit_removed = False
    share.retry_at = None
    if claim is not None and claim.allocation_version == share.allocation_version:
        _maybe_ready(state, claim, position)


def _known(mapping: dict[Any, Any], keys: Iterable[Any]) -> None:
    """KeyError unless ``mapping`` holds every key (a step looks up before it changes)."""
    for key in keys:
        if key not in mapping:
            raise KeyError(key)


def _maybe_ready(state: ClusterState, claim: ClaimState, position: int) -> None:
    """Make an allocated claim ready when every share that needs a limit has one."""
    if (claim.phase != "allocated" and claim.phase != "retrying") or not claim.share_ids:
        return
    shares = state.shares
    if _all_ready([shares[s] for s in claim.share_ids]):
        _set_phase(state, claim, "ready")  # allocated -> ready
        claim.ready_position = position


def _all_ready(shares: list[ShareState]) -> bool:
    """Whether every non-admin share (every share, if all are admin) is ready."""
    regular = False
    admin_ready = True
    for share in shares:
        if not share.admin_access:
            if share.state != "ready":
                return False
            regular = True
        elif share.state != "ready":
            admin_ready = False
    return regular or admin_ready


def _limit_failed(state: ClusterState, ev: LimitFailed, position: int) -> None:
    share = _share_for(state, ev.share_id, position)
    if share.state == "released":
        return
    share.last_error = ev.reason
    if ev.retryable:
        if ev.retry_at is None:
            return  # written before retries were scheduled: nothing will try again
        share.attempts = ev.attempt
        share.failing_since = ev.failing_since
        share.retry_at = ev.retry_at
        claim = state.claims.get(share.claim)
        if (
            claim is not None
            and claim.allocation_version == share.allocation_version
            and claim.phase in ("allocated", "retrying")
        ):
            _set_phase(state, claim, "retrying")  # allocated -> retrying
            claim.reason = (
                f"{ev.reason} (try {ev.attempt} failed; next try at "
                f"{ev.retry_at.isoformat(timespec='seconds')})"
            )
        return
    share.retry_at = None
    claim = state.claims.get(share.claim)
    if claim is not None and claim.allocation_version == share.allocation_version:
        _set_phase(state, claim, "failed")
        claim.reason = ev.reason


def _release_requested(state: ClusterState, ev: ReleaseRequested, position: int) -> None:
    claim = state.claims.get((ev.namespace, ev.name))
    if claim is None or claim.allocation_version != ev.allocation_version:
        return  # stale or unknown: nothing of that allocation to release
    phase = claim.phase
    if phase == "releasing" or phase == "released":
        return
    if ev.reason:
        claim.reason = ev.reason
    released = True  # whether every known share of the allocation is released
    shares = state.shares
    for sid in claim.share_ids:
        share = shares.get(sid)
        if share is None:
            continue
        status = share.state
        if status == "reserved" or status == "bound" or status == "ready":
            _set_share(state, share, "releasing")
            released = False
        elif status != "released":
            released = False
    _set_phase(state, claim, "released" if released else "releasing")


# --- claims -------------------------------------------------------------------------------


def _claim_record(state: ClusterState, namespace: str, name: str) -> ClaimState:
    key = (namespace, name)
    claim = state.claims.get(key)
    if claim is None:
        claim = _new_claim(state, key, "submitted")
    return claim


def _claim_submitted(state: ClusterState, ev: ClaimSubmitted, position: int) -> None:
    meta = ev.claim.metadata
    claim = _claim_record(state, meta.namespace or "", meta.name)
    claim.spec = claim_spec(ev.claim)
    if claim.phase not in _LIVE_CLAIM_PHASES:
        _set_phase(state, claim, "submitted")
        claim.reason = None
        claim.source = ev.source
        claim.uid = meta.uid if ev.source == "kubernetes" else None


# --- leases and fencing -------------------------------------------------------------------


def _node(state: ClusterState, name: str) -> NodeState:
    node = state.nodes.get(name)
    if node is None:
        node = state.nodes[name] = NodeState(name=name)
    return node


def _mark_unknown(state: ClusterState, share: ShareState) -> None:
    if share.state not in ("released", "unknown"):
        share.prior_state = share.state
        _set_share(state, share, "unknown")


def _vouched(state: ClusterState, share: ShareState) -> bool:
    """Whether an unknown share's node holds a new lease: its agent speaks for it again."""
    node = state.nodes.get(share.node) if share.node is not None else None
    return node is not None and node.lease == "live"


def _lease_acquired(state: ClusterState, ev: NodeLeaseAcquired, position: int) -> None:
    node = _node(state, ev.node)
    if ev.epoch <= node.lease_epoch or ev.epoch <= node.fenced_epoch:
        raise InvariantViolation(
            position,
            "fencing",
            f"node {ev.node}: lease epoch {ev.epoch} is not newer than "
            f"{max(node.lease_epoch, node.fenced_epoch)}",
        )
    node.lease = "live"
    node.lease_epoch = ev.epoch
    node.leased_epoch = ev.epoch
    node.boot_id = ev.boot_id
    node.ttl_ms = ev.ttl_ms
    node.enforcement = ev.enforcement
    node.reason = None


def _lease_expired(state: ClusterState, ev: NodeLeaseExpired, position: int) -> None:
    node = state.nodes.get(ev.node)
    if node is not None and stale(ev.epoch, node.lease_epoch, node.fenced_epoch):
        return  # stale
    shares = [state.shares[sid] for sid in node.live_shares] if node is not None else []
    node = _node(state, ev.node)
    node.lease_epoch = ev.epoch
    node.expired_epoch = ev.epoch
    node.lease = "expired"
    node.reason = f"lease of epoch {ev.epoch} expired"
    for share in shares:
        _mark_unknown(state, share)


def _fenced(state: ClusterState, ev: NodeFenced, position: int) -> None:
    node = state.nodes.get(ev.node)
    if node is not None and stale(ev.epoch, node.lease_epoch, node.fenced_epoch):
        return  # stale
    if node is not None:  # every look-up before a change
        _known(state.shares, node.live_shares)
        _known(state.devices, [state.shares[sid].device_key for sid in node.live_shares])
    node = _node(state, ev.node)
    node.fenced_epoch = ev.epoch
    node.lease = "fenced"
    node.reason = f"fenced at epoch {ev.epoch}" + (f": {ev.reason}" if ev.reason else "")
    touched: dict[ClaimKey, None] = {}
    for sid in sorted(node.live_shares):
        share = state.shares[sid]
        _free(state, share, position)
        touched[share.claim] = None
    for key in touched:
        claim = state.claims.get(key)
        if claim is None or claim.phase in ("released", "failed"):
            continue
        if claim.phase == "releasing" and _all_released(state.shares, claim.share_ids):
            _set_phase(state, claim, "released")
        elif claim.phase != "releasing":
            _set_phase(state, claim, "failed")
            claim.reason = f"node {ev.node} {node.reason}"


def _confirmed(state: ClusterState, ev: ShareConfirmed, position: int) -> None:
    share = _share_for(state, ev.share_id, position)
    if share.node is not None and share.node != ev.node:
        raise InvariantViolation(
            position, "fencing", f"share {ev.share_id} is on {share.node}, not {ev.node}"
        )
    if share.state == "released":
        raise InvariantViolation(
            position, "fencing", f"share {ev.share_id} confirmed after it was released"
        )
    if share.state == "unknown":
        claim = state.claims.get(share.claim)
        if (
            claim is not None
            and claim.phase == "releasing"
            and claim.allocation_version == share.allocation_version
        ):
            _set_share(state, share, "releasing")  # deleted while unknown: removed next
        else:
            _set_share(state, share, share.prior_state or "ready")
        share.prior_state = None
    node = state.nodes.get(ev.node)
    if node is not None and node.lease == "expired":
        node.lease = "live"


# --- inventory ----------------------------------------------------------------------------


def _slice_published(state: ClusterState, ev: ResourceSlicePublished, position: int) -> None:
    rslice = ev.slice
    spec = rslice.spec
    name = rslice.metadata.name
    old = state.slices.get(name)
    state.slices[name] = rslice
    pool_key = (spec.driver, spec.pool.name)
    pool = state.pools.get(pool_key)
    if pool is None:
        pool = state.pools[pool_key] = PoolState(
            driver=spec.driver,
            name=spec.pool.name,
            generation=spec.pool.generation,
            resource_slice_count=spec.pool.resource_slice_count,
        )
    elif spec.pool.generation >= pool.generation:
        pool.generation = spec.pool.generation
        pool.resource_slice_count = spec.pool.resource_slice_count
    if name not in pool.slices:
        pool.slices.append(name)
        pool.slices.sort()
    seen: set[str] = set()
    for device in spec.devices or ():
        seen.add(device.name)
        key = (spec.driver, spec.pool.name, device.name)
        dev = state.devices.get(key)
        if dev is None:
            dev = state.devices[key] = DeviceState(
                driver=spec.driver, pool=spec.pool.name, name=device.name
            )
        dev.slice = name
        dev.node = device.node_name or spec.node_name
        dev.present = True
        dev.allow_multiple_allocations = bool(device.allow_multiple_allocations)
        capacity = device.capacity or {}
        dev.total = {cap: c.value for cap, c in capacity.items()}
        _update_policies(dev, {cap: c.request_policy for cap, c in capacity.items()})
    if old is not None and old.spec.pool.name == spec.pool.name:
        for device in old.spec.devices or ():
            if device.name not in seen:
                gone = state.devices.get((old.spec.driver, old.spec.pool.name, device.name))
                if gone is not None:
                    gone.present = False


def _update_policies(dev: DeviceState, policies: dict[str, CapacityRequestPolicy | None]) -> None:
    """Record changed policies under the device's next policy version."""
    fresh = not dev.policies and not dev.policy_history
    changed = [
        cap
        for cap, policy in policies.items()
        if cap not in dev.capacity_policy_versions or dev.policies.get(cap) != policy
    ]
    if not changed:
        return
    version = dev.policy_version if fresh else dev.policy_version + 1
    for cap in changed:
        dev.policies[cap] = policies[cap]
        dev.capacity_policy_versions[cap] = version
        dev.policy_history.setdefault(cap, []).append(
            PolicyRecord(version=version, policy=policies[cap])
        )
    dev.policy_version = version


def _slice_withdrawn(state: ClusterState, ev: ResourceSliceWithdrawn, position: int) -> None:
    name = ev.name
    rslice = state.slices.pop(name, None)
    if rslice is None:
        return
    spec = rslice.spec
    for device in spec.devices or ():
        dev = state.devices.get((spec.driver, spec.pool.name, device.name))
        if dev is not None and dev.slice == name:
            dev.present = False
    pool = state.pools.get((spec.driver, spec.pool.name))
    if pool is not None and name in pool.slices:
        pool.slices.remove(name)
        if not pool.slices:
            del state.pools[(spec.driver, spec.pool.name)]


def _policy_changed(state: ClusterState, ev: RequestPolicyChanged, position: int) -> None:
    dev = state.devices.get((ev.driver, ev.pool, ev.device))
    if dev is None or ev.capacity not in dev.total:
        raise InvariantViolation(
            position,
            "policy",
            f"no capacity {ev.capacity!r} on device {ev.driver}/{ev.pool}/{ev.device}",
        )
    # the number its decider expected, unless a slice published meanwhile took it
    version = max(ev.policy_version, dev.policy_version + 1)
    dev.policies[ev.capacity] = ev.policy
    dev.capacity_policy_versions[ev.capacity] = version
    dev.policy_history.setdefault(ev.capacity, []).append(
        PolicyRecord(version=version, policy=ev.policy)
    )
    dev.policy_version = version


# --- the step table ------------------------------------------------------------------

# What each event means: one step per event class, each ``(state, event, position)``
# (see the module docstring for why a table and not a ``match``).


def _limit_removed(state: ClusterState, ev: LimitRemoved, position: int) -> None:
    share = _share_for(state, ev.share_id, position)
    share.limit_removed = True
    if share.state != "ready":
        return  # released, releasing or never applied: only noted
    # a kubelet unprepare: still allocated, its capacity held, no limit in force; the
    # next prepare applies it again (bound), and the claim is Ready only then
    _set_share(state, share, "bound")
    share.limit_level = None
    share.actual = None
    claim = state.claims.get(share.claim)
    if (
        claim is not None
        and claim.phase == "ready"
        and claim.allocation_version == share.allocation_version
    ):
        _set_phase(state, claim, "allocated")


def _claim_admitted(state: ClusterState, ev: ClaimAdmitted, position: int) -> None:
    key = (ev.namespace, ev.name)
    claim = state.claims.get(key)
    if claim is None:
        _new_claim(state, key, "admitted")
    else:
        _set_phase(state, claim, "admitted")


def _claim_rejected(state: ClusterState, ev: ClaimRejected, position: int) -> None:
    claim = _claim_record(state, ev.namespace, ev.name)
    _set_phase(state, claim, "rejected")
    claim.reason = ev.summary


def _claim_unschedulable(state: ClusterState, ev: ClaimUnschedulable, position: int) -> None:
    claim = _claim_record(state, ev.namespace, ev.name)
    _set_phase(state, claim, "unschedulable")
    claim.reason = ev.reason


def _share_unknown(state: ClusterState, ev: ShareMarkedUnknown, position: int) -> None:
    _mark_unknown(state, _share_for(state, ev.share_id, position))


def _class_applied(state: ClusterState, ev: DeviceClassApplied, position: int) -> None:
    name = ev.device_class.metadata.name
    before = state.classes.get(name)
    state.classes[name] = DeviceClassState(
        device_class=ev.device_class,
        rollout=ev.rollout,
        mode=before.mode if before is not None else "consumable",
        min_enforcement=before.min_enforcement if before is not None else "none",
    )


def _class_removed(state: ClusterState, ev: DeviceClassRemoved, position: int) -> None:
    state.classes.pop(ev.name, None)


def _class_mode_set(state: ClusterState, ev: ClassModeSet, position: int) -> None:
    cls = state.classes.get(ev.name)
    if cls is not None:  # the decision refuses an unknown class; a late one changes nothing
        cls.mode = ev.mode
        cls.min_enforcement = ev.min_enforcement


def _access_set(state: ClusterState, ev: NamespaceAccessSet, position: int) -> None:
    state.namespaces[ev.namespace] = NamespaceState(
        classes=list(ev.classes),
        admin_access=ev.admin_access,
        opaque_config_classes=list(ev.opaque_config_classes),
        max_claims=ev.max_claims,
        max_requests_per_claim=ev.max_requests_per_claim,
    )


def _claim_withdrawn(state: ClusterState, ev: ClaimWithdrawn, position: int) -> None:
    claim = _claim_record(state, ev.namespace, ev.name)
    if claim.phase in _LIVE_CLAIM_PHASES:
        detail = f"claim {ev.namespace}/{ev.name} is {claim.phase}: release it, not withdraw"
        raise InvariantViolation(position, "identity", detail)
    _set_phase(state, claim, "withdrawn")


def _device_health(state: ClusterState, ev: DeviceHealthChanged, position: int) -> None:
    dev = state.devices.get((ev.driver, ev.pool, ev.device))
    if dev is not None and (dev.node is None or dev.node == ev.node):
        dev.unhealthy = None if ev.healthy else (ev.reason or "reported unhealthy")


def _started(state: ClusterState, claim: ClaimState) -> None:
    """A stalled claim that a consumer reserved or used is Ready again."""
    if claim.phase == "stalled":
        _set_phase(state, claim, "ready")  # stalled -> ready
        claim.reason = None


def _claim_reserved(state: ClusterState, ev: ClaimReserved, position: int) -> None:
    claim = state.claims.get((ev.namespace, ev.name))
    if claim is None or claim.phase not in _LIVE_CLAIM_PHASES:
        return  # the API refuses it; a late one changes nothing
    if ev.consumer not in claim.reserved_for:
        claim.reserved_for.append(ev.consumer)
    _started(state, claim)


def _claim_unreserved(state: ClusterState, ev: ClaimUnreserved, position: int) -> None:
    claim = state.claims.get((ev.namespace, ev.name))
    if claim is not None and ev.consumer in claim.reserved_for:
        claim.reserved_for.remove(ev.consumer)


def _share_used(state: ClusterState, ev: ShareUsed, position: int) -> None:
    share = _share_for(state, ev.share_id, position)
    if share.node is not None and share.node != ev.node:
        return  # another node's report about it: the store refuses those; nothing here
    share.used = True
    claim = state.claims.get(share.claim)
    if claim is not None and claim.allocation_version == share.allocation_version:
        _started(state, claim)


def _claim_stalled(state: ClusterState, ev: ClaimStalled, position: int) -> None:
    claim = state.claims.get((ev.namespace, ev.name))
    if claim is None or claim.phase != "ready" or claim.allocation_version != ev.allocation_version:
        return  # stale: released, reserved or used meanwhile (the decider read a version)
    _set_phase(state, claim, "stalled")  # ready -> stalled
    claim.reason = ev.reason


def _dead_lettered(state: ClusterState, ev: MessageDeadLettered, position: int) -> None:
    state.dead_letters += 1


def _noted(state: ClusterState, ev: Event, position: int) -> None:
    """A report that changes no state (the agent's reconciliation, a checkpoint set aside,
    an append refused for a stale epoch)."""


_STEPS: Final[dict[type, Step]] = {
    CapacityReserved: _reserve,
    CapacityReleased: _release,
    AllocationBound: _bind,
    LimitApplied: _limit_applied,
    LimitFailed: _limit_failed,
    LimitRemoved: _limit_removed,
    EnforcementReconciled: _noted,
    EnforcementCheckpointSetAside: _noted,
    ReleaseRequested: _release_requested,
    ClaimSubmitted: _claim_submitted,
    ClaimAdmitted: _claim_admitted,
    ClaimRejected: _claim_rejected,
    ClaimUnschedulable: _claim_unschedulable,
    NodeLeaseAcquired: _lease_acquired,
    NodeLeaseExpired: _lease_expired,
    ShareMarkedUnknown: _share_unknown,
    NodeFenced: _fenced,
    ShareConfirmed: _confirmed,
    AppendRefused: _noted,
    DeviceHealthChanged: _device_health,
    ShareUsed: _share_used,
    ClaimStalled: _claim_stalled,
    ClaimReserved: _claim_reserved,
    ClaimUnreserved: _claim_unreserved,
    ResourceSlicePublished: _slice_published,
    ResourceSliceWithdrawn: _slice_withdrawn,
    RequestPolicyChanged: _policy_changed,
    DeviceClassApplied: _class_applied,
    DeviceClassRemoved: _class_removed,
    ClassModeSet: _class_mode_set,
    NamespaceAccessSet: _access_set,
    ClaimWithdrawn: _claim_withdrawn,
    MessageDeadLettered: _dead_lettered,
}
