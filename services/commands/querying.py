"""What ``dracap audit`` and ``dracap usage`` share: times, output, asking, serving.

* :func:`parse_time`: ``--since``/``--until``/``--from``/``--to`` are ISO 8601 times
  (``2026-12-01T10:00:00Z``; without a zone: UTC) or ``now``; anything else is one line
  naming the flag, exit 2.
* :func:`emit`: ``-o table|json|csv`` of a list of flat rows; booleans are ``true`` /
  ``false`` and numbers come as the API wrote them (plain decimals).
* :func:`ask`: one query through the API: with ``--namespace`` on the tenant's subject
  (``{prefix}.api.{ns}.claims.{op}``: a tenant's credentials allow only their own
  namespace, and the service scopes the answer to it), without it on the admin subject
  (operators only).
* :func:`serve_subscriber`: ``... serve``: run a subscriber on its own until SIGINT or
  SIGTERM, connected to PostgreSQL as the ledger's database user when
  ``DRACAP_DATABASE_URL_LEDGER`` names one, and to NATS with ``--creds``; with
  ``--metrics-port``, ``/metrics``, ``/healthz`` and ``/readyz`` beside it
  (:mod:`services.runtime.ops.health`: postgres, nats, and the projector's freshness).
* :func:`verify_subscriber`: ``... verify``: recompute a subscriber's tables from the
  log and print every row that differs (:class:`~services.runtime.delivery.subscribers.
  Difference`); exit 0 when none does, 5 (``INVARIANT_VIOLATED``) otherwise. It
  connects as ``DRACAP_DATABASE_URL_READONLY``'s user when set (it only reads).
* :func:`run_query_or_serve` and :func:`add_query_command`: a command's run (serve,
  verify or one query) and its parser, written once; a command gives its subscriber,
  its check, its query and its own flags.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import io
import json
import logging
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.endpoints import add_endpoint_arguments, endpoints_from_args, reaching
from services.runtime.delivery.subscribers import Difference
from services.runtime.ground import eventloop
from services.runtime.ground.context import ServiceContext
from services.runtime.ground.printable import json_text, printable, table
from services.runtime.ground.settings import ServiceKind, load_settings
from services.runtime.store.eventstore import Connection, EventStore, connect

if TYPE_CHECKING:
    from services.runtime.delivery.projecting import Projector

__all__ = [
    "Subscriber",
    "add_query_command",
    "add_serve_verb",
    "ask",
    "emit",
    "parse_time",
    "run_query_or_serve",
    "serve_subscriber",
    "verify_subscriber",
]

log = logging.getLogger(__name__)


def parse_time(flag: str, text: str | None) -> str | None:
    """``text`` as an ISO 8601 UTC time for the API; :class:`CommandError` (exit 2)."""
    if text is None:
        return None
    if text == "now":
        return datetime.datetime.now(datetime.UTC).isoformat()
    try:
        at = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise CommandError(
            f"{flag}: must be an ISO 8601 time such as 2026-12-01T10:00:00Z, or now (got {text!r})",
            ExitCode.BAD_INPUT,
        ) from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=datetime.UTC)
    return at.astimezone(datetime.UTC).isoformat()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):  # as JSON writes them, not Python's True/False
        return "true" if value else "false"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def emit(output: str, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """``rows`` as a table (``columns``), JSON (every field) or CSV (``columns``), text
    a tenant wrote escaped for a terminal (:mod:`services.runtime.ground.printable`)."""
    if output == "json":
        return json_text(json.dumps(list(rows), indent=2, default=str))
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    if output == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([[printable(c) for c in row] for row in cells])
        return buffer.getvalue().rstrip("\n")
    return table([c.upper() for c in columns], cells)


async def ask(
    args: argparse.Namespace, tenant_op: str, admin_op: str, body: dict[str, Any]
) -> dict[str, Any]:
    """One query (see the module docstring); the reply's fields."""
    endpoints = endpoints_from_args(args)
    async with ApiClient.connect(endpoints.nats(), endpoints.prefix, endpoints.credential()) as api:
        payload = {k: v for k, v in body.items() if v is not None}
        if args.namespace:
            return await api.claims(args.namespace, tenant_op, payload)
        return await api.admin(admin_op, payload)


class Subscriber(Protocol):
    @property
    def projector(self) -> Projector: ...

    async def run(self, stop: asyncio.Event) -> None: ...


async def serve_subscriber(
    args: argparse.Namespace,
    make: Callable[[ServiceContext[EventStore]], Subscriber],
    service: str,
) -> int:
    """Run the subscriber ``make`` builds until SIGINT or SIGTERM; ``service``: its
    health checks' name (``audit``, ``billing``: ``/healthz`` and ``/readyz``)."""
    from services.runtime.hosting.storehosting import serving
    from services.runtime.ops.health import projector_probe

    async with serving(args, service, login=ServiceKind.LEDGER, nats=True) as context:
        subscriber = make(context.service_context(context.store))
        context.health.register("state", projector_probe(subscriber.projector))
        log.info("%s started (prefix %s)", service, context.names.prefix)  # as `dracap serve`
        await subscriber.run(context.stop)
    return ExitCode.OK


Check = Callable[[Connection], Coroutine[Any, Any, list[Difference]]]


async def verify_subscriber(args: argparse.Namespace, check: Check, what: str) -> int:
    """Run ``check`` on the database and print what it found (see the module docstring)."""
    endpoints = endpoints_from_args(args, service=ServiceKind.READONLY)
    database_url = endpoints.database()
    settings = endpoints.settings(load_settings())
    with reaching("PostgreSQL", database_url):
        connection = await connect(settings)
    try:
        found = await check(connection)
    finally:
        await connection.close()
    if args.output == "json":
        print(json.dumps({"ok": not found, "differences": msgspec.to_builtins(found)}, indent=2))
    elif found:
        rows = [
            {
                "table": d.table,
                "key": d.key,
                "problem": d.problem,
                "columns": ",".join(d.columns),
                "expected": json.dumps(d.expected, default=str) if d.expected else "",
                "found": json.dumps(d.found, default=str) if d.found else "",
            }
            for d in found
        ]
        print(emit(args.output, rows, ("table", "key", "problem", "columns", "expected", "found")))
    if found:
        print(f"{what}: {len(found)} row(s) differ from the log", file=sys.stderr)
        return ExitCode.INVARIANT_VIOLATED
    if args.output != "json":
        print(f"{what}: every row agrees with the log")
    return ExitCode.OK


def add_serve_verb(parser: argparse.ArgumentParser, what: str) -> argparse.ArgumentParser:
    """``<command> serve`` (returned) and ``<command> verify`` (``func`` left to the
    command: ``args.verb == "verify"``)."""
    verbs = parser.add_subparsers(dest="verb", metavar="serve|verify")
    check: argparse.ArgumentParser = verbs.add_parser(
        "verify", help=f"recompute the {what} tables from the log; report rows that differ"
    )
    add_endpoint_arguments(check, database=True)
    check.add_argument("-o", "--output", choices=("table", "json", "csv"), default="table")
    serve: argparse.ArgumentParser = verbs.add_parser(
        "serve", help=f"run the {what} subscriber on its own"
    )
    add_endpoint_arguments(serve, database=True, nats=True)
    serve.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: off)")
    serve.add_argument(
        "--metrics-addr", default="127.0.0.1", metavar="ADDR", help="where metrics bind"
    )
    return serve


def run_query_or_serve(
    args: argparse.Namespace,
    query: Callable[[], Coroutine[Any, Any, int]],
    times: Sequence[tuple[str, str | None]],
    *,
    make: Callable[[ServiceContext[EventStore]], Subscriber],
    service: str,
    check: Check,
    what: str,
) -> int:
    """Serve (``args.verb == "serve"``: :func:`serve_subscriber` of ``make`` as
    ``service``, logging to stderr), verify (``"verify"``: :func:`verify_subscriber` of
    ``check`` as ``what``) or answer one query; the query's ``times`` (``(flag, text)``)
    are checked first, so bad input exits 2 before connecting."""
    try:
        if args.verb == "serve":
            from services.runtime.hosting.process import run_service

            return run_service(lambda: serve_subscriber(args, make, service))
        if args.verb == "verify":
            return eventloop.run(verify_subscriber(args, check, what))
        for flag, text in times:
            parse_time(flag, text)
        return eventloop.run(query())
    except KeyboardInterrupt:
        return ExitCode.OK


def add_query_command(
    sub: Any,
    name: str,
    doc: str | None,
    what: str,
    run: Callable[[argparse.Namespace], int],
    flags: Callable[[argparse.ArgumentParser], None],
) -> None:
    """``dracap <name>``: its ``serve`` and ``verify`` verbs (:func:`add_serve_verb` of
    ``what``), ``--namespace``, the query's own ``flags``, ``-o`` and the endpoints."""
    parser = sub.add_parser(name, description=doc.split("\n\n")[1] if doc else None)
    add_serve_verb(parser, what).set_defaults(func=run, verb="serve")
    parser.add_argument("-n", "--namespace", help="a tenant's namespace (its own subject)")
    flags(parser)
    parser.add_argument("-o", "--output", choices=("table", "json", "csv"), default="table")
    add_endpoint_arguments(parser, nats=True)
    parser.set_defaults(func=run, verb=None)
