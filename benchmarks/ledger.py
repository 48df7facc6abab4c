"""The ledger's writes: audit's and billing's batches, CPU per claim on each side.

One run, one fresh database (``benchmarks.databases.fresh``: created from an
administrator URL, migrated, dropped at the end unless ``--keep``). Each batch is what
the ledger's projectors get under load: ``--claims`` claims' lifecycles (submitted,
admitted, capacity reserved, limit applied: four log positions each, 1,000 a batch by
default), which
:func:`services.audit.service.write_update` and :func:`services.billing.service.write_update`
write in one transaction, as the projector does (the log's read and the projector's
position are left out: they are the same whatever the writes). It prints the CPU per
claim of this process (building the rows and sending them) and of its PostgreSQL
backend (read from ``/proc``: the server must run on this machine; else ``n/a``),
averaged over ``--batches`` batches after two to warm up. The batches run with the
collector tuned as the ledger process runs it
(:func:`services.runtime.ground.gctuning.long_lived_state`): with CPython's defaults
the figure depended on how much else this process had imported (0.048-0.060 ms with
``benchmarks.pipeline`` imported, 0.066-0.097 without).

Usage::

    .venv/bin/python -m benchmarks.ledger \
        --admin-url postgresql://postgres@127.0.0.1:5432/postgres
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import time
from pathlib import Path

import asyncpg

from benchmarks import databases, stopping
from events import catalog
from events.envelopes import Envelope, new_envelope
from services.audit import service as audit
from services.billing import service as billing
from services.runtime.ground.gctuning import long_lived_state
from services.runtime.store.eventstore import _init_connection
from tests.integration import sample as s

T0 = datetime.datetime(2026, 12, 1, 9, 30, tzinfo=datetime.UTC)
WARM_UP = 2


def lifecycles(first: int, claims: int, position: int) -> list[Envelope]:
    """``claims`` claims from the ``first``-th, each at four positions after ``position``."""
    envs: list[Envelope] = []
    for i in range(first, first + claims):
        name = f"c{i}"
        r = s.reserved("team-a", name, device=f"gpu-{i % 8}", consumed="10Gi", pool="node-a")
        applied = catalog.LimitApplied(share_id=r.share_id, node="node-a", level="hard", actual={})
        for minutes, event, actor in (
            (0, s.claim_submitted("team-a", name), "tenant:alice@team-a"),
            (0, catalog.ClaimAdmitted(namespace="team-a", name=name), "tenant:alice@team-a"),
            (1, r, "system:reservation-0"),
            (2, applied, "agent:node-a#1"),
        ):
            envs.append(
                new_envelope(
                    event,
                    stream_version=1,
                    actor=actor,
                    position=position + len(envs) + 1,
                    recorded_at=T0 + datetime.timedelta(minutes=minutes),
                )
            )
    return envs


def server_seconds(pid: int) -> float | None:
    """The CPU seconds of PostgreSQL backend ``pid``; None when it is not on this machine."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench(connection: asyncpg.Connection, claims: int, batches: int) -> tuple[float, float]:
    """This process's and the backend's CPU ms per claim (the backend's: nan if unknown)."""
    pid = connection.get_server_pid()
    client: list[float] = []
    server: list[float] = []
    position = 0
    for k in range(WARM_UP + batches):
        envs = lifecycles(k * claims, claims, position)
        position = envs[-1].position
        billed = [e for e in envs if type(e.event) in billing.EVENTS]
        started, backend = time.process_time(), server_seconds(pid)
        async with connection.transaction():
            await audit.write_update(connection, envs)
            await billing.write_update(connection, billed)
        ended, backend_end = time.process_time(), server_seconds(pid)
        if k >= WARM_UP:
            client.append((ended - started) / claims * 1000)
            if backend is not None and backend_end is not None:
                server.append((backend_end - backend) / claims * 1000)
    return sum(client) / len(client), sum(server) / len(server) if server else float("nan")


async def main(args: argparse.Namespace) -> None:
    async with databases.fresh(args.admin_url, pool=1, keep=args.keep) as settings:
        name = settings.database_url.rsplit("/", 1)[1]
        connection = await asyncpg.connect(settings.database_url)
        try:
            await _init_connection(connection)  # the store's jsonb codec
            with long_lived_state():  # the collector as the ledger process has it
                client, server = await bench(connection, args.claims, args.batches)
        finally:
            await connection.close()
    positions = 4 * args.claims
    print(
        f"database {name}: {args.batches} batches of {args.claims} claims ({positions} positions)"
    )
    print(f"  the ledger's CPU per claim      {client:6.3f} ms")
    shown = "n/a" if math.isnan(server) else f"{server:6.3f} ms"
    print(f"  PostgreSQL's CPU per claim      {shown}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--claims", type=int, default=250, help="claims a batch (4 positions each)")
    parser.add_argument("--batches", type=int, default=10, help="batches measured")
    databases.add_admin_url(parser)
    parser.add_argument("--keep", action="store_true", help="keep the benchmark database")
    return parser.parse_args(argv)


if __name__ == "__main__":
    stopping.run("ledger", main(parse()))
