"""Kubelet prepare latency of the node agent in Kubernetes mode (tc enforcer, in a netns).

The system under test is the one of ``tests/integration/test_kubernetes.py``
(:class:`tests.fixtures.kubernetes.Cluster`): the API-server stand-in, the relay and the
Kubernetes bridge in-process, ``dracap agent --enforcer tc --kubelet-plugin`` as its own
process on a veth whose peer lives in a fresh network namespace, on a fresh database.
This benchmark plays kube-scheduler and the kubelet. For each run it allocates a claim
(one share of 100M), waits until the bridge has mirrored it into the log, then, over the
real gRPC Unix socket:

* **prepare**: ``NodePrepareResources`` of the new claim — read the ResourceClaim from
  the API server, check its UID, apply the HTB class, record ``LimitApplied`` in the log,
  write the CDI spec — the time the kubelet waits before it can start the containers;
* **prepare again**: the same call repeated (a kubelet restart): idempotent, nothing
  applied;
* **unprepare**: ``NodeUnprepareResources``: the class removed, the capacity released
  in the log.

Reported as p50 / p99 / max over the runs, against the kubelet's 45 s timeout and the
10-25 ms the upstream example driver is quoted at. Needs CAP_NET_ADMIN (root).

Usage::

    .venv/bin/python -m benchmarks.prepare --runs 200
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import pipeline
from events.fold import ClusterState
from services.runtime.kubeletplugin import ClaimRef
from tests.fixtures.k8s_standin import StandinApiServer
from tests.fixtures.kubernetes import NAMESPACE, Cluster

KUBELET_TIMEOUT_S = 45.0


def mirrored(name: str) -> Callable[[ClusterState], bool]:
    def check(state: ClusterState) -> bool:
        claim = state.claim(NAMESPACE, name)
        return claim is not None and claim.phase == "allocated"

    return check


async def main(args: argparse.Namespace) -> dict[str, list[float]]:
    pipeline_args = argparse.Namespace(
        admin_url=args.admin_url, nats=args.nats, embedded=False, keep=False, pool=4
    )
    samples: dict[str, list[float]] = {"prepare": [], "again": [], "unprepare": []}
    async with pipeline.fresh_database(pipeline_args) as settings:
        with tempfile.TemporaryDirectory(prefix="dracap-prepare-") as work:
            async with StandinApiServer(history_limit=100_000) as standin:
                cluster = Cluster(settings, args.nats, Path(work), standin)
                try:
                    cluster.make_link()
                    cluster.write_files()
                    await cluster.start()
                    cluster.start_agent()
                    await cluster.bridge.synced.wait()
                    kubelet = await cluster.kubelet()
                    for i in range(args.runs):
                        name = f"bench-{i}"
                        rc = await cluster.allocate(name, "100M", consumers=("pod",))
                        await cluster.until(mirrored(name), f"{name} mirrored")
                        ref = ClaimRef(namespace=NAMESPACE, name=name, uid=rc.metadata.uid or "")
                        for key, call in (
                            ("prepare", kubelet.prepare),
                            ("again", kubelet.prepare),
                            ("unprepare", kubelet.unprepare),
                        ):
                            start = time.perf_counter()
                            answer = await call([ref])
                            samples[key].append(time.perf_counter() - start)
                            error = getattr(answer[ref.uid], "error", answer[ref.uid])
                            assert not error, f"{key} of {name}: {error}"
                    await kubelet.close()
                finally:
                    await cluster.close()
                    cluster.remove_link()
    return samples


def report(samples: dict[str, list[float]], args: argparse.Namespace) -> None:
    print(f"\nkubelet calls over the agent's Unix socket, tc enforcer, {args.runs} claims:")
    labels = {
        "prepare": "prepare (limit applied)",
        "again": "prepare again (idempotent)",
        "unprepare": "unprepare (limit removed)",
    }
    for key, label in labels.items():
        values = samples[key]
        p50, p99 = pipeline.percentile(values, 50) * 1000, pipeline.percentile(values, 99) * 1000
        worst = max(values) * 1000
        print(
            f"  {label:<28} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  max {worst:7.2f} ms"
            f"  (kubelet timeout {KUBELET_TIMEOUT_S:g} s; example driver 10-25 ms)"
        )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="claims prepared, one per run")
    pipeline.add_server_arguments(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    report(asyncio.run(main(arguments)), arguments)
