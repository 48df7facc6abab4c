"""Node-loss recovery times: heartbeat -> Unknown, fence -> release, return -> confirmed.

The system under test is ``dracap up --insecure`` with no node in its inventory (relay,
claims API, reservation worker and the reclamation service, polling every 0.25 s; no
agent) as its own process, started as :mod:`benchmarks.pipeline` does, on a fresh
database and a unique subject prefix; the node agents are ``dracap agent --enforcer
none`` processes started by this benchmark with ``--lease-ttl`` (NATS only: they
reach the log through the enforcement service inside ``dracap up``). Each run takes a
node of its own (its slice published through the admin API, so earlier runs' fenced
nodes are out of the way) and:

1. starts the agent and makes two claims Ready on the node;
2. stops the agent (SIGSTOP) and waits for ``NodeLeaseExpired``: **heartbeat ->
   Unknown** is the event's time minus the lease's last renewal (``renewed_at``);
3. resumes it (SIGCONT): **return -> confirmed** is the time from the signal to the
   last ``ShareConfirmed`` of the two shares;
4. stops it again, waits for the second expiry (another heartbeat -> Unknown sample),
   and fences the node through the admin API: **fence -> release** is the time from
   the request to its reply, which comes after the append that released the shares
   (checked: no share of the node is left in ``held_shares``).

Every time is one machine's wall clock (the database's ``clock_timestamp()`` for the
renewal, the appending process's for events). Goals: Unknown within ttl + 1 s, release
within 1 s of the fence, confirmation within 2 s of the agent's return. Reported as
p50 / p99 / max over the runs.

Usage::

    .venv/bin/python -m benchmarks.recovery --runs 10 --ttl 2
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg

from benchmarks import pipeline, stopping
from events.subjects import BusNames
from services.runtime.bus.apiclient import ApiClient
from services.runtime.ground.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


class Agent:
    """One ``dracap agent`` process of a node."""

    def __init__(self, settings: Settings, names: BusNames, node: str, ttl: float, log: Path):
        argv = [
            *(sys.executable, "-m", "services.cli", "agent", "--node", node),
            *("--prefix", names.prefix),
            *("--nats", settings.nats_url, "--enforcer", "none", "--checkpoint", "none"),
            *("--lease-ttl", str(ttl), "--metrics-port", "0", "--boot-id", "boot-a"),
        ]
        self.argv = argv
        self.log = log
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        sink = self.log.open("ab")
        self.process = await asyncio.create_subprocess_exec(
            *self.argv, cwd=ROOT, stdout=sink, stderr=sink
        )
        sink.close()

    def signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        os.kill(self.process.pid, sig)

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


async def until(check: object, what: str, within: float = 60.0) -> object:
    """Poll the coroutine function ``check`` every 20 ms until it returns a truthy value."""
    deadline = time.monotonic() + within
    while True:
        value = await check()  # type: ignore[operator]
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def one_run(
    api: ApiClient, db: asyncpg.Connection, agent: Agent, node: str, claims: int
) -> dict[str, list[float]]:
    """One node's loss, return, loss and fence (see the module docstring)."""
    out: dict[str, list[float]] = {"unknown": [], "confirm": [], "fence": []}
    await api.admin("slices.apply", json.dumps(pipeline.resource_slice(node)).encode())
    await agent.start()
    await until(lambda: db.fetchval("SELECT 1 FROM node_leases WHERE node = $1", node), "the lease")
    names = [f"{node}-c{i}" for i in range(claims)]
    for name in names:
        await api.claims(pipeline.NAMESPACE, "apply", pipeline.claim(name))

    async def all_ready() -> bool:
        for name in names:
            view = (await api.claims(pipeline.NAMESPACE, "get", {"name": name}))["claim"]
            if view["phase"] != "ready":
                return False
        return True

    await until(all_ready, "the claims to be ready")

    async def expiry(epoch: int) -> float:
        row = await until(
            lambda: db.fetchrow(
                "SELECT recorded_at FROM events WHERE stream = $1 AND type = "
                "'reclamation.node_lease_expired' AND (payload->>'epoch')::int = $2",
                f"lease:{node}",
                epoch,
            ),
            "the expiry",
        )
        renewed = await db.fetchval("SELECT renewed_at FROM node_leases WHERE node = $1", node)
        return float((row["recorded_at"] - renewed).total_seconds())  # type: ignore[index]

    agent.signal(signal.SIGSTOP)
    out["unknown"].append(await expiry(1))
    resumed = datetime.datetime.now(datetime.UTC)
    agent.signal(signal.SIGCONT)

    async def confirmed() -> datetime.datetime | None:
        rows = await db.fetch(
            "SELECT recorded_at FROM events WHERE stream = $1 AND type = "
            "'reclamation.share_confirmed' ORDER BY position",
            f"node:{node}",
        )
        return rows[-1]["recorded_at"] if len(rows) >= claims else None

    last = await until(confirmed, "the confirmations")
    out["confirm"].append((last - resumed).total_seconds())  # type: ignore[operator]

    agent.signal(signal.SIGSTOP)
    out["unknown"].append(await expiry(2))
    asked = time.monotonic()
    await api.admin("nodes.fence", {"node": node, "reason": "recovery benchmark"})
    out["fence"].append(time.monotonic() - asked)
    held = await db.fetchval("SELECT count(*) FROM held_shares WHERE node = $1", node)
    if held:
        raise RuntimeError(f"{held} share(s) of {node} still held after the fence")
    await agent.kill()
    return out


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def main(args: argparse.Namespace) -> None:
    pipeline_args = argparse.Namespace(
        admin_url=args.admin_url, nats=args.nats, embedded=False, keep=args.keep, pool=10
    )
    samples: dict[str, list[float]] = {"unknown": [], "confirm": [], "fence": []}
    async with pipeline.fresh_database(pipeline_args) as settings:
        names = BusNames(prefix=f"rec{uuid.uuid4().hex[:8]}")
        with tempfile.TemporaryDirectory(prefix="dracap-recovery-") as work:
            up = argparse.Namespace(nodes=0, workers=1, pool=10, insecure=True, up_log=None)
            async with pipeline.dracap_up(settings, up, names, Path(work)):
                db = await asyncpg.connect(settings.database_url)
                try:
                    async with ApiClient.connect(settings.nats_url, names.prefix) as api:
                        for run in range(args.runs):
                            node = f"rec-{run}"
                            log = Path(work) / f"agent-{node}.log"
                            agent = Agent(settings, names, node, args.ttl, log)
                            try:
                                got = await one_run(api, db, agent, node, args.claims)
                            finally:
                                await agent.kill()
                            for key, values in got.items():
                                samples[key] += values
                            print(
                                f"  run {run + 1:>2}: unknown "
                                + ", ".join(f"{v:.2f}" for v in got["unknown"])
                                + f" s   confirm {got['confirm'][0]:.2f} s"
                                + f"   fence {got['fence'][0] * 1000:.0f} ms",
                                flush=True,
                            )
                finally:
                    await db.close()
        await pipeline._delete_stream(settings.nats_url, names.stream)
    report(samples, args)


def report(samples: dict[str, list[float]], args: argparse.Namespace) -> None:
    print(
        f"\nlease ttl {args.ttl:g} s (renewed every {args.ttl / 3:.2f} s), reclamation poll "
        f"0.25 s, {args.runs} runs, {args.claims} shares per node:"
    )
    goals = {
        "unknown": ("last heartbeat -> Unknown", args.ttl + 1.0),
        "fence": ("fence -> capacity released", 1.0),
        "confirm": ("agent return -> confirmed", 2.0),
    }
    for key, (label, goal) in goals.items():
        values = samples[key]
        p50, p99, worst = percentile(values, 50), percentile(values, 99), max(values)
        verdict = "met" if p99 <= goal else "NOT met"
        print(
            f"  {label:<28} p50 {p50:6.3f} s  p99 {p99:6.3f} s  max {worst:6.3f} s"
            f"  (n={len(values)}; goal <= {goal:g} s: {verdict})"
        )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="nodes lost, one per run")
    parser.add_argument("--ttl", type=float, default=2.0, help="the agents' lease ttl (s)")
    parser.add_argument("--claims", type=int, default=2, help="shares per node")
    parser.add_argument(
        "--keep", action="store_true", help="keep the benchmark database (for dracap report)"
    )
    pipeline.add_server_arguments(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    stopping.run("recovery", main(parse()))
