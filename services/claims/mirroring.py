"""Kubernetes mode: kube-scheduler's allocations mirrored into the log (pure decisions).

In Kubernetes mode kube-scheduler allocates ResourceClaims (it implements the same
consumable-capacity rules as dracap's allocator) and writes ``status.allocation``. The
bridge (:mod:`services.claims.bridge`) watches the claims and hands each one it sees to
:func:`decide_claim`, which says what the log must record so that dracap's ledger holds
exactly what Kubernetes allocated on dracap's drivers' devices:

* a claim allocated on dracap's devices that the log does not hold yet (unknown, or in a
  reusable phase, or refused before for another allocation) is **mirrored** in one
  append: ``ClaimSubmitted(source="kubernetes")`` with the claim as the API server has it
  (its ``metadata.uid`` identifies it), ``ClaimAdmitted``, one ``CapacityReserved`` per
  device result of dracap's drivers (the result's ``shareID``; a dedicated device gets a
  ShareID derived from the claim's UID, the allocation version, the request and the
  device, so a second decision on the same allocation names the same shares, and a
  later allocation of the same claim other ones) and ``AllocationBound``. The database's
  guards check the capacity invariant in that append, as for every reservation;
* an allocation that would break an invariant in dracap's ledger (a device past its
  total, a second holder of a dedicated device, a share outside the policy it was granted
  under, a device dracap has not published) is **refused**: ``ClaimSubmitted`` +
  ``ClaimRejected`` naming the result and the rule. The decision is the fold's own: the
  reservations are folded on a scratch copy of the devices they touch
  (:func:`_trial`), so the rule is written once. The agent then refuses the claim at
  prepare, and the bridge shows why in the claim's ``status.devices`` conditions;
* a mirrored claim whose allocation went away (deallocated, deleted, recreated with
  another UID, or allocated anew) gets ``ReleaseRequested``: the agent removes its
  limits and gives the capacity back (through the fencing rules when its node is lost).
  An allocation dracap released while Kubernetes still holds it (the kubelet unprepared
  it, or the not-started rule released it) stays released: nothing is recorded until
  Kubernetes deallocates it or allocates the claim anew. A released claim that
  Kubernetes no longer allocates (deallocated, deleted) gets ``ClaimWithdrawn``: its
  record ends, and the next allocation of the claim is mirrored anew;
* ``status.reservedFor`` is mirrored as ``ClaimReserved`` / ``ClaimUnreserved`` (the
  consumers ``<resource>/<namespace>/<name>``), which the not-started rule reads.

Every rule compares the claim with the folded log, never with what the bridge saw
before: a watch restarted or re-listed after ``410 Gone`` hands the same claim again,
and the decision is then empty. That is what makes mirroring exactly once.

Kubernetes' own admission (RBAC, quota, the DRA gates) decided who may have the claim;
dracap's namespace access rules (``dracap namespace set``) are the standalone API's and
are not applied to mirrored claims (``docs/kubernetes.md``).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Collection
from typing import Final

import msgspec

from events.catalog import (
    AllocationBound,
    CapacityReserved,
    ClaimAdmitted,
    ClaimRejected,
    ClaimReserved,
    ClaimSubmitted,
    ClaimUnreserved,
    ClaimWithdrawn,
    Event,
    ReleaseRequested,
)
from events.envelopes import claim_stream, device_stream
from events.errors import InvariantViolation
from events.fold import apply_event
from events.model import (
    AllocationResult,
    DeviceRequestAllocationResult,
    ResourceClaim,
    ResourceClaimConsumerReference,
)
from events.state import REUSABLE_PHASES, ClaimState, ClusterState, DeviceKey

__all__ = [
    "BRIDGE_SERVICE",
    "RELEASABLE",
    "SOURCE",
    "Mirror",
    "consumer_of",
    "decide_claim",
    "decide_deleted",
    "results_of",
    "share_id_of",
]

SOURCE: Final = "kubernetes"
BRIDGE_SERVICE: Final = "kubernetes-bridge"  #: the actor is ``system:kubernetes-bridge``
#: ShareIDs of dedicated devices: uuid5 in this namespace of "uid/request/driver/pool/device"
_SHARE_NAMESPACE: Final = uuid.UUID("5f0f3c62-6f2b-4c43-9f59-2d3b8d0e6a41")
#: phases of a mirrored claim that a release request acts on (the fold ignores the others)
RELEASABLE: Final = frozenset({"allocated", "retrying", "ready", "stalled", "failed"})


class Mirror(msgspec.Struct, frozen=True, kw_only=True):
    """What to append for one claim: ``(stream, event)`` pairs in the order they fold
    (every device stream's events before the claim stream's: one append names a stream once).

    ``claim_stream`` is the stream whose version the append must expect (the claim's);
    ``mirrored``/``refused``/``released`` say which rule decided, for metrics and logs.
    """

    claim_stream: str
    events: tuple[tuple[str, Event], ...] = ()
    #: mirrored | refused | released | reserved | withdrawn | unchanged
    outcome: str = "unchanged"


def results_of(
    claim: ResourceClaim, drivers: Collection[str]
) -> list[DeviceRequestAllocationResult]:
    """The device results of ``claim``'s allocation that are dracap's drivers'."""
    return [r for r in results_of_any(claim) if r.driver in drivers]


def share_id_of(uid: str, version: int, result: DeviceRequestAllocationResult) -> str:
    """The ShareID of a result of allocation ``version``: its ``shareID``, or for a
    dedicated device one derived from the claim, the allocation version and the device
    (the same decision twice names the same share; a later allocation, another)."""
    if result.share_id:
        return result.share_id
    name = f"{uid}/{version}/{result.request}/{result.driver}/{result.pool}/{result.device}"
    return str(uuid.uuid5(_SHARE_NAMESPACE, name))


def consumer_of(namespace: str, ref: ResourceClaimConsumerReference) -> str:
    """A ``reservedFor`` entry as dracap names consumers: ``pod/<namespace>/<name>``."""
    resource = ref.resource[:-1] if ref.resource.endswith("s") else ref.resource
    return f"{resource}/{namespace}/{ref.name}"


def _node_of(
    state: ClusterState, claim: ResourceClaim, results: list[DeviceRequestAllocationResult]
) -> str | None:
    """The node the allocation lives on: its devices' (a node-local pool's) node."""
    for result in results:
        dev = state.devices.get((result.driver, result.pool, result.device))
        if dev is not None and dev.node is not None:
            return dev.node
    return None


def _same_allocation(
    current: ClaimState, uid: str, results: list[DeviceRequestAllocationResult]
) -> bool:
    """Whether ``current`` records the allocation these results describe."""
    version = current.allocation_version
    return set(current.share_ids) == {share_id_of(uid, version, r) for r in results}


def _recorded_results(
    current: ClaimState, drivers: Collection[str]
) -> list[DeviceRequestAllocationResult]:
    recorded = current.spec.results if current.spec is not None else ()
    return [r for r in recorded if r.driver in drivers]


def _release(current: ClaimState, reason: str) -> Mirror:
    stream = claim_stream(current.namespace, current.name)
    event = ReleaseRequested(
        namespace=current.namespace,
        name=current.name,
        allocation_version=current.allocation_version,
        node=current.node,
        reason=reason,
    )
    return Mirror(claim_stream=stream, events=((stream, event),), outcome="released")


def _withdrawn(current: ClaimState | None, uid: str | None, stream: str) -> Mirror:
    """``ClaimWithdrawn`` of a mirrored claim dracap released that Kubernetes no longer
    allocates (deallocated or deleted): its record ends, and a later allocation of the
    claim is mirrored anew."""
    if (
        current is None
        or current.source != SOURCE
        or (uid is not None and current.uid != uid)
        or current.phase != "released"
    ):
        return Mirror(claim_stream=stream)
    event = ClaimWithdrawn(namespace=current.namespace, name=current.name)
    return Mirror(claim_stream=stream, events=((stream, event),), outcome="withdrawn")


def decide_deleted(state: ClusterState, namespace: str, name: str, uid: str | None) -> Mirror:
    """What to record when the ResourceClaim ``namespace/name`` was deleted."""
    stream = claim_stream(namespace, name)
    current = state.claims.get((namespace, name))
    if current is not None and current.phase == "released":
        return _withdrawn(current, uid, stream)
    if (
        current is None
        or current.source != SOURCE
        or (uid is not None and current.uid != uid)
        or current.phase not in RELEASABLE
    ):
        return Mirror(claim_stream=stream)
    return _release(current, "the ResourceClaim was deleted in Kubernetes")


def decide_claim(state: ClusterState, claim: ResourceClaim, drivers: Collection[str]) -> Mirror:
    """What the log must record for ``claim`` as the API server has it now (module doc)."""
    meta = claim.metadata
    namespace, name, uid = meta.namespace or "", meta.name, meta.uid or ""
    stream = claim_stream(namespace, name)
    results = results_of(claim, drivers)
    current = state.claims.get((namespace, name))
    live = current is not None and current.phase not in REUSABLE_PHASES
    if current is not None and live:
        if current.source != SOURCE or current.uid != uid:
            if current.source == SOURCE and current.phase in RELEASABLE:
                return _release(current, "the ResourceClaim was recreated in Kubernetes")
            return Mirror(claim_stream=stream)  # a standalone claim of that name: not ours
        if not results:
            if current.phase in RELEASABLE:
                return _release(current, "deallocated in Kubernetes")
            return Mirror(claim_stream=stream)
        if not _same_allocation(current, uid, results):
            if current.phase in RELEASABLE:
                return _release(current, "allocated anew in Kubernetes")
            return Mirror(claim_stream=stream)  # releasing: mirrored anew once released
        return _reservations(current, claim, stream)
    if not results:
        return _withdrawn(current, uid, stream)
    if current is not None and current.source == SOURCE and current.uid == uid:
        if current.phase == "rejected" and _recorded_results(current, drivers) == results:
            return Mirror(claim_stream=stream)  # refused once for this allocation: stays so
        if current.phase == "released" and _same_allocation(current, uid, results):
            # released in dracap (a kubelet unprepare, the not-started rule) while
            # Kubernetes still holds it: it stays released until allocated anew
            return Mirror(claim_stream=stream)
    return _mirror(state, claim, current, results, stream)


def _reservations(current: ClaimState, claim: ResourceClaim, stream: str) -> Mirror:
    """``ClaimReserved`` / ``ClaimUnreserved`` that make the log's consumers the API's."""
    namespace, name = current.namespace, current.name
    status = claim.status
    wanted = [
        consumer_of(namespace, ref) for ref in (status.reserved_for if status else None) or ()
    ]
    events: list[tuple[str, Event]] = []
    for consumer in current.reserved_for:
        if consumer not in wanted:
            events.append(
                (stream, ClaimUnreserved(namespace=namespace, name=name, consumer=consumer))
            )
    for consumer in wanted:
        if consumer not in current.reserved_for:
            events.append(
                (stream, ClaimReserved(namespace=namespace, name=name, consumer=consumer))
            )
    return Mirror(
        claim_stream=stream, events=tuple(events), outcome="reserved" if events else "unchanged"
    )


def _mirror(
    state: ClusterState,
    claim: ResourceClaim,
    current: ClaimState | None,
    results: list[DeviceRequestAllocationResult],
    stream: str,
) -> Mirror:
    meta = claim.metadata
    namespace, name, uid = meta.namespace or "", meta.name, meta.uid or ""
    version = (current.allocation_version if current is not None else 0) + 1
    node = _node_of(state, claim, results)
    reserved: list[tuple[str, CapacityReserved]] = []
    for result in results:
        dev = state.devices.get((result.driver, result.pool, result.device))
        shared = dev.allow_multiple_allocations if dev is not None else result.share_id is not None
        reserved.append(
            (
                device_stream(result.driver, result.pool, result.device),
                CapacityReserved(
                    namespace=namespace,
                    name=name,
                    allocation_version=version,
                    request=result.request,
                    driver=result.driver,
                    pool=result.pool,
                    device=result.device,
                    node=node,
                    share_id=share_id_of(uid, version, result),
                    shared=shared,
                    admin_access=bool(result.admin_access),
                    consumed=dict(result.consumed_capacity or {}) if shared else {},
                    policy_version=dev.policy_version if dev is not None else 1,
                ),
            )
        )
    submitted: tuple[str, Event] = (stream, ClaimSubmitted(claim=claim, source=SOURCE))
    refusal = _trial(state, [event for _, event in reserved])
    if refusal is not None:
        index, violation = refusal
        rejected = ClaimRejected(
            namespace=namespace,
            name=name,
            field=f"status.allocation.devices.results[{_index_in(claim, results[index])}]",
            rule=f"dracap's ledger refuses the allocation ({violation.invariant})",
            reason=violation.detail,
        )
        return Mirror(
            claim_stream=stream, events=(submitted, (stream, rejected)), outcome="refused"
        )
    allocation = claim.status.allocation if claim.status is not None else None
    bound = AllocationBound(
        namespace=namespace,
        name=name,
        allocation_version=version,
        node=node,
        allocation=allocation if allocation is not None else AllocationResult(),
        share_ids=[event.share_id for _, event in reserved],
    )
    # the order of the append: a stream appears once in it, so the device streams'
    # reservations go first and the claim's own events after (as in a reservation round)
    events: list[tuple[str, Event]] = list(reserved)
    events += [submitted, (stream, ClaimAdmitted(namespace=namespace, name=name))]
    events.append((stream, bound))
    status = claim.status
    for ref in (status.reserved_for if status else None) or ():
        consumer = consumer_of(namespace, ref)
        events.append((stream, ClaimReserved(namespace=namespace, name=name, consumer=consumer)))
    return Mirror(claim_stream=stream, events=tuple(events), outcome="mirrored")


def _index_in(claim: ResourceClaim, result: DeviceRequestAllocationResult) -> int:
    """The index of ``result`` among all of the allocation's results (for the field path)."""
    return next((i for i, r in enumerate(results_of_any(claim)) if r is result), 0)


def results_of_any(claim: ResourceClaim) -> list[DeviceRequestAllocationResult]:
    """Every device result of ``claim``'s allocation, whichever driver's."""
    status = claim.status
    allocation = status.allocation if status is not None else None
    devices = allocation.devices if allocation is not None else None
    return list((devices.results if devices else None) or ())


def _trial(
    state: ClusterState, reservations: list[CapacityReserved]
) -> tuple[int, InvariantViolation] | None:
    """Fold ``reservations`` on copies of the devices they touch; the first refusal, if any.

    Only the touched devices are copied (a mirror touches a handful), so the check costs
    what the reservations cost, not what the cluster's state weighs.
    """
    scratch = ClusterState(position=state.position)
    for event in reservations:
        key: DeviceKey = (event.driver, event.pool, event.device)
        if key not in scratch.devices and key in state.devices:
            scratch.devices[key] = copy.deepcopy(state.devices[key])
    for i, event in enumerate(reservations):
        if event.share_id in state.shares:
            detail = f"share {event.share_id} is already in the ledger"
            return i, InvariantViolation(0, "identity", detail)
        try:
            apply_event(scratch, event, 0)
        except InvariantViolation as exc:
            return i, exc
    return None
