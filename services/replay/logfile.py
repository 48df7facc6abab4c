"""The portable log file of ``dracap replay export`` / ``import`` and ``--log FILE``.

Format (``dracap-log`` version 2), NDJSON, one JSON value per line:

1. a **header** object: ``{"format": "dracap-log", "version": 2, "columns": [...],
   "schema_versions": {type: version}, "exported_at": ISO time, "source": text}`` —
   ``columns`` names the fields of every event line (:data:`~services.runtime.store.rows.COLUMNS`),
   ``schema_versions`` the catalog of the code that wrote the file;
2. one **event** array per stored event, in position order, its fields in ``columns``
   order; ``recorded_at`` is an ISO 8601 string, ``payload`` the event's JSON object
   exactly as the database stored it, with its own ``schema_version`` beside it — an
   export made by older code keeps its old payloads and replays through the catalog's
   upcasters (:func:`events.eventcodec.decode_stored`);
3. (version 2) **checkpoint** objects (:class:`CheckpointLine`), each right after the
   event line of its position: the fold up to there (:mod:`services.replay.checkpoints`);
4. an **end** object: ``{"end": true, "count": N, "last": position, "sha256": hex,
   "checkpoints": [[position, offset], ...]}``, the SHA-256 of every byte before the end line
   (header, events and checkpoints, newlines included) and the checkpoint lines'
   positions and byte offsets (an index: a reader checks what it finds there).

Version 1 (no checkpoint lines, no ``checkpoints`` in the end line; nothing else
differs) is read as a version 2 file without checkpoints: the upcasting rule of the
format; a checkpoint line in a version 1 file is refused.

Events are arrays, not objects, so a reader decodes a line straight into a tuple in
the store's row order (the replay loop indexes rows by column); the header says which
column is which. Reading checks the header (format, version, columns), that positions
run 1, 2, 3 ... without a gap, that the count matches and the checksum: a file that was
cut short, edited or is something else is refused with a :class:`LogFileError` (one
line, exit 2), never folded silently. The checksum is checked over the *whole* file
even when a replay stops early (``state --at``), before anything is reported; the
event lines a replay does not fold (before the checkpoint it starts from, after the
position it stops at) are counted and checked by position prefix only (:class:`_Reader`).

Reading to fold (``read_rows(..., lines=True)``: ``state --at``, ``diff``, ``verify`` and
``import`` of a file): the reader hands out a :class:`LinePage` — the chunk's event lines,
not decoded — and the fold decodes each line with :data:`decode_line`, in **one**
msgspec call, into a :class:`DecodedLine` whose payload is already the typed event,
right before it folds it. That is cheaper than decoding the page into rows and then
each payload again (one pass over the JSON, one call per event), and the event is
still in the CPU's cache when its step runs: at a million events, ~25% less CPU than
the two-pass path. A line is folded that way only when it is what
:func:`events.eventcodec.decode_stored` would have made of it (its payload's class is the
row's ``type``, its ``schema_version`` the current one, its position the next);
anything else (an export from older code to upcast, a tag its column contradicts, a
line that does not decode, a gap) takes the plain path of that one line, with its
errors. The file's SHA-256 is computed in a thread beside the reader, over a memory
map of the file in one ``hashlib`` call that releases the GIL throughout (a thread
that read and hashed chunk by chunk would need the GIL for every chunk, and a long
decode of the reader's holds it for a second).
"""

from __future__ import annotations

import bisect
import datetime
import hashlib
import io
import mmap
import os
import re
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, Final

import msgspec

from events.catalog import SCHEMA_VERSIONS, Event
from events.model import decode_hook
from services.runtime.store.rows import COLUMNS

__all__ = [
    "FORMAT",
    "VERSION",
    "Checkpoint",
    "CheckpointLine",
    "DecodedLine",
    "EndLine",
    "Header",
    "LinePage",
    "LogFileError",
    "LogWriter",
    "decode_line",
    "read_end",
    "read_header",
    "read_line_at",
    "read_rows",
]

FORMAT: Final = "dracap-log"
VERSION: Final = 2
#: The oldest version this code reads (1: no checkpoint lines, nothing else differs).
OLDEST_VERSION: Final = 1
_BRACE: Final = ord("{")
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
    #: (position, byte offset) of each checkpoint line, in file order (version 2; an index,
    #: not trusted: a reader checks each line it uses, and that the file has as many)
    checkpoints: list[tuple[int, int]] = []


class CheckpointLine(msgspec.Struct, kw_only=True):
    """A checkpoint line (version 2): the fold right after the event at ``checkpoint``.

    ``snapshot`` is base64 of a database snapshot's stored form
    (:func:`services.runtime.store.snapshots.frame`: its SHA-256, ``event_id``, the zlib
    body of :func:`events.statecodec.snapshot_encode`); ``event_id`` is the id of the event
    line right before this line, which is at position ``checkpoint``.
    """

    checkpoint: int
    event_id: str
    snapshot: str


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
#: The eleven columns before the payload, for a line whose payload nests too deep for a
#: parser to skip (:func:`_row_of`): each a JSON scalar followed by a comma.
_HEAD: Final = re.compile(
    rb'\s*\[(?:\s*(?:"(?:[^"\\]|\\.)*"|-?[0-9][0-9.eE+-]*|null|true|false)\s*,){11}', re.S
)
_HEAD_COLUMNS: Final = msgspec.json.Decoder(
    tuple[int, str, str, int, str, int, str | None, str, str | None, str | None, str]
)
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
        self.checkpoints: list[tuple[int, int]] = []
        self.size = 0  #: bytes written
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
        self.size += len(data)

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

    def write_checkpoint(self, line: CheckpointLine) -> None:
        """Append a checkpoint line; it must be of the last event written."""
        if line.checkpoint != self.last or not self.last:
            raise LogFileError(f"checkpoint at {line.checkpoint} after event {self.last}")
        offset = self.size
        self._emit(_ENCODER.encode(line) + b"\n")
        self.checkpoints.append((line.checkpoint, offset))

    def close(self) -> None:
        """Write the end line and move the file into place."""
        end = EndLine(
            end=True,
            count=self.count,
            last=self.last,
            sha256=self._sha.hexdigest(),
            checkpoints=self.checkpoints,
        )
        self._file.write(_ENCODER.encode(end) + b"\n")
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Drop a file that was not finished."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)


def _row_of(line: bytes) -> FileRow:
    """One event line as a row. A line whose payload nests deeper than a parser can skip
    (a ``RecursionError``: an event admitted before the depth limit, :mod:`events.nesting`)
    is split without parsing the payload: the eleven columns before it are scalars, and
    the payload is kept as it is (``msgspec.Raw``), for the fold's driver to decode."""
    try:
        return _ROW_LIST.decode(line)
    except RecursionError:
        pass
    head = _HEAD.match(line)
    end = line.rstrip().rfind(b"]")
    if head is None or end < head.end():
        raise msgspec.DecodeError("not an event line (its payload nests too deep to read)")
    columns = _HEAD_COLUMNS.decode(line[: head.end() - 1] + b"]")
    return (*columns, msgspec.Raw(line[head.end() : end].strip()))


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


def read_line_at(path: str | Path, offset: int) -> bytes:
    """The line that starts at byte ``offset`` (a checkpoint line, by the end line's index)."""
    with _open(path) as f:
        f.seek(offset)
        return f.readline()


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
    if not OLDEST_VERSION <= header.version <= VERSION:
        raise LogFileError(
            f"{path}: version {header.version} is not {OLDEST_VERSION}..{VERSION} (newer dracap?)"
        )
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
            row = _row_of(self.lines[index])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise LogFileError(f"{self.path}: line {line_no}: {exc}") from None
        if row[0] != self.first + index:
            raise LogFileError(
                f"{self.path}: position {row[0]} where {self.first + index} was expected"
            )
        return row


class Checkpoint:
    """A checkpoint line met by :func:`read_rows`, not decoded yet (``checkpoints.py`` does).

    ``position``: the position of the event line before it, ``event_line`` that line;
    ``line`` ``None``: the file has no checkpoint line where one was asked for.
    """

    __slots__ = ("event_line", "line", "position")

    def __init__(self, position: int, line: bytes | None, event_line: bytes) -> None:
        self.position = position
        self.line = line
        self.event_line = event_line

    def event_id(self) -> str | None:
        """The event id of the event line before the checkpoint (``None``: none, or broken)."""
        if not self.event_line:
            return None
        try:
            return str(_row_of(self.event_line)[1])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None


def read_rows(
    path: str | Path,
    *,
    to_position: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    lines: bool = False,
    resume_at: int | None = None,
    checkpoints: bool = False,
) -> Generator[Any, None, None]:
    """Pages of event rows (tuples in :data:`COLUMNS` order), checked as they are read.

    Stops handing out rows after ``to_position`` but still reads (and hashes) the rest
    of the file; raises :class:`LogFileError` at the first thing wrong — a checksum
    mismatch only at the end, after the last page, so a caller must consume the whole
    iterator before trusting what it folded. ``progress(bytes_read, bytes_total)`` is
    called once per chunk. With ``lines``, the pages are :class:`LinePage` s, which
    the caller decodes and checks (module docstring); otherwise lists of
    :data:`FileRow`. Checkpoint lines are left out of the pages; with ``checkpoints``
    (and ``lines``) each one up to ``to_position`` is handed out as a
    :class:`Checkpoint` between the pages, where it stands. With ``resume_at`` (a
    position > 0, and ``lines``) the event lines up to it are only counted and checked
    by their position prefix, the first item is the :class:`Checkpoint` after the event
    at ``resume_at`` (its ``line`` ``None`` if there is none), and the pages start after it.
    """
    header = read_header(path)
    end, end_offset = read_end(path)
    reader = _Reader(path, header.version, end, to_position, lines, resume_at, checkpoints)
    with ThreadPoolExecutor(1, thread_name_prefix="dracap-log-hash") as pool:
        digest = pool.submit(_sha256, path, end_offset)
        yield from _read(path, reader, end_offset, progress)
        if digest.result() != end.sha256:
            raise LogFileError(f"{path}: checksum mismatch: the file was changed after export")
    if reader.expected - 1 != end.count or end.last != end.count:
        raise LogFileError(f"{path}: end line says {end.count} events, found {reader.expected - 1}")
    if reader.seen != len(end.checkpoints):
        raise LogFileError(
            f"{path}: end line lists {len(end.checkpoints)} checkpoints, found {reader.seen}"
        )


def _read(
    path: str | Path,
    reader: _Reader,
    end_offset: int,
    progress: Callable[[int, int], None] | None,
) -> Iterator[Any]:
    """The items of the file's lines before the end line (:func:`read_rows`)."""
    with _open(path) as f:
        read = len(f.readline())
        rest = b""
        for chunk in _chunks(f, read, end_offset):
            read += len(chunk)
            if progress is not None:
                progress(read, end_offset)
            skimmed = reader.skim(rest, chunk)
            if skimmed is not None:
                rest = skimmed
                continue
            data = rest + chunk
            cut = data.rfind(b"\n") + 1
            body, rest = data[:cut], data[cut:]
            if body:
                yield from reader.body(body)
    if rest:
        raise LogFileError(f"{path}: the last event line has no newline")


class _Reader:
    """What :func:`read_rows` knows between chunks, and how it takes one chunk's lines.

    Three modes: *skipping* (before the checkpoint of ``resume_at``) and *done* (past
    ``to_position``) only count event lines and check the position prefix of the first
    and the last of each run (a missing, extra or checkpoint line shifts every later
    position, so the next check, or the end line's count, fails); in between,
    *folding*, the event lines go out as pages. Only a chunk where the end line's index
    puts a checkpoint is cut at its checkpoint lines (found with ``bytes.find``); a
    checkpoint line the index does not list fails as a line that is not an event, and
    the count of those found must equal the index's.
    """

    def __init__(
        self,
        path: str | Path,
        version: int,
        end: EndLine,
        to_position: int | None,
        lines: bool,
        resume_at: int | None,
        checkpoints: bool,
    ) -> None:
        self.path = path
        self.version = version
        self.marks = sorted(position for position, _ in end.checkpoints)
        self.to_position = to_position
        self.lines = lines
        self.resume_at = resume_at or None  #: not None: skipping to its checkpoint
        self.checkpoints = checkpoints
        self.expected = 1  #: the position of the next event line
        self.line_no = 2  #: the file's line number of the next line
        self.previous = b""  #: the last event line
        self.seen = 0  #: checkpoint lines
        self.done = False

    def skim(self, rest: bytes, chunk: bytes) -> bytes | None:
        """Count a chunk of event lines skipped or done without copying it (the new
        ``rest``), or ``None``: :meth:`body` must take it."""
        if self.resume_at is None and not self.done:
            return None
        n = chunk.count(b"\n")
        if n < 2 or (self.resume_at is not None and self.resume_at < self.expected + n - 1):
            return None
        if self.resume_at is not None and self.expected > self.resume_at:
            return None
        k = bisect.bisect_left(self.marks, self.expected - 1)
        if k < len(self.marks) and self.marks[k] <= self.expected + n:
            return None
        end = chunk.rfind(b"\n")
        last = chunk[chunk.rfind(b"\n", 0, end) + 1 : end + 1]
        self._check(rest + chunk[: chunk.find(b"\n")], self.expected, self.line_no)
        self._check(last, self.expected + n - 1, self.line_no + n - 1)
        self.previous = last
        self.expected += n
        self.line_no += n
        return chunk[end + 1 :]

    def body(self, body: bytes) -> Iterator[Any]:
        """The items of one chunk's whole lines."""
        n = body.count(b"\n")
        k = bisect.bisect_left(self.marks, self.expected - 1)
        if k == len(self.marks) or self.marks[k] > self.expected + n:
            yield from self._events(body, n)
            return
        start = 0
        while start < len(body):
            if body[start] == _BRACE:
                stop = body.index(b"\n", start) + 1
                yield from self._checkpoint(body[start:stop])
            else:
                brace = body.find(b"\n{", start)
                stop = len(body) if brace < 0 else brace + 1
                part = body[start:stop]
                yield from self._events(part, part.count(b"\n"))
            start = stop

    def _events(self, part: bytes, n: int) -> Iterator[Any]:
        """``n`` event lines, by mode."""
        if self.resume_at is not None:
            if self.expected > self.resume_at:  # its checkpoint line did not follow it
                yield Checkpoint(self.resume_at, None, self.previous)
                self.resume_at = None
            elif self.resume_at < self.expected + n - 1:  # ... nor here
                lines = io.BytesIO(part).readlines()
                k = self.resume_at - self.expected + 1
                self._span(b"".join(lines[:k]), k)
                yield Checkpoint(self.resume_at, None, self.previous)
                self.resume_at = None
                yield from self._segment(lines[k:])
                return
            else:
                self._span(part, n)
                return
        if self.done:
            self._span(part, n)
        elif self.lines:
            # readlines() finds line ends with memchr: cheaper than bytes.split
            yield from self._segment(io.BytesIO(part).readlines())
        else:
            yield from self._rows(part, n)

    def _checkpoint(self, line: bytes) -> Iterator[Checkpoint]:
        if self.version < 2:
            raise LogFileError(
                f"{self.path}: line {self.line_no}: a checkpoint line in a version 1 file"
            )
        position = self.expected - 1
        self.seen += 1
        self.line_no += 1
        if self.resume_at is not None:
            if position == self.resume_at:
                self.resume_at = None
                yield Checkpoint(position, line, self.previous)
        elif self.checkpoints and not self.done:
            yield Checkpoint(position, line, self.previous)

    def _span(self, body: bytes, n: int) -> None:
        """Count ``n`` event lines, checking the positions of the first and the last."""
        last = body[body.rfind(b"\n", 0, len(body) - 1) + 1 :]
        self._check(body[: body.find(b"\n")], self.expected, self.line_no)
        self._check(last, self.expected + n - 1, self.line_no + n - 1)
        self.previous = last
        self.expected += n
        self.line_no += n

    def _check(self, line: bytes, position: int, line_no: int) -> None:
        comma = line.find(b",", 1, 24)
        try:
            found = int(line[1:comma]) if line[:1] == b"[" and comma > 0 else None
        except ValueError:
            found = None
        if found is None:
            raise LogFileError(f"{self.path}: line {line_no}: not an event line")
        if found != position:
            raise LogFileError(f"{self.path}: position {found} where {position} was expected")

    def _segment(self, lines: list[bytes]) -> Iterator[LinePage]:
        if not lines:
            return
        page = LinePage(self.path, lines, self.expected, self.line_no)
        self.expected += len(lines)
        self.line_no += len(lines)
        self.previous = lines[-1]
        if self.to_position is not None and page.last >= self.to_position:
            page = page.between(0, self.to_position)
            self.done = True
        if page.lines:
            yield page

    def _rows(self, body: bytes, n: int) -> Iterator[list[FileRow]]:
        rows = _decode(body, self.path, self.line_no - 1)
        expected = self.expected
        if rows[0][0] != expected or rows[-1][0] != expected + len(rows) - 1:
            _gap(rows, expected, self.path)
        self.expected += len(rows)
        self.line_no += n
        self.previous = body[body.rfind(b"\n", 0, len(body) - 1) + 1 :]
        if self.to_position is not None and rows[-1][0] >= self.to_position:
            rows = [r for r in rows if r[0] <= self.to_position]
            self.done = True
        if rows:
            yield rows


def _sha256(path: str | Path, size: int) -> str:
    """The SHA-256 of the first ``size`` bytes of the file, in one call that releases
    the GIL throughout (a memory map): it runs in a thread beside the reader, and no
    long C call of the reader's (decoding a checkpoint) can stall it."""
    sha = hashlib.sha256()
    with (
        _open(path) as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
        memoryview(mapped) as view,
        view[:size] as head,
    ):
        sha.update(head)
    return sha.hexdigest()


def _chunks(f: IO[bytes], read: int, end_offset: int) -> Iterator[bytes]:
    """The chunks of ``f`` from offset ``read`` to ``end_offset``."""
    while read < end_offset:
        chunk = f.read(min(CHUNK_BYTES, end_offset - read))
        if not chunk:
            return
        read += len(chunk)
        yield chunk


def _decode(body: bytes, path: str | Path, line_no: int) -> list[FileRow]:
    try:
        return _ROWS.decode(b"[" + body.rstrip(b"\n").replace(b"\n", b",") + b"]")
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        pass
    rows = []
    for i, line in enumerate(body.splitlines()):  # line by line: name the bad one
        try:
            rows.append(_row_of(line))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise LogFileError(f"{path}: line {line_no + i + 1}: {exc}") from None
    return rows


def _gap(rows: Sequence[FileRow], expected: int, path: str | Path) -> None:
    for row in rows:
        if row[0] != expected:
            raise LogFileError(f"{path}: position {row[0]} where {expected} was expected")
        expected += 1
