"""``dracap replay verify [--from-start]``: check invariant 8 against the live database.

Exit status 0 when the fold of the log equals the projections, 1 (the CLI's
"invariant violated") otherwise; the summary names the first violating position.
"""

from __future__ import annotations

import argparse
import asyncio

from services.replay.verify import summary, verify
from services.runtime.settings import load_settings

EXIT_OK = 0
EXIT_VIOLATION = 1


def _verify(args: argparse.Namespace) -> int:
    report = asyncio.run(verify(load_settings(), from_start=args.from_start))
    print(summary(report))
    return EXIT_OK if report.ok else EXIT_VIOLATION


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``replay`` noun and its ``verify`` verb to the CLI."""
    replay = subparsers.add_parser("replay", help="replay the event log")
    verbs = replay.add_subparsers(dest="replay_verb", required=True)
    check = verbs.add_parser("verify", help="fold the log and compare it with the projections")
    check.add_argument(
        "--from-start",
        action="store_true",
        help="fold from position 0 instead of the newest snapshot",
    )
    check.set_defaults(func=_verify)
