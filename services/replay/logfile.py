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

Reading to fold (``read_rows(..., lines=True)``: ``state --at``, ``diff``, ``verify`` and
``import`` of a file): the reader hands out a :class:`LinePage` — the chunk's event lines,
not decoded — and the fold decodes each line with :data:`decode_line`, in **one**
msgspec call, into a :class:`DecodedLine` whose payload is already the typed event,
right before it folds it. That is cheaper than decoding the page into rows and then
each payload again (one pass over the JSON, one call per event), and the event is
still in the CPU's cache when its step runs: at a million events, ~25% less CPU than
the two-pass path. A line is folded that way only when it is what
:func:`events.catalog.decode_stored` would have made of it (its payload's class is the
row's ``type``, its ``schema_version`` the current one, its position the next);
anything else (an export from older code to upcast, a tag its column contradicts, a
line that does not decode, a gap) takes the plain path of that one line, with its
errors. Reading the next chunk and hashing it run in a thread while this one is
folded (file reads and ``hashlib`` release the GIL).
"""

from __future__ import annotations

import datetime
import hashlib
import io
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, Final

import msgspec

from events.catalog import SCHEMA_VERSIONS, Event
from events.model import decode_hook
from services.runtime.rows import COLUMNS

__all__ = [
    "FORMAT",
    "VERSION",
    "DecodedLine",
    "EndLine",
    "Header",
    "LinePage",
    "LogFileError",
    "LogWriter",
    "decode_line",
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


class DecodedLine(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One event line decoded in one pass (:class:`LinePage`): the payload is the event."""

    position: int
    event_id: str
    stream: str
    stream_version: int
    type: str
    schema_version: int
    namespace: str | None
    actor: str
    correlation_id: str | None
    causation_id: str | None
    recorded_at: str
    payload: Event


_ROWS: Final = msgspec.json.Decoder(list[FileRow])
#: Decode one event line into a :class:`DecodedLine` (msgspec errors for anything else).
decode_line: Final = msgspec.json.Decoder(DecodedLine, dec_hook=decode_hook).decode
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


class LinePage:
    """The event lines of one chunk, positions ``first`` on, not decoded yet.

    Whoever reads it decodes each line (:data:`decode_line`) and must check that its
    position is the one its place gives (``first`` + index): the reader counted the
    lines, it did not look at them. :meth:`row` is the plain, checked path of one line.
    """

    __slots__ = ("first", "line_no", "lines", "path")

    def __init__(self, path: str | Path, lines: list[bytes], first: int, line_no: int) -> None:
        self.path = path
        self.lines = lines
        self.first = first  #: the position of ``lines[0]``
        self.line_no = line_no  #: the file's line number of ``lines[0]``

    @property
    def last(self) -> int:
        """The position of the last line."""
        return self.first + len(self.lines) - 1

    def between(self, after: int, through: int | None = None) -> LinePage:
        """The lines at positions after ``after`` (and up to ``through``)."""
        start = max(0, after - self.first + 1)
        stop = len(self.lines) if through is None else max(0, through - self.first + 1)
        return LinePage(self.path, self.lines[start:stop], self.first + start, self.line_no + start)

    def row(self, index: int) -> FileRow:
        """Line ``index`` as a plain row; :class:`LogFileError` if it is not the next event."""
        line_no = self.line_no + index
        try:
            row = _ROW_LIST.decode(self.lines[index])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise LogFileError(f"{self.path}: line {line_no}: {exc}") from None
        if row[0] != self.first + index:
            raise LogFileError(
                f"{self.path}: position {row[0]} where {self.first + index} was expected"
            )
        return row


def read_rows(
    path: str | Path,
    *,
    to_position: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    lines: bool = False,
) -> Iterator[Any]:
    """Pages of event rows (tuples in :data:`COLUMNS` order), checked as they are read.

    Stops handing out rows after ``to_position`` but still reads (and hashes) the rest
    of the file; raises :class:`LogFileError` at the first thing wrong — a checksum
    mismatch only at the end, after the last page, so a caller must consume the whole
    iterator before trusting what it folded. ``progress(bytes_read, bytes_total)`` is
    called once per chunk. With ``lines``, the pages are :class:`LinePage` s, which
    the caller decodes and checks (module docstring); otherwise lists of
    :data:`FileRow`.
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
        for chunk in _hashed_chunks(f, sha, read, end_offset):
            read += len(chunk)
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
            if lines:
                # readlines() finds line ends with memchr: cheaper than bytes.split
                page = LinePage(path, io.BytesIO(body).readlines(), expected, line_no + 1)
                line_no += len(page.lines)
                expected += len(page.lines)
                if to_position is not None and page.last >= to_position:
                    page = page.between(0, to_position)
                    done = True
                if page.lines:
                    yield page
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


def _hashed_chunks(f: IO[bytes], sha: Any, read: int, end_offset: int) -> Iterator[bytes]:
    """The chunks of ``f`` from offset ``read`` to ``end_offset``, each added to ``sha``.

    The next chunk is read and hashed in a thread while the caller works on this one.
    """

    def load(size: int) -> bytes:
        chunk = f.read(size)
        sha.update(chunk)
        return chunk

    with ThreadPoolExecutor(1, thread_name_prefix="dracap-log-read") as pool:
        pending: Future[bytes] | None = None
        if read < end_offset:
            pending = pool.submit(load, min(CHUNK_BYTES, end_offset - read))
        while pending is not None:
            chunk = pending.result()
            if not chunk:
                return
            read += len(chunk)
            pending = None
            if read < end_offset:
                pending = pool.submit(load, min(CHUNK_BYTES, end_offset - read))
            yield chunk


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
