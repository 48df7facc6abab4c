"""Checkpoint lines in a log file (``services/replay/checkpoints.py``).

``state --at`` from a checkpointed file must equal the fold from position 1 of the same
events at every position (before, at and after a checkpoint, and with chunks smaller
than a checkpoint line); an older-format file (version 1, no checkpoints) still reads;
a checkpoint that does not verify is skipped (logged) and the answer stays the same; a
forged one that verifies is trusted by ``state --at`` (as a database snapshot is) and
caught by ``verify``, which compares every checkpoint with the fold.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest

from events.state import ClusterState
from services.replay import logfile
from services.replay.checkpoints import (
    CheckpointMismatchError,
    CheckpointWriter,
    encode_checkpoint,
)
from services.replay.history import state_at
from services.replay.logfile import LogFileError, read_rows
from services.replay.sources import FileSource
from services.replay.transfer import check_file
from services.runtime.store.snapshots import frame
from tests.unit.test_logfile import history, write

EVERY = 10


def write_checkpointed(path: Path, rows: list[list[Any]], every: int = EVERY) -> Path:
    writer = CheckpointWriter(path, every=every)
    writer.write(rows[:7])  # batches that do not line up with the checkpoints
    writer.write(rows[7:33])
    writer.write(rows[33:])
    writer.close()
    return path


def reseal(path: Path, lines: list[bytes], *, version: int | None = None) -> Path:
    """Rewrite ``path`` with these lines (header first, no end line), its end line
    recomputed: as someone who edits a file and fixes its checksum would."""
    if version is not None:
        header = msgspec.json.decode(lines[0])
        header["version"] = version
        lines = [msgspec.json.encode(header), *lines[1:]]
    body = b"".join(line + b"\n" for line in lines)
    marks, offset = [], len(lines[0]) + 1
    for line in lines[1:]:
        if line[:1] == b"{":
            marks.append((msgspec.json.decode(line)["checkpoint"], offset))
        offset += len(line) + 1
    events = sum(1 for line in lines[1:] if line[:1] == b"[")
    end: dict[str, Any] = {
        "end": True,
        "count": events,
        "last": events,
        "sha256": hashlib.sha256(body).hexdigest(),
    }
    if version != 1:
        end["checkpoints"] = marks
    path.write_bytes(body + msgspec.json.encode(end) + b"\n")
    return path


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().rstrip(b"\n").split(b"\n")[:-1]  # without the end line


def at(path: Path, position: int) -> ClusterState:
    return asyncio.run(state_at(FileSource(path), position))


def start(path: Path, position: int) -> int:
    """The position the replay to ``position`` starts folding from."""

    async def go() -> int:
        source = FileSource(path)
        begun = (await source.start(position)).position
        source._close_resumed()
        return begun

    return asyncio.run(go())


@pytest.fixture
def files(tmp_path: Path, monkeypatch: Any) -> tuple[Path, Path, list[list[Any]]]:
    monkeypatch.setattr(logfile, "CHUNK_BYTES", 2048)  # checkpoint lines span chunks
    rows = history(12)
    plain = write(tmp_path / "plain.ndjson", rows)
    return plain, write_checkpointed(tmp_path / "cp.ndjson", rows), rows


def test_state_at_equals_the_fold_from_1_at_every_position(
    files: tuple[Path, Path, list[list[Any]]],
) -> None:
    plain, checkpointed, rows = files
    total = len(rows)
    end = logfile.read_end(checkpointed)[0]
    assert [position for position, _ in end.checkpoints] == [*range(EVERY, total, EVERY), total]
    assert logfile.read_end(plain)[0].checkpoints == []
    for position in range(1, total + 1):
        assert at(checkpointed, position) == at(plain, position), position
    assert start(checkpointed, EVERY - 1) == 0  # before the first checkpoint
    assert start(checkpointed, EVERY) == EVERY  # at one
    assert start(checkpointed, EVERY + 3) == EVERY  # after one
    assert start(checkpointed, total) == total


def test_the_other_readers_leave_checkpoint_lines_out(
    files: tuple[Path, Path, list[list[Any]]],
) -> None:
    plain, checkpointed, _ = files
    rows = [r for page in read_rows(checkpointed) for r in page]
    assert rows == [r for page in read_rows(plain) for r in page]
    assert check_file(checkpointed, checkpoints=True) == check_file(plain)
    pages = [p.lines for p in read_rows(checkpointed, lines=True)]
    assert [line.rstrip(b"\n") for page in pages for line in page] == lines_of(plain)[1:]


def test_a_version_1_file_still_reads_and_may_hold_no_checkpoint(
    files: tuple[Path, Path, list[list[Any]]], tmp_path: Path
) -> None:
    plain, checkpointed, rows = files
    old = reseal(tmp_path / "v1.ndjson", lines_of(plain), version=1)
    assert logfile.read_header(old).version == 1
    for position in (1, EVERY, len(rows)):
        assert at(old, position) == at(plain, position)
    assert check_file(old, checkpoints=True) == check_file(plain)
    rows = [r for page in read_rows(old) for r in page]  # what import copies
    assert rows == [r for page in read_rows(plain) for r in page]
    bad = reseal(tmp_path / "v1cp.ndjson", lines_of(checkpointed), version=1)
    with pytest.raises(LogFileError, match=r"line \d+: "):
        check_file(bad)


def _replace_checkpoint(lines: list[bytes], position: int, make: Any) -> list[bytes]:
    out = lines[:1]
    for line in lines[1:]:
        if line[:1] == b"{" and msgspec.json.decode(line)["checkpoint"] == position:
            line = make(msgspec.json.decode(line))
        out.append(line)
    return out


def test_an_unusable_checkpoint_is_skipped_and_the_answer_is_the_same(
    files: tuple[Path, Path, list[list[Any]]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain, checkpointed, _ = files

    def other_event(line: dict[str, Any]) -> bytes:
        line["event_id"] = "00000000-0000-0000-0000-000000000000"
        return msgspec.json.encode(line)

    def torn(line: dict[str, Any]) -> bytes:
        line["snapshot"] = line["snapshot"][:-40] + "A" * 40
        return msgspec.json.encode(line)

    for name, make in (("event", other_event), ("torn", torn)):
        broken = reseal(
            tmp_path / f"{name}.ndjson",
            _replace_checkpoint(lines_of(checkpointed), 2 * EVERY, make),
        )
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert at(broken, 2 * EVERY + 3) == at(plain, 2 * EVERY + 3)
        assert "checkpoint skipped" in caplog.text, name
        assert start(broken, 2 * EVERY + 3) == EVERY  # the next older one
        with pytest.raises(CheckpointMismatchError, match="does not verify") as raised:
            check_file(broken, checkpoints=True)
        assert raised.value.position == 2 * EVERY
        check_file(broken)  # import ignores checkpoint lines


def test_a_forged_checkpoint_is_trusted_by_state_at_and_caught_by_verify(
    files: tuple[Path, Path, list[list[Any]]], tmp_path: Path
) -> None:
    plain, checkpointed, _ = files
    truth = at(plain, EVERY)
    forged_state = at(plain, EVERY)
    forged_state.dead_letters = 7  # a state the events do not give

    def forge(line: dict[str, Any]) -> bytes:
        return msgspec.json.encode(encode_checkpoint(forged_state, line["event_id"]))

    forged = reseal(
        tmp_path / "forged.ndjson", _replace_checkpoint(lines_of(checkpointed), EVERY, forge)
    )
    assert at(forged, EVERY) != truth  # trusted: it verifies (docs/forensics.md)
    with pytest.raises(CheckpointMismatchError, match="differs from the fold") as raised:
        check_file(forged, checkpoints=True)
    assert raised.value.position == EVERY
    assert check_file(forged) == check_file(plain)  # import ignores it


def test_a_stale_checkpoint_of_another_position_fails_verify(
    files: tuple[Path, Path, list[list[Any]]], tmp_path: Path
) -> None:
    plain, checkpointed, _ = files
    earlier = at(plain, EVERY - 1)

    def stale(line: dict[str, Any]) -> bytes:
        packed = frame(msgspec.json.encode({"format": 0}), line["event_id"])
        line["snapshot"] = base64.b64encode(packed).decode()
        return msgspec.json.encode(line)

    broken = reseal(
        tmp_path / "stale.ndjson", _replace_checkpoint(lines_of(checkpointed), EVERY, stale)
    )
    with pytest.raises(CheckpointMismatchError) as raised:
        check_file(broken, checkpoints=True)
    assert raised.value.position == EVERY
    assert at(broken, EVERY) == at(plain, EVERY) != earlier


def test_an_end_line_that_lists_other_checkpoints_is_refused(
    files: tuple[Path, Path, list[list[Any]]], tmp_path: Path
) -> None:
    _, checkpointed, _ = files
    body, _, last = checkpointed.read_bytes().rstrip(b"\n").rpartition(b"\n")
    end = msgspec.json.decode(last)
    listed = end["checkpoints"]
    edited = tmp_path / "index.ndjson"
    for index, refusal in (
        (listed[1:], r"line \d+: "),  # one left out: that line is not an event line
        (
            [*listed, [listed[-1][0] + 1, listed[-1][1]]],
            f"lists {len(listed) + 1} checkpoints, found {len(listed)}",
        ),
    ):
        end["checkpoints"] = index
        edited.write_bytes(body + b"\n" + msgspec.json.encode(end) + b"\n")
        with pytest.raises(LogFileError, match=refusal):
            check_file(edited)  # lines folded: the fold checks each line
        with pytest.raises(LogFileError, match=refusal):
            for _ in read_rows(edited):  # rows
                pass


def test_an_index_that_points_elsewhere_only_costs_time(
    files: tuple[Path, Path, list[list[Any]]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain, checkpointed, _ = files
    body, _, last = checkpointed.read_bytes().rstrip(b"\n").rpartition(b"\n")
    end = msgspec.json.decode(last)
    (p1, o1), (p2, o2) = end["checkpoints"][:2]
    end["checkpoints"][:2] = [[p1, o2], [p2, o1]]  # each offset at the other's line
    edited = tmp_path / "swapped.ndjson"
    edited.write_bytes(body + b"\n" + msgspec.json.encode(end) + b"\n")
    with caplog.at_level(logging.WARNING):
        assert at(edited, p2 + 1) == at(plain, p2 + 1)
    assert "checkpoint skipped" in caplog.text
    assert start(edited, p2 + 1) == 0  # neither verifies where it is said to be
    assert start(edited, end["checkpoints"][2][0]) == end["checkpoints"][2][0]
