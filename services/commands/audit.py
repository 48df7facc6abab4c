"""``dracap audit``: the audit records; ``dracap audit serve``: the subscriber on its own.

``dracap audit [--namespace NS] [--claim NAME] [--share ID] [--device D] [--node N]
[--since T] [--until T] [--limit N] [-o table|json|csv]`` asks the audit service
(:mod:`services.audit.service`) for its records: the newest ``--limit`` that match, in
log order. With ``--namespace`` the
question goes on the tenant's subject (``{prefix}.api.{ns}.claims.audit``): a tenant's
credentials reach their own namespace only, and the answer is limited to it; without,
on the admin subject (``{prefix}.admin.audit.list``, operators only). ``--device`` is
``pool/device`` (as ``dracap devices`` prints it) or ``driver/pool/device``. Times are
ISO 8601 (UTC when no zone is given) or ``now``.

``dracap audit serve`` runs the subscriber and its query endpoints until SIGINT or
SIGTERM (``dracap up`` runs it too); PostgreSQL as ``DRACAP_DATABASE_URL_LEDGER``'s user
when set, NATS with ``--creds``. ``dracap audit verify`` recomputes the audit's tables
from the log and prints every row that differs (exit 5 when one does:
:mod:`services.audit.verifying`).
"""

from __future__ import annotations

import argparse
from typing import Any, Final

from services.audit.service import AuditService
from services.audit.verifying import verify
from services.commands.querying import (
    add_query_command,
    ask,
    emit,
    parse_time,
    run_query_or_serve,
)
from services.exitcodes import ExitCode

COLUMNS: Final = (
    "position",
    "recorded_at",
    "namespace",
    "claim",
    "request",
    "share_id",
    "device",
    "amounts",
    "policy_version",
    "actor",
    "decision",
    "reason",
)


async def _query(args: argparse.Namespace) -> int:
    body = {
        "namespace": args.namespace,
        "claim": args.claim,
        "share": args.share,
        "device": args.device,
        "node": args.node,
        "since": parse_time("--since", args.since),
        "until": parse_time("--until", args.until),
        "limit": args.limit,
    }
    records = (await ask(args, "audit", "audit.list", body))["records"]
    print(emit(args.output, records, COLUMNS))
    return ExitCode.OK


def run(args: argparse.Namespace) -> int:
    return run_query_or_serve(
        args,
        lambda: _query(args),
        [("--since", args.since), ("--until", args.until)],
        make=AuditService,
        service="audit",
        check=verify,
        what="audit",
    )


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--claim", metavar="NAME")
    parser.add_argument("--share", metavar="ID")
    parser.add_argument(
        "--device",
        metavar="POOL/DEVICE",
        help="as `dracap devices` prints it, or DRIVER/POOL/DEVICE",
    )
    parser.add_argument("--node", metavar="N")
    parser.add_argument("--since", metavar="T", help="ISO 8601 time or now")
    parser.add_argument("--until", metavar="T", help="ISO 8601 time or now")
    parser.add_argument(
        "--limit", type=int, default=10_000, help="the newest this many records (default 10000)"
    )


def register(sub: Any) -> None:
    add_query_command(sub, "audit", __doc__, "audit", run, _flags)
