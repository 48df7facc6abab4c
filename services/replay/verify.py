"""Replay verification: the fold of the whole log must equal the live projections.

Invariant 8 says that folding the log gives exactly what the projections hold. This
module checks it:

1. open one ``REPEATABLE READ`` read-only transaction, so the log and the projection
   rows are read as of the same instant even while services keep appending;
2. start from the newest snapshot (or from an empty state with ``from_start``), then
   fold every later event with :func:`events.fold.apply`, paging through the log by
   position; an :class:`~events.errors.InvariantViolation` stops the replay at its
   position;
3. derive the projection rows the folded state implies (:func:`expected_projections`)
   and compare them with the rows in ``capacity_ledger``, ``device_holds``,
   ``shares`` and ``claims`` (:func:`actual_projections`).

The result is a :class:`Report`; its ``first_violation`` is the smallest position at
which something is wrong (the failing event, or the last event that touched a row
that differs), ``None`` when all is well.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from decimal import Decimal
from typing import Any, Final

import asyncpg
import msgspec

from events.catalog import EVENT_TYPES, Event, current_decoders, decode_stored
from events.errors import InvariantViolation
from events.fold import ClusterState, Step, apply_event, snapshot_decode, step_of
from events.ledger import amount
from events.quantities import Quantity
from services.runtime.eventstore import connect, iter_rows
from services.runtime.settings import Settings

Rows = dict[tuple[str, ...], tuple[Any, ...]]


class Mismatch(msgspec.Struct, frozen=True, kw_only=True):
    """One projection row that differs from the fold."""

    table: str
    key: tuple[str, ...]
    expected: tuple[Any, ...] | None
    actual: tuple[Any, ...] | None
    position: int | None


class Report(msgspec.Struct, kw_only=True):
    """What a verification run found."""

    head: int = 0
    started_at: int = 0
    folded: int = 0
    seconds: float = 0.0
    violation: str | None = None
    violation_position: int | None = None
    mismatches: list[Mismatch] = []

    @property
    def ok(self) -> bool:
        """True when the replay succeeded and every projection row agrees."""
        return self.violation is None and not self.mismatches

    @property
    def first_violation(self) -> int | None:
        """The smallest position at which something is wrong."""
        positions = [m.position for m in self.mismatches if m.position is not None]
        if self.violation_position is not None:
            positions.append(self.violation_position)
        return min(positions) if positions else None


def _canonical(consumed: dict[str, Quantity]) -> str:
    return msgspec.json.encode({k: consumed[k].canonical() for k in sorted(consumed)}).decode()


def expected_projections(state: ClusterState) -> dict[str, Rows]:
    """The projection rows that ``state`` implies, keyed like :func:`actual_projections`."""
    ledger: Rows = {}
    holds: Rows = {}
    for (driver, pool, device), dev in state.devices.items():
        for cap, total in dev.total.items():
            allocated = Decimal(dev.consumed_nanos.get(cap, 0)).scaleb(-9)
            ledger[(driver, pool, device, cap)] = (amount(total), allocated)
        if dev.exclusive_share is not None:
            holds[(driver, pool, device)] = (dev.exclusive_share,)
    shares: Rows = {
        (sid,): (
            s.state,
            s.claim[0],
            s.claim[1],
            s.allocation_version,
            s.driver,
            s.pool,
            s.device,
            s.node,
            s.admin_access,
            s.shared,
            _canonical(s.consumed),
            s.limit_level,
        )
        for sid, s in state.shares.items()
    }
    claims: Rows = {
        key: (c.phase, c.allocation_version, c.node, c.reason) for key, c in state.claims.items()
    }
    return {"capacity_ledger": ledger, "device_holds": holds, "shares": shares, "claims": claims}


_QUERIES: dict[str, tuple[str, Callable[[asyncpg.Record], tuple[Any, ...]]]] = {
    "capacity_ledger": (
        "SELECT driver, pool, device, capacity, total, allocated, NULL FROM capacity_ledger",
        lambda r: (r[4].normalize(), r[5].normalize()),
    ),
    "device_holds": (
        "SELECT driver, pool, device, share_id::text, NULL FROM device_holds",
        lambda r: (r[3],),
    ),
    "shares": (
        "SELECT share_id::text, state, namespace, claim, allocation_version, driver, pool, "
        "device, node, admin_access, shared, consumed, level, position FROM shares",
        lambda r: (
            r[1],
            r[2],
            r[3],
            r[4],
            r[5],
            r[6],
            r[7],
            r[8],
            r[9],
            r[10],
            msgspec.json.encode(msgspec.json.decode(r[11]), order="sorted").decode(),
            r[12],
        ),
    ),
    "claims": (
        "SELECT namespace, name, phase, allocation_version, node, reason, position FROM claims",
        lambda r: (r[2], r[3], r[4], r[5]),
    ),
}
_KEY_WIDTH = {"capacity_ledger": 4, "device_holds": 3, "shares": 1, "claims": 2}


async def actual_projections(
    connection: asyncpg.Connection,
) -> tuple[dict[str, Rows], dict[tuple[str, tuple[str, ...]], int | None]]:
    """The projection rows in the database, and the last position that touched each."""
    tables: dict[str, Rows] = {}
    positions: dict[tuple[str, tuple[str, ...]], int | None] = {}
    for table, (sql, project) in _QUERIES.items():
        rows: Rows = {}
        for record in await connection.fetch(sql):
            key = tuple(str(v) for v in record[: _KEY_WIDTH[table]])
            rows[key] = project(record)
            positions[(table, key)] = record[-1]
        tables[table] = rows
    return tables, positions


def _normalise(table: str, rows: Rows) -> Rows:
    if table != "capacity_ledger":
        return rows
    return {k: tuple(v.normalize() for v in values) for k, values in rows.items()}


def compare(
    expected: dict[str, Rows],
    actual: dict[str, Rows],
    positions: dict[tuple[str, tuple[str, ...]], int | None],
) -> list[Mismatch]:
    """Every row that differs, sorted by the position that last touched it."""
    out: list[Mismatch] = []
    for table, want_rows in expected.items():
        want = _normalise(table, want_rows)
        have = actual[table]
        for key in sorted(set(want) | set(have)):
            if want.get(key) != have.get(key):
                out.append(
                    Mismatch(
                        table=table,
                        key=key,
                        expected=want.get(key),
                        actual=have.get(key),
                        position=positions.get((table, key)),
                    )
                )
    out.sort(key=lambda m: (m.position is None, m.position or 0))
    return out


async def _initial_state(connection: asyncpg.Connection, from_start: bool) -> ClusterState:
    if from_start:
        return ClusterState()
    row = await connection.fetchrow("SELECT payload FROM snapshots ORDER BY position DESC LIMIT 1")
    return ClusterState() if row is None else snapshot_decode(bytes(row[0]))


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector during a replay.

    Folding creates millions of small, long-lived objects and no cycles; the collector's
    full passes over the growing state would cost more than the fold itself.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_REPLAY: Final[dict[str, tuple[int, Callable[[bytes | str], Event], Step]]] = {
    tag: (version, decode, step_of(EVENT_TYPES[tag]))
    for tag, (version, decode) in current_decoders().items()
}


def fold_rows(state: ClusterState, rows: Sequence[asyncpg.Record]) -> None:
    """Fold stored event rows (``eventstore`` column order) without building envelopes.

    The same as ``apply_event(state, decode_stored(payload, type, schema_version),
    position)`` for each row, with the per-row lookups done once per event type: a
    payload of the current schema version goes straight to its type's decoder and
    fold step (a payload that fails to decode is handed to :func:`decode_stored` for
    its error), an older one takes the upcasting path.
    """
    table = _REPLAY
    for row in rows:
        tag = row[4]
        entry = table.get(tag)
        if entry is None or entry[0] != row[5]:
            apply_event(state, decode_stored(row[11], tag, row[5]), row[0])
            continue
        _, decode, step = entry
        try:
            event = decode(row[11])
        except (msgspec.ValidationError, msgspec.DecodeError):
            event = decode_stored(row[11], tag, row[5])
        position = row[0]
        if position:
            if position <= state.position:
                raise InvariantViolation(
                    position, "order", f"position {position} after {state.position}"
                )
            step(state, event, position)
            state.position = position
        else:
            step(state, event, position)


async def fold_log(
    connection: asyncpg.Connection,
    state: ClusterState,
    report: Report,
    to_position: int | None = None,
) -> ClusterState:
    """Fold the log after ``state.position`` into ``state``; record a violation in ``report``."""
    report.started_at = state.position
    with paused_gc():
        async for rows in iter_rows(connection, state.position, to_position=to_position):
            try:
                fold_rows(state, rows)
            except InvariantViolation as exc:
                report.violation = str(exc)
                report.violation_position = exc.position
                report.folded = state.position - report.started_at
                return state
    report.folded = state.position - report.started_at
    return state


async def verify(settings: Settings, *, from_start: bool = False) -> Report:
    """Fold the log and compare it with the projections (see the module docstring)."""
    started = time.perf_counter()
    report = Report()
    connection = await connect(settings)
    try:
        async with connection.transaction(isolation="repeatable_read", readonly=True):
            report.head = await connection.fetchval("SELECT position FROM event_log_head")
            state = await _initial_state(connection, from_start)
            state = await fold_log(connection, state, report, to_position=report.head)
            if report.violation is None:
                actual, positions = await actual_projections(connection)
                report.mismatches = compare(expected_projections(state), actual, positions)
    finally:
        await connection.close()
    report.seconds = time.perf_counter() - started
    return report


def summary(report: Report, limit: int = 10) -> str:
    """A human-readable summary of ``report``."""
    lines = [
        f"replayed {report.folded} events from position {report.started_at} "
        f"to {report.head} in {report.seconds:.2f}s",
    ]
    if report.violation is not None:
        lines.append(
            f"INVARIANT VIOLATED at position {report.violation_position}: {report.violation}"
        )
    for m in report.mismatches[:limit]:
        lines.append(
            f"MISMATCH {m.table} {'/'.join(m.key)} (last touched at {m.position}): "
            f"fold={m.expected} projection={m.actual}"
        )
    if len(report.mismatches) > limit:
        lines.append(f"... and {len(report.mismatches) - limit} more mismatches")
    if report.ok:
        lines.append("OK: projections equal the fold of the log")
    else:
        lines.append(f"FAILED: first violating position {report.first_violation}")
    return "\n".join(lines)
