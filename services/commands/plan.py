"""``dracap simulate`` and ``dracap plan`` (``docs/placement.md``).

``dracap simulate [--trace FILE | synthetic flags] [--devices 100] [--capacity 40Gi]
[--modes consumable,whole-device,fixed-slices:10Gi] [--policies first-fit,...|all]
[--max-wait 600] [--no-devices-needed] [--plot FILE.png] [-o table|json]`` runs one
simulation per mode and placement policy over the same trace, on the real allocator
(:mod:`services.planning.simulating`). A progress bar goes to stderr when it is a
terminal.

``dracap plan --devices 100 --capacity 40Gi --target-utilization 0.7 [--overhead 1Gi]
[--headroom-nodes 2] [--devices-per-node 8] [--trace FILE] [--policy P]`` prints the
capacity math step by step (:mod:`services.planning.capacity`); ``--live`` takes the
devices from a running control plane (the admin API's ``devices.list``) instead of
``--devices`` / ``--capacity``.

Bad input (a flag out of range, a trace line breaking a rule) is one line naming the
flag or the file, line and field, exit code 2, before anything is simulated.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Callable
from typing import Any, Final, TextIO

from events.errors import QuantityError
from events.tenancy import PLACEMENTS
from services.exitcodes import CommandError, ExitCode
from services.planning.capacity import CapacityPlan, plan_capacity
from services.planning.fleets import CONSUMABLE, Fleet, Mode, parse_mode
from services.planning.reporting import (
    SIM_HEADER,
    describe_trace,
    plan_table,
    result_rows,
    table,
    to_json,
    trace_summary,
)
from services.planning.simulating import Options, compare, simulate
from services.planning.traces import (
    SyntheticSpec,
    TraceClaim,
    format_bytes,
    load_trace,
    parse_bytes,
    parse_sizes,
    rate_for_load,
    synthetic,
    write_trace,
)
from services.runtime.bus.endpoints import add_endpoint_arguments, endpoints_from_args
from services.runtime.ground.outputs import check_out, written

__all__ = ["DEFAULT_SIZES", "register"]

#: the default synthetic size distribution (median 8Gi, a fifth of a 40Gi device)
DEFAULT_SIZES: Final = "4Gi:30,8Gi:25,10Gi:15,16Gi:15,20Gi:10,40Gi:5"
DEFAULT_MODES: Final = "consumable,whole-device,fixed-slices:10Gi"


def _bad(message: str) -> CommandError:
    return CommandError(message, ExitCode.BAD_INPUT)


def _quantity(flag: str, text: str) -> int:
    try:
        value = parse_bytes(text)
    except QuantityError as exc:
        raise _bad(f"{flag}: must be a quantity like 40Gi ({exc})") from None
    if value < 0:
        raise _bad(f"{flag}: must not be negative (got {text!r})")
    return value


def _seconds(flag: str, text: str | None) -> float | None:
    """Seconds > 0 (``>= 0`` for --max-wait), or ``None`` for ``inf`` / unset."""
    if text is None or text.strip().lower() in ("inf", "forever"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    low_ok = value >= 0 if flag == "--max-wait" else value > 0
    if not math.isfinite(value) or not low_ok:
        rule = ">= 0" if flag == "--max-wait" else "> 0"
        raise _bad(f"{flag}: must be a number of seconds {rule}, or inf (got {text!r})")
    return value


# --- progress -------------------------------------------------------------------------------


class _Progress:
    """A one-line bar on a terminal: run i of n, its label, and its arrivals done."""

    def __init__(self, stream: TextIO, runs: int) -> None:
        self.stream = stream
        self.runs = runs
        self.run = 0
        self.label = ""
        self.shown = 0.0

    def start(self, run: int, fleet: Fleet) -> None:
        self.run, self.label = run, fleet.label
        self.update(0, 1)

    def update(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.shown < 0.2:
            return
        self.shown = now
        width = 30
        filled = int(width * done / max(1, total))
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(
            f"\r[{bar}] {done / max(1, total):4.0%} run {self.run + 1}/{self.runs} {self.label:<32}"
        )
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\r" + " " * 90 + "\r")
        self.stream.flush()


# --- simulate -------------------------------------------------------------------------------


def _trace(args: argparse.Namespace, capacity_total: int) -> tuple[list[TraceClaim], str]:
    if args.trace:
        return load_trace(args.trace), args.trace
    if args.claims <= 0:
        raise _bad(f"--claims: must be a whole number > 0 (got {args.claims})")
    sizes = parse_sizes(args.sizes)
    duration = _seconds("--duration", args.duration)
    if args.rate is not None:
        if not math.isfinite(args.rate) or args.rate <= 0:
            raise _bad(f"--rate: must be claims per second > 0 (got {args.rate})")
        rate = args.rate
    elif duration is None:
        rate = 1.0
    else:
        if not math.isfinite(args.load) or args.load <= 0:
            raise _bad(f"--load: must be a number > 0 (got {args.load})")
        rate = rate_for_load(args.load, capacity_total, sizes, duration)
    spec = SyntheticSpec(args.claims, sizes, rate, duration, args.seed)
    claims = synthetic(spec)
    if args.save_trace:
        write_trace(claims, args.save_trace)
    load = "" if duration is None or args.rate is not None else f", load {args.load:g}"
    return claims, f"synthetic(seed {args.seed}{load})"


def fleets_of(devices: int, capacity: int, modes: list[Mode], policies: list[str]) -> list[Fleet]:
    """One fleet per mode, and per placement policy for the consumable mode."""
    fleets = []
    for mode in modes:
        for policy in policies if mode.kind == CONSUMABLE else [PLACEMENTS[0]]:
            fleets.append(Fleet(devices, capacity, mode, policy))
    return fleets


def _policies(text: str) -> list[str]:
    if text.strip() == "all":
        return list(PLACEMENTS)
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    for policy in chosen:
        if policy not in PLACEMENTS:
            raise _bad(f"--policies: {policy!r}: must be 'all' or of {', '.join(PLACEMENTS)}")
    if not chosen:
        raise _bad("--policies: name at least one policy")
    return chosen


def _simulate(args: argparse.Namespace) -> int:
    capacity = _quantity("--capacity", args.capacity)
    if args.devices <= 0:
        raise _bad(f"--devices: must be a whole number > 0 (got {args.devices})")
    modes = [parse_mode(m) for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise _bad("--modes: name at least one mode")
    fleets = fleets_of(args.devices, capacity, modes, _policies(args.policies))
    max_wait = _seconds("--max-wait", args.max_wait)
    if args.plot:  # before the run: a figure that cannot be written wastes it
        from services.planning.plotting import check_plotting

        check_plotting()
        check_out("--plot", args.plot, ".png")
    trace, source = _trace(args, args.devices * capacity)
    progress = _Progress(sys.stderr, len(fleets)) if sys.stderr.isatty() else None
    options = Options(
        max_wait=max_wait,
        samples=args.samples,
        progress=progress.update if progress is not None else None,
    )
    try:
        results = compare(
            trace,
            fleets,
            options,
            needed=args.devices_needed,
            on_run=progress.start if progress is not None else None,
        )
    finally:
        if progress is not None:
            progress.close()
    summary = trace_summary(trace, source)
    if args.plot:
        from services.planning.plotting import plot

        with written("--plot", args.plot):
            plot([(f"{source}", results)], args.plot)
    if args.output == "json":
        fleet = {"devices": args.devices, "capacity": capacity, "max_wait_s": max_wait}
        print(to_json({"trace": summary, "fleet": fleet, "results": results}))
    else:
        wait = "forever" if max_wait is None else f"{max_wait:g}s"
        print(describe_trace(summary))
        print(
            f"fleet: {args.devices} devices x {format_bytes(capacity)}; "
            f"a refused claim waits {wait}"
        )
        print(table(SIM_HEADER, result_rows(results)))
        if args.plot:
            print(f"plot: {args.plot}")
    return ExitCode.OK


# --- plan -----------------------------------------------------------------------------------


async def _live_devices(args: argparse.Namespace) -> tuple[list[tuple[str, int]], int]:
    """(node, total) of each device with capacity ``--capacity-name``, and what is in use."""
    from services.runtime.bus.apiclient import ApiClient

    endpoints = endpoints_from_args(args)
    async with ApiClient.connect(endpoints.nats(), endpoints.prefix, endpoints.credential()) as api:
        listed: list[dict[str, Any]] = (await api.admin("devices.list"))["devices"]
    devices, in_use = [], 0
    for d in listed:
        cap = d["capacity"].get(args.capacity_name)
        if cap is None:
            continue
        devices.append((d.get("node") or "(any node)", parse_bytes(cap["total"])))
        in_use += parse_bytes(cap["consumed"])
    if not devices:
        raise CommandError(
            f"--live: no device publishes the capacity {args.capacity_name!r}",
            ExitCode.NOT_FOUND,
        )
    return devices, in_use


def _plan(args: argparse.Namespace) -> int:
    target = args.target_utilization
    if not (math.isfinite(target) and 0 < target <= 1):
        raise _bad(f"--target-utilization: must be a number in (0, 1] (got {target})")
    overhead = _quantity("--overhead", args.overhead)
    if args.headroom_nodes < 0:
        raise _bad(f"--headroom-nodes: must be a whole number >= 0 (got {args.headroom_nodes})")
    if args.devices_per_node <= 0:
        raise _bad(f"--devices-per-node: must be a whole number > 0 (got {args.devices_per_node})")
    if args.policy not in PLACEMENTS:
        raise _bad(f"--policy: {args.policy!r}: must be one of {', '.join(PLACEMENTS)}")
    trace = load_trace(args.trace) if args.trace else None
    in_use: int | None = None
    if args.live:
        if args.devices is not None or args.capacity is not None:
            raise _bad("--live: takes the devices from the cluster; no --devices / --capacity")
        devices, in_use = asyncio.run(_live_devices(args))
    else:
        if args.devices is None or args.capacity is None:
            raise _bad("--devices and --capacity are required (or --live)")
        if args.devices <= 0:
            raise _bad(f"--devices: must be a whole number > 0 (got {args.devices})")
        capacity = _quantity("--capacity", args.capacity)
        if capacity == 0:
            raise _bad("--capacity: must be a quantity > 0")
        per = args.devices_per_node
        devices = [(f"node-{i // per}", capacity) for i in range(args.devices)]
    loss, source = None, ""
    if trace is not None:
        totals = sorted(total for _, total in devices)
        common = max(set(totals), key=lambda t: (totals.count(t), -t))
        if common <= overhead:
            raise _bad("--overhead: must be less than a device's capacity")
        fleet = Fleet(len(devices), common - overhead, Mode(CONSUMABLE), args.policy)
        result = simulate(trace, fleet, Options(samples=0))
        loss = (
            result.stranded_saturated
            if result.stranded_saturated is not None
            else result.stranded_mean
        )
        source = (
            f"stranded, simulating {args.trace} ({len(trace):,} claims) on "
            f"{len(devices)} x {format_bytes(common - overhead)}, {args.policy}"
        )
    plan: CapacityPlan = plan_capacity(
        devices,
        target=target,
        overhead=overhead,
        headroom_nodes=args.headroom_nodes,
        fragmentation=loss,
        fragmentation_source=source,
        in_use=in_use,
    )
    print(to_json(plan) if args.output == "json" else plan_table(plan))
    return ExitCode.OK


# --- registration ---------------------------------------------------------------------------


def _run(action: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return action(args)
        except KeyboardInterrupt:
            return ExitCode.ERROR

    return run


def register(sub: Any) -> None:
    sim = sub.add_parser("simulate")
    source = sim.add_argument_group("trace (a file, or a synthetic one)")
    source.add_argument("--trace", metavar="FILE", help="CSV or NDJSON trace (docs/placement.md)")
    source.add_argument("--claims", type=int, default=20000, help="synthetic: claims (20000)")
    source.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"synthetic: SIZE:WEIGHT,... ({DEFAULT_SIZES})"
    )
    source.add_argument(
        "--load",
        type=float,
        default=1.2,
        help="synthetic: demand as a multiple of the fleet's capacity, sets the rate (1.2)",
    )
    source.add_argument("--rate", type=float, help="synthetic: arrivals per second (not --load)")
    source.add_argument(
        "--duration",
        default="3600",
        help="synthetic: mean seconds a claim holds (exponential), or inf (3600)",
    )
    source.add_argument("--seed", type=int, default=1, help="synthetic: random seed (1)")
    source.add_argument("--save-trace", metavar="FILE", help="write the synthetic trace here")
    sim.add_argument("--devices", type=int, default=100, help="devices in the fleet (100)")
    sim.add_argument("--capacity", default="40Gi", help="capacity of each device (40Gi)")
    sim.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help=f"comma-separated: consumable, whole-device, fixed-slices:SIZE ({DEFAULT_MODES})",
    )
    sim.add_argument(
        "--policies",
        default="all",
        help=f"placement policies of the consumable mode: all or of {', '.join(PLACEMENTS)}",
    )
    sim.add_argument(
        "--max-wait",
        default="600",
        help="seconds a refused claim waits before it is rejected, or inf (600)",
    )
    sim.add_argument(
        "--no-devices-needed",
        dest="devices_needed",
        action="store_false",
        help="skip the search for the devices the trace needs (several runs more)",
    )
    sim.add_argument("--samples", type=int, default=200, help="points of the series (200)")
    sim.add_argument("--plot", metavar="FILE.png", help="write the comparison figure")
    sim.add_argument("-o", "--output", choices=("table", "json"), default="table")
    sim.set_defaults(func=_run(_simulate))

    plan = sub.add_parser("plan")
    plan.add_argument("--devices", type=int, help="devices in the fleet")
    plan.add_argument("--capacity", help="capacity of each device (a quantity, like 40Gi)")
    plan.add_argument(
        "--target-utilization", type=float, required=True, help="fraction to fill, like 0.7"
    )
    plan.add_argument("--overhead", default="0", help="driver overhead per device (0)")
    plan.add_argument("--headroom-nodes", type=int, default=0, help="nodes that may fail (0)")
    plan.add_argument(
        "--devices-per-node", type=int, default=8, help="devices per node, without --live (8)"
    )
    plan.add_argument("--trace", metavar="FILE", help="measure the fragmentation loss on it")
    plan.add_argument(
        "--policy", default=PLACEMENTS[0], help="placement policy of the simulated trace"
    )
    plan.add_argument("--live", action="store_true", help="the devices of a running cluster")
    plan.add_argument(
        "--capacity-name", default="memory", help="with --live: the capacity to plan (memory)"
    )
    plan.add_argument("-o", "--output", choices=("table", "json"), default="table")
    add_endpoint_arguments(plan, nats=True)
    plan.set_defaults(func=_run(_plan))
