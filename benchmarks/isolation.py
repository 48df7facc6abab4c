"""One tenant's expensive selectors against another tenant's apply -> Ready time.

Invariant 11 says no tenant can stall another. This benchmark measures it on ``dracap
up`` itself (started as its own process, as in :mod:`benchmarks.pipeline`, whose
inventory, tracker and helpers it reuses):

1. **unloaded**: tenant ``bench`` applies claims open-loop at ``--rate`` claims/s for
   ``--seconds``; apply -> Ready per claim, p50 / p99;
2. **loaded**: tenant ``noisy`` first applies ``--noisy`` claims whose selector costs
   just under the limit of 1,000,000 units (each a different expression, so nothing is
   memoised: tens of seconds of cel-python per device, evaluated in the selector
   pool), then ``bench`` runs the same open loop again while those are evaluated.

Goal: loaded p50 and p99 within 2x the unloaded ones.

Usage::

    .venv/bin/python -m benchmarks.isolation --rate 50 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import tempfile
import uuid
from pathlib import Path

from benchmarks import pipeline
from events.subjects import BusNames
from services.runtime.apiclient import ApiClient
from services.runtime.gctuning import tune_for_long_lived_state
from services.runtime.settings import Settings

NOISY = "noisy"


def expensive_claim(i: int) -> bytes:
    """A claim of ``noisy`` whose selector costs just under the limit (distinct per ``i``)."""
    items = "[" + ",".join(str(n) for n in range(1, 371)) + "]"
    expression = f"{items}.all(x, {items}.all(y, x*y >= -{i}))"
    request = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": pipeline.CLASS,
            "capacity": {"requests": {"memory": "1Gi"}},
            "selectors": [{"cel": {"expression": expression}}],
        },
    }
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": f"expensive-{i}", "namespace": NOISY},
        "spec": {"devices": {"requests": [request]}},
    }
    return json.dumps(body).encode()


async def run(settings: Settings, args: argparse.Namespace) -> dict[str, float]:
    names = BusNames(prefix=f"bench{uuid.uuid4().hex[:8]}")
    out: dict[str, float] = {}
    tenants = (pipeline.NAMESPACE, NOISY)
    try:
        with tempfile.TemporaryDirectory(prefix="dracap-bench-") as work:
            async with (
                pipeline.dracap_up(settings, args, names, Path(work), tenants) as reach,
                ApiClient.connect(reach.nats_url, names.prefix, reach.credential) as api,
            ):
                tracker = pipeline.ReadyTracker()
                async with pipeline.watching(api, tracker):
                    await pipeline.throughput(api, tracker, 50, 8, "warm")
                    await _phase(api, tracker, args, "unloaded", out)
                    for i in range(args.noisy):
                        reply = await api.claims(NOISY, "apply", expensive_claim(i))
                        assert reply["ok"], reply
                    await asyncio.sleep(3.0)  # the worker has started and taken the first job
                    await _phase(api, tracker, args, "loaded", out)
                    states = [
                        (await api.claims(NOISY, "get", {"name": f"expensive-{i}"}))["claim"]
                        for i in range(args.noisy)
                    ]
                    out["noisy_undecided"] = sum(s["phase"] == "admitted" for s in states)
    finally:
        if args.insecure:  # a secure run's nats-server went with its data directory
            with contextlib.suppress(Exception):
                await pipeline._delete_stream(settings.nats_url, names.stream)
    return out


async def _phase(
    api: ApiClient,
    tracker: pipeline.ReadyTracker,
    args: argparse.Namespace,
    label: str,
    out: dict[str, float],
) -> None:
    latencies = await pipeline.latency(api, tracker, args.rate, args.seconds, label)
    p50, p99 = pipeline.percentile(latencies, 50), pipeline.percentile(latencies, 99)
    out[f"{label}_p50"], out[f"{label}_p99"] = p50, p99
    print(
        f"  {label:<9} {len(latencies)} claims: p50 {p50:6.1f} ms   p99 {p99:6.1f} ms", flush=True
    )


async def main(args: argparse.Namespace) -> None:
    gc.freeze()
    tune_for_long_lived_state()
    async with pipeline.fresh_database(args) as settings:
        print(f"database {settings.database_url.rsplit('/', 1)[1]}:", flush=True)
        r = await run(settings, args)
    print("\nratios, loaded / unloaded (goal: <= 2):")
    p50, p99 = r["loaded_p50"] / r["unloaded_p50"], r["loaded_p99"] / r["unloaded_p99"]
    print(f"  p50 {p50:.2f}x   p99 {p99:.2f}x")
    print(f"  expensive claims still being evaluated at the end: {r['noisy_undecided']:.0f}")


def cli() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=50.0, help="bench's claims/s")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--noisy", type=int, default=4, help="expensive claims of the noisy tenant")
    parser.add_argument("--nodes", type=int, default=2, help="nodes (one agent each)")
    parser.add_argument("--embedded", action="store_true", help="start embedded servers instead")
    own, rest = parser.parse_known_args()
    args = pipeline.parse([*rest, "--nodes", str(own.nodes), "--seconds", str(own.seconds)])
    args.rate, args.noisy, args.embedded = own.rate, own.noisy, own.embedded
    return args


if __name__ == "__main__":
    asyncio.run(main(cli()))
