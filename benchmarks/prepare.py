"""Kubelet prepare latency of the node agent in Kubernetes mode (tc enforcer, in a netns).

The system under test is the one of ``tests/integration/test_kubernetes.py``
(:class:`tests.fixtures.kubernetes.Cluster`): the API-server stand-in, the relay and the
Kubernetes bridge in-process, ``dracap agent --enforcer tc --kubelet-plugin`` as its own
process on a veth whose peer lives in a fresh network namespace, on a fresh database.
This benchmark plays kube-scheduler and the kubelet. For each run it allocates a claim
(one share of 50M), waits until the bridge has mirrored it into the log, then, over the
real gRPC Unix socket:

* **prepare**: ``NodePrepareResources`` of the new claim — read the ResourceClaim from
  the API server, check its UID, apply the HTB class, record ``LimitApplied`` in the log,
  write the CDI spec — the time the kubelet waits before it can start the containers;
* **prepare again**: the same call repeated (a kubelet restart): idempotent, nothing
  applied;
* **unprepare**: ``NodeUnprepareResources``: the class removed, ``LimitRemoved`` recorded
  (the capacity stays held until Kubernetes deallocates the claim, which the benchmark
  then does, untimed).

Then, for each ``--parallel`` N, ``--rounds`` times: N claims allocated and mirrored, N
``NodePrepareResources`` calls of one claim each at once (as the kubelet makes them for
Pods starting together), then N unprepares at once; each call's latency, and how many
failed at the first call (the kubelet would retry them).

Reported as p50 / p99 / max, against the kubelet's 45 s timeout and the 10-25 ms the
upstream example driver is quoted at. Needs CAP_NET_ADMIN (root).

Usage::

    .venv/bin/python -m benchmarks.prepare --runs 100 --parallel 8,32 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks import pipeline, stopping
from events.state import ClusterState
from services.runtime.kubeletplugin import ClaimRef
from tests.fixtures.k8s_standin import StandinApiServer
from tests.fixtures.kubernetes import NAMESPACE, Cluster, running

KUBELET_TIMEOUT_S = 45.0
#: Each claim's share (and the class policy's step): 32 of them fit the 10G device.
SHARE = "50M"


def mirrored(*names: str) -> Callable[[ClusterState], bool]:
    def check(state: ClusterState) -> bool:
        claims = [state.claim(NAMESPACE, name) for name in names]
        return all(c is not None and c.phase == "allocated" for c in claims)

    return check


def withdrawn(*names: str) -> Callable[[ClusterState], bool]:
    def check(state: ClusterState) -> bool:
        claims = [state.claim(NAMESPACE, name) for name in names]
        return all(c is not None and c.phase == "withdrawn" for c in claims)

    return check


Samples = dict[str, list[float]]


async def _timed(call: Callable[[], Awaitable[Any]], ref: ClaimRef) -> tuple[float, bool]:
    """One kubelet call's latency, and whether it succeeded at the first try."""
    start = time.perf_counter()
    answer = await call()
    took = time.perf_counter() - start
    outcome = answer[ref.uid]
    error = getattr(outcome, "error", outcome)
    return took, not error


async def _allocate(cluster: Cluster, names: list[str]) -> list[ClaimRef]:
    refs = []
    for name in names:
        rc = await cluster.allocate(name, SHARE, consumers=("pod",))
        refs.append(ClaimRef(namespace=NAMESPACE, name=name, uid=rc.metadata.uid or ""))
    await cluster.until(mirrored(*names), f"{len(names)} claim(s) mirrored")
    return refs


async def _deallocate(cluster: Cluster, names: list[str]) -> None:
    """Kubernetes deallocates (the capacity comes back only then)."""
    for name in names:
        await cluster.set_status(
            name, lambda _: {"allocation": None, "reservedFor": None, "devices": None}
        )
    await cluster.until(withdrawn(*names), f"{len(names)} claim(s) withdrawn")


async def main(args: argparse.Namespace) -> tuple[Samples, dict[int, Samples], dict[str, int]]:
    """Sequential samples, per parallelism the samples, and the calls that failed."""
    pipeline_args = argparse.Namespace(
        admin_url=args.admin_url, nats=args.nats, embedded=False, keep=False, pool=4
    )
    samples: Samples = {"prepare": [], "again": [], "unprepare": []}
    batches: dict[int, Samples] = {}
    failed: dict[str, int] = {}
    async with pipeline.fresh_database(pipeline_args) as settings:
        with tempfile.TemporaryDirectory(prefix="dracap-prepare-") as work:
            async with StandinApiServer(history_limit=100_000) as standin:
                cluster = Cluster(
                    settings, args.nats, Path(work), standin, bandwidth="10G", step=SHARE
                )
                async with running(cluster):
                    kubelet = await cluster.kubelet()
                    for i in range(args.runs):
                        name = f"bench-{i}"
                        [ref] = await _allocate(cluster, [name])
                        for key, call in (
                            ("prepare", kubelet.prepare),
                            ("again", kubelet.prepare),
                            ("unprepare", kubelet.unprepare),
                        ):
                            took, ok = await _timed(lambda call=call, ref=ref: call([ref]), ref)
                            samples[key].append(took)
                            failed[key] = failed.get(key, 0) + (not ok)
                        await _deallocate(cluster, [name])
                    for parallel in args.parallel:
                        got: Samples = batches.setdefault(
                            parallel, {"prepare": [], "unprepare": []}
                        )
                        for r in range(args.rounds):
                            names = [f"p{parallel}-{r}-{i}" for i in range(parallel)]
                            refs = await _allocate(cluster, names)
                            for key, verb in (
                                ("prepare", kubelet.prepare),
                                ("unprepare", kubelet.unprepare),
                            ):
                                label = f"{parallel} {key}s"
                                outcomes = await asyncio.gather(
                                    *(
                                        _timed(lambda ref=ref, verb=verb: verb([ref]), ref)
                                        for ref in refs
                                    )
                                )
                                got[key] += [took for took, _ in outcomes]
                                failed[label] = failed.get(label, 0) + sum(
                                    not ok for _, ok in outcomes
                                )
                            await _deallocate(cluster, names)
                    await kubelet.close()
    return samples, batches, failed


def _line(label: str, values: list[float], failed: int) -> str:
    p50, p99 = pipeline.percentile(values, 50) * 1000, pipeline.percentile(values, 99) * 1000
    worst = max(values) * 1000
    return (
        f"  {label:<30} p50 {p50:8.2f} ms  p99 {p99:8.2f} ms  max {worst:8.2f} ms"
        f"  failed at the first call: {failed}/{len(values)}"
    )


def report(
    results: tuple[Samples, dict[int, Samples], dict[str, int]], args: argparse.Namespace
) -> None:
    samples, batches, failed = results
    print(
        f"\nkubelet calls over the agent's Unix socket, tc enforcer, {args.runs} claims "
        f"(kubelet timeout {KUBELET_TIMEOUT_S:g} s; upstream's example driver 10-25 ms):"
    )
    labels = {
        "prepare": "prepare (limit applied)",
        "again": "prepare again (idempotent)",
        "unprepare": "unprepare (limit removed)",
    }
    for key, label in labels.items():
        print(_line(label, samples[key], failed.get(key, 0)))
    for parallel, got in batches.items():
        print(f"{parallel} parallel calls, {args.rounds} round(s), each call's latency:")
        for key in ("prepare", "unprepare"):
            label = f"{parallel} {key}s"
            print(_line(label, got[key], failed.get(label, 0)))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="claims prepared, one per run")
    parser.add_argument(
        "--parallel",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[8, 32],
        help="parallel calls of distinct claims on the node, comma-separated (default 8,32)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each parallelism")
    pipeline.add_server_arguments(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    report(stopping.run("prepare", main(arguments)), arguments)
