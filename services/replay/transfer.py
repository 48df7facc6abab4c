"""``dracap replay export`` / ``import``: the log to a file and back.

Export reads the whole log in one ``REPEATABLE READ`` transaction (a consistent cut at
the head of that instant) and writes a :mod:`services.replay.logfile` file; the
payloads go out exactly as stored, with their schema versions. It folds the log as it
writes and puts a checkpoint line every ``checkpoint_every`` events and after the last
(:mod:`services.replay.checkpoints`; 0: none).

Import refuses a file that does not check out (header, gap-free positions, checksum)
**before** it writes anything, and writes only into an empty log (head 0: importing on
top of another history would renumber it). It folds the file first as every reader
does (:mod:`events.folding`): an event the fold refuses — one that does not decode, an
oversubscription — is skipped there and *kept* in the log: the log is copied as it
was, and every reader of the imported log skips the same events again. Then, in one
transaction holding the head lock, it copies the rows as they are — positions, event
ids, actors, times, payloads byte for byte — with binary ``COPY`` and runs the
database's guards over the events that decode (``dracap_guard``, as the bulk append
path does; the exporting database ran them when it appended each one), so the guard
tables end where the exporting database's were; ``replay verify`` on the result is the
proof. Checkpoint lines are not imported nor compared (the database writes its own
snapshots).

:func:`check_file` with ``checkpoints`` (``replay verify --log``) also compares every
checkpoint line with the fold at its position (:func:`services.replay.checkpoints.compare`).
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg

from events.errors import InvariantViolation
from events.folding import Refusal, decode
from events.guards import encode_guards, guards_of_many
from events.state import ClusterState
from services.replay.checkpoints import EVERY, CheckpointMismatchError, CheckpointWriter, compare
from services.replay.logfile import Checkpoint, read_end, read_rows
from services.replay.verify import OnRefused, fold_rows, note_refused, paused_gc
from services.runtime.store.eventstore import CHANNEL, iter_rows
from services.runtime.store.rows import COLUMNS, PAYLOAD, POSITION, SCHEMA_VERSION, TYPE

__all__ = ["ImportRefusedError", "check_file", "export_log", "import_log"]

Progress = Callable[[int, int], None]


class ImportRefusedError(Exception):
    """The database is not empty, or the file does not fold (one line).

    ``folds``: False when the file breaks an invariant (``position`` names where).
    """

    def __init__(self, message: str, *, position: int | None = None) -> None:
        super().__init__(message)
        self.position = position


async def export_log(
    connection: asyncpg.Connection,
    path: str | Path,
    *,
    source: str = "",
    progress: Progress | None = None,
    checkpoint_every: int = EVERY,
) -> tuple[int, int]:
    """Write the whole log to ``path``; returns (events, last position)."""
    writer = CheckpointWriter(path, source=source, every=checkpoint_every)
    try:
        async with connection.transaction(isolation="repeatable_read", readonly=True):
            head: int = await connection.fetchval("SELECT position FROM event_log_head")
            async for rows in iter_rows(connection, 0, batch_size=20_000, to_position=head):
                writer.write(rows)
                if progress is not None:
                    progress(writer.last, head)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return writer.count, writer.last


def check_file(
    path: str | Path,
    progress: Progress | None = None,
    *,
    checkpoints: bool = False,
    on_refused: OnRefused = note_refused,
) -> ClusterState:
    """Read and fold the whole file; raises LogFileError or :class:`ImportRefusedError`
    (with ``checkpoints``: also :class:`~services.replay.checkpoints.CheckpointMismatchError`
    for the first checkpoint that is not the fold at its position). Each event the fold
    refuses is skipped and handed to ``on_refused``."""
    state = ClusterState()
    head = read_end(path)[0].last
    mismatch: CheckpointMismatchError | None = None  # raised once the checksum held
    with paused_gc():
        for rows in read_rows(path, progress=progress, lines=True, checkpoints=checkpoints):
            if isinstance(rows, Checkpoint):
                if mismatch is None:
                    try:
                        compare(rows, state, head)
                    except CheckpointMismatchError as exc:
                        mismatch = exc
                continue
            try:
                fold_rows(state, rows, on_refused)
            except InvariantViolation as exc:
                if mismatch is not None:  # the earlier position
                    raise mismatch from None
                raise ImportRefusedError(
                    f"{path}: the log does not fold at position {exc.position}: {exc}",
                    position=exc.position,
                ) from None
    if mismatch is not None:
        raise mismatch
    return state


def _record(row: Any) -> tuple[Any, ...]:
    return (
        row[0],
        uuid.UUID(row[1]),
        row[2],
        row[3],
        row[4],
        row[5],
        row[6],
        row[7],
        row[8],
        row[9],
        datetime.datetime.fromisoformat(row[10]),
        bytes(row[11]),
    )


async def import_log(
    connection: asyncpg.Connection, path: str | Path, *, progress: Progress | None = None
) -> int:
    """Check ``path``, then copy it into the (empty) log; returns the events imported."""
    check_file(path, progress)  # everything checked before anything is written
    count = 0
    async with connection.transaction():
        head = await connection.fetchval("SELECT position FROM event_log_head FOR UPDATE")
        if head:
            raise ImportRefusedError(
                f"the database's log is not empty (head {head}): import needs an empty one"
            )
        for rows in read_rows(path, progress=progress):
            decoded = (decode(r[PAYLOAD], r[TYPE], r[SCHEMA_VERSION], r[POSITION]) for r in rows)
            events = [e for e in decoded if not isinstance(e, Refusal)]
            await connection.copy_records_to_table(
                "events", records=[_record(r) for r in rows], columns=list(COLUMNS)
            )
            guards = guards_of_many(events)
            if guards:
                await connection.execute(
                    "SELECT dracap_guard($1, $2)", rows[0][0] - 1, encode_guards(guards)
                )
            count += len(rows)
        await connection.execute("UPDATE event_log_head SET position = $1", count)
        await connection.execute("SELECT pg_notify($1, $2)", CHANNEL, str(count))
    return count
