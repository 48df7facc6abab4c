"""Checkpoints inside a log file: the fold every N events, as a pack index is to git.

``dracap replay export`` folds the log as it writes it (:class:`CheckpointWriter`) and,
after every ``every`` events (default :data:`EVERY`, 100,000; 0: none) and after the
last event, writes a **checkpoint line** (:class:`~services.replay.logfile.CheckpointLine`):
the position, the id of the event at that position, and the fold's state in the stored
form of a database snapshot (:func:`services.runtime.store.snapshots.frame`: one home for the
encoding), base64 in the JSON line. The file's SHA-256 covers checkpoint lines like
every line.

A replay to a point (``replay state --at P --log FILE``,
:meth:`services.replay.sources.FileSource.start`) still reads and checks the whole file,
but starts its fold from the newest checkpoint at or before ``P`` that verifies
(:func:`checkpoint_state`): the line decodes, its position is the event line's before
it, its event id is that line's, and the snapshot verifies as a database snapshot does
(checksum, event id, format, position: :func:`~services.runtime.store.snapshots.verify_snapshot`).
One that does not is skipped with a warning and the next older one tried, else the fold
starts at 0.

A checkpoint that verifies is **trusted** as a database start trusts a snapshot: a
checkpoint forged consistently (its checksum, event id and format right, its state
wrong) and the file's checksum recomputed would be believed by ``state --at``.
``replay verify --log FILE`` is the check: it folds every event from 0 and compares
each checkpoint with the fold at its position (:func:`compare`); one that differs is a
failure naming its position (exit 7, ``SNAPSHOT_MISMATCH``). ``replay import`` ignores
checkpoint lines (the database writes its own snapshots).
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from events.errors import InvariantViolation, SnapshotError
from events.state import ClusterState
from events.statecodec import same_state, snapshot_encode
from services.replay.logfile import Checkpoint, CheckpointLine, LogWriter
from services.replay.verify import fold_rows, paused_gc
from services.runtime.store.snapshots import FRAME_VERSION, frame, verify_snapshot

__all__ = [
    "EVERY",
    "CheckpointMismatchError",
    "CheckpointWriter",
    "check_place",
    "checkpoint_state",
    "compare",
    "decode_checkpoint",
    "encode_checkpoint",
]

log = logging.getLogger(__name__)

#: Events between checkpoints of an export, by default.
EVERY: Final = 100_000

_LINE: Final = msgspec.json.Decoder(CheckpointLine)


class CheckpointMismatchError(Exception):
    """A checkpoint of a file is not the fold at its position (``position`` names it)."""

    def __init__(self, position: int, detail: str) -> None:
        super().__init__(f"checkpoint at position {position}: {detail}")
        self.position = position


def encode_checkpoint(state: ClusterState, event_id: str) -> CheckpointLine:
    """The checkpoint line of ``state``, taken right after event ``event_id``."""
    packed = frame(snapshot_encode(state), event_id)
    return CheckpointLine(
        checkpoint=state.position,
        event_id=event_id,
        snapshot=base64.b64encode(packed).decode("ascii"),
    )


def decode_checkpoint(line: bytes, position: int, head: int) -> tuple[CheckpointLine, ClusterState]:
    """A checkpoint line said to be at ``position``, and its state, if the snapshot it
    holds verifies (with the line's own event id); else SnapshotError. Where the line
    stands is :func:`check_place`'s."""
    parsed, payload = _parse(line, position)
    return parsed, verify_snapshot(position, FRAME_VERSION, payload, head, parsed.event_id)


def check_place(found: Checkpoint, line: bytes, parsed: CheckpointLine) -> None:
    """SnapshotError unless ``line`` is the checkpoint line the reader ``found`` right
    after the event of its position, and names that event's id."""
    if found.line is None:
        raise SnapshotError(
            f"checkpoint at {found.position}: the file has no checkpoint line there"
        )
    if found.line != line:
        raise SnapshotError(
            f"checkpoint at {found.position}: the end line's index points at another line"
        )
    event_id = found.event_id()
    if parsed.event_id != event_id:
        raise SnapshotError(
            f"checkpoint at {found.position} was taken after event {parsed.event_id}, "
            f"the file has {event_id} there"
        )


def checkpoint_state(found: Checkpoint, head: int) -> ClusterState:
    """The state of a checkpoint the reader found, if it verifies (module docstring),
    else SnapshotError."""
    if found.line is None:
        raise SnapshotError(
            f"checkpoint at {found.position}: the file has no checkpoint line there"
        )
    parsed, payload = _parse(found.line, found.position)
    check_place(found, found.line, parsed)  # the cheap checks first
    return verify_snapshot(found.position, FRAME_VERSION, payload, head, parsed.event_id)


def _parse(line: bytes, position: int) -> tuple[CheckpointLine, bytes]:
    try:
        parsed = _LINE.decode(line)
        payload = base64.b64decode(parsed.snapshot, validate=True)
    except (msgspec.DecodeError, msgspec.ValidationError, binascii.Error) as exc:
        raise SnapshotError(f"checkpoint at {position}: not a checkpoint line: {exc}") from None
    if parsed.checkpoint != position:
        raise SnapshotError(
            f"checkpoint line for position {parsed.checkpoint} stands where {position} was expected"
        )
    return parsed, payload


def compare(found: Checkpoint, state: ClusterState, head: int) -> None:
    """Raise :class:`CheckpointMismatchError` unless the checkpoint verifies and holds
    exactly ``state`` (the fold at its position)."""
    if state.position != found.position:
        raise CheckpointMismatchError(
            found.position, f"stands where the fold is at {state.position}"
        )
    try:
        stored = checkpoint_state(found, head)
    except SnapshotError as exc:
        raise CheckpointMismatchError(found.position, f"does not verify: {exc}") from None
    if not same_state(stored, state):
        raise CheckpointMismatchError(
            found.position, "its state differs from the fold of the events before it"
        )


class CheckpointWriter(LogWriter):
    """A :class:`~services.replay.logfile.LogWriter` that folds what it writes and writes
    a checkpoint line every ``every`` events and after the last (0: none at all).

    An event the fold refuses (:mod:`events.folding`) is written as it is and skipped by
    the fold, as every reader skips it; a log that cannot be folded at all (a position
    out of order) is still written whole, without checkpoints from there on (logged).
    """

    def __init__(self, path: str | Path, *, source: str = "", every: int = EVERY) -> None:
        super().__init__(path, source=source)
        self.every = every
        self.state = ClusterState()
        self._event_id = ""

    def write(self, rows: Sequence[Any]) -> None:
        """Append stored rows, with a checkpoint line after every ``every``-th position."""
        if self.every <= 0:
            super().write(rows)
            return
        start = 0
        while start < len(rows):
            due = (self.last // self.every + 1) * self.every
            segment = rows[start : start + due - self.last]
            super().write(segment)
            start += len(segment)
            self._fold(segment)
            if self.last == due:
                self._checkpoint()

    def _fold(self, rows: Sequence[Any]) -> None:
        if self.every <= 0 or not rows:
            return
        try:
            with paused_gc():
                fold_rows(self.state, rows)
        except InvariantViolation as exc:
            log.warning("no more checkpoints: the log cannot be folded from there: %s", exc)
            self.every = 0
            return
        self._event_id = str(rows[-1][1])

    def _checkpoint(self) -> None:
        if self.every > 0 and self.state.position == self.last and self.last:
            self.write_checkpoint(encode_checkpoint(self.state, self._event_id))

    def close(self) -> None:
        """Write a checkpoint at the last event (unless there is one), then the end line."""
        if not self.checkpoints or self.checkpoints[-1][0] != self.last:
            self._checkpoint()
        super().close()
