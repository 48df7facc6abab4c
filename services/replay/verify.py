"""Replay verification: the fold of the whole log must equal the database's guard rows.

Invariant 8 says that folding the log gives exactly what the database holds. The
database keeps only the rows its guards need (:mod:`events.guards`); this module
checks that they say what the fold says:

1. open one ``REPEATABLE READ`` read-only transaction, so the log and the guard
   rows are read as of the same instant even while services keep appending;
2. start from the newest snapshot that verifies (:mod:`services.runtime.snapshots`;
   from an empty state with ``from_start``), then fold every later event with
   :func:`events.fold.apply`, paging through the log by position; an
   :class:`~events.errors.InvariantViolation` stops the replay at its position;
3. derive the guard rows the folded state implies (:func:`expected_rows`) and
   compare them with the rows in ``capacity_ledger``, ``device_holds``,
   ``held_shares``, ``node_epochs`` and ``node_leases`` (:func:`actual_rows`).

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
from events.fold import ClusterState, Step, apply_event, step_of
from events.guards import amount
from events.quantities import Quantity
from services.replay.logfile import LinePage, decode_line
from services.runtime.eventstore import connect, iter_rows
from services.runtime.rows import PAYLOAD, POSITION, SCHEMA_VERSION, TYPE
from services.runtime.settings import Settings
from services.runtime.snapshots import load_verified

Rows = dict[tuple[str, ...], tuple[Any, ...]]


class Mismatch(msgspec.Struct, frozen=True, kw_only=True):
    """One guard row that differs from the fold."""

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
        """True when the replay succeeded and every guard row agrees."""
        return self.violation is None and not self.mismatches

    @property
    def first_violation(self) -> int | None:
        """The smallest position at which something is wrong."""
        positions = [m.position for m in self.mismatches if m.position is not None]
        if self.violation_position is not None:
            positions.append(self.violation_position)
        return min(positions) if positions else None


def _amounts(consumed: dict[str, Quantity]) -> tuple[tuple[str, Decimal], ...]:
    return tuple(sorted((name, amount(q).normalize()) for name, q in consumed.items()))


def expected_rows(state: ClusterState) -> dict[str, Rows]:
    """The guard rows that ``state`` implies, keyed like :func:`actual_rows`."""
    ledger: Rows = {}
    holds: Rows = {}
    for (driver, pool, device), dev in state.devices.items():
        for cap, total in dev.total.items():
            allocated = Decimal(dev.consumed_nanos.get(cap, 0)).scaleb(-9)
            ledger[(driver, pool, device, cap)] = (amount(total), allocated)
        if dev.exclusive_share is not None:
            holds[(driver, pool, device)] = (dev.exclusive_share,)
    held: Rows = {
        (sid,): (s.driver, s.pool, s.device, s.node, _amounts(s.consumed))
        for sid, s in state.shares.items()
        if s.live and not s.admin_access
    }
    epochs: Rows = {
        (name,): (max(node.expired_epoch, node.fenced_epoch),)
        for name, node in state.nodes.items()
        if max(node.expired_epoch, node.fenced_epoch) > 0
    }
    leases: Rows = {
        (name,): (node.leased_epoch, node.boot_id, node.ttl_ms)
        for name, node in state.nodes.items()
        if node.leased_epoch > 0
    }
    return {
        "capacity_ledger": ledger,
        "device_holds": holds,
        "held_shares": held,
        "node_epochs": epochs,
        "node_leases": leases,
    }


def _held(record: asyncpg.Record) -> tuple[Any, ...]:
    amounts = msgspec.json.decode(record[5], type=dict[str, Decimal])
    pairs = tuple(sorted((name, value.normalize()) for name, value in amounts.items()))
    return (record[1], record[2], record[3], record[4], pairs)


#: Per guard table: the query (key columns first, the last column the position that
#: last touched the row, if the table keeps one) and how a row is compared.
_QUERIES: dict[str, tuple[str, Callable[[asyncpg.Record], tuple[Any, ...]]]] = {
    "capacity_ledger": (
        "SELECT driver, pool, device, capacity, total, allocated, position FROM capacity_ledger",
        lambda r: (r[4].normalize(), r[5].normalize()),
    ),
    "device_holds": (
        "SELECT h.driver, h.pool, h.device, h.share_id::text, s.position FROM device_holds h "
        "LEFT JOIN held_shares s USING (share_id)",
        lambda r: (r[3],),
    ),
    "held_shares": (
        "SELECT share_id::text, driver, pool, device, node, amounts, position FROM held_shares",
        _held,
    ),
    "node_epochs": (
        "SELECT node, epoch, NULL FROM node_epochs WHERE epoch > 0",
        lambda r: (r[1],),
    ),
    "node_leases": (
        "SELECT node, epoch, boot_id, ttl_ms, NULL FROM node_leases",
        lambda r: (r[1], r[2], r[3]),
    ),
}
_KEY_WIDTH = {
    "capacity_ledger": 4,
    "device_holds": 3,
    "held_shares": 1,
    "node_epochs": 1,
    "node_leases": 1,
}


async def actual_rows(
    connection: asyncpg.Connection,
) -> tuple[dict[str, Rows], dict[tuple[str, tuple[str, ...]], int | None]]:
    """The guard rows in the database, and the last position that touched each."""
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
    state = await load_verified(connection)  # the newest snapshot that verifies
    return ClusterState() if state is None else state


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


#: tag -> (event class, current schema version, step): a line of a LinePage that
#: decoded to exactly this folds straight away.
_LINES: Final[dict[str, tuple[type, int, Step]]] = {
    tag: (EVENT_TYPES[tag], version, step) for tag, (version, _, step) in _REPLAY.items()
}


def fold_rows(state: ClusterState, rows: Sequence[Any] | LinePage) -> None:
    """Fold stored event rows (:mod:`services.runtime.rows` order) without building envelopes.

    The same as ``apply_event(state, decode_stored(payload, type, schema_version),
    position)`` for each row, with the per-row lookups done once per event type: a
    payload of the current schema version goes straight to its type's decoder and
    fold step (a payload that fails to decode is handed to :func:`decode_stored` for
    its error), an older one takes the upcasting path. A
    :class:`~services.replay.logfile.LinePage` of a log file is decoded line by line
    as it is folded (:func:`_fold_lines`).
    """
    if isinstance(rows, LinePage):
        _fold_lines(state, rows)
        return
    table = _REPLAY
    for row in rows:
        tag, version, payload = row[TYPE], row[SCHEMA_VERSION], row[PAYLOAD]
        entry = table.get(tag)
        if entry is None or entry[0] != version:
            apply_event(state, decode_stored(payload, tag, version), row[POSITION])
            continue
        _, decode, step = entry
        try:
            event = decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            event = decode_stored(payload, tag, version)
        position = row[POSITION]
        if position:
            if position <= state.position:
                raise InvariantViolation(
                    position, "order", f"position {position} after {state.position}"
                )
            step(state, event, position)
            state.position = position
        else:
            step(state, event, position)


def _fold_lines(state: ClusterState, page: LinePage) -> None:
    """Fold the lines of a log file's page, each decoded in one pass right before its step.

    A line that decodes to the event :func:`decode_stored` would give, at the position
    its place in the file gives, is folded like :func:`fold_rows` folds a row (order
    check, step, position); any other line goes through :meth:`LinePage.row` (a line
    that is not an event or not the next position: ``LogFileError``) and
    :func:`fold_rows` — upcasting, and the errors of a payload that does not decode.
    """
    table = _LINES
    position = page.first - 1
    for line in page.lines:
        position += 1
        try:
            row = decode_line(line)
        except (msgspec.DecodeError, msgspec.ValidationError):
            row = None
        if row is not None:
            event = row.payload
            entry = table.get(row.type)
            if (
                entry is not None
                and type(event) is entry[0]
                and row.schema_version == entry[1]
                and row.position == position
            ):
                if position <= state.position:
                    raise InvariantViolation(
                        position, "order", f"position {position} after {state.position}"
                    )
                entry[2](state, event, position)
                state.position = position
                continue
        fold_rows(state, [page.row(position - page.first)])


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
    """Fold the log and compare it with the guard rows (see the module docstring)."""
    started = time.perf_counter()
    report = Report()
    connection = await connect(settings)
    try:
        async with connection.transaction(isolation="repeatable_read", readonly=True):
            report.head = await connection.fetchval("SELECT position FROM event_log_head")
            state = await _initial_state(connection, from_start)
            state = await fold_log(connection, state, report, to_position=report.head)
            if report.violation is None:
                actual, positions = await actual_rows(connection)
                report.mismatches = compare(expected_rows(state), actual, positions)
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
            f"fold={m.expected} database={m.actual}"
        )
    if len(report.mismatches) > limit:
        lines.append(f"... and {len(report.mismatches) - limit} more mismatches")
    if report.ok:
        lines.append("OK: the guard rows equal the fold of the log")
    else:
        lines.append(f"FAILED: first violating position {report.first_violation}")
    return "\n".join(lines)
