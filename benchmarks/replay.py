"""Forensic replay and snapshot start-up on a 1-million-event log.

Two parts (``docs/forensics.md`` has the figures):

1. **File**: a ``dracap-log`` file of ``--events`` events (the valid history of
   :func:`benchmarks.eventlog.history`: slices, then claim lifecycles) is written with
   :class:`~services.replay.checkpoints.CheckpointWriter`, a checkpoint line every
   ``--checkpoint-every`` events and after the last, as ``dracap replay export`` writes
   it by default. Measured, median of ``--repeat``:

   * *raw read* (the baseline of the goal): the file read in chunks of the reader's
     size and every event line parsed as JSON into its row tuple (msgspec; the
     envelope's columns as values, the payload's JSON syntax-checked and skipped,
     left raw) — what any reader of the file must do at least to know what each line
     is, the counterpart of the raw keyset read of ``benchmarks/eventlog.py``. Not
     "read and split only" (that parses nothing; shown too), and not a generic decode
     of every payload into dicts (shown too: it costs more than the replay's typed
     decode, so it would flatter the ratio). Checkpoint lines are parsed too (into
     their struct): they are lines of the same file;
   * *replay state --at*: :func:`services.replay.history.state_at` over a
     :class:`~services.replay.sources.FileSource` at the last position — checked
     header, gap-free positions, SHA-256 of the whole file, the newest checkpoint at or
     before it verified and decoded, the events after it decoded and folded (what
     ``dracap replay state --at`` does before it prints); also in the middle between
     two checkpoints, one event before a checkpoint (the most to fold after one), and
     at the head ignoring the checkpoints (the fold of every event, as before them);
   * *verify*: ``replay verify --log`` (:func:`~services.replay.transfer.check_file`
     comparing every checkpoint with the fold), one run.

2. **Start-up** (``--admin-url``; skipped with ``--no-database``): a fresh database,
   migrated, the same history loaded with binary ``COPY`` (as ``benchmarks/eventlog.py``
   does: bulk rows, no per-append work), then the time from nothing to a
   :class:`~services.runtime.store.livestate.LiveState` current at the head (``load_snapshot``
   + ``fresh(HEAD)``, what ``dracap up`` does before its services start): without a
   snapshot, with one at the head, with one ``EVERY_EVENTS - 1`` events behind (the
   worst case of the writer's rule) and one 99,999 behind (the rule before). Also the
   snapshot's size and write time, and how long the event loop stalls while a
   snapshot is encoded: the longest gap between the ticks of a 10 ms timer task,
   encoding on the loop (as before) and in a forked child
   (:func:`~services.runtime.store.snapshots.encode_detached`, now), and the ``fork()`` alone.

``--example FILE`` instead writes the small demo log of ``docs/forensics.md`` (three
tenants on one node over an hour, releases, a lease expiry and a fence) and exits.

Usage::

    .venv/bin/python -m benchmarks.replay --events 1000000 \\
        --admin-url postgresql://postgres@127.0.0.1:5432/postgres
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import tempfile
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import asyncpg
import msgspec

from benchmarks import databases, stopping
from benchmarks.eventlog import history, load_history
from events import catalog
from events.catalog import Event, schema_version_of, tag_of
from events.envelopes import namespace_of, stream_of
from events.eventcodec import encode_payload
from events.statecodec import snapshot_encode
from services.replay.checkpoints import EVERY as CHECKPOINT_EVERY
from services.replay.checkpoints import CheckpointWriter
from services.replay.history import state_at
from services.replay.logfile import CHUNK_BYTES, CheckpointLine, FileRow, LogWriter, read_end
from services.replay.sources import DatabaseSource, FileSource
from services.replay.transfer import check_file
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import EventStore, _init_connection, connect
from services.runtime.store.livestate import HEAD, LiveState
from services.runtime.store.snapshots import EVERY_EVENTS, encode_detached, write_snapshot
from tests.integration import sample as s


def write_file(path: Path, n: int, every: int = CHECKPOINT_EVERY) -> float:
    started = time.perf_counter()
    writer = CheckpointWriter(path, source="benchmarks.replay", every=every)
    chunk: list[tuple[Any, ...]] = []
    for row in history(n):
        chunk.append(row)
        if len(chunk) == 50_000:
            writer.write(chunk)
            chunk = []
    writer.write(chunk)
    writer.close()
    return time.perf_counter() - started


def raw_read(path: Path, *, parse: bool = True, generic: bool = False) -> int:
    """Read every event line and parse it into its row tuple, payload left as raw JSON
    (no checks, no checksum, no fold; ``parse=False``: only split the lines;
    ``generic``: decode every line, payload included, into plain lists and dicts)."""
    decoder: Any = msgspec.json.Decoder(Any if generic else list[FileRow | CheckpointLine])
    count = 0
    end_offset = read_end(path)[1]
    with open(path, "rb") as f:
        f.readline()
        rest = b""
        read = f.tell()
        while read < end_offset:
            chunk = f.read(min(CHUNK_BYTES, end_offset - read))
            if not chunk:
                break
            read += len(chunk)
            data = rest + chunk
            cut = data.rfind(b"\n") + 1
            body, rest = data[:cut], data[cut:]
            if body and parse:
                count += len(decoder.decode(b"[" + body[:-1].replace(b"\n", b",") + b"]"))
            elif body:
                count += body.count(b"\n")
    return count


async def replay_file(path: Path, position: int, *, checkpoints: bool = True) -> int:
    state = await state_at(FileSource(path, checkpoints=checkpoints), position)
    assert state.position == position
    return state.position


def median(repeat: int, work: Any) -> float:
    """The median time of ``repeat`` runs (the machine is shared: one lucky run says little)."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def file_part(n: int, repeat: int, directory: Path, every: int) -> dict[str, float]:
    path = directory / "bench.ndjson"
    wrote = write_file(path, n, every)
    size = path.stat().st_size
    marks = len(read_end(path)[0].checkpoints)
    print(f"  wrote {n:,} events, {marks} checkpoints ({size / 2**20:,.0f} MiB) in {wrote:.1f}s")
    lines = median(repeat, lambda: raw_read(path, parse=False))
    raw = median(repeat, lambda: raw_read(path))
    generic = median(1, lambda: raw_read(path, generic=True))
    replay = median(repeat, lambda: asyncio.run(replay_file(path, n)))
    step = every or n
    middle = min(n, n // 2 + step // 2)
    worst = max(1, min(n - 1, (n // 2 // step + 1) * step - 1))
    half = median(1, lambda: asyncio.run(replay_file(path, middle)))
    behind = median(1, lambda: asyncio.run(replay_file(path, worst)))
    full = median(1, lambda: asyncio.run(replay_file(path, n, checkpoints=False)))
    verified = median(1, lambda: check_file(path, checkpoints=True))
    path.unlink()
    return {
        "file MiB": size / 2**20,
        "file write (fold + checkpoints) s": wrote,
        "read + split lines only events/s": n / lines,
        "raw read events/s": n / raw,
        "raw read s": raw,
        "(generic decode of every line) events/s": n / generic,
        "replay state --at head events/s": n / replay,
        "replay state --at head s": replay,
        f"replay state --at {middle:,} (middle) s": half,
        f"replay state --at {worst:,} (a checkpoint - 1) s": behind,
        "replay state --at head, checkpoints ignored s": full,
        "replay verify --log (every checkpoint compared) s": verified,
    }


async def _start(settings: Settings) -> tuple[float, int, bool]:
    async with await EventStore.open(settings) as store:
        started = time.perf_counter()
        live = LiveState(store)  # as dracap up: its default page size
        used = await live.load_snapshot()
        await live.fresh(HEAD)
        return time.perf_counter() - started, live.state.position, used


async def _max_lag(work: Any) -> float:
    """The longest the loop went without running a 10 ms timer while ``work`` ran."""
    loop = asyncio.get_running_loop()
    worst = 0.0
    done = False

    async def tick() -> None:
        nonlocal worst
        while not done:
            before = loop.time()
            await asyncio.sleep(0.01)
            worst = max(worst, loop.time() - before - 0.01)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    try:
        await work
    finally:
        done = True
        await ticker
    return worst


async def _on_loop(state: Any) -> None:
    """How snapshots were encoded before: on the loop, compressed in a thread."""
    body = snapshot_encode(state)
    await asyncio.to_thread(zlib.compress, body, 1)


def _fork_seconds() -> float:
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    seconds = time.perf_counter() - started
    os.waitpid(pid, 0)
    return seconds


async def database_part(admin_url: str, n: int, *, full_start: bool = True) -> dict[str, float]:
    async with databases.fresh(admin_url) as settings:
        return await _database_part(settings, n, full_start=full_start)


async def _database_part(settings: Settings, n: int, *, full_start: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    admin = await asyncpg.connect(settings.database_url)
    await _init_connection(admin)  # payloads as bytes
    try:
        await load_history(admin, n)
    finally:
        await admin.close()
    if full_start:
        seconds, position, used = await _start(settings)
        assert position == n and not used
        out["start without snapshot s"] = seconds
    connection = await connect(settings)
    try:
        async with DatabaseSource(connection, snapshots=False) as source:
            state = await state_at(source, n)
        started = time.perf_counter()
        await write_snapshot(connection, state)
        out["snapshot write s"] = time.perf_counter() - started
        out["loop stall, encoding on the loop (before) s"] = await _max_lag(_on_loop(state))
        out["loop stall, encoding in a forked child (now) s"] = await _max_lag(
            encode_detached(state)
        )
        out["fork() alone s"] = _fork_seconds()
        out["snapshot MiB"] = (
            await connection.fetchval("SELECT octet_length(payload) FROM snapshots") / 2**20
        )
        seconds, position, used = await _start(settings)
        assert position == n and used
        out["start from snapshot at head s"] = seconds
        del state
        for gap in (EVERY_EVENTS - 1, 99_999):
            await connection.execute("DELETE FROM snapshots")
            async with DatabaseSource(connection, snapshots=False) as source:
                state = await state_at(source, max(1, n - gap))
            await write_snapshot(connection, state)
            del state
            seconds, position, used = await _start(settings)
            assert position == n and used
            out[f"start from snapshot {gap:,} behind s"] = seconds
    finally:
        await connection.close()
    return out


# --- the demo log of docs/forensics.md ---------------------------------------------------------

T0 = datetime.datetime(2026, 12, 1, 9, 0, tzinfo=datetime.UTC)


def example(path: Path) -> None:
    """Three tenants on node-a's two GPUs over an hour; a lease expiry and a fence."""
    rows: list[tuple[Any, ...]] = []
    versions: dict[str, int] = {}

    def add(minute: float, event: Event, actor: str) -> None:
        stream = stream_of(event)
        versions[stream] = versions.get(stream, 0) + 1
        rows.append(
            (
                len(rows) + 1,
                str(uuid.uuid4()),
                stream,
                versions[stream],
                tag_of(event),
                schema_version_of(event),
                namespace_of(event),
                actor,
                None,
                None,
                T0 + datetime.timedelta(minutes=minute),
                encode_payload(event),
            )
        )

    devices = {"gpu-0": {"memory": "80Gi"}, "gpu-1": {"memory": "80Gi"}}
    add(0, s.slice_published(devices=devices), "operator:ops")
    add(
        0.5,
        catalog.NodeLeaseAcquired(node="node-a", epoch=1, boot_id="b1", ttl_ms=30_000),
        "agent:node-a#1",
    )
    plan = [  # minute, tenant, claim, device, amount, released at
        (2, "research", "train-1", "gpu-0", "40Gi", 25),
        (5, "inference", "serve-1", "gpu-0", "20Gi", None),
        (8, "inference", "serve-2", "gpu-1", "10Gi", None),
        (12, "batch", "etl-1", "gpu-1", "30Gi", 20),
        (18, "research", "train-2", "gpu-1", "25Gi", None),
        (28, "batch", "etl-2", "gpu-0", "15Gi", None),
    ]
    reserved: dict[str, catalog.CapacityReserved] = {}
    timeline: list[tuple[float, Event, str]] = []
    for minute, ns, name, device, amount, release in plan:
        r = s.reserved(ns, name, device, amount)
        reserved[name] = r
        timeline += [
            (minute, s.claim_submitted(ns, name), f"tenant:dev@{ns}"),
            (minute + 0.1, catalog.ClaimAdmitted(namespace=ns, name=name), "system:claims"),
            (minute + 0.2, r, "system:reservation-0"),
            (minute + 0.3, s.bound(r), "system:reservation-0"),
        ]
        if release is not None:
            timeline += [
                (
                    release,
                    catalog.ReleaseRequested(namespace=ns, name=name, allocation_version=1),
                    f"tenant:dev@{ns}",
                ),
                (release + 0.2, s.released(r), "system:reservation-0"),
            ]
    timeline += [
        (36, catalog.NodeLeaseExpired(node="node-a", epoch=1), "system:reclamation"),
        (44, catalog.NodeFenced(node="node-a", epoch=1, reason="powered off"), "operator:ops"),
        (
            48,
            catalog.NodeLeaseAcquired(node="node-a", epoch=2, boot_id="b2", ttl_ms=30_000),
            "agent:node-a#2",
        ),
    ]
    for minute, ns, name, device, amount in (
        (50, "research", "train-3", "gpu-0", "50Gi"),
        (52, "inference", "serve-3", "gpu-1", "20Gi"),
        (55, "batch", "etl-3", "gpu-1", "35Gi"),
    ):
        r = s.reserved(ns, name, device, amount)
        timeline += [
            (minute, s.claim_submitted(ns, name), f"tenant:dev@{ns}"),
            (minute + 0.1, catalog.ClaimAdmitted(namespace=ns, name=name), "system:claims"),
            (minute + 0.2, r, "system:reservation-0"),
            (minute + 0.3, s.bound(r), "system:reservation-0"),
        ]
    for minute, event, actor in sorted(timeline, key=lambda t: t[0]):
        add(minute, event, actor)
    writer = LogWriter(path, source="benchmarks.replay --example")
    writer.write(rows)
    writer.close()
    check_file(path)  # it folds
    print(f"wrote {len(rows)} events to {path}")


def report(r: dict[str, float]) -> None:
    width = max(len(k) for k in r)
    for key, value in r.items():
        print(f"  {key:<{width}}  {value:>14,.2f}")
    if "raw read events/s" in r:
        ratio = r["replay state --at head events/s"] / r["raw read events/s"]
        print(f"  replay state --at / raw read: {ratio:.2f}x  [goal >= 0.5]")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3, help="file runs, median kept")
    databases.add_admin_url(parser)
    parser.add_argument("--no-database", action="store_true", help="the file part only")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=CHECKPOINT_EVERY,
        metavar="N",
        help="file part: a checkpoint every N events and after the last (0: none)",
    )
    parser.add_argument("--no-file", action="store_true", help="the start-up part only")
    parser.add_argument("--example", metavar="FILE", help="write the demo log and exit")
    parser.add_argument(
        "--no-full-start", action="store_true", help="skip the start without a snapshot"
    )
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    if args.example:
        example(Path(args.example))
        return
    results: dict[str, float] = {}
    if not args.no_file:
        print(f"file part, {args.events:,} events:")
        with tempfile.TemporaryDirectory() as directory:
            results |= file_part(args.events, args.repeat, Path(directory), args.checkpoint_every)
    if not args.no_database:
        print(f"start-up part, {args.events:,} events:")
        results |= stopping.run(
            "replay", database_part(args.admin_url, args.events, full_start=not args.no_full_start)
        )
    report(results)


if __name__ == "__main__":
    main()
