"""Where a forensic replay reads the log: the live database, or an exported file.

Both hand out pages of stored rows in :data:`~services.runtime.store.rows.COLUMNS` order, so
one fold loop (:func:`services.replay.verify.fold_rows`) serves both:

* :class:`DatabaseSource`: one ``REPEATABLE READ`` read-only transaction (every question
  is answered as of one instant, while services keep appending); a replay to position
  *p* starts from the newest snapshot at or before *p* that verifies
  (:func:`services.runtime.store.snapshots.load_verified`), the rest from position 0;
* :class:`FileSource`: a ``dracap-log`` file (:mod:`services.replay.logfile`), no
  database at all; a replay to position *p* starts from the newest checkpoint line at
  or before *p* that verifies (:mod:`services.replay.checkpoints`), else from position
  0, and is reported only after the whole file's checksum held.

A point in the log (``--at``, ``diff A B``) is a position or a time
(:func:`parse_point`); a time means the last event recorded at or before it, read in
log order (the position of the first event recorded later, minus one).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import AsyncIterator, Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import asyncpg

from events.errors import SnapshotError
from events.state import ClusterState
from services.exitcodes import CommandError, ExitCode
from services.replay import logfile
from services.replay.checkpoints import check_place, decode_checkpoint
from services.runtime.store.eventstore import iter_rows
from services.runtime.store.rows import POSITION
from services.runtime.store.snapshots import load_verified

__all__ = ["DatabaseSource", "FileSource", "LogSource", "Point", "parse_point"]

#: A point in the log: a position, or a time.
Point = int | datetime.datetime
RECORDED_AT = 10
log = logging.getLogger(__name__)


def parse_point(text: str, what: str = "--at") -> Point:
    """A position (``1234``) or an ISO 8601 time (``2026-12-01T10:00:00Z``)."""
    if text.isdigit():
        return int(text)
    try:
        value = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise CommandError(
            f"{what} {text!r}: must be a position (an integer) or an ISO 8601 time",
            ExitCode.BAD_INPUT,
        ) from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.UTC)
    return value


def _time_of(value: Any) -> datetime.datetime:
    if isinstance(value, datetime.datetime):
        return value
    return datetime.datetime.fromisoformat(value)


class LogSource(Protocol):
    """What a replay reads."""

    async def head(self) -> int:
        """The last position."""

    async def start(self, at_or_before: int) -> ClusterState:
        """The state to fold from for a replay to ``at_or_before``."""

    def rows(
        self, after: int, to_position: int | None = None, *, to_fold: bool = False
    ) -> AsyncIterator[Any]:
        """Pages of rows after ``after`` (up to ``to_position``); ``to_fold``: pages only
        :func:`~services.replay.verify.fold_rows` reads (a file's undecoded lines)."""

    async def position_at(self, when: datetime.datetime) -> int:
        """The last position recorded at or before ``when``."""


async def resolve(source: LogSource, point: Point) -> int:
    """The position of ``point`` (capped at the head)."""
    head = await source.head()
    if isinstance(point, int):
        return min(point, head)
    return await source.position_at(point)


class DatabaseSource:
    """The live database, read in one repeatable-read transaction (``async with``)."""

    def __init__(self, connection: asyncpg.Connection, *, snapshots: bool = True) -> None:
        self.connection = connection
        self.snapshots = snapshots
        self._tx = connection.transaction(isolation="repeatable_read", readonly=True)

    async def __aenter__(self) -> DatabaseSource:
        await self._tx.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._tx.rollback()

    async def head(self) -> int:
        head: int = await self.connection.fetchval("SELECT position FROM event_log_head")
        return head

    async def start(self, at_or_before: int) -> ClusterState:
        if not self.snapshots:
            return ClusterState()
        state = await load_verified(self.connection, at_or_before)
        return state if state is not None else ClusterState()

    async def rows(
        self, after: int, to_position: int | None = None, *, to_fold: bool = False
    ) -> AsyncIterator[Any]:
        async for page in iter_rows(self.connection, after, to_position=to_position):
            yield page

    async def position_at(self, when: datetime.datetime) -> int:
        first_later = await self.connection.fetchval(
            "SELECT min(position) FROM events WHERE recorded_at > $1", when
        )
        return (first_later - 1) if first_later is not None else await self.head()


class FileSource:
    """An exported ``dracap-log`` file.

    :meth:`start` reads the file up to the checkpoint it starts from (checking what it
    skips) and keeps that read open: the :meth:`rows` that follow it for the same replay
    go on from there, so the file is read once.
    """

    def __init__(
        self,
        path: str | Path,
        progress: Callable[[int, int], None] | None = None,
        *,
        checkpoints: bool = True,
    ) -> None:
        self.path = Path(path)
        self.progress = progress
        self.checkpoints = checkpoints
        self._head: int | None = None
        #: (checkpoint position, to_position, the read after it) of the last start
        self._resumed: tuple[int, int, Generator[Any, None, None]] | None = None

    async def head(self) -> int:
        if self._head is None:
            logfile.read_header(self.path)
            self._head = logfile.read_end(self.path)[0].last
        return self._head

    async def start(self, at_or_before: int) -> ClusterState:
        """The newest checkpoint at or before ``at_or_before`` that verifies, read up to;
        an empty state when none does (each one that does not is logged)."""
        self._close_resumed()
        if not self.checkpoints:
            return ClusterState()
        head = await self.head()
        end = logfile.read_end(self.path)[0]
        for position, offset in sorted(set(end.checkpoints), reverse=True):
            if 0 < position <= at_or_before:
                state = self._resume(position, offset, at_or_before, head)
                if state is not None:
                    return state
        return ClusterState()

    def _resume(
        self, position: int, offset: int, to_position: int, head: int
    ) -> ClusterState | None:
        """Read up to the checkpoint at ``position`` while its line (at ``offset``, by the
        end line's index) is decoded in a thread: inflating it releases the GIL, so it
        overlaps the reading. ``None``: it does not verify (logged)."""
        line = logfile.read_line_at(self.path, offset)
        with ThreadPoolExecutor(1, thread_name_prefix="dracap-checkpoint") as pool:
            decoding = pool.submit(decode_checkpoint, line, position, head)
            pages = logfile.read_rows(
                self.path,
                to_position=to_position,
                progress=self.progress,
                lines=True,
                resume_at=position,
            )
            try:
                found = next(pages, None)
                if not isinstance(found, logfile.Checkpoint):
                    raise SnapshotError(f"checkpoint at {position}: not in the file")
                parsed, state = decoding.result()
                check_place(found, line, parsed)
            except SnapshotError as exc:
                pages.close()
                log.warning("checkpoint skipped (folding from an earlier point): %s", exc)
                return None
            except BaseException:
                pages.close()
                raise
        self._resumed = (position, to_position, pages)
        return state

    def _close_resumed(self) -> None:
        if self._resumed is not None:
            pages = self._resumed[2]
            self._resumed = None
            pages.close()

    async def rows(
        self, after: int, to_position: int | None = None, *, to_fold: bool = False
    ) -> AsyncIterator[Any]:
        resumed = self._resumed
        self._resumed = None
        if resumed is not None and to_fold and resumed[:2] == (after, to_position):
            pages = resumed[2]
        else:
            if resumed is not None:
                self._resumed = resumed
                self._close_resumed()
            pages = logfile.read_rows(
                self.path, to_position=to_position, progress=self.progress, lines=to_fold
            )
        for page in pages:
            if isinstance(page, logfile.LinePage):
                if page.last > after:
                    yield page.between(after) if page.first <= after else page
                continue
            if page[-1][POSITION] <= after:
                continue
            if page[0][POSITION] <= after:
                page = [r for r in page if r[POSITION] > after]
            yield page

    async def position_at(self, when: datetime.datetime) -> int:
        found: int | None = None
        async for page in self.rows(0):
            if found is not None:
                continue  # read on: the checksum covers the whole file
            for row in page:
                if _time_of(row[RECORDED_AT]) > when:
                    found = row[POSITION] - 1
                    break
        return found if found is not None else await self.head()
