"""What the database checks inside an append, derived from the fold.

The fold (:mod:`events.fold`) is the one definition of what an event means. Three of
its rules must also hold where the log is written, because a decision may be taken on
a stale view (or be wrong) and a refused append is the last line of defence:

* ``capacity``: the consumed amount of a device capacity never exceeds its total;
* ``exclusive``: a device that does not allow multiple allocations has at most one
  live, non-admin holder;
* ``release once``: a share gives its capacity back once, however many times its
  release (or its node's fence) is logged.

:func:`guards_of` restates, per event, what the fold does to the state those rules
read, as :data:`Guard` values: a tagged msgspec union, encoded as JSON objects that
the server reads by field name (``c->>'share_id'``). The database applies them with
one function, ``dracap_guard`` (migration 0005), on every append path; its tables are
small because they hold only what the rules need:

* ``capacity_ledger``: total and allocated per (device, capacity), with
  ``CHECK (allocated <= total)``;
* ``held_shares``: every live non-admin share and the amounts it holds — releasing
  deletes the row, so a second release finds nothing to give back;
* ``device_holds``: the exclusive holder of a dedicated device (its key is the device);
* ``node_epochs``: the newest expired or fenced epoch per node, so a stale fence (an
  epoch older than one already acted on) releases nothing, as in the fold;
* ``node_leases``: the lease each node's agent holds now (migration 0007). A new lease
  (``acquire``) must be numbered exactly one more than the newest epoch of its node in
  either table, or the append is refused as a conflict; appends of an agent whose
  actor names an older epoch are refused by the append function itself.

Which reservations count and which take a hold is decided by the fold's own
predicates (:func:`events.fold.counts_capacity`, :func:`events.fold.holds_device`), so
the rule has one home. Everything else the fold keeps (claim phases, share states,
readiness) is checked by the fold alone and needs no table: a service reads it from
its live view, ``dracap replay`` from the log.

Adding an event type touches this module only if the event changes one of the three
rules above; ``tests/unit/test_guards.py`` folds every event of a scenario and checks
that applying its guards to a model of the tables gives the fold's numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from typing import Final, TypeAlias

import msgspec

from events.catalog import (
    CapacityReleased,
    CapacityReserved,
    Event,
    NodeFenced,
    NodeLeaseAcquired,
    NodeLeaseExpired,
    ResourceSlicePublished,
)
from events.fold import counts_capacity, holds_device
from events.quantities import Quantity

__all__ = [
    "Acquire",
    "Fence",
    "Guard",
    "NoteEpoch",
    "Release",
    "Reserve",
    "SetTotal",
    "amount",
    "encode_guards",
    "guards_of",
    "guards_of_many",
]


def amount(quantity: Quantity) -> Decimal:
    """The exact decimal value of ``quantity`` (nanos scaled by 1e-9)."""
    return Decimal(quantity.nanos).scaleb(-9)


class _Guard(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Common base: a JSON object with a ``kind`` and ``at``, the event's 1-based offset
    in its append (the server adds the append's base position)."""

    at: int


class SetTotal(_Guard, frozen=True, kw_only=True, tag="set_total"):
    """A slice publishes ``total`` for one device capacity (creating its ledger row)."""

    driver: str
    pool: str
    device: str
    capacity: str
    total: str


class Reserve(_Guard, frozen=True, kw_only=True, tag="reserve"):
    """A non-admin share takes ``amounts`` (and, if ``exclusive``, the device's hold).

    Refused if a capacity has no ledger row (never published: SQLSTATE ``DR002``),
    if an amount would pass the total (the ledger's CHECK), or if the device is held.
    """

    share_id: str
    driver: str
    pool: str
    device: str
    node: str | None
    namespace: str
    claim: str
    amounts: dict[str, str]
    exclusive: bool


class Release(_Guard, frozen=True, kw_only=True, tag="release"):
    """A share gives back what it holds; nothing if it holds nothing (any more)."""

    share_id: str


class NoteEpoch(_Guard, frozen=True, kw_only=True, tag="note_epoch"):
    """A node's lease of ``epoch`` expired: fences of older epochs are stale from now."""

    node: str
    epoch: int


class Fence(_Guard, frozen=True, kw_only=True, tag="fence"):
    """Unless ``epoch`` is stale, every share held on ``node`` is released."""

    node: str
    epoch: int


class Acquire(_Guard, frozen=True, kw_only=True, tag="acquire"):
    """A node agent takes lease ``epoch`` of ``node`` for ``ttl_ms``; refused (a conflict)
    unless ``epoch`` is one more than the node's newest lease, expired or fenced epoch."""

    node: str
    epoch: int
    boot_id: str
    ttl_ms: int


Guard: TypeAlias = SetTotal | Reserve | Release | NoteEpoch | Fence | Acquire

_NONE: Final[list[Guard]] = []


def _totals(event: ResourceSlicePublished, at: int) -> list[Guard]:
    spec = event.slice.spec
    return [
        SetTotal(
            at=at,
            driver=spec.driver,
            pool=spec.pool.name,
            device=device.name,
            capacity=name,
            total=str(amount(capacity.value)),
        )
        for device in spec.devices or ()
        for name, capacity in sorted((device.capacity or {}).items())
    ]


def _reserve(event: CapacityReserved, at: int) -> list[Guard]:
    if not counts_capacity(event):
        return _NONE
    return [
        Reserve(
            at=at,
            share_id=event.share_id,
            driver=event.driver,
            pool=event.pool,
            device=event.device,
            node=event.node,
            namespace=event.namespace,
            claim=event.name,
            amounts={name: str(amount(q)) for name, q in sorted(event.consumed.items())},
            exclusive=holds_device(event),
        )
    ]


def guards_of(event: Event, at: int = 1) -> list[Guard]:
    """The guards of one event at offset ``at`` of its append (often none)."""
    match event:
        case CapacityReserved():
            return _reserve(event, at)
        case CapacityReleased():
            return [Release(at=at, share_id=event.share_id)]
        case ResourceSlicePublished():
            return _totals(event, at)
        case NodeLeaseExpired():
            return [NoteEpoch(at=at, node=event.node, epoch=event.epoch)]
        case NodeFenced():
            return [Fence(at=at, node=event.node, epoch=event.epoch)]
        case NodeLeaseAcquired():
            return [
                Acquire(
                    at=at,
                    node=event.node,
                    epoch=event.epoch,
                    boot_id=event.boot_id,
                    ttl_ms=event.ttl_ms,
                )
            ]
    return _NONE


def guards_of_many(events: Sequence[Event]) -> list[Guard]:
    """The guards of the events of one append, in log order (offsets from 1)."""
    out: list[Guard] = []
    for at, event in enumerate(events, start=1):
        out += guards_of(event, at)
    return out


_ENCODER: Final = msgspec.json.Encoder()


def encode_guards(guards: Sequence[Guard]) -> bytes:
    """The JSON array ``dracap_guard`` takes."""
    return _ENCODER.encode(guards)
