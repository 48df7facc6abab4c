"""Event-log throughput: dracap's store against raw asyncpg on the same database.

One run, one fresh database (created from an administrator URL, migrated, dropped at
the end unless ``--keep``). It measures, on the same server and connection settings:

* raw single-row ``INSERT`` commits/s and raw batched ``INSERT ... unnest`` rows/s
  into ``bench_raw`` (``LIKE events INCLUDING ALL``: same columns and indexes);
* dracap single-event ``append`` calls/s and batched ``append`` events/s (validation,
  head lock, version check, insert, projections, notify — the whole path);
* a raw keyset read of every row (no decoding) rows/s, and dracap replay events/s
  (the same read + ``services.replay.verify.fold_rows``, as ``replay verify``).

The replay log (``--events``, default 1,000,000) is a valid history — slices, then
claim lifecycles submitted -> admitted -> reserved -> bound -> ready -> released — made
by encoding one lifecycle per claim and loading the rows with binary ``COPY``.

Usage::

    .venv/bin/python -m benchmarks.eventlog --events 1000000 \
        --admin-url postgresql://postgres@127.0.0.1:5432/postgres
"""

from __future__ import annotations

import argparse
import datetime
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import asyncpg

from benchmarks import databases, stopping
from events import catalog, model
from events.catalog import Event, schema_version_of, tag_of
from events.envelopes import stream_of
from events.eventcodec import encode_payload
from events.state import ClusterState
from services.replay.verify import fold_rows, paused_gc
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import (
    EventStore,
    _init_connection,
    connect,
    iter_rows,
)
from tests.integration import sample as s

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
DEVICES = 64


def _row(position: int, stream: str, version: int, event: Event) -> tuple[Any, ...]:
    return (
        position,
        uuid.uuid4(),
        stream,
        version,
        tag_of(event),
        schema_version_of(event),
        getattr(event, "namespace", None),
        "bench",
        "corr",
        None,
        T0,
        encode_payload(event),
    )


def manifest(namespace: str, name: str, config_bytes: int = 0) -> model.ResourceClaim:
    """A tenant's claim for 1Gi of one GPU; ``config_bytes``: with that much opaque
    configuration (the parameters' JSON), as a tenant allowed to configure sends it."""
    exactly = {"deviceClassName": s.DRIVER, "capacity": {"requests": {"memory": "1Gi"}}}
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": exactly}]}
    if config_bytes:
        filler = "x" * max(0, config_bytes - 64)
        parameters = {"apiVersion": "gpu.example.com/v1", "kind": "Tuning", "notes": filler}
        devices["config"] = [{"opaque": {"driver": s.DRIVER, "parameters": parameters}}]
    doc = {"metadata": {"name": name, "namespace": namespace}, "spec": {"devices": devices}}
    return model.convert(doc, model.ResourceClaim)


def _lifecycle(i: int, manifests: int | None = None) -> list[Event]:
    """One claim's events; ``manifests``: with its ``ClaimSubmitted`` first, its manifest
    carrying that many bytes of configuration (``None``: no ``ClaimSubmitted``, as the
    figures of ``docs/`` were measured)."""
    ns, name = f"ns-{i % 97}", f"claim-{i}"
    r = s.reserved(ns, name, f"gpu-{i % DEVICES}", "1Gi", share_id=str(uuid.UUID(int=i + 1)))
    submitted: list[Event] = []
    if manifests is not None:
        submitted.append(catalog.ClaimSubmitted(claim=manifest(ns, name, manifests)))
    return [
        *submitted,
        catalog.ClaimAdmitted(namespace=ns, name=name),
        r,
        s.bound(r),
        catalog.LimitApplied(
            share_id=r.share_id, node=s.POOL, level="hard", actual=dict(r.consumed)
        ),
        catalog.ReleaseRequested(namespace=ns, name=name, allocation_version=1),
        s.released(r),
    ]


def history(n: int, manifests: int | None = None) -> Iterator[tuple[Any, ...]]:
    """``n`` stored rows of a valid history (positions 1..n); ``manifests``: see
    :func:`_lifecycle`."""
    devices = {f"gpu-{d}": {"memory": "80Gi"} for d in range(DEVICES)}
    first = s.slice_published("bench", devices)
    position, versions = 1, {"slice:bench": 1}
    yield _row(1, "slice:bench", 1, first)
    i = 0
    while position < n:
        for event in _lifecycle(i, manifests):
            if position >= n:
                return
            position += 1
            stream = stream_of(event)
            versions[stream] = versions.get(stream, 0) + 1
            yield _row(position, stream, versions[stream], event)
        i += 1


async def _timed(label: str, count: int, work: Callable[[], Awaitable[None]]) -> tuple[str, float]:
    started = time.perf_counter()
    await work()
    rate = count / (time.perf_counter() - started)
    print(f"  {label:<34} {rate:>12,.0f}/s", flush=True)
    return label, rate


RAW_INSERT = (
    "INSERT INTO bench_raw SELECT * FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::int[], "
    "$5::text[], $6::int[], $7::text[], $8::text[], $9::text[], $10::text[], "
    "$11::timestamptz[], $12::jsonb[])"
)


async def bench_writes(
    admin: asyncpg.Connection, store: EventStore, single: int, batches: int, batch: int
) -> dict[str, float]:
    await admin.execute("CREATE TABLE bench_raw (LIKE events INCLUDING ALL)")
    await _init_connection(admin)
    events = [catalog.ClaimAdmitted(namespace="bench", name=f"c{i}") for i in range(batch)]
    rows = [_row(i + 1, f"claim:bench/c{i}", 1, e) for i, e in enumerate(events)]
    out: dict[str, float] = {}

    async def raw_single() -> None:
        for i in range(single):
            await admin.execute(
                "INSERT INTO bench_raw VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
                *(10_000_000 + i, uuid.uuid4(), f"raw-{i}", 1, *rows[0][4:]),
            )

    async def raw_batched() -> None:
        for b in range(batches):
            cols = [list(c) for c in zip(*rows, strict=True)]
            cols[0] = [20_000_000 + b * batch + i for i in range(batch)]
            cols[1] = [uuid.uuid4() for _ in range(batch)]
            cols[2] = [f"rawb-{b}-{i}" for i in range(batch)]
            await admin.execute(RAW_INSERT, *cols)

    async def dracap_single() -> None:
        for i in range(single):
            await store.append(f"claim:single/{i}", 0, [events[i % batch]], actor="bench")

    async def dracap_batched() -> None:
        for b in range(batches):
            await store.append("claim:bench/batched", b * batch, events, actor="bench")

    for label, count, work in (
        ("raw single-row INSERT commits", single, raw_single),
        ("dracap single-event append", single, dracap_single),
        ("raw batched INSERT rows", batches * batch, raw_batched),
        ("dracap batched append events", batches * batch, dracap_batched),
    ):
        name, rate = await _timed(label, count, work)
        out[name] = rate
    return out


async def load_history(admin: asyncpg.Connection, n: int) -> None:
    await admin.execute("TRUNCATE capacity_ledger, device_holds, held_shares, node_epochs")
    await admin.execute("ALTER TABLE events DISABLE TRIGGER USER")  # bench database only
    await admin.execute("DELETE FROM events")
    await admin.execute("ALTER TABLE events ENABLE TRIGGER USER")
    started = time.perf_counter()
    chunk: list[tuple[Any, ...]] = []
    for row in history(n):
        chunk.append(row)
        if len(chunk) == 50_000:
            await admin.copy_records_to_table("events", records=chunk)
            chunk = []
    if chunk:
        await admin.copy_records_to_table("events", records=chunk)
    await admin.execute("UPDATE event_log_head SET position = $1", n)
    await admin.execute("VACUUM ANALYZE events")
    print(f"  generated + COPY {n:,} events in {time.perf_counter() - started:.1f}s")


async def bench_reads(settings: Settings, n: int) -> dict[str, float]:
    connection = await connect(settings)
    out: dict[str, float] = {}
    state = ClusterState()
    try:

        async def raw_read() -> None:
            count = 0
            async for rows in iter_rows(connection, 0, 10_000):
                count += len(rows)
            assert count == n, count

        async def replay() -> None:
            with paused_gc():
                async for rows in iter_rows(connection, 0, 10_000):
                    fold_rows(state, rows)

        for label, work in (
            ("raw keyset read rows", raw_read),
            ("dracap replay (decode + fold) events", replay),
        ):
            name, rate = await _timed(label, n, work)
            out[name] = rate
        assert state.position == n
        out["replay seconds"] = n / out["dracap replay (decode + fold) events"]
    finally:
        await connection.close()
    return out


async def main(args: argparse.Namespace) -> None:
    async with databases.fresh(args.admin_url, keep=args.keep) as settings:
        name = settings.database_url.rsplit("/", 1)[1]
        admin = await asyncpg.connect(settings.database_url)
        try:
            print(f"database {name}; writes:")
            async with await EventStore.open(settings) as store:
                results = await bench_writes(admin, store, args.single, args.batches, args.batch)
            print(f"replay of {args.events:,} events:")
            await load_history(admin, args.events)
            results |= await bench_reads(settings, args.events)
        finally:
            await admin.close()
    report(results)


def report(r: dict[str, float]) -> None:
    batched = r["dracap batched append events"] / r["raw batched INSERT rows"]
    single = r["dracap single-event append"] / r["raw single-row INSERT commits"]
    replay = r["dracap replay (decode + fold) events"] / r["raw keyset read rows"]
    print("\nratios (goal in brackets):")
    print(f"  single append / raw single INSERT      {single:6.2f}x")
    print(f"  batched append / raw batched INSERT    {batched:6.2f}x  [>= 0.6]")
    print(f"  replay / raw read                      {replay:6.2f}x  [>= 0.5]")
    print(f"  replay time for the log                {r['replay seconds']:6.2f}s  [< 10 s per 1M]")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="replay log length")
    parser.add_argument("--single", type=int, default=2_000, help="single-event appends")
    parser.add_argument("--batches", type=int, default=50, help="batched appends")
    parser.add_argument("--batch", type=int, default=1_000, help="events per batched append")
    databases.add_admin_url(parser)
    parser.add_argument("--keep", action="store_true", help="keep the benchmark database")
    return parser.parse_args(argv)


if __name__ == "__main__":
    stopping.run("eventlog", main(parse()))
