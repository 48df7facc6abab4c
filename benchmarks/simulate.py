"""Simulated claims per second of ``dracap simulate``: 100,000 claims over 1,000 devices.

The trace is the synthetic one of ``dracap simulate`` (sizes 4Gi:30, 8Gi:25, 10Gi:15,
16Gi:15, 20Gi:10, 40Gi:5; Poisson arrivals at 1.2x the fleet's capacity; exponential
durations of mean 3,600 s; seed 1), the fleet 1,000 devices of 40Gi, refused claims
waiting up to 600 s. A run is one :func:`services.planning.simulating.simulate` call
(building the inventory included, the search for devices needed not); claims per
second is the trace's claims over the run's wall time. Every decision is a real
``Allocator.allocate`` (plus commit and release). Goal: >= 20,000 claims/s.

Run:  python benchmarks/simulate.py [--claims 100000] [--devices 1000] [--modes ...]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from events.tenancy import PLACEMENTS
from services.commands.plan import DEFAULT_SIZES, fleets_of
from services.planning.fleets import parse_mode
from services.planning.simulating import Options, simulate
from services.planning.traces import SyntheticSpec, parse_sizes, rate_for_load, synthetic

GI = 1024**3
GOAL = 20_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=100_000)
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--modes", default="consumable,whole-device,fixed-slices:10Gi")
    parser.add_argument("--policies", default=",".join(PLACEMENTS))
    args = parser.parse_args()
    capacity = 40 * GI
    sizes = parse_sizes(DEFAULT_SIZES)
    rate = rate_for_load(1.2, args.devices * capacity, sizes, 3600.0)
    trace = synthetic(SyntheticSpec(args.claims, sizes, rate, 3600.0, 1))
    modes = [parse_mode(m) for m in args.modes.split(",")]
    fleets = fleets_of(args.devices, capacity, modes, args.policies.split(","))
    print(f"{args.claims:,} claims over {args.devices:,} devices of 40Gi (load 1.2, wait 600 s)")
    print(f"{'mode/policy':<32} {'claims/s':>10} {'decisions':>10} {'µs/decision':>12} {'goal':>5}")
    for fleet in fleets:
        gc.collect()
        start = time.perf_counter()
        result = simulate(trace, fleet, Options(max_wait=600.0))
        elapsed = time.perf_counter() - start
        rate_s = args.claims / elapsed
        print(
            f"{fleet.label:<32} {rate_s:>10,.0f} {result.decisions:>10,} "
            f"{result.decision_us_mean:>12.1f} {'met' if rate_s >= GOAL else 'MISS':>5}"
        )


if __name__ == "__main__":
    main()
