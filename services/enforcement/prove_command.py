"""``dracap prove bandwidth``: show, on this machine, that bandwidth shares hold.

It builds two network namespaces joined by a veth pair, gets ShareIDs and amounts from
the allocator (one claim per rate on a device whose ``bandwidth`` is twice their sum),
applies them with the tc enforcer on the sender's veth, measures each share alone
(baseline) and then all of them at once next to an unclassified saturating neighbour
and a latency probe in its own 10 Mbit/s class, and times ten ``apply`` calls that
change a live share's rate. Rates are Kubernetes quantities in bits per second
(``10M`` = 10^7 bit/s). Needs root (CAP_NET_ADMIN); see
:mod:`services.enforcement.proving` for the method and ``docs/enforcement-tc.md`` for
figures.

Exit codes: 0 — every share within 3 % of its rate over the window and no share pushed
below its rate by a neighbour; 1 — a goal missed; 2 — bad input or no CAP_NET_ADMIN.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import msgspec

from events.errors import QuantityError
from events.quantities import Quantity
from services.enforcement.proving import ProofReport, have_net_admin, prove_bandwidth

EXIT_OK = 0
EXIT_MISSED = 1
EXIT_BAD_INPUT = 2
ACCURACY_GOAL = 0.03


def _mbit(bits: float) -> str:
    return f"{bits / 1e6:,.2f}"


def table(report: ProofReport) -> str:
    """The report as a text table."""
    head = (
        f"{'share':<10} {'rate':>8} {'alone':>9} {'loaded':>9} {'acc':>7} {'worst s':>8} "
        f"{'1st s':>6} {'kernel':>9} {'drops':>6} {'interf':>7} {'below':>5}"
    )
    lines = [f"allocation: {report.allocation}; window {report.duration:g} s (Mbit/s)", head]
    for s in report.shares:
        lines.append(
            f"{s.share_id[:8]:<10} {_mbit(s.configured):>8} {_mbit(s.alone):>9} "
            f"{_mbit(s.achieved):>9} {s.accuracy:>+7.2%} {s.worst_second:>8.2%} "
            f"{s.first_second:>6.2f} {_mbit(s.kernel_rate):>9} {s.drops:>6} "
            f"{s.interference:>+7.2%} {'yes' if s.pushed_below else 'no':>5}"
        )
    p50 = f"{report.probe_p50_ms:.2f}" if report.probe_p50_ms is not None else "-"
    p99 = f"{report.probe_p99_ms:.2f}" if report.probe_p99_ms is not None else "-"
    ms = sorted(report.apply_change_ms)
    lines.append(
        f"probe ({_mbit(report.probe_rate)} Mbit/s class, {report.probe_samples} round trips): "
        f"p50 {p50} ms, p99 {p99} ms"
    )
    lines.append(f"unclassified neighbour (default class): {_mbit(report.aggressor_rate)} Mbit/s")
    if ms:
        lines.append(
            f"apply of a rate change: median {ms[len(ms) // 2]:.1f} ms, max {ms[-1]:.1f} ms"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``dracap prove bandwidth``."""
    try:
        rates = [Quantity.parse(r.strip()) for r in args.rates.split(",") if r.strip()]
    except QuantityError as exc:
        print(f"error: --rates: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not rates or any(r.sign() <= 0 for r in rates) or args.duration < 2:
        print("error: need positive --rates and --duration >= 2", file=sys.stderr)
        return EXIT_BAD_INPUT
    why = have_net_admin()
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return EXIT_BAD_INPUT
    report = asyncio.run(
        prove_bandwidth(rates, duration=args.duration, aggressor=not args.no_neighbour)
    )
    if args.output == "json":
        print(msgspec.json.format(msgspec.json.encode(report).decode(), indent=2))
    else:
        print(table(report))
    ok = all(abs(s.accuracy) <= ACCURACY_GOAL and not s.pushed_below for s in report.shares)
    return EXIT_OK if ok else EXIT_MISSED


def register(sub: Any) -> None:
    """Add ``dracap prove bandwidth`` to the command line."""
    prove = sub.add_parser("prove", help="prove on this machine that limits hold")
    verbs = prove.add_subparsers(dest="what", metavar="WHAT", required=True)
    parser = verbs.add_parser(
        "bandwidth",
        help="measure tc bandwidth shares in network namespaces (needs root)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument(
        "--rates", default="10M,100M,1G", help="share rates in bit/s (default: 10M,100M,1G)"
    )
    parser.add_argument(
        "--duration", type=float, default=10.0, help="measurement window in s (default: 10)"
    )
    parser.add_argument(
        "--no-neighbour", action="store_true", help="no unclassified saturating neighbour"
    )
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    parser.set_defaults(func=run)
