"""The fold's driver: stored events in, the state out — and the events it refuses.

:mod:`events.fold` says what each event means; this module is the one place that
decides what a *reader* does with a stored event that cannot mean anything. Every
reader of the log folds through it — each service's live state, snapshots, the
forensic replay (state, timeline, diff, verify, export, import, plot, report), the
audit and billing subscribers, and the consumers' confirmation — so they all skip the
same events and fold the same state.

An event is **refused** when

* its payload does not decode into the catalog's class for its type and schema version
  (``undecodable``: :class:`~events.errors.CatalogError`, a tag this code does not
  know, a value of the wrong type, JSON that does not parse), or
* its step raises: an :class:`~events.errors.InvariantViolation` (``invariant``: a
  ``LimitApplied`` for a share that is already ready, say) or any other error
  (``error``).

A refused event is skipped: the state is left exactly as it was before it — a step
checks everything it needs before it changes anything (:mod:`events.fold`; the
property tests in ``tests/unit/test_folding.py`` hold every step to it) — except that
the state's position moves past it and :attr:`~events.fold.ClusterState.refused`
records it (position -> reason), so that a reader that starts from a snapshot still
knows which events before it were refused, and ``dracap replay verify`` can name every
one. Folding a log never stops at an event: the log is append-only, so an event a
reader stopped at would stop it forever. What a reader does with a :class:`Refusal`
beyond that (count it, log it once, report it) is I/O and lives in
:mod:`services.runtime.refusals`.

Not a refusal: an event at a position that does not come after the state's
(``InvariantViolation(..., "order", ...)`` is raised). Positions come from the reader's
source (the log's keyset order, a file's checked line numbers); one out of order is a
broken source, not a bad event.

Depth: every payload is decoded through :func:`events.nesting.bounded` (by
:func:`events.catalog.decode_stored`), so no reader builds a value nested deeper than
:data:`~events.nesting.MAX_STORED_DEPTH`.

Speed: replay folds millions of events, so :func:`fold_stored` keeps the hot path of the
replay loops it replaces — a payload at its type's current schema version, shallow
enough (:func:`events.nesting.shallow`), goes straight to that type's decoder and step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Literal, TypeAlias

import msgspec

from events.catalog import EVENT_TYPES, Event, current_decoders, decode_stored, tag_of
from events.errors import CatalogError, InvariantViolation
from events.fold import ClusterState, Step, step_of
from events.nesting import MAX_STORED_DEPTH

__all__ = [
    "REFUSAL_REASONS",
    "Refusal",
    "RefusalReason",
    "decode",
    "fold_event",
    "fold_stored",
    "refuse",
]

RefusalReason: TypeAlias = Literal["undecodable", "invariant", "error"]
#: Every reason, in the order reports list them (a metric label's values).
REFUSAL_REASONS: Final[tuple[RefusalReason, ...]] = ("undecodable", "invariant", "error")


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    """A stored event the fold's driver skipped (see the module docstring)."""

    position: int
    type: str
    reason: RefusalReason
    detail: str


_FAST: Final[dict[str, tuple[int, Callable[[Any], Event], Step]]] = {
    tag: (version, decoder, step_of(EVENT_TYPES[tag]))
    for tag, (version, decoder) in current_decoders().items()
}
_STEPS: Final[dict[type, Step]] = {EVENT_TYPES[tag]: step for tag, (_, _, step) in _FAST.items()}
_MSGSPEC_ERRORS: Final = (msgspec.ValidationError, msgspec.DecodeError)


def _as_bytes(payload: Any) -> bytes:
    if type(payload) is bytes:
        return payload
    if isinstance(payload, str):
        return payload.encode()
    return bytes(payload)  # msgspec.Raw, memoryview, bytearray


def decode(payload: Any, tag: str, schema_version: int, position: int) -> Event | Refusal:
    """The event of a stored payload (bytes, str or ``msgspec.Raw``), or why it is refused."""
    return _decoded(_as_bytes(payload), tag, schema_version, position)[0]


def _decoded(
    data: bytes, tag: str, schema_version: int, position: int
) -> tuple[Event, Step] | tuple[Refusal, None]:
    """The event of a stored payload and its step, or its refusal: a payload at its type's
    current schema version, shallow enough, straight to that type's decoder."""
    entry = _FAST.get(tag)
    if (
        entry is not None
        and entry[0] == schema_version
        and data.count(b"{") + data.count(b"[") <= MAX_STORED_DEPTH
    ):
        try:
            return entry[1](data), entry[2]
        except _MSGSPEC_ERRORS:
            pass  # decode_stored names what is wrong
    try:
        event = decode_stored(data, tag, schema_version)
    except CatalogError as exc:
        return Refusal(position=position, type=tag, reason="undecodable", detail=str(exc)), None
    except Exception as exc:  # a decoder's own failure: still the payload's fault
        detail = f"{type(exc).__name__}: {exc}"
        return Refusal(position=position, type=tag, reason="undecodable", detail=detail), None
    return event, _STEPS[type(event)]


def _refuse(state: ClusterState, refusal: Refusal) -> Refusal:
    """Record ``refusal`` in ``state`` and move its position past it."""
    if refusal.position:
        state.refused[refusal.position] = refusal.reason
        if refusal.position > state.position:
            state.position = refusal.position
    return refusal


def _check_order(state: ClusterState, position: int) -> None:
    if position and position <= state.position:
        raise InvariantViolation(position, "order", f"position {position} after {state.position}")


def _step(state: ClusterState, step: Step, event: Event, position: int) -> Refusal | None:
    """Run one step; the :class:`Refusal` if it raised (the state is as before it)."""
    try:
        step(state, event, position)
    except InvariantViolation as exc:
        reason: RefusalReason = "invariant"
        detail = f"invariant {exc.invariant!r}: {exc.detail}"
    except Exception as exc:
        reason, detail = "error", f"{type(exc).__name__}: {exc}"
    else:
        if position:
            state.position = position
        return None
    refusal = Refusal(position=position, type=tag_of(event), reason=reason, detail=detail)
    return _refuse(state, refusal)


def fold_event(state: ClusterState, event: Event, position: int) -> Refusal | None:
    """Fold one decoded event stored at ``position``; its :class:`Refusal` if refused.

    Raises ``InvariantViolation`` (``order``) only for a position that does not come
    after the state's.
    """
    _check_order(state, position)
    return _step(state, _STEPS[type(event)], event, position)


def refuse(state: ClusterState, refusal: Refusal) -> Refusal:
    """Skip an event a reader could not even hand over (its :class:`Refusal` from
    :func:`decode`): record it in ``state`` as :func:`fold_stored` would."""
    _check_order(state, refusal.position)
    return _refuse(state, refusal)


def fold_stored(
    state: ClusterState, payload: Any, tag: str, schema_version: int, position: int
) -> Event | Refusal:
    """Decode and fold one stored event: the event if it was folded, else its
    :class:`Refusal` (recorded in ``state``). The hot path of every replay loop."""
    if position <= state.position and position:
        raise InvariantViolation(position, "order", f"position {position} after {state.position}")
    data = payload if type(payload) is bytes else _as_bytes(payload)
    event, step = _decoded(data, tag, schema_version, position)
    if step is None:
        assert isinstance(event, Refusal)
        return _refuse(state, event)
    assert not isinstance(event, Refusal)
    refusal = _step(state, step, event, position)
    return event if refusal is None else refusal
