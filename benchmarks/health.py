"""What a service process's health checks cost: one round, and one ``/readyz``.

Every service process runs a round of its checks every 0.5 s
(:mod:`services.runtime.ops.health`); this measures, against the real PostgreSQL and
nats-server, the round of the heaviest process (``postgres``: ``SELECT 1`` on the
check's own connection; ``nats``: a flush; ``state``: in memory) and an HTTP GET of
``/readyz`` answered from the last round (no probing on request). Times are wall
clock, the median and the 99th percentile of ``--rounds``.

Run:  python -m benchmarks.health --database-url URL --nats URL [--rounds 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import urllib.request

from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground.metrics import start_metrics_server
from services.runtime.ops.health import (
    HealthMonitor,
    PostgresProbe,
    bus_probe,
    serve,
)


def _quantiles(samples: list[float]) -> str:
    cuts = statistics.quantiles(samples, n=100)
    return f"p50 {statistics.median(samples) * 1e3:.3f} ms, p99 {cuts[98] * 1e3:.3f} ms"


def _gets(url: str, count: int) -> list[float]:
    """``count`` GETs of ``url``, each timed."""
    out: list[float] = []
    for _ in range(count):
        start = time.perf_counter()
        with urllib.request.urlopen(url, timeout=5) as reply:
            reply.read()
        out.append(time.perf_counter() - start)
    return out


async def _main(args: argparse.Namespace) -> None:
    nc, _ = await connect_bus(args.nats)
    postgres = PostgresProbe(args.database_url)

    async def state() -> str | None:  # what live_probe costs: attribute reads
        return None

    monitor = HealthMonitor(["postgres", "nats", "state"])
    monitor.register("postgres", postgres)
    monitor.register("nats", bus_probe(nc))
    monitor.register("state", state)
    server, _ = start_metrics_server(0, addr="127.0.0.1")
    serve(server, monitor)
    try:
        rounds: list[float] = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            await monitor.check_once()
            rounds.append(time.perf_counter() - start)
        url = f"http://127.0.0.1:{server.server_port}/readyz"
        gets = await asyncio.to_thread(_gets, url, args.rounds)
    finally:
        server.shutdown()
        server.server_close()
        await postgres.close()
        await nc.close()
    print(f"a round of checks (postgres, nats, state): {_quantiles(rounds)}")
    print(f"GET /readyz (from the last round):          {_quantiles(gets)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--rounds", type=int, default=2000)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
