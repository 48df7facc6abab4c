"""Allocator decisions per second and latency per decision.

Inventory: N shareable GPUs (40Gi, policy min 5Gi step 5Gi), 128 per ResourceSlice,
reachable from every node. Before measuring, shares of 5Gi are placed on random
devices until the wanted fraction of all capacity is allocated (random placement
fragments free space like a long-running cluster does; first-fit filling would put
all free space at the end, which is the easy case for any index).

A decision is one ``Allocator.allocate`` call for a claim asking for 5Gi or 10Gi
(randomly). Each granted allocation is committed and released again outside the
timed region, so the fill level stays put and the incremental index updates are
exercised on every round. The first decision of a run builds the candidate list
(all CEL selectors run once per device); it is reported as "index build" and not
counted among the decisions.

Run:  python benchmarks/allocator.py [--devices 1000 10000] [--decisions 20000]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from events import model
from events.inventory import Inventory
from events.quantities import Quantity
from services.reservation.allocating import Allocator
from services.reservation.outcomes import Allocated, Grant

DRIVER = "gpu.bench.io"
GI = 1024**3


def build_inventory(n: int) -> Inventory:
    cls = model.convert(
        {
            "apiVersion": model.API_VERSION,
            "kind": "DeviceClass",
            "metadata": {"name": "gpu-memory"},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
        },
        model.DeviceClass,
    )
    slices = []
    for s in range(0, n, 128):
        devices = [
            {
                "name": f"gpu-{i}",
                "allowMultipleAllocations": True,
                "attributes": {"index": {"int": i}},
                "capacity": {
                    "memory": {
                        "value": "40Gi",
                        "requestPolicy": {
                            "default": "5Gi",
                            "validRange": {"min": "5Gi", "step": "5Gi", "max": "40Gi"},
                        },
                    }
                },
            }
            for i in range(s, min(n, s + 128))
        ]
        slices.append(
            model.convert(
                {
                    "apiVersion": model.API_VERSION,
                    "kind": "ResourceSlice",
                    "metadata": {"name": f"slice-{s // 128}"},
                    "spec": {
                        "driver": DRIVER,
                        "allNodes": True,
                        "pool": {
                            "name": "pool",
                            "generation": 1,
                            "resourceSliceCount": (n + 127) // 128,
                        },
                        "devices": devices,
                    },
                },
                model.ResourceSlice,
            )
        )
    return Inventory([cls], slices)


def make_claim(i: int, amount: str) -> model.ResourceClaim:
    return model.convert(
        {
            "apiVersion": model.API_VERSION,
            "kind": "ResourceClaim",
            "metadata": {"name": f"c{i}", "namespace": "bench"},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": "gpu-memory",
                                "capacity": {"requests": {"memory": amount}},
                            },
                        }
                    ]
                }
            },
        },
        model.ResourceClaim,
    )


def fill(alloc: Allocator, inventory: Inventory, fraction: float, rng: random.Random) -> None:
    total = len(inventory.devices) * 40 * GI
    target = int(total * fraction)
    five = Quantity(5 * GI * 10**9)
    used = 0
    free = {d.key: 40 * GI for d in inventory.devices}
    keys = list(free)
    grants = []
    while used + 5 * GI <= target:
        key = keys[rng.randrange(len(keys))]
        if free[key] < 5 * GI:
            continue
        free[key] -= 5 * GI
        used += 5 * GI
        grants.append(
            Grant(
                request="gpu",
                device=key,
                share_id=f"fill-{len(grants)}",
                admin_access=False,
                consumed={"memory": five},
            )
        )
    alloc.add_grants(grants)


def run(
    n: int, fraction: float, decisions: int, amounts: list[str], seed: int = 1
) -> dict[str, float]:
    rng = random.Random(seed)
    inventory = build_inventory(n)
    alloc = Allocator(inventory, new_share_id=lambda: "00000000-0000-4000-8000-000000000000")
    fill(alloc, inventory, fraction, rng)
    claims = [make_claim(i, rng.choice(amounts)) for i in range(64)]
    t0 = time.perf_counter()
    alloc.allocate(claims[0], node="node-0")
    build = time.perf_counter() - t0
    gc.collect()
    gc.freeze()  # the inventory is long-lived: keep the collector off it, as a service would
    latencies = []
    allocated = 0
    clock = time.perf_counter_ns
    for i in range(decisions):
        c = claims[i % len(claims)]
        start = clock()
        out = alloc.allocate(c, node="node-0")
        latencies.append(clock() - start)
        if isinstance(out, Allocated):
            allocated += 1
            alloc.commit(out)
            alloc.release(out)
    gc.unfreeze()
    total_s = sum(latencies) / 1e9
    latencies.sort()
    return {
        "devices": n,
        "fill": fraction,
        "build_s": build,
        "per_s": decisions / total_s,
        "p50_us": latencies[len(latencies) // 2] / 1e3,
        "p99_us": latencies[int(len(latencies) * 0.99)] / 1e3,
        "mean_us": statistics.fmean(latencies) / 1e3,
        "allocated": allocated / decisions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--fills", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    parser.add_argument("--decisions", type=int, default=20000)
    parser.add_argument("--amounts", nargs="+", default=["5Gi", "10Gi"], help="request sizes")
    args = parser.parse_args()
    print(
        f"{'devices':>8} {'full':>5} {'index build':>12} {'decisions/s':>12} "
        f"{'p50 µs':>8} {'p99 µs':>8} {'granted':>8}"
    )
    for n in args.devices:
        base = None
        for fraction in args.fills:
            r = run(n, fraction, args.decisions, args.amounts)
            base = base or r["mean_us"]
            print(
                f"{n:>8} {fraction:>5.0%} {r['build_s']:>11.2f}s {r['per_s']:>12,.0f} "
                f"{r['p50_us']:>8.1f} {r['p99_us']:>8.1f} {r['allocated']:>8.0%}"
                f"   cost vs empty: {r['mean_us'] / base:.2f}x"
            )


if __name__ == "__main__":
    main()
