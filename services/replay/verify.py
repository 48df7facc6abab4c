"""Replay verification: the fold of the whole log, its refused events, its snapshots
and the database's guard rows.

Invariant 8 says that folding the log gives exactly what the database holds. The
database keeps only the rows its guards need (:mod:`events.guards`); this module
checks that they say what the fold says, and that nothing a reader would start from
says otherwise:

1. open one ``REPEATABLE READ`` read-only transaction, so the log, the snapshots and
   the guard rows are read as of the same instant even while services keep appending;
2. fold every event from position 0 through the fold's driver (:mod:`events.folding`),
   paging through the log by position. An event the driver refuses (its payload does
   not decode, or the fold refuses its step) is skipped as every reader skips it, and
   listed with its position, type, actor, reason and detail (:class:`RefusedEvent`);
3. at the position of every stored snapshot, compare the snapshot with the fold
   (:class:`SnapshotCheck`): one that verifies (:func:`services.runtime.store.snapshots.
   verify_snapshot`: a reader would start from it) but holds another state is forged or
   stale — a failure naming its position. One that does not verify is no reader's start
   (every reader skips it) and is only listed. Verification never starts from a
   snapshot: it is what is being checked;
4. derive the guard rows the folded state implies (:func:`expected_rows`) and
   compare them with the rows in ``capacity_ledger``, ``device_holds``,
   ``held_shares``, ``node_epochs`` and ``node_leases`` (:func:`actual_rows`).

The result is a :class:`Report`. Its :attr:`~Report.outcome` is the worst of what it
found — ``mismatch`` (a guard row differs from the fold, or positions out of order),
``snapshot`` (a snapshot differs), ``refused`` (the log holds refused events; the rest
agrees), ``ok`` — and :attr:`~Report.first_violation` is the smallest position at which
something is wrong (the last event that touched a row that differs, a snapshot, a
refused event), ``None`` when all is well.
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

from events.catalog import EVENT_TYPES, SCHEMA_VERSIONS
from events.errors import InvariantViolation, SnapshotError
from events.fold import Step, step_of
from events.folding import DEEP_CLASSES, Refusal, fold_step, fold_stored
from events.guards import amount
from events.nesting import MAX_STORED_DEPTH
from events.quantities import Quantity
from events.state import ClusterState
from events.statecodec import same_state
from services.replay.logfile import LinePage, decode_line
from services.runtime.ground.printable import printable
from services.runtime.ground.settings import Settings
from services.runtime.store import refusals
from services.runtime.store.eventstore import connect, iter_rows
from services.runtime.store.rows import ACTOR, EVENT_ID, PAYLOAD, POSITION, SCHEMA_VERSION, TYPE
from services.runtime.store.snapshots import verify_snapshot

Rows = dict[tuple[str, ...], tuple[Any, ...]]


class Mismatch(msgspec.Struct, frozen=True, kw_only=True):
    """One guard row that differs from the fold."""

    table: str
    key: tuple[str, ...]
    expected: tuple[Any, ...] | None
    actual: tuple[Any, ...] | None
    position: int | None


class RefusedEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An event of the log the fold's driver refused (skipped by every reader)."""

    position: int
    type: str
    actor: str
    reason: str
    detail: str


class SnapshotCheck(msgspec.Struct, frozen=True, kw_only=True):
    """A stored snapshot against the fold at its position.

    ``outcome``: ``same``; ``differs`` (it verifies, so a reader would start from it, but
    it is not the fold: forged or stale); ``unusable`` (it does not verify: no reader
    starts from it).
    """

    position: int
    outcome: str
    detail: str = ""


class Report(msgspec.Struct, kw_only=True):
    """What a verification run found."""

    head: int = 0
    started_at: int = 0
    folded: int = 0
    seconds: float = 0.0
    violation: str | None = None
    violation_position: int | None = None
    mismatches: list[Mismatch] = []
    refused: list[RefusedEvent] = []
    snapshots: list[SnapshotCheck] = []

    @property
    def forged(self) -> list[SnapshotCheck]:
        """The snapshots a reader would start from that are not the fold."""
        return [c for c in self.snapshots if c.outcome == "differs"]

    @property
    def outcome(self) -> str:
        """``mismatch``, ``snapshot``, ``refused`` or ``ok``: the worst found."""
        if self.violation is not None or self.mismatches:
            return "mismatch"
        if self.forged:
            return "snapshot"
        return "refused" if self.refused else "ok"

    @property
    def ok(self) -> bool:
        """True when every guard row and snapshot agrees and no event was refused."""
        return self.outcome == "ok"

    @property
    def first_violation(self) -> int | None:
        """The smallest position at which something is wrong."""
        positions = [m.position for m in self.mismatches if m.position is not None]
        if self.violation_position is not None:
            positions.append(self.violation_position)
        positions += [c.position for c in self.forged]
        positions += [r.position for r in self.refused]
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


#: tag -> (event class, current schema version, step): a line of a LinePage that decoded
#: to exactly this folds straight away.
_LINES: Final[dict[str, tuple[type, int, Step]]] = {
    tag: (EVENT_TYPES[tag], version, step_of(EVENT_TYPES[tag]))
    for tag, version in SCHEMA_VERSIONS.items()
}

#: What a replay loop does with a refused event: the event's row (``COLUMNS`` order).
OnRefused = Callable[[Refusal, Any], None]


def note_refused(refusal: Refusal, row: Any) -> None:
    """Count and log a refused event once per process (:mod:`services.runtime.store.refusals`)."""
    refusals.note(refusal, str(row[EVENT_ID]), row[ACTOR])


def fold_rows(
    state: ClusterState, rows: Sequence[Any] | LinePage, on_refused: OnRefused = note_refused
) -> None:
    """Fold stored event rows (:mod:`services.runtime.store.rows` order) without building envelopes.

    Each row goes through the fold's driver (:func:`events.folding.fold_stored`: the hot
    path of a payload at its type's current schema version, upcasting otherwise); an
    event it refuses is skipped and handed to ``on_refused`` with its row. A
    :class:`~services.replay.logfile.LinePage` of a log file is decoded line by line as it
    is folded (:func:`_fold_lines`).
    """
    if isinstance(rows, LinePage):
        _fold_lines(state, rows, on_refused)
        return
    for row in rows:
        folded = fold_stored(state, row[PAYLOAD], row[TYPE], row[SCHEMA_VERSION], row[POSITION])
        if type(folded) is Refusal:
            on_refused(folded, row)


def _fold_lines(state: ClusterState, page: LinePage, on_refused: OnRefused) -> None:
    """Fold the lines of a log file's page, each decoded in one pass right before its step.

    A line that decodes to the event the driver would decode from it, at the position its
    place in the file gives, is folded by :func:`events.folding.fold_step`; any other line
    (an older schema version to upcast, a tag its column contradicts, a payload that does
    not decode or nests deeper than the driver builds, a line that is not an event or not
    the next position: ``LogFileError``) goes through :meth:`LinePage.row` and
    :func:`fold_rows`.
    """
    table = _LINES
    deep, limit = DEEP_CLASSES, MAX_STORED_DEPTH + 1  # the line's array holds the payload
    position = page.first - 1
    for line in page.lines:
        position += 1
        try:
            row = decode_line(line)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            row = None
        if row is not None:
            event = row.payload
            entry = table.get(row.type)
            if (
                entry is not None
                and type(event) is entry[0]
                and row.schema_version == entry[1]
                and row.position == position
                and (type(event) not in deep or line.count(b"{") + line.count(b"[") <= limit)
            ):
                if position <= state.position:
                    raise InvariantViolation(
                        position, "order", f"position {position} after {state.position}"
                    )
                refusal = fold_step(state, entry[2], event, position)
                if refusal is not None:
                    on_refused(refusal, msgspec.structs.astuple(row))  # COLUMNS order
                continue
        fold_rows(state, [page.row(position - page.first)], on_refused)


def recorder(report: Report) -> OnRefused:
    """An ``on_refused`` that notes each refused event and lists it in ``report``."""
    return _recorder(report)


def _recorder(report: Report) -> OnRefused:
    def record(refusal: Refusal, row: Any) -> None:
        note_refused(refusal, row)
        report.refused.append(
            RefusedEvent(
                position=refusal.position,
                type=refusal.type,
                actor=str(row[ACTOR]),
                reason=refusal.reason,
                detail=refusal.detail,
            )
        )

    return record


async def fold_log(
    connection: asyncpg.Connection,
    state: ClusterState,
    report: Report,
    to_position: int | None = None,
) -> ClusterState:
    """Fold the log after ``state.position`` into ``state``; record in ``report`` the
    events refused and a position out of order."""
    report.started_at = state.position
    record = _recorder(report)
    with paused_gc():
        async for rows in iter_rows(connection, state.position, to_position=to_position):
            try:
                fold_rows(state, rows, record)
            except InvariantViolation as exc:
                report.violation = str(exc)
                report.violation_position = exc.position
                report.folded = state.position - report.started_at
                return state
    report.folded = state.position - report.started_at
    return state


async def _snapshot_rows(connection: asyncpg.Connection) -> list[asyncpg.Record]:
    return await connection.fetch(
        "SELECT s.position, s.schema_version, s.payload, e.event_id::text FROM snapshots s "
        "LEFT JOIN events e ON e.position = s.position ORDER BY s.position"
    )


def check_snapshot(record: asyncpg.Record, state: ClusterState, head: int) -> SnapshotCheck:
    """A stored snapshot (row of :func:`_snapshot_rows`) against ``state``, the fold at
    its position."""
    position = record[0]
    try:
        stored = verify_snapshot(position, record[1], bytes(record[2]), head, record[3])
    except SnapshotError as exc:
        return SnapshotCheck(position=position, outcome="unusable", detail=str(exc))
    if state.position != position:  # the log broke off before it
        return SnapshotCheck(
            position=position, outcome="differs", detail=f"the fold stops at {state.position}"
        )
    if not same_state(stored, state):
        detail = "its state is not the fold of the events before it (forged or stale)"
        return SnapshotCheck(position=position, outcome="differs", detail=detail)
    return SnapshotCheck(position=position, outcome="same")


async def verify(settings: Settings, *, from_start: bool = True) -> Report:
    """Fold the log from position 0, check every snapshot and compare the guard rows (see
    the module docstring). ``from_start`` is accepted for older callers: verification
    always folds from position 0 now."""
    started = time.perf_counter()
    report = Report()
    connection = await connect(settings)
    try:
        async with connection.transaction(isolation="repeatable_read", readonly=True):
            report.head = await connection.fetchval("SELECT position FROM event_log_head")
            state = ClusterState()
            checks: list[SnapshotCheck] = []
            for record in await _snapshot_rows(connection):
                if report.violation is None and record[0] <= report.head:
                    await _fold_more(connection, state, report, record[0])
                checks.append(check_snapshot(record, state, report.head))
            if report.violation is None:
                await _fold_more(connection, state, report, report.head)
            report.snapshots = checks
            report.started_at, report.folded = 0, state.position
            if report.violation is None:
                actual, positions = await actual_rows(connection)
                report.mismatches = compare(expected_rows(state), actual, positions)
    finally:
        await connection.close()
    report.seconds = time.perf_counter() - started
    return report


async def _fold_more(
    connection: asyncpg.Connection, state: ClusterState, report: Report, to_position: int
) -> None:
    """Fold on to ``to_position``, keeping what ``report`` found so far."""
    part = Report()
    await fold_log(connection, state, part, to_position=to_position)
    report.refused = [*report.refused, *part.refused]
    report.violation, report.violation_position = part.violation, part.violation_position


def summary(report: Report, limit: int = 10) -> str:
    """A human-readable summary of ``report`` (tenant-written text escaped)."""
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
    lines += refused_lines(report.refused, limit)
    lines += snapshot_lines(report.snapshots)
    outcome = report.outcome
    if outcome == "ok":
        lines.append("OK: the guard rows and every snapshot equal the fold of the log")
    elif outcome == "refused":
        lines.append(
            f"REFUSED: {len(report.refused)} event(s) of the log are refused and skipped by "
            "every reader (first at position "
            f"{report.first_violation}); the guard rows and snapshots equal the fold"
        )
    elif outcome == "snapshot":
        lines.append(f"FAILED: forged or stale snapshot at position {report.forged[0].position}")
    else:
        lines.append(f"FAILED: first violating position {report.first_violation}")
    return "\n".join(printable(line) for line in lines)


def refused_lines(refused: Sequence[RefusedEvent], limit: int = 10) -> list[str]:
    """One line per refused event (at most ``limit``)."""
    out = [
        f"REFUSED EVENT at position {r.position}: {r.type} by {r.actor}: {r.reason}: {r.detail}"
        for r in refused[:limit]
    ]
    if len(refused) > limit:
        out.append(f"... and {len(refused) - limit} more refused events")
    return out


def snapshot_lines(checks: Sequence[SnapshotCheck]) -> list[str]:
    """One line per snapshot that is not the fold or cannot be used."""
    out = []
    for c in checks:
        if c.outcome == "differs":
            out.append(f"SNAPSHOT MISMATCH at position {c.position}: {c.detail}")
        elif c.outcome == "unusable":
            out.append(f"snapshot at {c.position} is skipped by every reader: {c.detail}")
    return out
