"""The log file's fast fold path (``read_rows(..., lines=True)``) against the plain one.

Folding a file line by line (each line decoded in one pass right before its step) must
give exactly the state, and exactly the errors, of folding its rows (page decode, then
``decode_stored`` per payload): on a valid history, to the head and to a point inside
a page; with an old-schema line to upcast; with a line whose tag contradicts its
``type`` column; with a gap in the positions; with a line that is not JSON.
"""

from __future__ import annotations

import datetime
import hashlib
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from events import catalog as c
from events.envelopes import namespace_of, stream_of
from events.errors import CatalogError, InvariantViolation
from events.eventcodec import encode_payload
from events.state import ClusterState
from services.replay import logfile
from services.replay.logfile import LogFileError, LogWriter, read_rows
from services.replay.verify import fold_rows
from tests.integration import sample as s

T0 = datetime.datetime(2026, 12, 1, 9, 0, tzinfo=datetime.UTC)


def _row(position: int, event: c.Event, **override: Any) -> list[Any]:
    row = [
        position,
        str(uuid.uuid4()),
        stream_of(event),
        1,
        c.tag_of(event),
        c.schema_version_of(event),
        namespace_of(event),
        "system:test",
        None,
        None,
        T0 + datetime.timedelta(seconds=position),
        encode_payload(event),
    ]
    for index, value in override.items():
        row[int(index.lstrip("_"))] = value
    return row


def history(claims: int) -> list[list[Any]]:
    """A valid log: a slice, then ``claims`` claims reserved, bound, applied, released."""
    events: list[c.Event] = [s.slice_published(devices={"gpu-0": {"memory": "80Gi"}})]
    for i in range(claims):
        r = s.reserved("team-a", f"c{i}", "gpu-0", "1Gi")
        events += [
            c.ClaimAdmitted(namespace="team-a", name=f"c{i}"),
            r,
            s.bound(r),
            c.LimitApplied(share_id=r.share_id, node=s.POOL, level="hard", actual=r.consumed),
        ]
        if i % 3:
            events += [
                c.ReleaseRequested(namespace="team-a", name=f"c{i}", allocation_version=1),
                s.released(r),
            ]
    return [_row(i + 1, e) for i, e in enumerate(events)]


def write(path: Path, rows: list[list[Any]]) -> Path:
    writer = LogWriter(path)
    writer.write(rows)
    writer.close()
    return path


def write_raw(path: Path, lines: list[bytes]) -> Path:
    """A file with these event lines as they are (no checks), header and end line correct."""
    header = (write(path.with_suffix(".h"), []).read_bytes().split(b"\n"))[0] + b"\n"
    body = header + b"".join(line + b"\n" for line in lines)
    end = logfile.EndLine(
        end=True, count=len(lines), last=len(lines), sha256=hashlib.sha256(body).hexdigest()
    )
    path.write_bytes(body + msgspec.json.encode(end) + b"\n")
    return path


def fold(path: Path, *, lines: bool, to: int | None = None) -> ClusterState:
    state = ClusterState()
    for page in read_rows(path, to_position=to, lines=lines):
        fold_rows(state, page)
    return state


def outcome(path: Path, *, lines: bool) -> tuple[str, str]:
    try:
        return "state", repr(fold(path, lines=lines))
    except (LogFileError, InvariantViolation, CatalogError) as exc:
        return type(exc).__name__, str(exc)


def test_lines_fold_to_the_same_state_as_rows(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(logfile, "CHUNK_BYTES", 4096)  # many pages, cut mid-line
    path = write(tmp_path / "log.ndjson", history(60))
    total = len(history(60))
    for to in (None, 1, 37, total - 1):
        fast = fold(path, lines=True, to=to)
        assert fast == fold(path, lines=False, to=to)
        assert fast.position == (to or total)
    assert len(fold(path, lines=True).shares) == 60


def test_a_line_to_upcast_takes_the_plain_path(tmp_path: Path) -> None:
    rows = history(2)
    old = msgspec.json.decode(encode_payload(s.reserved("team-a", "old", "gpu-0", "5Gi")))
    del old["shared"], old["policy_version"]  # as schema version 1 wrote it
    rows.append(
        _row(
            len(rows) + 1,
            s.reserved("team-a", "old", "gpu-0", "5Gi"),
            _5=1,
            _11=msgspec.json.encode(old),
        )
    )
    path = write(tmp_path / "v1.ndjson", rows)
    fast = fold(path, lines=True)
    assert fast == fold(path, lines=False)
    assert any(share.claim == ("team-a", "old") for share in fast.shares.values())


def test_a_tag_its_column_contradicts_is_refused_alike(tmp_path: Path) -> None:
    rows = history(1)
    # the payload is an admission, the column says it is a release request
    rows.append(
        _row(
            len(rows) + 1,
            c.ClaimAdmitted(namespace="team-a", name="x"),
            _4="reclamation.release_requested",
        )
    )
    path = write(tmp_path / "tag.ndjson", rows)
    fast = fold(path, lines=True)  # skipped by both paths (events.folding), not folded
    assert fast == fold(path, lines=False)
    assert fast.refused == {len(rows): "undecodable"}
    assert ("team-a", "x") not in fast.claims


def test_a_gap_and_a_broken_line_are_refused_alike(tmp_path: Path) -> None:
    lines = [logfile._ENCODER.encode(tuple(_iso(r))) for r in history(3)]
    gap = write_raw(tmp_path / "gap.ndjson", lines[:4] + lines[5:])
    kind, message = outcome(gap, lines=True)
    assert (kind, message) == outcome(gap, lines=False)
    assert kind == "LogFileError" and "position 6 where 5 was expected" in message
    broken = write_raw(tmp_path / "broken.ndjson", [*lines[:3], b"[4, not json", *lines[4:]])
    kind, message = outcome(broken, lines=True)
    assert (kind, message) == outcome(broken, lines=False)
    assert kind == "LogFileError" and "line 5:" in message  # the header is line 1


def _iso(row: list[Any]) -> list[Any]:
    out = list(row)
    out[10] = row[10].isoformat()
    out[11] = msgspec.Raw(row[11])
    return out


@pytest.mark.parametrize("lines", [True, False])
def test_a_changed_file_fails_its_checksum(tmp_path: Path, lines: bool) -> None:
    path = write(tmp_path / "log.ndjson", history(3))
    path.write_bytes(path.read_bytes().replace(b'"1Gi"', b'"2Gi"', 1))
    with pytest.raises(LogFileError, match="checksum mismatch"):
        fold(path, lines=lines)
