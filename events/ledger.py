"""What each event changes in the database's projections, as pure data.

The event store writes an event and the projection rows it implies in one
transaction. This module says *which* rows, without any I/O: :func:`ledger_deltas`
gives the capacity-ledger changes of one event, :func:`projection_changes` the rows of
the ``device_holds``, ``shares`` and ``claims`` tables; ``services.runtime`` turns the
changes into SQL. The fold (:mod:`events.fold`) is the other, independent reading of
the same events; ``dracap replay verify`` checks that both agree (invariant 8).

Capacity ledger (invariant 1, second enforcement):

* ``ResourceSlicePublished`` sets the ``total`` of every (device, capacity) it lists;
* ``CapacityReserved`` adds ``consumed`` to ``allocated`` unless ``admin_access``
  (admin shares never count as consumption); a capacity without a ledger row is
  refused (the device was never published);
* ``CapacityReleased`` subtracts ``consumed`` again (unless ``admin_access``), but only
  the first time for a share: the change is *guarded* by the share's state, so a
  duplicate release subtracts nothing (invariant 5).

The database enforces ``0 <= allocated <= total`` with CHECK constraints, so a
reservation that would oversubscribe a device is refused even if the allocator
erred.

Exclusive devices (invariant 4): a non-admin reservation of a device that does not
allow multiple allocations (``shared`` false) takes a row in ``device_holds``, whose
primary key is the device; a second hold is a unique violation. Releasing the share
drops its hold.

Shares and claims follow the fold's state machine (:mod:`events.fold`): share states
``reserved -> bound -> ready -> releasing -> released`` with ``unknown`` after a lost
lease; a claim's phase is derived the same way (``ready`` once every share that needs
a limit has one, ``released`` once every share of its allocation is released, ``failed``
on a permanent limit failure or a fence). Changes whose effect depends on current rows
(a guarded release, a node fence) are expressed as one change each and evaluated
against the rows by the store's SQL, inside the append transaction.

Quantities travel as exact :class:`decimal.Decimal` values (nanos scaled by 1e-9) so
that ``numeric`` columns compare exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any, Final, TypeAlias

import msgspec

from events.catalog import (
    AllocationBound,
    CapacityReleased,
    CapacityReserved,
    ClaimAdmitted,
    ClaimRejected,
    ClaimSubmitted,
    ClaimUnschedulable,
    ClaimWithdrawn,
    EnforcementCheckpointSetAside,
    EnforcementReconciled,
    Event,
    LimitApplied,
    LimitFailed,
    LimitRemoved,
    MessageDeadLettered,
    NodeFenced,
    NodeLeaseExpired,
    ReleaseRequested,
    ResourceSlicePublished,
    ShareConfirmed,
    ShareMarkedUnknown,
)
from events.quantities import Quantity

#: Share states in which a share still holds capacity.
LIVE_SHARE_STATES: tuple[str, ...] = ("reserved", "bound", "ready", "unknown", "releasing")


def amount(quantity: Quantity) -> Decimal:
    """The exact decimal value of ``quantity``."""
    return Decimal(quantity.nanos).scaleb(-9)


class _Change(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Common base of every change."""


class SetTotal(_Change, frozen=True, kw_only=True):
    """Create the ledger row of a device capacity or set its total."""

    driver: str
    pool: str
    device: str
    capacity: str
    total: Decimal


class Reserve(_Change, frozen=True, kw_only=True):
    """Add ``amount`` to ``allocated`` of an existing ledger row (refused if none)."""

    driver: str
    pool: str
    device: str
    capacity: str
    amount: Decimal


class HoldDevice(_Change, frozen=True, kw_only=True):
    """Take the exclusive hold of a dedicated device."""

    driver: str
    pool: str
    device: str
    share_id: str
    namespace: str
    claim: str


class InsertShare(_Change, frozen=True, kw_only=True):
    """A new share row in state ``reserved``; the claim moves to its allocation version."""

    share_id: str
    namespace: str
    claim: str
    allocation_version: int
    request: str
    driver: str
    pool: str
    device: str
    node: str | None
    shared: bool
    admin_access: bool
    consumed: dict[str, str]
    amounts: dict[str, Decimal]
    policy_version: int


class ReleaseShare(_Change, frozen=True, kw_only=True):
    """Release a live share: capacity back, hold dropped, claim maybe ``released``.

    Applied to a share that is already released it changes nothing (invariant 5).
    """

    share_id: str


class BindAllocation(_Change, frozen=True, kw_only=True):
    """Shares ``reserved -> bound``; the claim is ``allocated`` (maybe ``ready``)."""

    namespace: str
    name: str
    allocation_version: int
    node: str | None
    share_ids: tuple[str, ...]


class ApplyLimit(_Change, frozen=True, kw_only=True):
    """A share is ``ready`` at ``level``; its claim maybe ``ready``."""

    share_id: str
    level: str


class FailLimit(_Change, frozen=True, kw_only=True):
    """A permanent limit failure fails the share's claim (current allocation only)."""

    share_id: str
    reason: str


class RequestRelease(_Change, frozen=True, kw_only=True):
    """The claim's allocation is ``releasing`` (a stale version changes nothing)."""

    namespace: str
    name: str
    allocation_version: int


class MarkUnknown(_Change, frozen=True, kw_only=True):
    """One share, or every live share of ``node`` (lease expired at ``epoch``), unknown."""

    share_id: str | None = None
    node: str | None = None
    epoch: int | None = None


class ConfirmShare(_Change, frozen=True, kw_only=True):
    """An unknown share goes back to the state it had; an expired lease is live again."""

    share_id: str
    node: str


class FenceNode(_Change, frozen=True, kw_only=True):
    """Every live share of ``node`` is released; their claims fail (or finish releasing)."""

    node: str
    epoch: int


class UpsertClaim(_Change, frozen=True, kw_only=True):
    """Set a claim's phase; ``submitted`` keeps a live phase; ``reason`` when ``set_reason``."""

    namespace: str
    name: str
    phase: str
    reason: str | None = None
    set_reason: bool = True


Change: TypeAlias = (
    SetTotal
    | Reserve
    | HoldDevice
    | InsertShare
    | ReleaseShare
    | BindAllocation
    | ApplyLimit
    | FailLimit
    | RequestRelease
    | MarkUnknown
    | ConfirmShare
    | FenceNode
    | UpsertClaim
)


def _totals(event: ResourceSlicePublished) -> list[Change]:
    spec = event.slice.spec
    out: list[Change] = []
    for device in spec.devices or ():
        for name, capacity in sorted((device.capacity or {}).items()):
            out.append(
                SetTotal(
                    driver=spec.driver,
                    pool=spec.pool.name,
                    device=device.name,
                    capacity=name,
                    total=amount(capacity.value),
                )
            )
    return out


def _amounts(event: CapacityReserved) -> dict[str, Decimal]:
    if event.admin_access:
        return {}
    return {name: amount(q) for name, q in sorted(event.consumed.items())}


def ledger_deltas(event: Event) -> list[Change]:
    """The capacity-ledger changes ``event`` implies (possibly none).

    ``CapacityReleased`` and ``NodeFenced`` give capacity back too, but how much
    depends on the share rows (a duplicate release gives nothing back); their
    changes (:class:`ReleaseShare`, :class:`FenceNode`) are in
    :func:`projection_changes` and move the ledger as well.
    """
    match event:
        case ResourceSlicePublished():
            return _totals(event)
        case CapacityReserved():
            return [
                Reserve(
                    driver=event.driver,
                    pool=event.pool,
                    device=event.device,
                    capacity=name,
                    amount=value,
                )
                for name, value in _amounts(event).items()
            ]
    return []


def _share_row(event: CapacityReserved) -> list[Change]:
    out: list[Change] = []
    if not event.shared and not event.admin_access:
        out.append(
            HoldDevice(
                driver=event.driver,
                pool=event.pool,
                device=event.device,
                share_id=event.share_id,
                namespace=event.namespace,
                claim=event.name,
            )
        )
    out.append(
        InsertShare(
            share_id=event.share_id,
            namespace=event.namespace,
            claim=event.name,
            allocation_version=event.allocation_version,
            request=event.request,
            driver=event.driver,
            pool=event.pool,
            device=event.device,
            node=event.node,
            shared=event.shared,
            admin_access=event.admin_access,
            consumed={k: v.canonical() for k, v in sorted(event.consumed.items())},
            amounts=_amounts(event),
            policy_version=event.policy_version,
        )
    )
    return out


def _claim_changes(event: Event) -> list[Change]:
    match event:
        case ClaimSubmitted():
            meta = event.claim.metadata
            return [UpsertClaim(namespace=meta.namespace or "", name=meta.name, phase="submitted")]
        case ClaimAdmitted():
            return [
                UpsertClaim(
                    namespace=event.namespace, name=event.name, phase="admitted", set_reason=False
                )
            ]
        case ClaimRejected():
            return [
                UpsertClaim(
                    namespace=event.namespace,
                    name=event.name,
                    phase="rejected",
                    reason=event.summary,
                )
            ]
        case ClaimUnschedulable():
            return [
                UpsertClaim(
                    namespace=event.namespace,
                    name=event.name,
                    phase="unschedulable",
                    reason=event.reason,
                )
            ]
        case ClaimWithdrawn():
            return [
                UpsertClaim(
                    namespace=event.namespace, name=event.name, phase="withdrawn", set_reason=False
                )
            ]
    return []


def projection_changes(event: Event) -> list[Change]:
    """The ``device_holds``/``shares``/``claims`` changes ``event`` implies."""
    match event:
        case CapacityReserved():
            return _share_row(event)
        case CapacityReleased():
            return [ReleaseShare(share_id=event.share_id)]
        case AllocationBound():
            return [
                BindAllocation(
                    namespace=event.namespace,
                    name=event.name,
                    allocation_version=event.allocation_version,
                    node=event.node,
                    share_ids=tuple(event.share_ids),
                )
            ]
        case LimitApplied():
            return [ApplyLimit(share_id=event.share_id, level=event.level)]
        case LimitFailed():
            return (
                [] if event.retryable else [FailLimit(share_id=event.share_id, reason=event.reason)]
            )
        case ReleaseRequested():
            return [
                RequestRelease(
                    namespace=event.namespace,
                    name=event.name,
                    allocation_version=event.allocation_version,
                )
            ]
        case ShareMarkedUnknown():
            return [MarkUnknown(share_id=event.share_id)]
        case NodeLeaseExpired():
            return [MarkUnknown(node=event.node, epoch=event.epoch)]
        case ShareConfirmed():
            return [ConfirmShare(share_id=event.share_id, node=event.node)]
        case NodeFenced():
            return [FenceNode(node=event.node, epoch=event.epoch)]
    return _claim_changes(event)


def changes_of(event: Event) -> list[Change]:
    """Every row change of ``event``: ledger first, then projections."""
    return ledger_deltas(event) + projection_changes(event)


def _admitted(event: ClaimAdmitted) -> list[Change]:
    return [
        UpsertClaim(namespace=event.namespace, name=event.name, phase="admitted", set_reason=False)
    ]


def _none(event: Event) -> list[Change]:
    return []


#: :func:`changes_of` by event class, where a shorter path gives the same changes.
_CHANGES_BY_CLASS: Final[dict[type, Callable[[Any], list[Change]]]] = {
    ClaimAdmitted: _admitted,
    LimitRemoved: _none,
    EnforcementReconciled: _none,
    EnforcementCheckpointSetAside: _none,
    MessageDeadLettered: _none,
}


def changes_of_many(events: Sequence[Event], positions: Sequence[int]) -> list[tuple[Change, int]]:
    """``(change, position)`` for every change of ``events`` stored at ``positions``, in order.

    The same as :func:`changes_of` event by event.
    """
    out: list[tuple[Change, int]] = []
    shortcuts = _CHANGES_BY_CLASS
    for event, position in zip(events, positions, strict=True):
        changes = shortcuts.get(type(event), changes_of)(event)
        if len(changes) == 1:
            out.append((changes[0], position))
        else:
            out += [(change, position) for change in changes]
    return out
