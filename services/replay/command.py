"""``dracap replay verify [--from-start]``: check invariant 8 against the live database.

The database is found like every command finds its servers
(:mod:`services.runtime.endpoints`: ``--database-url``, else
``DRACAP_DATABASE_URL_READONLY`` — a user of ``dracap_readonly``, which can read and
nothing else —, else ``DRACAP_DATABASE_URL``, else ``<data-dir>/connection.json`` of
``dracap up``), so it verifies the log that
``dracap up`` writes. Exit status 0 when the fold of the log equals the projections,
5 (``ExitCode.INVARIANT_VIOLATED``) otherwise; the summary names the first violating
position. A database that cannot be reached, or has no dracap schema, is one line on
stderr and exit 1 (``ExitCode.ERROR``): not knowing is not a violation.
"""

from __future__ import annotations

import argparse
import asyncio

from services.exitcodes import ExitCode
from services.replay.verify import summary, verify
from services.runtime.endpoints import add_endpoint_arguments, endpoints_from_args, reaching
from services.runtime.settings import ServiceKind, load_settings


def _verify(args: argparse.Namespace) -> int:
    endpoints = endpoints_from_args(args, service=ServiceKind.READONLY)
    database_url = endpoints.database()
    settings = endpoints.settings(load_settings())
    with reaching("PostgreSQL", database_url):
        report = asyncio.run(verify(settings, from_start=args.from_start))
    print(summary(report))
    return ExitCode.OK if report.ok else ExitCode.INVARIANT_VIOLATED


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
    add_endpoint_arguments(check, database=True)
    check.set_defaults(func=_verify)
