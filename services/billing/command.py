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
SIGTERM (``dracap up`` runs it too).
"""

from __future__ import annotations

import argparse
from typing import Any, Final

from services.billing.service import BillingService
from services.exitcodes import ExitCode
from services.runtime import eventloop
from services.runtime.endpoints import add_endpoint_arguments
from services.runtime.querycommand import ask, emit, parse_time, serve_subscriber

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


async def _serve(args: argparse.Namespace) -> int:
    return await serve_subscriber(
        args, lambda store, js, names, nc: BillingService(store, js, names, nc=nc)
    )


def run(args: argparse.Namespace) -> int:
    try:
        if args.verb == "serve":
            eventloop.log_to_stderr()
            return eventloop.run(_serve(args))
        parse_time("--from", args.start)  # bad input: exit 2 before connecting
        parse_time("--to", args.end)
        return eventloop.run(_query(args))
    except KeyboardInterrupt:
        return ExitCode.OK


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "usage",
        help="usage per namespace and DeviceClass (GiB-hours, Gbit/s-hours), unknown apart",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    verbs = parser.add_subparsers(dest="verb", metavar="serve")
    serve = verbs.add_parser("serve", help="run the billing subscriber on its own")
    add_endpoint_arguments(serve, database=True, nats=True)
    serve.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: off)")
    serve.add_argument(
        "--metrics-addr", default="127.0.0.1", metavar="ADDR", help="where metrics bind"
    )
    serve.set_defaults(func=run, verb="serve")
    parser.add_argument("-n", "--namespace", help="a tenant's namespace (its own subject)")
    parser.add_argument("--class", dest="device_class", metavar="C", help="a DeviceClass")
    parser.add_argument("--from", dest="start", metavar="T", help="ISO 8601 time or now")
    parser.add_argument("--to", dest="end", metavar="T", help="ISO 8601 time or now")
    parser.add_argument(
        "--closed-only", action="store_true", help="leave out what open shares ran so far"
    )
    parser.add_argument("-o", "--output", choices=("table", "json", "csv"), default="table")
    add_endpoint_arguments(parser, nats=True)
    parser.set_defaults(func=run, verb=None)
