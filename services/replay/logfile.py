"""The portable log file of ``dracap replay export`` / ``import`` and ``--log FILE``.

Format (``dracap-log`` version 1), NDJSON, one JSON value per line:

1. a **header** object: ``{"format": "dracap-log", "version": 1, "columns": [...],
   "schema_versions": {type: version}, "exported_at": ISO time, "source": text}`` —
   ``columns`` names the fields of every event line (:data:`~services.runtime.rows.COLUMNS`),
   ``schema_versions`` the catalog of the code that wrote the file;
2. one **event** array per stored event, in position order, its fields in ``columns``
   order; ``recorded_at`` is an ISO 8601 string, ``payload`` the event's JSON object
   exactly as the database stored it, with its own ``schema_version`` beside it — an
   export made by older code keeps its old payloads and replays through the catalog's
   upcasters (:func:`events.catalog.decode_stored`);
3. an **end** object: ``{"end": true, "count": N, "last": position, "sha256": hex}``,
   the SHA-256 of every byte before the end line (header and events, newlines included).

Events are arrays, not objects, so a reader decodes a line straight into a tuple in
the store's row order (the replay loop indexes rows by column); the header says which
column is which. Reading checks the header (format, version, columns), that positions
run 1, 2, 3 ... without a gap, that the count matches and the checksum: a file that was
cut short, edited or is something else is refused with a :class:`LogFileError` (one
line, exit 2), never folded silently. The checksum is checked over the *whole* file
even when a replay stops early (``state --at``), before anything is reported.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Final

import msgspec

from events.catalog import SCHEMA_VERSIONS
from services.runtime.rows import COLUMNS

__all__ = [
    "FORMAT",
    "VERSION",
    "EndLine",
    "Header",
    "LogFileError",
    "LogWriter",
    "read_rows",
]

FORMAT: Final = "dracap-log"
VERSION: Final = 1
#: Bytes read per chunk (and events per page handed to the fold, at most).
CHUNK_BYTES: Final = 4 << 20
_TAIL_BYTES: Final = 4096

#: One event line: the columns of :data:`COLUMNS`, payload kept as raw JSON.
FileRow = tuple[
    int,
    str,
    str,
    int,
    str,
    int,
    str | None,
    str,
    str | None,
    str | None,
    str,
    msgspec.Raw,
]


class LogFileError(Exception):
    """A log file that cannot be read as a dracap log (one line, names what is wrong)."""


class Header(msgspec.Struct, kw_only=True):
    """The first line of a log file."""

    format: str
    version: int
    columns: list[str]
    schema_versions: dict[str, int] = {}
    exported_at: str = ""
    source: str = ""


class EndLine(msgspec.Struct, kw_only=True):
    """The last line of a log file."""

    end: bool
    count: int
    last: int
    sha256: str


_ROWS: Final = msgspec.json.Decoder(list[FileRow])
_ROW_LIST: Final = msgspec.json.Decoder(FileRow)
_ENCODER: Final = msgspec.json.Encoder()


def _iso(value: Any) -> str:
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    return str(value)


class LogWriter:
    """Writes a log file: ``write(rows)`` any number of times, then ``close()``.

    Rows are in :data:`COLUMNS` order (asyncpg records or tuples, payload as stored
    text/bytes). Positions must follow each other from 1 — an export is a whole log.
    """

    def __init__(self, path: str | Path, *, source: str = "") -> None:
        self.path = Path(path)
        self._tmp = self.path.with_name(self.path.name + ".part")
        self._file: IO[bytes] = open(self._tmp, "wb")  # noqa: SIM115 (closed in close())
        self._sha = hashlib.sha256()
        self.count = 0
        self.last = 0
        header = Header(
            format=FORMAT,
            version=VERSION,
            columns=list(COLUMNS),
            schema_versions=dict(SCHEMA_VERSIONS),
            exported_at=datetime.datetime.now(datetime.UTC).isoformat(),
            source=source,
        )
        self._emit(_ENCODER.encode(header) + b"\n")

    def _emit(self, data: bytes) -> None:
        self._sha.update(data)
        self._file.write(data)

    def write(self, rows: Sequence[Any]) -> None:
        """Append stored rows (in position order, continuing the file's positions)."""
        parts: list[bytes] = []
        for row in rows:
            position = row[0]
            if position != self.last + 1:
                raise LogFileError(f"position {position} does not follow {self.last}")
            payload = row[11]
            raw = msgspec.Raw(payload.encode() if isinstance(payload, str) else bytes(payload))
            line = (
                position,
                str(row[1]),
                row[2],
                row[3],
                row[4],
                row[5],
                row[6],
                row[7],
                row[8],
                row[9],
                _iso(row[10]),
                raw,
            )
            parts.append(_ENCODER.encode(line))
            self.last = position
        if parts:
            self._emit(b"\n".join(parts) + b"\n")
            self.count += len(parts)

    def close(self) -> None:
        """Write the end line and move the file into place."""
        end = EndLine(end=True, count=self.count, last=self.last, sha256=self._sha.hexdigest())
        self._file.write(_ENCODER.encode(end) + b"\n")
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Drop a file that was not finished."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)


def _open(path: str | Path) -> IO[bytes]:
    try:
        return open(path, "rb")
    except OSError as exc:
        raise LogFileError(f"--log {path}: cannot read: {exc.strerror}") from None


def read_end(path: str | Path) -> tuple[EndLine, int]:
    """The end line of the file and the offset where it starts."""
    with _open(path) as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - _TAIL_BYTES))
        tail = f.read()
    stripped = tail.rstrip(b"\n")
    last = stripped.rsplit(b"\n", 1)[-1]
    try:
        end = msgspec.json.decode(last, type=EndLine)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise LogFileError(f"{path}: no end line (cut short, or not a dracap log)") from None
    return end, size - len(tail) + len(stripped) - len(last)


def read_header(path: str | Path) -> Header:
    """The header line of the file, checked."""
    with _open(path) as f:
        first = f.readline()
    try:
        header = msgspec.json.decode(first, type=Header)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise LogFileError(f"{path}: line 1: not a dracap-log header") from None
    if header.format != FORMAT:
        raise LogFileError(f"{path}: format {header.format!r} is not {FORMAT!r}")
    if header.version != VERSION:
        raise LogFileError(f"{path}: version {header.version} is not {VERSION} (newer dracap?)")
    if tuple(header.columns) != COLUMNS:
        raise LogFileError(f"{path}: columns {header.columns} are not {list(COLUMNS)}")
    return header


def read_rows(
    path: str | Path,
    *,
    to_position: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[list[FileRow]]:
    """Pages of event rows (tuples in :data:`COLUMNS` order), checked as they are read.

    Stops handing out rows after ``to_position`` but still reads (and hashes) the rest
    of the file; raises :class:`LogFileError` at the first thing wrong — a checksum
    mismatch only at the end, after the last page, so a caller must consume the whole
    iterator before trusting what it folded. ``progress(bytes_read, bytes_total)`` is
    called once per chunk.
    """
    read_header(path)
    end, end_offset = read_end(path)
    sha = hashlib.sha256()
    expected = 1
    done = False
    with _open(path) as f:
        first = f.readline()
        sha.update(first)
        read = len(first)
        line_no = 1
        rest = b""
        while read < end_offset:
            chunk = f.read(min(CHUNK_BYTES, end_offset - read))
            if not chunk:
                break
            read += len(chunk)
            sha.update(chunk)
            data = rest + chunk
            cut = data.rfind(b"\n") + 1
            body, rest = data[:cut], data[cut:]
            if progress is not None:
                progress(read, end_offset)
            if done:  # past to_position: only count the lines
                expected += body.count(b"\n")
                continue
            if not body:
                continue
            rows = _decode(body, path, line_no)
            line_no += len(rows)
            if rows[0][0] != expected or rows[-1][0] != expected + len(rows) - 1:
                _gap(rows, expected, path)
            expected += len(rows)
            if to_position is not None and rows[-1][0] >= to_position:
                rows = [r for r in rows if r[0] <= to_position]
                done = True
            if rows:
                yield rows
    if rest:
        raise LogFileError(f"{path}: the last event line has no newline")
    if sha.hexdigest() != end.sha256:
        raise LogFileError(f"{path}: checksum mismatch: the file was changed after export")
    if expected - 1 != end.count or end.last != end.count:
        raise LogFileError(f"{path}: end line says {end.count} events, found {expected - 1}")


def _decode(body: bytes, path: str | Path, line_no: int) -> list[FileRow]:
    try:
        return _ROWS.decode(b"[" + body.rstrip(b"\n").replace(b"\n", b",") + b"]")
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    for i, line in enumerate(body.splitlines()):  # find the line to name it
        try:
            _ROW_LIST.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise LogFileError(f"{path}: line {line_no + i + 1}: {exc}") from None
    raise LogFileError(f"{path}: lines after {line_no}: do not decode")


def _gap(rows: Sequence[FileRow], expected: int, path: str | Path) -> None:
    for row in rows:
        if row[0] != expected:
            raise LogFileError(f"{path}: position {row[0]} where {expected} was expected")
        expected += 1
