"""Snapshots of the fold: written every N events or M minutes, verified before use, pruned.

Every start (a service's :class:`~services.runtime.store.livestate.LiveState`, ``dracap up``,
``dracap replay state``) begins from the newest stored snapshot that *verifies*, and
folds only the events after it. A snapshot that does not verify is skipped (logged), and
the next older one is tried; with none, the fold starts from position 0. Verifying proves
that a snapshot is of this log and not torn, not that its state is the fold: a live state
checks the one it started from in the background (:mod:`services.runtime.store.snapshotcheck`)
and ``dracap replay verify`` checks every one.

Stored form (the ``snapshots`` table of migration 0001, no new migration)
-------------------------------------------------------------------------
``payload`` is a frame: one ASCII header line, then the body of
:func:`events.statecodec.snapshot_encode` compressed with zlib (level 1)::

    dracap-snapshot 1 <sha256 of the compressed body> <event_id at position>\\n<zlib body>

Compressed because reading is what a start waits for: at a million events the JSON is
151 MiB and fetching it took 0.7 s, the 8 MiB compressed form 0.05 s plus 0.35-0.45 s
to inflate.

Encoding off the event loop (:func:`encode_detached`)
-------------------------------------------------------
Encoding a million-event state takes ~2 s of CPU, and msgspec holds the GIL for all
of it, so neither the loop nor a thread can do it without stopping the process's
other work for that long. Where ``os.fork`` exists (Linux, where dracap runs), the
writer forks: the child process gets a copy-on-write image of the state *as it is at
that instant* — the loop forks between two folds, so that image is the state at exactly
``state.position``, never a torn one — encodes and compresses it, writes the bytes to a
pipe and exits; the parent reads them in a thread and stores them while its loop goes
on folding and serving. What the loop waits for is the ``fork()`` call itself (copying
the page tables: milliseconds, see ``benchmarks/replay.py``). The child does nothing
but encode, compress and write — no locks, no logging, no I/O but its pipe — and leaves
with ``os._exit``; if it fails or the writer is cancelled, it is killed and reaped, and
no snapshot is written. Without ``os.fork`` the state is encoded on the loop as before.

The child runs at the lowest priority (``nice`` +:data:`CHILD_NICENESS`, and Linux's
``SCHED_IDLE`` policy): its work grows with the state (~0.3 s of CPU at 40,000 live
claims, every 25,000 events), and at the parent's priority it took a core from the
services while it ran — on a 2-core machine, the claims in flight queued behind the
encoding of all the others, a cost per claim that grew with the claims live (issue 25).
Nobody waits for a snapshot: at the lowest priority it takes what the services leave,
and takes longer only when they are busy. ``SCHED_IDLE`` on top of the niceness: the
scheduler then lets any other task that wakes on the child's core run at once (a niced
task may keep its slice), and the child's share under contention is a fifth of nice 19's
(measured beside the standard benchmark with a busy loop in each policy:
``docs/services.md``, "The snapshot child at SCHED_IDLE").

``schema_version`` is :data:`FRAME_VERSION`. Rows written before this module (no
frame, ``schema_version`` 1) are read as a bare body and checked by the rules that do
not need the header.

Verification (:func:`verify_snapshot`), in this order, each cheap before the costly:

1. its ``position`` is at most the log's head (a snapshot from a log that was since
   restored from an older backup is ahead of it);
2. the frame header parses and the stored body's SHA-256 equals the header's (a
   torn or edited row), and it inflates;
3. the event stored at ``position`` has the header's event id (a snapshot of another
   log: an event id's 74 random bits (:mod:`events.uuids`) give a database re-created
   or imported under the same positions other ids);
4. the body decodes with :func:`events.statecodec.snapshot_decode` (its format is this code's
   :data:`~events.statecodec.SNAPSHOT_FORMAT`) and the state's position equals the row's.

Writing and pruning (:class:`SnapshotWriter`)
--------------------------------------------
The writer watches a :class:`LiveState` (it folds nothing itself) — once that state is
checked, if it started from a snapshot (:mod:`services.runtime.store.snapshotcheck`: a forged
snapshot is never copied into new ones) — and writes a snapshot when the state is at
least :func:`interval` events past the newest snapshot — ``every_events`` (default
:data:`EVERY_EVENTS`, 25,000) or, with more than :data:`RECORDS_PER_INTERVAL` (50,000)
records in the state (:func:`snapshot_records`), as many more in proportion:
:data:`EVENTS_PER_RECORD` (½) per record — or ``every_seconds`` (default 10
minutes, on the writer's :class:`~services.runtime.ground.clock.Clock`) have passed and
at least one event was folded since, and once more when it stops (a clean shutdown), so
that the next start begins at the head instead of folding up to an interval again.

Why the interval grows with the state (issue 25). A snapshot is the whole state: a write
costs CPU in proportion to the records it holds, ``c·R`` (measured: ~6-12 µs per record,
encode, compress and insert — 70 ms at 5,000 live claims, 1.42 s at 100,000, 3.45 s at a
million events' 286,000 records). At a fixed 25,000 events that was ``c·R / 25,000`` per
event, a cost per claim that grew with the claims live (at 100,000 live, ~0.3 ms a claim
on top of the ~1 ms the services spend). With the interval at least ``k·R`` events
(``k`` = :data:`EVENTS_PER_RECORD`), each write is preceded by at least ``k·R`` events,
so the work per event is at most ``c / k`` (~12-24 µs), whatever the state — O(1) per
event. What it trades is the start after a crash, which folds up to one interval (two
under traffic that never pauses: below): ``k·R`` events at ~6.5 µs each, against a
snapshot load of ~5.5 µs per record (inflate, decode; measured at a million events) — at
most ~0.6x the snapshot's own load time, a bounded multiple of it at any size (a start
after a crash is at most ~1.6x a clean one). Below 50,000 records (~25,000 claims ever
folded) the floor of 25,000 events rules, as before: ~0.3 s to fold at most. At a
million events (286,000 records: 143,000 events) the worst start after a crash is ~2.5
s, where the fixed 25,000 kept it under 2 s; a clean stop still writes at the head, so a
restart folds nothing. The time rule costs ``c·R`` per ``every_seconds``, not per event
(~0.6 % of a core at a million events). Incremental snapshots (what changed since the
last, folded onto it) would make both O(1) and are not done.

A due snapshot waits for a lull (issue 25). The writer checks four times a second
(:data:`CHECK_EVERY_S`); a snapshot that is due is written at a check that finds the
state moved by at most :data:`LULL_EVENTS` (4) events since the check before — a quarter
of a second in which at most one claim came in — or, lull or not, once its rule has
passed :data:`OVERDUE` (2) times over (twice the interval's events, or twice
``every_seconds``). The write costs the same whenever it runs, but at 100,000 live
claims it is ~1.4 s of CPU in the child: on two cores, written in the middle of a burst
of claims it took a fifth to half of the burst's rate and doubled its tail latency, even
at ``SCHED_IDLE`` (``docs/services.md``, "A snapshot waits for a lull"). Under traffic
with pauses (most clusters: claims come with deployments) the write falls in the pause.
Under traffic that never pauses it is made at twice the interval, half as often: a start
after a crash then folds up to two intervals (at a million events up to ~286,000 events,
~1.9 s on top of the load: ~3.4 s in the worst case; a clean stop still writes at the
head).

After each write it prunes: it **keeps the newest** :data:`KEEP` **(3) snapshots** and
deletes older ones — three, so that one torn or unverifiable snapshot still leaves two
to fall back on, and bounded, so the table does not grow with the log. ``dracap replay
snapshot`` writes one on demand (and prunes by the same rule).

The writer counts what it stores (``dracap_snapshots_written_total``), what it was due
to store and could not (``dracap_snapshot_failures_total``: logged, tried again at the
next check) and the position of the newest snapshot it knows (``dracap_snapshot_position``).
It writes as a member of ``dracap_snapshots`` (migration 0010) or the app role; the
service roles may read snapshots, not write them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import logging
import os
import signal
import warnings
import zlib
from collections.abc import Awaitable, Callable
from typing import Final, NoReturn, Protocol

import asyncpg

from events.errors import SnapshotError
from events.state import ClusterState
from events.statecodec import snapshot_decode, snapshot_encode
from services.runtime.ground.clock import SYSTEM, Clock
from services.runtime.ground.metrics import SNAPSHOT_FAILURES, SNAPSHOT_POSITION, SNAPSHOTS_WRITTEN

__all__ = [
    "CHECK_EVERY_S",
    "CHILD_NICENESS",
    "EVENTS_PER_RECORD",
    "FRAME_VERSION",
    "KEEP",
    "LULL_EVENTS",
    "OVERDUE",
    "RECORDS_PER_INTERVAL",
    "Detached",
    "SnapshotWriter",
    "detach",
    "encode_detached",
    "frame",
    "frame_packed",
    "interval",
    "load_verified",
    "prune",
    "serve_snapshots",
    "snapshot_records",
    "unframe",
    "verify_snapshot",
    "write_snapshot",
]

log = logging.getLogger(__name__)

FRAME_VERSION: Final = 2
KEEP: Final = 3
EVERY_EVENTS: Final = 25_000
#: A state of more records than this waits ``every_events`` per this many records between
#: two snapshots (:func:`interval`; the module docstring: a write's CPU is linear in the
#: records, so the work per event stays below ``c / k``)
RECORDS_PER_INTERVAL: Final = 50_000
#: what that makes of the default interval: events per record between two snapshots
EVENTS_PER_RECORD: Final = EVERY_EVENTS / RECORDS_PER_INTERVAL
#: How much nicer than its parent the encoding child runs (19: the least share of a busy
#: CPU the scheduler gives; see the module docstring).
CHILD_NICENESS: Final = 19
EVERY_SECONDS: Final = 600.0
#: A snapshot that is due is written at a check that finds the state moved by at most
#: this many events since the check before (a lull: the module docstring)...
LULL_EVENTS: Final = 4
#: ...or once its rule (events or time) has passed this many times over, lull or not.
OVERDUE: Final = 2
#: Seconds between two checks of the writer: a lull is this long.
CHECK_EVERY_S: Final = 0.25
_MAGIC: Final = b"dracap-snapshot 1 "

Connection = asyncpg.Connection | asyncpg.Pool


class Framed:
    """The parts of a framed snapshot payload."""

    __slots__ = ("body", "event_id", "sha256")

    def __init__(self, body: bytes, sha256: str | None, event_id: str | None) -> None:
        self.body = body
        self.sha256 = sha256
        self.event_id = event_id


def frame(body: bytes, event_id: str) -> bytes:
    """The stored payload of a snapshot ``body`` taken right after event ``event_id``."""
    return frame_packed(zlib.compress(body, 1), event_id)


def frame_packed(packed: bytes, event_id: str) -> bytes:
    """:func:`frame` of a body compressed already."""
    digest = hashlib.sha256(packed).hexdigest()
    return _MAGIC + f"{digest} {event_id}\n".encode() + packed


async def encode_detached(state: ClusterState) -> tuple[int, bytes]:
    """``state``'s position and its body compressed, encoded in a forked child (module
    docstring) so that the event loop is not stalled; on the loop without ``os.fork``."""
    position = state.position  # the child's image is of this instant: no await between
    if not hasattr(os, "fork"):
        body = snapshot_encode(state)
        return position, await asyncio.to_thread(zlib.compress, body, 1)
    packed, code = await detach(lambda: zlib.compress(snapshot_encode(state), 1)).result()
    if code != 0:
        raise SnapshotError(f"snapshot at {position}: the encoding process exited with {code}")
    return position, packed


class Detached:
    """A forked child running a piece of work (:func:`detach`); :meth:`result` awaits it."""

    __slots__ = ("pid", "read_fd")

    def __init__(self, pid: int, read_fd: int) -> None:
        self.pid = pid
        self.read_fd = read_fd

    async def result(self) -> tuple[bytes, int]:
        """What the work returned and the child's exit code (0: it returned)."""
        try:
            return await asyncio.to_thread(_collect, self.pid, self.read_fd)
        except BaseException:  # cancelled: the thread reaps the child once it is gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            raise


def detach(work: Callable[[], bytes]) -> Detached:
    """Fork a child that runs ``work`` on a copy-on-write image of this process as it is
    at this call, and writes what it returns to a pipe. The child does nothing else (module
    docstring): ``work`` must take no lock and do no I/O. Linux (``os.fork``) only."""
    read_fd, write_fd = os.pipe()
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns that forking a process with threads may deadlock the
            # child in a lock another thread held; this child takes none (module docstring)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:
        _run_in_child(work, read_fd, write_fd)
    os.close(write_fd)
    return Detached(pid, read_fd)


def _run_in_child(work: Callable[[], bytes], read_fd: int, write_fd: int) -> NoReturn:
    """The forked child: run ``work``, write its bytes to the pipe, exit (never returns)."""
    code = 1
    try:
        os.close(read_fd)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the parent's
        with contextlib.suppress(OSError):
            os.nice(CHILD_NICENESS)  # the hot path first (module docstring)
        with contextlib.suppress(OSError, AttributeError):  # Linux: SCHED_IDLE
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)  # the parent's loop owns that fd
        gc.disable()  # nothing to collect in a process that lives for one piece of work
        view = memoryview(work())
        while view:
            view = view[os.write(write_fd, view) :]
        code = 0
    finally:
        os._exit(code)  # no atexit handlers, no flushing of the parent's buffers


def _collect(pid: int, read_fd: int) -> tuple[bytes, int]:
    """Read the child's pipe to its end, then reap it: (bytes, exit code)."""
    parts: list[bytes] = []
    try:
        while chunk := os.read(read_fd, 1 << 20):
            parts.append(chunk)
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    return b"".join(parts), os.waitstatus_to_exitcode(status)


def unframe(payload: bytes, schema_version: int) -> Framed:
    """Split a stored payload; raises :class:`SnapshotError` for a broken frame."""
    if schema_version < FRAME_VERSION:
        return Framed(payload, None, None)  # written before frames: a bare body
    if not payload.startswith(_MAGIC):
        raise SnapshotError("snapshot frame header missing")
    newline = payload.find(b"\n")
    parts = payload[len(_MAGIC) : newline].decode("ascii", "replace").split(" ")
    if newline < 0 or len(parts) != 2:
        raise SnapshotError("snapshot frame header malformed")
    return Framed(payload[newline + 1 :], parts[0], parts[1])


def verify_snapshot(
    position: int, schema_version: int, payload: bytes, head: int, event_id: str | None
) -> ClusterState:
    """The state of a stored snapshot if it verifies (module docstring), else SnapshotError.

    ``event_id``: the id of the event stored at ``position`` (``None``: no such event).
    """
    if position > head:
        raise SnapshotError(f"snapshot at {position} is past the log's head {head}")
    framed = unframe(payload, schema_version)
    if framed.sha256 is not None:
        if hashlib.sha256(framed.body).hexdigest() != framed.sha256:
            raise SnapshotError(f"snapshot at {position}: checksum mismatch")
        if position and framed.event_id != event_id:
            raise SnapshotError(
                f"snapshot at {position} was taken after event {framed.event_id}, "
                f"the log has {event_id} there"
            )
        try:
            framed.body = zlib.decompress(framed.body)
        except zlib.error as exc:
            raise SnapshotError(f"snapshot at {position} does not inflate: {exc}") from None
    enabled = gc.isenabled()
    gc.disable()  # millions of long-lived objects, no cycles: 6x faster without passes
    try:
        state = snapshot_decode(framed.body)
        # ... and out of the collector's sight afterwards: without this, the first
        # collections after a start walk every decoded object (~1.4 s at 1 M events)
        gc.freeze()
    finally:
        if enabled:
            gc.enable()
    if state.position != position:
        raise SnapshotError(f"snapshot row {position} holds a state at {state.position}")
    return state


async def load_verified(
    connection: Connection, at_or_before: int | None = None
) -> ClusterState | None:
    """The newest snapshot at or before ``at_or_before`` (default: the head) that verifies."""
    head: int = await connection.fetchval("SELECT position FROM event_log_head")
    limit = head if at_or_before is None else min(head, at_or_before)
    rows = await connection.fetch(
        "SELECT position, schema_version FROM snapshots ORDER BY position DESC"
    )
    for position, schema_version in rows:
        if position > limit:
            if position > head:
                log.warning("snapshot at %d is past the log's head %d; skipped", position, head)
            continue
        record = await connection.fetchrow(
            "SELECT s.payload, e.event_id::text FROM snapshots s "
            "LEFT JOIN events e ON e.position = s.position WHERE s.position = $1",
            position,
        )
        if record is None:  # pruned meanwhile
            continue
        try:
            return verify_snapshot(position, schema_version, bytes(record[0]), head, record[1])
        except SnapshotError as exc:
            log.warning("snapshot skipped: %s", exc)
    return None


async def write_snapshot(pool: Connection, state: ClusterState, *, keep: int = KEEP) -> int:
    """Store a snapshot of ``state`` as it is now (:func:`encode_detached`) and prune; its
    position."""
    position, packed = await encode_detached(state)
    event_id = await pool.fetchval(
        "SELECT event_id::text FROM events WHERE position = $1", position
    )
    if event_id is None:
        raise SnapshotError(f"no event at position {position} to anchor a snapshot to")
    await pool.execute(
        "INSERT INTO snapshots (position, schema_version, payload) VALUES ($1, $2, $3) "
        "ON CONFLICT (position) DO UPDATE SET payload = EXCLUDED.payload, "
        "schema_version = EXCLUDED.schema_version, created_at = now()",
        position,
        FRAME_VERSION,
        await asyncio.to_thread(frame_packed, packed, event_id),
    )
    await prune(pool, keep=keep)
    return position


async def prune(pool: Connection, *, keep: int = KEEP) -> int:
    """Delete all but the newest ``keep`` snapshots; how many were deleted."""
    status: str = await pool.execute(
        "DELETE FROM snapshots WHERE position < ALL "
        "(SELECT position FROM snapshots ORDER BY position DESC LIMIT $1)",
        keep,
    )
    return int(status.split()[-1])


def snapshot_records(state: ClusterState) -> int:
    """The records a snapshot of ``state`` holds (what its encoding's cost is linear in):
    O(1), the sizes of the fold's tables."""
    return (
        len(state.claims)
        + len(state.shares)
        + len(state.devices)
        + len(state.slices)
        + len(state.pools)
        + len(state.nodes)
        + len(state.namespaces)
        + len(state.classes)
        + len(state.refused)
    )


def interval(records: int, every_events: int = EVERY_EVENTS) -> int:
    """Events between two snapshots of a state of ``records`` records: ``every_events``,
    or ``every_events`` per :data:`RECORDS_PER_INTERVAL` records when that is more (with
    the defaults :data:`EVENTS_PER_RECORD`, ½ an event per record; the module docstring).
    A smaller ``every_events`` (tests, ``replay snapshot --every-events``) scales both."""
    return max(every_events, every_events * records // RECORDS_PER_INTERVAL)


class SnapshotWriter:
    """Writes snapshots of a live state's fold by the rule of the module docstring."""

    def __init__(
        self,
        pool: Connection,
        state: Callable[[], ClusterState],
        *,
        every_events: int = EVERY_EVENTS,
        every_seconds: float = EVERY_SECONDS,
        keep: int = KEEP,
        check_every_s: float = CHECK_EVERY_S,
        checked: Callable[[], bool] = lambda: True,
        clock: Clock = SYSTEM,
    ) -> None:
        self.pool = pool
        self.state = state
        #: whether the state may be stored: not while it is served from a snapshot that
        #: is not checked yet (a forged one must not be copied into new snapshots)
        self.checked = checked
        self.every_events = every_events
        self.every_seconds = every_seconds
        self.keep = keep
        self.check_every_s = check_every_s
        self.clock = clock  #: the ``every_seconds`` rule and the checks run on it
        self.last_position = 0
        self.last_time = clock.monotonic()
        self.written = 0
        self._seen: int | None = None  # the state's position at the check before

    async def start(self) -> None:
        """Learn where the newest stored snapshot is."""
        newest = await self.pool.fetchval("SELECT max(position) FROM snapshots")
        self.last_position = newest or 0
        self.last_time = self.clock.monotonic()
        SNAPSHOT_POSITION.set(self.last_position)

    def due(self, times: int = 1) -> bool:
        """Whether the state is far enough (events or time) past the last snapshot: an
        :func:`interval`, which grows with the state, or ``every_seconds`` (``times``
        over)."""
        state = self.state()
        position = state.position
        if position <= self.last_position:
            return False
        every = interval(snapshot_records(state), self.every_events)
        if position - self.last_position >= times * every:
            return True
        return self.clock.monotonic() - self.last_time >= times * self.every_seconds

    def to_write(self, *, stopping: bool = False) -> bool:
        """Whether this check writes: a snapshot due in a lull, or :data:`OVERDUE` times
        over (``stopping``: anything folded since the last). Each call is a check."""
        position = self.state().position
        seen, self._seen = self._seen, position
        if stopping:
            return position > self.last_position
        if not self.due():
            return False
        lull = seen is not None and position - seen <= LULL_EVENTS
        return lull or self.due(OVERDUE)

    async def maybe_write(self, *, stopping: bool = False) -> bool:
        """Write a snapshot if :meth:`to_write` says so; True if it wrote one."""
        if not self.checked() or not self.to_write(stopping=stopping):
            return False
        position = await write_snapshot(self.pool, self.state(), keep=self.keep)
        self.last_position, self.last_time = position, self.clock.monotonic()
        self.written += 1
        SNAPSHOTS_WRITTEN.inc()
        SNAPSHOT_POSITION.set(position)
        log.info("snapshot written at position %d", position)
        return True

    async def run(
        self, stop: asyncio.Event, wake: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Check every ``check_every_s`` (or when ``wake`` returns) until ``stop``; then
        write one last snapshot if anything was folded since the last one."""
        await self.start()
        while not stop.is_set():
            await self._write(stopping=False)
            if wake is not None:
                await wake()
                continue
            await self.clock.wait(stop, self.check_every_s)
        await self._write(stopping=True)

    async def _write(self, *, stopping: bool) -> None:
        try:
            await self.maybe_write(stopping=stopping)
        except (SnapshotError, asyncpg.PostgresError, OSError) as exc:
            SNAPSHOT_FAILURES.inc()
            log.warning("snapshot not written: %s", exc)


class Watched(Protocol):
    """What the writer of :func:`serve_snapshots` reads of a live state (a
    :class:`~services.runtime.store.livestate.LiveState`, which imports this module)."""

    @property
    def state(self) -> ClusterState: ...

    @property
    def unchecked_start(self) -> int | None: ...


async def serve_snapshots(
    pool: Connection,
    live: Watched,
    stop: asyncio.Event,
    *,
    every_events: int = EVERY_EVENTS,
    every_seconds: float = EVERY_SECONDS,
) -> None:
    """Run a :class:`SnapshotWriter` over ``live`` on ``pool`` until ``stop``, then write
    what was folded since the last snapshot. ``pool`` connects as a member of
    ``dracap_snapshots`` (migration 0010) or the app role: the other roles may read
    snapshots, not write them."""
    writer = SnapshotWriter(
        pool,
        lambda: live.state,
        every_events=every_events,
        every_seconds=every_seconds,
        checked=lambda: live.unchecked_start is None,
    )
    await writer.run(stop)
