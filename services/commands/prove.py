"""``dracap prove bandwidth``: show, on this machine, that bandwidth shares hold.

It builds two network namespaces joined by a veth pair and allocates the shares
through the real control plane: the relay, live state, claims and admin APIs and a
reservation worker run in-process (:class:`services.stack.Stack`) with one node agent,
for node ``prove-node``, whose enforcer is the tc enforcer on the sender's veth. The
veth is published through the admin API as a shareable device whose ``bandwidth`` is
twice the sum of the rates; each rate becomes one ResourceClaim applied through the
tenant API and waited on until Ready (limit applied, level ``hard``), and its ShareID's
firewall mark tags the traffic. Each share is measured alone (baseline), then all of
them at once next to an unclassified saturating neighbour and a latency probe in its
own 10 Mbit/s class; ten enforcer ``apply`` calls that change a live share's rate are
timed; the claims are deleted at the end and the capacity must come back. Rates are
Kubernetes quantities in bits per second (``10M`` = 10^7 bit/s). Needs root
(CAP_NET_ADMIN); see :mod:`services.enforcement.proving` for the method and
``docs/enforcement-tc.md`` for figures.

Servers: ``--database-url`` / ``--nats`` (else ``DRACAP_DATABASE_URL`` /
``DRACAP_NATS_URL``); each one not given is started embedded in ``--data-dir`` (default:
a temporary directory, deleted afterwards). The database is migrated to head first.
``--attach`` runs only the prove node's agent here and uses the services already
running on those servers (``dracap up``), found as every command finds them
(:mod:`services.runtime.bus.endpoints`, ``<data-dir>/connection.json`` included).

It sits beside ``services/commands/up.py``, above the services: :func:`control_plane` composes
the in-process stack with a node agent, which no service package may do (the
import-linter layers in ``pyproject.toml``); :mod:`services.enforcement.proving` only
uses what it is handed.

Exit codes (:mod:`services.exitcodes`): 0 — every share within 3 % of its rate over the
window, no share pushed below its rate by a neighbour and the capacity given back;
5 — one of those goals missed (the limits do not hold as reported); 1 — the run
failed (a server, the control plane or the lab); 2 — bad input or no CAP_NET_ADMIN.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import msgspec

from events.errors import QuantityError
from events.quantities import Quantity
from events.subjects import BusNames, SubjectError
from services.enforcement.proving import (
    NODE,
    ProofReport,
    have_net_admin,
    prove_bandwidth,
)
from services.enforcement.tc import BACKENDS, TcEnforcer
from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.endpoints import DEFAULT_DATA_DIR, redact, resolve_endpoints
from services.runtime.ground.settings import Settings, SettingsError, load_settings
from services.runtime.ground.waiting import wait_for
from services.runtime.ops.embedded import EmbeddedError, embedded_servers

ACCURACY_GOAL = 0.03


def _mbit(bits: float) -> str:
    return f"{bits / 1e6:,.2f}"


def table(report: ProofReport) -> str:
    """The report as a text table."""
    head = (
        f"{'share':<10} {'rate':>8} {'alone':>9} {'loaded':>9} {'acc':>7} {'worst s':>8} "
        f"{'1st s':>6} {'kernel':>9} {'drops':>6} {'interf':>7} {'below':>5}"
    )
    lines = [
        f"allocation: {report.allocation}",
        f"services: {report.control_plane}",
        f"window {report.duration:g} s (Mbit/s)",
        head,
    ]
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
            f"apply of a rate change (enforcer): median {ms[len(ms) // 2]:.1f} ms, "
            f"max {ms[-1]:.1f} ms"
        )
    ready = sorted([s.ready_ms for s in report.shares] + [report.probe_ready_ms])
    lines.append(
        f"claim apply -> Ready (control plane, {len(ready)} claims): "
        f"median {ready[len(ready) // 2]:.1f} ms, max {ready[-1]:.1f} ms"
    )
    lines.append(
        "capacity after deleting the claims: "
        + ("all free" if report.capacity_returned else "NOT given back")
    )
    return "\n".join(lines)


@contextlib.asynccontextmanager
async def servers(args: argparse.Namespace) -> AsyncIterator[tuple[Settings, str]]:
    """Settings that reach the servers (embedded ones started for URLs not given), and
    a description of them for the report."""
    settings = load_settings()
    endpoints = resolve_endpoints(
        args.data_dir or DEFAULT_DATA_DIR,
        database_url=args.database_url,
        nats_url=args.nats,
        saved=args.attach,  # without --attach, the servers not named are started here
    )
    database_url, nats_url = endpoints.database_url, endpoints.nats_url
    if args.attach or (database_url and nats_url):
        database_url, nats_url = endpoints.database(), endpoints.nats()
        if args.attach and endpoints.creds:
            raise CommandError(
                "--attach runs an agent for node "
                f"{NODE}, which the broker of a secure `dracap up` has no user for: attach "
                "to a `dracap up --insecure`, or run prove without --attach",
                ExitCode.BAD_INPUT,
            )
        yield (
            msgspec.structs.replace(settings, database_url=database_url, nats_url=nats_url),
            f"servers {nats_url}, {redact(database_url)}",
        )
        return
    started = " and ".join(
        name for name, url in (("PostgreSQL", database_url), ("NATS", nats_url)) if not url
    )
    scratch = not args.data_dir
    data_dir = (
        Path(args.data_dir) if args.data_dir else Path(tempfile.mkdtemp(prefix="dracap-prove-"))
    )
    where = f"embedded {started} in " + ("a temporary directory" if scratch else str(data_dir))
    try:
        async with embedded_servers(
            data_dir, postgres=not database_url, nats=not nats_url
        ) as embedded:
            database_url = database_url or embedded.database_url
            nats_url = nats_url or embedded.nats_url
            yield (
                msgspec.structs.replace(settings, database_url=database_url, nats_url=nats_url),
                where,
            )
    finally:
        if scratch:
            shutil.rmtree(data_dir, ignore_errors=True)


IN_PROCESS: Final = "in-process stack (relay, live state, claims API, reservation worker)"
ATTACHED: Final = "attached to the running services"


@contextlib.asynccontextmanager
async def control_plane(
    settings: Settings,
    names: BusNames,
    enforcer: TcEnforcer,
    *,
    start_services: bool = True,
    workers: int = 1,
) -> AsyncIterator[ApiClient]:
    """The real services, with one node agent for :data:`NODE` driving ``enforcer``.

    ``start_services``: relay, live state, claims/admin API and reservation workers run
    in-process (:class:`services.stack.Stack`, no agents of its own); else they are already
    running somewhere on these servers (``dracap up``) and only the agent runs here.
    Yields a client of the claims and admin APIs.
    """
    from services.enforcement.agent import Agent
    from services.runtime.bus.jetstream import connect_bus
    from services.runtime.ground.context import ServiceContext
    from services.stack import Stack

    if start_services:
        async with Stack.running(settings, names, nodes=(), workers=workers) as stack:
            agent = Agent(
                stack.context(f"agent-{NODE}", None, bus="relay"), node=NODE, enforcer=enforcer
            )
            stack.spawn(f"agent-{NODE}", functools.partial(agent.run, stack.stop))
            async with ApiClient.connect(settings.nats_url, names.prefix) as api:
                yield api
        return
    nc, _ = await connect_bus(settings.nats_url, name=f"dracap-prove-{NODE}")
    try:
        stop = asyncio.Event()
        context = ServiceContext(stores=None, names=names, settings=settings, connection=nc)
        agent = Agent(context, node=NODE, enforcer=enforcer)
        task = asyncio.create_task(agent.run(stop), name=f"agent-{NODE}")
        try:
            async with ApiClient.connect(settings.nats_url, names.prefix) as api:
                yield api
        finally:
            stop.set()
            try:
                await wait_for(task, 10)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    finally:
        await nc.drain()


async def _prove(args: argparse.Namespace, rates: list[Quantity]) -> ProofReport:
    from migrations import runner as migrating

    names = BusNames(prefix=args.prefix)
    async with servers(args) as (settings, where):
        if not args.attach:
            await migrating.upgrade_async(settings)
        return await prove_bandwidth(
            rates,
            control_plane=functools.partial(
                control_plane, settings, names, start_services=not args.attach
            ),
            services=ATTACHED if args.attach else IN_PROCESS,
            where=where,
            duration=args.duration,
            aggressor=not args.no_neighbour,
            tc_backend=args.tc_backend,
        )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``dracap prove bandwidth``."""
    try:
        rates = [Quantity.parse(r.strip()) for r in args.rates.split(",") if r.strip()]
    except QuantityError as exc:
        print(f"error: --rates: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    if not rates or any(r.sign() <= 0 for r in rates) or args.duration < 2:
        print("error: need positive --rates and --duration >= 2", file=sys.stderr)
        return ExitCode.BAD_INPUT
    why = have_net_admin()
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    try:
        BusNames(prefix=args.prefix)
    except SubjectError as exc:
        print(f"error: --prefix: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    try:
        report = asyncio.run(_prove(args, rates))
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except (EmbeddedError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.ERROR
    if args.output == "json":
        print(msgspec.json.format(msgspec.json.encode(report).decode(), indent=2))
    else:
        print(table(report))
    ok = report.capacity_returned and all(
        abs(s.accuracy) <= ACCURACY_GOAL and not s.pushed_below for s in report.shares
    )
    return ExitCode.OK if ok else ExitCode.INVARIANT_VIOLATED


def register(sub: Any) -> None:
    """Add ``dracap prove bandwidth`` to the command line."""
    prove = sub.add_parser("prove")
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
    parser.add_argument(
        "--tc-backend",
        choices=BACKENDS,
        default="netlink",
        help="how the prove agent's tc enforcer talks to the kernel: netlink (default) or tc "
        "(a tc process per request), as dracap agent --tc-backend",
    )
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    parser.add_argument(
        "--database-url", metavar="URL", help="PostgreSQL URL (default: DRACAP_DATABASE_URL)"
    )
    parser.add_argument("--nats", metavar="URL", help="NATS URL (default: DRACAP_NATS_URL)")
    parser.add_argument(
        "--data-dir",
        metavar="DIR",
        help="embedded servers' data (default: a temporary directory); with --attach, "
        "where connection.json is (default: .dracap)",
    )
    parser.add_argument(
        "--attach",
        action="store_true",
        help="use the services already running on the servers; run only the prove agent",
    )
    parser.add_argument("--prefix", default="dracap", help="subject prefix (default: dracap)")
    parser.set_defaults(func=run)
