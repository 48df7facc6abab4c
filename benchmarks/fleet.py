"""A fleet of node agents against one control plane: does the database notice the fleet?

For each fleet size N (``--nodes 100,1000,5000``), on a fresh database and a fresh
nats-server:

* the broker's accounts are written by ``dracap auth init`` for N nodes (each agent a
  user of its own in ``NODES``), and nats-server runs with them;
* the control plane runs as processes, as a deployment runs it: ``dracap serve relay``,
  ``serve claims``, ``serve reservation``, ``serve enforcement`` (one replica) and
  ``dracap reclaim``, each with its own broker credential; the inventory is one
  ResourceSlice of one shareable GPU per node, loaded through the admin API;
* this process runs the N agents (``enforcer none``, ``--lease-ttl`` as given), each
  with its own credential and its own NATS connection and no database access, started
  in waves of 200 (the next wave once the last one holds its leases: a cluster's nodes
  do not all boot in the same second).

Then, with the fleet beating:

* **PostgreSQL connections**: the most sessions on the benchmark's database seen over
  the steady window (goal: independent of N, at most 30);
* **lease-renewal statements/s**: ``dracap_lease_renewal_statements_total`` of the
  enforcement service over the window (goal: a few, whatever N), and the renewals it
  carried (``dracap_lease_renewals_total{outcome="held"}``: about N every ttl/3);
* **claim apply -> Ready p50/p99** at ``--rate`` claims/s (default 50) for ``--seconds``,
  a tenant applying through the claims API and following the watch subject
  (:mod:`benchmarks.pipeline`'s tracker); each claim lands on some node of the fleet
  and is Ready when that node's agent reported its limit;
* **last heartbeat -> Unknown**: ``--lost`` agents stop (their tasks end and their
  connection closes, as a node that dies); the time from their lease's last renewal
  (``node_leases.renewed_at``, the database's clock) to the ``NodeLeaseExpired``
  recorded by the reclamation service (goal: ttl + 1 s);
* **memory**: resident memory of each service process, of nats-server, and of this
  process (the agents) per agent;
* **leases lost**: the expiries recorded before the deliberate stops (a heartbeat path
  that cannot keep up with the fleet shows here first; goal 0).

The machine is shared by the load generator (this process: N agents) and the control
plane: at large N its own CPU shows in the latency. Report the table with the command.

Usage::

    .venv/bin/python -m benchmarks.fleet --nodes 100,1000,5000
    .venv/bin/python -m benchmarks.fleet --nodes 100 --seconds 10 --lost 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg

from benchmarks import pipeline, stopping
from events.subjects import BusNames
from services.brokerauth import Installation, init_auth
from services.enforcement.agent import Agent
from services.enforcement.enforcers import NoneEnforcer
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.credentials import AuthDir
from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground.context import ServiceContext
from services.runtime.ground.gctuning import tune_for_long_lived_state
from services.runtime.ground.settings import Settings
from services.runtime.ops.embedded import EmbeddedNats, free_port

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("relay", "claims", "reservation", "enforcement")
WAVE = 200  #: agents started at once


#: ResourceSlices per ``slices.apply`` of the inventory (a YAML stream of documents)
SLICES_PER_APPLY = 50


def gpu_slice(node: str) -> bytes:
    """One shareable GPU with room for every claim of the run."""
    device = {
        "name": "gpu-0",
        "allowMultipleAllocations": True,
        "capacity": {"memory": {"value": "1000Gi"}},
    }
    spec = {
        "driver": pipeline.DRIVER,
        "nodeName": node,
        "pool": {"name": f"{node}-gpus", "generation": 1, "resourceSliceCount": 1},
        "devices": [device],
    }
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-gpu"},
        "spec": spec,
    }
    return json.dumps(body).encode()


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` (MiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class ControlPlane:
    """The services as processes (see the module docstring)."""

    def __init__(self, settings: Settings, url: str, names: BusNames, auth: AuthDir, work: Path):
        self.settings, self.url, self.names, self.auth, self.work = settings, url, names, auth, work
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.metrics_port = free_port()

    async def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DRACAP_")}
        env["DRACAP_APP_ROLE"] = "dracap_app"
        env["DRACAP_POOL_MAX_SIZE"] = "4"
        common = ["--database-url", self.settings.database_url, "--data-dir", str(self.work)]
        bus = ["--nats", self.url, "--prefix", self.names.prefix]
        for service in SERVICES:  # the relay first: its user is the one that makes the stream
            creds = self.auth.creds_path(self.auth.service(service).principal)
            argv = ["serve", service, *common, *bus, "--creds", str(creds)]
            if service in ("claims", "enforcement"):
                argv += ["--directory", str(self.auth.directory)]
            if service == "enforcement":
                argv += ["--metrics-port", str(self.metrics_port)]
            await self._start(service, argv, env)
            if service == "relay":
                await until(self._relay_started, "the relay", 60)
        await self._start("reclaim", ["reclaim", *common, "--poll", "0.25"], env)

    async def _start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = (self.work / f"{name}.log").open("ab")
        self.processes[name] = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.cli", *argv, cwd=ROOT, env=env, stdout=log, stderr=log
        )
        log.close()

    async def _relay_started(self) -> bool:
        return "relay started" in (self.work / "relay.log").read_text()

    def memory(self) -> dict[str, float]:
        return {name: rss_mib(p.pid) for name, p in self.processes.items()}

    async def stop(self) -> None:
        for process in self.processes.values():
            if process.returncode is None:
                process.terminate()
        for process in self.processes.values():
            try:
                async with asyncio.timeout(30):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()


class Fleet:
    """N agents in this process, each with its own credential and connection."""

    def __init__(self, url: str, names: BusNames, auth: AuthDir, ttl: float) -> None:
        self.url, self.names, self.auth, self.ttl = url, names, auth, ttl
        self.agents: dict[str, tuple[Any, asyncio.Event, asyncio.Task[None]]] = {}

    async def start(self, nodes: list[str], db: asyncpg.Connection) -> None:
        """Start ``nodes``' agents in waves, each once the wave before holds its leases."""
        for first in range(0, len(nodes), WAVE):
            await asyncio.gather(*(self._start(node) for node in nodes[first : first + WAVE]))
            count = min(first + WAVE, len(nodes))
            await until(lambda count=count: _leases(db, count), f"{count} leases", 300)

    async def _start(self, node: str) -> None:
        nc, js = await connect_bus(self.url, name=f"fleet-{node}", credential=self.auth.agent(node))
        agent = Agent(
            ServiceContext(stores=None, names=self.names, connection=nc, jetstream=js),
            node=node, enforcer=NoneEnforcer(), lease_ttl=self.ttl, boot_id="fleet",
            health_interval=0,
        )  # fmt: skip
        stop = asyncio.Event()
        self.agents[node] = (nc, stop, asyncio.ensure_future(agent.run(stop)))

    async def stop(self, node: str) -> None:
        """End ``node``'s agent as a node that dies: its beats stop, its connection goes."""
        nc, _, task = self.agents.pop(node)
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        await nc.close()

    async def close(self) -> None:
        for _, stop, _ in self.agents.values():
            stop.set()
        tasks = [task for _, _, task in self.agents.values()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=30)
            for task in pending:
                task.cancel()
        for nc, _, _ in self.agents.values():
            with contextlib.suppress(Exception):
                await nc.close()


async def until(check: Any, what: str, within: float) -> Any:
    deadline = time.monotonic() + within
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def broker(
    work: Path, names: BusNames, nodes: list[str]
) -> AsyncIterator[tuple[str, AuthDir]]:
    auth = AuthDir(work / "auth")
    installation = Installation(
        prefix=names.prefix, namespaces={pipeline.NAMESPACE: [pipeline.NAMESPACE]}, nodes=nodes
    )
    await asyncio.to_thread(init_auth, auth, installation)
    server = EmbeddedNats(work, config=auth.accounts)
    url = await asyncio.to_thread(server.start)
    try:
        yield url, auth
    finally:
        await asyncio.to_thread(server.stop)


async def load_inventory(api: ApiClient, nodes: list[str]) -> None:
    await api.admin("deviceclasses.apply", json.dumps(pipeline.device_class()).encode())
    await api.admin("namespaces.access", {"namespace": pipeline.NAMESPACE, "classes": ["*"]})
    for first in range(0, len(nodes), SLICES_PER_APPLY):  # one admin write per batch
        batch = b"\n---\n".join(gpu_slice(n) for n in nodes[first : first + SLICES_PER_APPLY])
        await api.admin("slices.apply", batch)


async def measure(size: int, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"nodes": size}
    nodes = [f"n{i}" for i in range(size)]
    names = BusNames(prefix=f"fleet{uuid.uuid4().hex[:8]}")
    with tempfile.TemporaryDirectory(prefix="dracap-fleet-") as tmp:
        work = Path(tmp)
        async with (
            pipeline.fresh_database(args) as settings,
            broker(work, names, nodes) as (url, auth),
        ):
            database = settings.database_url.rsplit("/", 1)[1]
            plane = ControlPlane(settings, url, names, auth, work)
            fleet = Fleet(url, names, auth, args.ttl)
            db: asyncpg.Connection | None = None
            try:  # a stop (Ctrl-C, SIGTERM) mid-start leaves no process behind either
                await plane.start()
                db = await asyncpg.connect(settings.database_url)
                operator = auth.operator()
                async with ApiClient.connect(url, names.prefix, operator) as admin:
                    await until(lambda: _answers(admin), "the claims API", 120)
                    started = time.monotonic()
                    await load_inventory(admin, nodes)
                    print(f"  N={size}: inventory in {time.monotonic() - started:.1f}s", flush=True)
                started = time.monotonic()
                await fleet.start(nodes, db)
                print(
                    f"  N={size}: every lease taken in {time.monotonic() - started:.1f}s",
                    flush=True,
                )
                await asyncio.sleep(args.settle)
                out.update(await steady(db, database, plane, args.window))
                tenant = auth.tenant(pipeline.NAMESPACE, pipeline.NAMESPACE)
                async with ApiClient.connect(url, names.prefix, tenant) as api:
                    tracker = pipeline.ReadyTracker()
                    async with pipeline.watching(api, tracker):
                        await pipeline.latency(api, tracker, 5, 2, "warm")
                        lat = await pipeline.latency(api, tracker, args.rate, args.seconds)
                out["p50"], out["p99"] = pipeline.percentile(lat, 50), pipeline.percentile(lat, 99)
                out["unknown"] = await lost(db, fleet, nodes[: args.lost], args.ttl)
                out["memory"] = plane.memory()
                out["nats"] = rss_mib(_nats_pid(work))
                out["fleet"] = rss_mib(os.getpid())
            finally:
                await fleet.close()
                if db is not None:
                    await db.close()
                await plane.stop()
    return out


async def _answers(api: ApiClient) -> bool:
    try:
        await api.admin("devices.list")
    except Exception:
        return False
    return True


async def _leases(db: asyncpg.Connection, size: int) -> bool:
    return int(await db.fetchval("SELECT count(*) FROM node_leases")) >= size


def _nats_pid(work: Path) -> int:
    return int((work / "nats.pid").read_text().strip())


async def steady(
    db: asyncpg.Connection, database: str, plane: ControlPlane, window: float
) -> dict[str, Any]:
    """Connections and renewals over ``window`` seconds of the fleet beating."""
    port = plane.metrics_port
    statements = await asyncio.to_thread(
        pipeline.scrape, port, "dracap_lease_renewal_statements_total"
    )
    held = await asyncio.to_thread(
        pipeline.scrape, port, "dracap_lease_renewals_total", '{outcome="held"}'
    )
    started, most = time.monotonic(), 0
    while time.monotonic() - started < window:
        count = await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            database,
        )
        most = max(most, int(count))
        await asyncio.sleep(0.5)
    seconds = time.monotonic() - started
    statements_after = await asyncio.to_thread(
        pipeline.scrape, port, "dracap_lease_renewal_statements_total"
    )
    held_after = await asyncio.to_thread(
        pipeline.scrape, port, "dracap_lease_renewals_total", '{outcome="held"}'
    )
    expired = await db.fetchval(
        "SELECT count(*) FROM events WHERE type = 'reclamation.node_lease_expired'"
    )
    return {
        "connections": most,
        "statements_per_s": (statements_after - statements) / seconds,
        "renewals_per_s": (held_after - held) / seconds,
        "expired": int(expired),
    }


async def lost(db: asyncpg.Connection, fleet: Fleet, victims: list[str], ttl: float) -> list[float]:
    """Stop ``victims``' agents; seconds from each lease's last renewal to its expiry."""
    for node in victims:
        await fleet.stop(node)
    out = []
    for node in victims:
        row = await until(
            lambda node=node: db.fetchrow(
                "SELECT recorded_at FROM events WHERE stream = $1 AND type = "
                "'reclamation.node_lease_expired'",
                f"lease:{node}",
            ),
            f"{node}'s expiry",
            ttl * 3 + 60,
        )
        renewed = await db.fetchval("SELECT renewed_at FROM node_leases WHERE node = $1", node)
        out.append(float((row["recorded_at"] - renewed).total_seconds()))
    return out


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\nfleet of simulated agents (enforcer none, lease ttl {args.ttl:g} s), "
        f"claims at {args.rate:g}/s for {args.seconds:g} s:"
    )
    header = (
        f"{'N':>6} {'pg conns':>8} {'renew stmts/s':>13} {'renewals/s':>10} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'beat->Unknown s':>16} {'leases lost':>11}"
    )
    print(header)
    for r in rows:
        unknown = r["unknown"]
        spread = f"{min(unknown):.2f}-{max(unknown):.2f}" if unknown else "-"
        print(
            f"{r['nodes']:>6} {r['connections']:>8} {r['statements_per_s']:>13.2f} "
            f"{r['renewals_per_s']:>10.0f} {r['p50']:>7.1f} {r['p99']:>7.1f} {spread:>16} "
            f"{r['expired']:>11}"
        )
    print("\nresident memory (MiB):")
    for r in rows:
        services = "  ".join(f"{k} {v:.0f}" for k, v in r["memory"].items())
        per_agent = r["fleet"] / r["nodes"]
        print(
            f"  N={r['nodes']:>5}: {services}  nats-server {r['nats']:.0f}  "
            f"agents' process {r['fleet']:.0f} ({per_agent * 1024:.0f} KiB/agent)"
        )
    print(
        "\ngoals: pg conns independent of N and <= 30; renewal statements a few per second "
        f"whatever N; beat->Unknown <= ttl + 1 s = {args.ttl + 1:g} s"
    )


async def main(args: argparse.Namespace) -> None:
    gc.freeze()
    tune_for_long_lived_state()
    rows = []
    for size in args.nodes:
        rows.append(await measure(size, args))
    report(rows, args)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--nodes",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[100, 1000, 5000],
        metavar="N,N,...",
        help="fleet sizes (default 100,1000,5000)",
    )
    parser.add_argument("--ttl", type=float, default=10.0, help="the agents' lease ttl (s)")
    parser.add_argument("--rate", type=float, default=50.0, help="claims/s of the latency run")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the latency run")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of steady sampling")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after the last lease")
    parser.add_argument("--lost", type=int, default=3, help="agents stopped (beat->Unknown)")
    parser.add_argument("--keep", action="store_true", help="keep each benchmark database")
    parser.add_argument("--pool", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--embedded", action="store_true", help=argparse.SUPPRESS)
    pipeline.add_server_arguments(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    stopping.run("fleet", main(parse()))
