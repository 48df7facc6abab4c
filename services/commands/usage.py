"""``dracap usage``: usage per namespace and DeviceClass; ``dracap usage serve``.

``dracap usage [--namespace NS] [--class C] [--from T] [--to T] [--closed-only]
[-o table|json|csv]`` asks the billing service (:mod:`services.billing.service`) for
amount x time per namespace, DeviceClass, capacity and state: ``held`` (from the
reservation to the release) and ``unknown`` (while the share's node was not heard from)
apart. ``memory`` is shown in GiB-hours, ``bandwidth`` in Gbit/s-hours; ``unit_seconds``
(JSON, CSV) is the exact figure in the capacity's base unit times seconds. The window is
whole hours: ``--from`` counts from the start of its hour, ``--to`` up to the hour it
falls in. Shares still held count up to ``--to`` or now (``OPEN`` yes), unless
``--closed-only``. With ``--namespace`` the question goes on the tenant's subject
(``{prefix}.api.{ns}.claims.usage``; a tenant sees its own namespace only), without on
the admin subject (``{prefix}.admin.usage.list``, operators only).

``dracap usage serve`` runs the subscriber and its query endpoints until SIGINT or
SIGTERM (``dracap up`` runs it too). ``dracap usage verify`` recomputes billing's
tables from the log and prints every row that differs (exit 5 when one does:
:mod:`services.billing.verifying`).
"""

from __future__ import annotations

import argparse
from typing import Any, Final

from services.billing.service import BillingService
from services.billing.verifying import verify
from services.commands.querying import (
    add_query_command,
    ask,
    emit,
    parse_time,
    run_query_or_serve,
)
from services.exitcodes import ExitCode

COLUMNS: Final = ("namespace", "device_class", "capacity", "state", "amount", "unit", "open")


async def _query(args: argparse.Namespace) -> int:
    body = {
        "namespace": args.namespace,
        "device_class": args.device_class,
        "start": parse_time("--from", args.start),
        "end": parse_time("--to", args.end),
        "open": not args.closed_only,
    }
    rows = (await ask(args, "usage", "usage.list", body))["usage"]
    columns = (*COLUMNS, "unit_seconds") if args.output == "csv" else COLUMNS
    print(emit(args.output, rows, columns))
    return ExitCode.OK


def run(args: argparse.Namespace) -> int:
    return run_query_or_serve(
        args,
        lambda: _query(args),
        [("--from", args.start), ("--to", args.end)],
        make=BillingService,
        service="billing",
        check=verify,
        what="usage",
    )


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--class", dest="device_class", metavar="C", help="a DeviceClass")
    parser.add_argument("--from", dest="start", metavar="T", help="ISO 8601 time or now")
    parser.add_argument("--to", dest="end", metavar="T", help="ISO 8601 time or now")
    parser.add_argument(
        "--closed-only", action="store_true", help="leave out what open shares ran so far"
    )


def register(sub: Any) -> None:
    add_query_command(sub, "usage", __doc__, "billing", run, _flags)
