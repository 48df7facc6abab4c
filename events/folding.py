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
the state's position moves past it and :attr:`~events.state.ClusterState.refused`
records it (position -> reason), so that a reader that starts from a snapshot still
knows which events before it were refused, and ``dracap replay verify`` can name every
one. Folding a log never stops at an event: the log is append-only, so an event a
reader stopped at would stop it forever. What a reader does with a :class:`Refusal`
beyond that (count it, log it once, report it) is I/O and lives in
:mod:`services.runtime.store.refusals`.

Not a refusal: an event at a position that does not come after the state's
(``InvariantViolation(..., "order", ...)`` is raised). Positions come from the reader's
source (the log's keyset order, a file's checked line numbers); one out of order is a
broken source, not a bad event.

Depth: every payload is decoded through :func:`events.nesting.bounded` (by
:func:`events.eventcodec.decode_stored`), so no reader builds a value nested deeper than
:data:`~events.nesting.MAX_STORED_DEPTH`.

Speed: replay folds millions of events, so :func:`fold_stored` keeps the hot path of the
replay loops it replaces — a payload at its type's current schema version goes straight
to that type's decoder and step. Only the four classes whose payload can nest without a
bound (:data:`DEEP_CLASSES`, derived from the catalog: ``Any`` in their schema — opaque
parameters) have their brackets counted first (:func:`events.nesting.shallow`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Literal, TypeAlias

import msgspec
import msgspec.inspect

from events.catalog import EVENT_TYPES, Event, tag_of
from events.errors import CatalogError, InvariantViolation
from events.eventcodec import current_decoders, decode_stored
from events.fold import Step, step_of
from events.nesting import MAX_STORED_DEPTH
from events.state import ClusterState

__all__ = [
    "DEEP_CLASSES",
    "REFUSAL_REASONS",
    "Refusal",
    "RefusalReason",
    "decode",
    "fold_event",
    "fold_step",
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
#: What a fast decode may raise; a payload nested deeper than a parser can skip (an
#: unknown field of any depth) raises RecursionError, and takes the bounded slow path.
_MSGSPEC_ERRORS: Final = (msgspec.ValidationError, msgspec.DecodeError, RecursionError)


def _unbounded(info: msgspec.inspect.Type, path: tuple[type, ...] = ()) -> bool:
    """Whether values of this type can nest without a bound: ``Any`` somewhere in it (a
    manifest's opaque parameters), or a Struct that holds itself."""
    if isinstance(info, msgspec.inspect.AnyType):
        return True
    if isinstance(info, msgspec.inspect.StructType):
        if info.cls in path:
            return True
        return any(_unbounded(f.type, (*path, info.cls)) for f in info.fields)
    inner = [getattr(info, a) for a in ("item_type", "key_type", "value_type") if hasattr(info, a)]
    inner += list(getattr(info, "item_types", ())) + list(getattr(info, "types", ()))
    return any(_unbounded(t, path) for t in inner)


#: The event classes whose payload can nest deeper than the bound: only theirs are
#: counted (:func:`events.nesting.shallow`) before a fast decode (derived from the catalog).
DEEP_CLASSES: Final = frozenset(
    cls for cls in EVENT_TYPES.values() if _unbounded(msgspec.inspect.type_info(cls))
)
_DEEP_TAGS: Final = frozenset(
    tag_of_class for tag_of_class, cls in EVENT_TYPES.items() if cls in DEEP_CLASSES
)


def _as_bytes(payload: Any) -> bytes:
    if type(payload) is bytes:
        return payload
    if isinstance(payload, str):
        return payload.encode()
    return bytes(payload)  # msgspec.Raw, memoryview, bytearray


def decode(payload: Any, tag: str, schema_version: int, position: int) -> Event | Refusal:
    """The event of a stored payload (bytes, str or ``msgspec.Raw``), or why it is refused."""
    data = _as_bytes(payload)
    entry = _fast_entry(data, tag, schema_version)
    if entry is not None:
        try:
            return entry[1](data)
        except _MSGSPEC_ERRORS:
            pass  # the slow path names what is wrong
    return _decode_slow(data, tag, schema_version, position)


def _fast_entry(
    data: bytes, tag: str, schema_version: int
) -> tuple[int, Callable[[Any], Event], Step] | None:
    """The decoder and step of a payload at its type's current schema version that cannot
    nest deeper than the bound (its type cannot, or it has no more opening brackets than
    that), else ``None``."""
    entry = _FAST.get(tag)
    if entry is None or entry[0] != schema_version:
        return None
    if tag in _DEEP_TAGS and data.count(b"{") + data.count(b"[") > MAX_STORED_DEPTH:
        return None
    return entry


def _decode_slow(data: bytes, tag: str, schema_version: int, position: int) -> Event | Refusal:
    """:func:`events.eventcodec.decode_stored` (upcast, bounded in depth), or the refusal."""
    try:
        return decode_stored(data, tag, schema_version)
    except CatalogError as exc:
        return Refusal(position=position, type=tag, reason="undecodable", detail=str(exc))
    except Exception as exc:  # a decoder's own failure: still the payload's fault
        detail = f"{type(exc).__name__}: {exc}"
        return Refusal(position=position, type=tag, reason="undecodable", detail=detail)


def _refuse(state: ClusterState, refusal: Refusal) -> Refusal:
    """Record ``refusal`` in ``state`` and move its position past it (a refused event
    changed no claim's phase, no share's state)."""
    state.phases_before.clear()
    state.shares_before.clear()
    if refusal.position:
        state.refused[refusal.position] = refusal.reason
        if refusal.position > state.position:
            state.position = refusal.position
    return refusal


def _check_order(state: ClusterState, position: int) -> None:
    if position and position <= state.position:
        raise InvariantViolation(position, "order", f"position {position} after {state.position}")


def _refused_by(state: ClusterState, event: Event, position: int, exc: Exception) -> Refusal:
    """The refusal of an event whose step raised ``exc`` (the state is as before it)."""
    if isinstance(exc, InvariantViolation):
        reason: RefusalReason = "invariant"
        detail = f"invariant {exc.invariant!r}: {exc.detail}"
    else:
        reason, detail = "error", f"{type(exc).__name__}: {exc}"
    return _refuse(
        state, Refusal(position=position, type=tag_of(event), reason=reason, detail=detail)
    )


def fold_step(state: ClusterState, step: Step, event: Event, position: int) -> Refusal | None:
    """Run ``step`` (:func:`events.fold.step_of` the event's class) for an event stored at
    ``position``; its :class:`Refusal` if the step raised. For replay loops that decode and
    dispatch themselves: they check the order of positions, as :func:`fold_event` does."""
    if moved := state.phases_before:  # the journal of the event before
        moved.clear()
    if held := state.shares_before:
        held.clear()
    try:
        step(state, event, position)
    except Exception as exc:
        return _refused_by(state, event, position, exc)
    if position:
        state.position = position
    return None


def fold_event(state: ClusterState, event: Event, position: int) -> Refusal | None:
    """Fold one decoded event stored at ``position``; its :class:`Refusal` if refused.

    Raises ``InvariantViolation`` (``order``) only for a position that does not come
    after the state's.
    """
    _check_order(state, position)
    return fold_step(state, _STEPS[type(event)], event, position)


def refuse(state: ClusterState, refusal: Refusal) -> Refusal:
    """Skip an event a reader could not even hand over (its :class:`Refusal` from
    :func:`decode`): record it in ``state`` as :func:`fold_stored` would."""
    _check_order(state, refusal.position)
    return _refuse(state, refusal)


def fold_stored(
    state: ClusterState, payload: Any, tag: str, schema_version: int, position: int
) -> Event | Refusal:
    """Decode and fold one stored event: the event if it was folded, else its
    :class:`Refusal` (recorded in ``state``). The hot path of every replay loop, written
    out: a payload at its type's current schema version goes straight to its decoder and
    step."""
    if position <= state.position and position:
        raise InvariantViolation(position, "order", f"position {position} after {state.position}")
    data = payload if type(payload) is bytes else _as_bytes(payload)
    entry = _fast_entry(data, tag, schema_version)
    if entry is not None:
        try:
            event = entry[1](data)
        except _MSGSPEC_ERRORS:
            pass  # the slow path names what is wrong
        else:
            if moved := state.phases_before:  # the journal of the event before
                moved.clear()
            if held := state.shares_before:
                held.clear()
            try:
                entry[2](state, event, position)
            except Exception as exc:
                return _refused_by(state, event, position, exc)
            if position:
                state.position = position
            return event
    decoded = _decode_slow(data, tag, schema_version, position)
    if isinstance(decoded, Refusal):
        return _refuse(state, decoded)
    refusal = fold_step(state, _STEPS[type(decoded)], decoded, position)
    return decoded if refusal is None else refusal
