"""``dracap up``: the whole control plane in one process, on one machine.

One command starts everything the issue's services need, as asyncio tasks in one
event loop, and audit and billing as a child process (below)::

    PostgreSQL (event log) ──relay──> JetStream stream ──> reservation workers
          ^                                           └──> one node agent per node
          ├── claims API + admin API (NATS micro) <── dracap claim / devices
          └── enforcement service <── {prefix}.node.<node>.* <── the node agents (NATS only)

Where the servers come from
---------------------------
``DRACAP_DATABASE_URL`` / ``DRACAP_NATS_URL`` when set; each one that is not set is
started embedded under ``--data-dir`` (:mod:`services.runtime.ops.embedded`), so the command
works on a machine with nothing running. The data directory keeps PGDATA and the
JetStream store, so a second ``dracap up`` on it resumes: the relay continues from its
checkpoint, consumers from theirs, and every claim is still there because the state is
the fold of the log.

Start-up order
--------------
servers (and their watchdog) -> migrations (``alembic`` to head, under an advisory
lock) -> the services' database users (on the embedded PostgreSQL: one per service,
:mod:`services.runtime.store.provisioning`; node agents have none) -> bus stream and the
services' durable consumers (the relay's keeper, :mod:`services.runtime.delivery.rebuilding`) ->
:class:`Stack` (relay, live state, claims API, reservation workers, reclamation service,
the enforcement service, agents) -> the ledger process -> the
example inventory through
the admin API (each ResourceSlice only if its devices are not listed yet, so a restart
does not append it again) ->
``<data-dir>/connection.json`` -> the banner, whose last line starts with ``dracap is
ready`` -> the health checks (until then ``/readyz`` says "starting"). The banner's
hints name dracap as it can be run from here (:func:`invocation`).

Supervision
-----------
Each service runs as a supervised task of the stack, started again after a back-off
when it fails (:mod:`services.stack`); a health check that passes again cuts the
back-off short (:meth:`~services.stack.Stack.retry_now`).

The audit and billing subscribers run as ``dracap serve ledger``, a child process
(:func:`ledger_process`, kept by :class:`~services.runtime.ops.children.ChildService`):
in the loop, each of their batches held every claim in flight for 30-120 ms a few
times a second (issue 25). It gets the ledger's database and broker logins in its
environment, serves its metrics and checks on ``--ledger-metrics-port`` (default
``--metrics-port`` + 2), is started again when it exits and stopped first on the way
out; the ``ledger`` check says whether it runs.

The embedded servers are supervised too (:mod:`services.runtime.ops.supervising`): one
that dies is started again on its port, with back-off, at most
``--max-server-restarts`` times within 10 minutes; past that ``dracap up`` stops and
exits with status 1 and one line saying which server and why. The services are not
restarted for it: their clients reconnect. While the servers are away, the health
monitor (:mod:`services.runtime.ops.health`) logs one line per change of state and keeps
the retries of everything else out of the log; ``/healthz`` and ``/readyz`` on the
metrics port say what is down.

Stopping
--------
SIGINT and SIGTERM set one ``stop`` event. Every task's ``run(stop)`` drains and
returns; the stack waits for them (cancelling stragglers after a grace period), closes
the NATS connection and the store, and the embedded servers are stopped last
(nats-server first, then a fast PostgreSQL shutdown). The servers run in their own
sessions, so the terminal's Ctrl-C reaches dracap only and the order above holds.

The stack itself (its services, their supervision and how they stop) is
:mod:`services.stack`, which the integration tests and ``benchmarks/pipeline.py`` start
on their own database and subject prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import shlex
import shutil
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from events.manifests import ManifestError
from events.subjects import BusNames
from migrations import runner as migrating
from services.brokerauth import init_auth, installation_from
from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.credentials import AUTH_DIR, AuthDir, Principal
from services.runtime.bus.endpoints import Connection
from services.runtime.ground import eventloop
from services.runtime.ground.gctuning import freeze_at_exit, long_lived_state
from services.runtime.ground.metrics import add_metrics_arguments
from services.runtime.ground.outages import quiet_outages
from services.runtime.ground.settings import ServiceKind, Settings, SettingsError, load_settings
from services.runtime.ops.children import ChildService
from services.runtime.ops.embedded import EmbeddedError, embedded_servers
from services.runtime.ops.health import HealthMonitor, PostgresProbe, nats_probe, serve
from services.runtime.ops.supervising import RestartLimitError, RestartPolicy, Watchdog
from services.stack import (
    STOP_GRACE_S,
    InventoryManifests,
    Stack,
    load_inventory,
    read_inventory,
)

READY_LINE: Final = "dracap is ready"
#: the ledger process's time to drain on stop, within the stack's own grace period
LEDGER_STOP_GRACE_S: Final = STOP_GRACE_S - 2
HEALTH_CHECKS: Final = ("postgres", "nats", "services", "ledger")
#: the broker user of the audit and billing process (:mod:`services.brokerauth`)
LEDGER_USER: Final = Principal(name="ledger", kind="service", public_key="")
#: the ledger's metrics port, past dracap up's own (+1 is a standalone agent's default)
LEDGER_PORT_OFFSET: Final = 2
#: how much nicer the ledger process runs than dracap up: the deciding services first
LEDGER_NICENESS: Final = 10

log = logging.getLogger("dracap.up")


class UpOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What ``dracap up`` was asked to run."""

    data_dir: Path = Path(".dracap")
    inventory: tuple[str, ...] = ("deploy/examples",)
    agents: str = "auto"  # "auto": every node of the inventory; "none" (or ""): none; "a,b"
    workers: int = 1
    metrics_port: int = 9400  # 0: no metrics server (and no health endpoints)
    metrics_addr: str = "127.0.0.1"  # where the metrics server binds
    #: the ledger process's metrics port (None: metrics_port + 2, or 0 when that is 0)
    ledger_metrics_port: int | None = None
    max_server_restarts: int = 5  # of one embedded server within 10 minutes; 0: never
    prefix: str = "dracap"
    insecure: bool = False  # an open broker: nobody is authenticated


# --- dracap up -----------------------------------------------------------------------------


def _nodes(option: str, inventory: InventoryManifests) -> list[str]:
    """The nodes ``--agents`` names: ``auto`` every node of the inventory, ``none`` no
    node (the agents run elsewhere: ``dracap agent``), else a comma-separated list."""
    if option == "auto":
        return inventory.nodes
    if option.strip().lower() == "none":
        return []
    return [n.strip() for n in option.split(",") if n.strip()]


def write_connection(data_dir: Path, connection: Connection) -> Path:
    """Write ``connection.json`` atomically (a reader never sees half a file)."""
    data_dir.mkdir(parents=True, exist_ok=True)  # servers from the environment made none
    path = data_dir / "connection.json"
    partial = path.with_suffix(".json.partial")
    partial.write_bytes(msgspec.json.format(msgspec.json.encode(connection)) + b"\n")
    os.replace(partial, path)
    return path


def invocation() -> str:
    """This dracap as it can be run from the current directory, for the printed hints.

    ``dracap`` when that name on ``PATH`` is this very script; else the script's path
    (``.venv/bin/dracap`` when the venv is not activated), or ``python -m MODULE`` when
    started that way.
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return f"{_shell_path(sys.executable)} -m {spec.name.removesuffix('.__main__')}"
    script = os.path.abspath(sys.argv[0])
    name = os.path.basename(script)
    if not os.path.isfile(script):  # python -c, an embedding: nothing better to say
        return "dracap"
    found = shutil.which(name)
    if found is not None and os.path.samefile(found, script):
        return name
    return _shell_path(script)


def _shell_path(path: str) -> str:
    """``path`` relative to the current directory when below it, quoted for a shell."""
    relative = os.path.relpath(os.path.abspath(path))
    if relative.startswith(os.pardir):
        return shlex.quote(os.path.abspath(path))  # not below: the absolute path
    return shlex.quote(relative if os.sep in relative else f".{os.sep}{relative}")


def banner(
    connection: Connection,
    data_dir: Path,
    nodes: Sequence[str],
    metrics: int,
    command: str = "dracap",
    ledger_metrics: int = 0,
) -> str:
    where = "" if data_dir == Path(".dracap") else f" --data-dir {shlex.quote(str(data_dir))}"
    base = f"http://127.0.0.1:{metrics}"
    access = (
        f"  access      credentials in {Path(connection.creds).parent} (the CLI uses the "
        "operator's; each tenant user has a file of its own)"
        if connection.creds
        else "  access      INSECURE: no credentials, anyone can act as any namespace"
    )
    lines = [
        f"  event log   {connection.database_url}",
        f"  NATS        {connection.nats_url} (prefix {connection.prefix})",
        access,
        f"  agents      {', '.join(nodes) or 'none'} (NoneEnforcer)",
        f"  metrics     {base}/metrics" if metrics else "  metrics     off",
        f"  health      {base}/healthz, {base}/readyz" if metrics else "  health      off",
        "  audit       audit and billing in a process of their own (dracap serve ledger)"
        + (f", metrics http://127.0.0.1:{ledger_metrics}/metrics" if ledger_metrics else ""),
        "",
        "Try, from another terminal in this directory:",
        f"  {command} claim apply -f deploy/examples/claims.yaml --wait{where}",
        f"  {command} claim list -n tenant-a{where}",
        f"  {command} claim get train-small -n tenant-a -o yaml{where}",
        f"  {command} claim watch -n tenant-a{where}",
        f"  {command} claim delete train-small -n tenant-a{where}",
        f"  {command} devices{where}",
        "",
        f"{READY_LINE} (Ctrl-C stops it; `{command} up` again resumes from the log)",
    ]
    return "\n".join(lines)


Supervisor = asyncio.Task[None] | None  # the embedded servers' watchdog, if any


INSECURE_WARNING: Final = (
    "INSECURE: --insecure runs NATS without accounts or credentials: anyone who reaches "
    "the server can act as any namespace, call the admin API and publish onto the event "
    "stream. Use it for experiments only."
)


def broker_auth(
    options: UpOptions, inventory: InventoryManifests, nodes: Sequence[str]
) -> AuthDir | None:
    """The auth directory ``dracap up`` runs with (None: ``--insecure``).

    With an embedded nats-server, ``<data-dir>/auth`` is written (keys kept) for the
    inventory's namespaces and nodes; a server named by ``DRACAP_NATS_URL`` must
    already run with the accounts of an existing auth directory.
    """
    if options.insecure:
        log.warning(INSECURE_WARNING)
        return None
    auth = AuthDir(options.data_dir / AUTH_DIR)
    if os.environ.get("DRACAP_NATS_URL"):
        if not auth.exists():
            raise CommandError(
                f"DRACAP_NATS_URL names a NATS server dracap up does not start, and {auth.path} "
                "holds no credentials: run `dracap auth init` and start that server with "
                "its accounts.conf, or pass --insecure",
                ExitCode.BAD_INPUT,
            )
        return auth
    objects: list[object] = [*inventory.namespaces, *inventory.slices]
    init_auth(auth, installation_from(objects, prefix=options.prefix, nodes=nodes))
    return auth


@contextlib.asynccontextmanager
async def _servers(
    options: UpOptions, settings: Settings, monitor: HealthMonitor, auth: AuthDir | None
) -> AsyncIterator[tuple[Settings, Supervisor]]:
    """``settings`` with the URLs of embedded servers for those not set in the
    environment, and the task that supervises them."""
    want_pg = not os.environ.get("DRACAP_DATABASE_URL")
    want_nats = not os.environ.get("DRACAP_NATS_URL")
    if not (want_pg or want_nats):
        yield settings, None
        return
    nats_config = auth.accounts if auth is not None else None
    async with embedded_servers(
        options.data_dir, postgres=want_pg, nats=want_nats, nats_config=nats_config
    ) as servers:
        policy = RestartPolicy(limit=options.max_server_restarts)
        monitor.watchdog = watchdog = Watchdog(servers.processes, policy)
        async with _supervised(watchdog) as task:
            yield (
                msgspec.structs.replace(
                    settings,
                    database_url=servers.database_url if want_pg else settings.database_url,
                    nats_url=servers.nats_url if want_nats else settings.nats_url,
                ),
                task,
            )


async def _database_users(options: UpOptions, settings: Settings) -> Settings:
    """``settings`` with a database user of its own for each service (agents have none).

    On the embedded PostgreSQL ``dracap up`` creates them (:mod:`services.runtime.
    provisioning`); on a server named by ``DRACAP_DATABASE_URL`` the operator's
    ``DRACAP_DATABASE_URL_<KIND>`` (already in ``settings``) say who connects, if anyone.
    """
    if os.environ.get("DRACAP_DATABASE_URL"):
        return settings
    from services.runtime.store import provisioning

    users = provisioning.load_users(options.data_dir)
    urls = await provisioning.provision(settings.database_url, users)
    return msgspec.structs.replace(settings, database_urls=urls)


@contextlib.asynccontextmanager
async def _supervised(watchdog: Watchdog) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``watchdog`` while inside; its :class:`RestartLimitError` wins over any other error."""
    done = asyncio.Event()
    task = asyncio.create_task(watchdog.run(done), name="watchdog")
    try:
        yield task
    finally:
        done.set()
        await asyncio.wait({task})
        failure = None if task.cancelled() else task.exception()
        if isinstance(failure, RestartLimitError):
            raise failure


def ledger_port(options: UpOptions) -> int:
    """The ledger process's metrics port (0: none)."""
    if options.ledger_metrics_port is not None:
        return options.ledger_metrics_port
    return options.metrics_port + LEDGER_PORT_OFFSET if options.metrics_port else 0


def ledger_process(
    options: UpOptions, settings: Settings, names: BusNames, auth: AuthDir | None
) -> ChildService:
    """Audit and billing as ``dracap serve ledger``, a child process of this one.

    It finds what the stack's services are handed: the NATS server and prefix, the
    ledger's database login (the one ``dracap up`` provisioned, else the operator's
    ``DRACAP_DATABASE_URL_LEDGER``, else the shared URL) in its environment, and the
    ledger's broker credential and the broker's directory in ``<data-dir>/auth``
    (``--insecure``: neither). The secrets travel in the environment, not in its
    command line, which every user of the machine can read. It runs
    :data:`LEDGER_NICENESS` nicer: its rows may lag a busy moment, claims may not.
    """
    argv = [sys.executable, "-m", "services.cli", "serve", "ledger"]
    argv += ["--data-dir", str(options.data_dir), "--prefix", names.prefix]
    argv += ["--metrics-port", str(ledger_port(options)), "--metrics-addr", options.metrics_addr]
    env = dict(os.environ, DRACAP_NATS_URL=settings.nats_url)
    own = settings.database_urls.get(ServiceKind.LEDGER)
    if own:
        env[f"DRACAP_DATABASE_URL_{ServiceKind.LEDGER.name}"] = own
    else:
        env["DRACAP_DATABASE_URL"] = settings.database_url
    if auth is None:
        argv.append("--insecure")
    else:
        env["DRACAP_NATS_CREDS"] = str(auth.creds_path(LEDGER_USER).resolve())
    return ChildService("ledger", argv, env, grace_s=LEDGER_STOP_GRACE_S, niceness=LEDGER_NICENESS)


@contextlib.asynccontextmanager
async def _health_checks(
    monitor: HealthMonitor, stack: Stack, settings: Settings, ledger: ChildService
) -> AsyncIterator[None]:
    """Check PostgreSQL (as the read-only service's user when roles are set up: nothing
    connects as the administrator once the services run), NATS, the services of
    ``stack`` and the ledger process while inside."""
    postgres = PostgresProbe(settings.for_service(ServiceKind.READONLY).database_url)
    monitor.register("postgres", postgres)
    monitor.register("nats", nats_probe(stack.nc, stack.js, stack.names.stream))
    monitor.register("services", stack.trouble)
    monitor.register("ledger", ledger.trouble)
    monitor.on_recovery(stack.retry_now)
    monitor.on_recovery(ledger.retry_now)
    done = asyncio.Event()
    task = asyncio.create_task(monitor.run(done), name="health")
    try:
        yield
    finally:
        done.set()
        await task
        await postgres.close()


async def _until_stopped(stop: asyncio.Event, supervisor: Supervisor) -> None:
    """Wait for ``stop``; raises :class:`RestartLimitError` as soon as the supervisor does."""
    stopped = asyncio.ensure_future(stop.wait())
    waits: set[asyncio.Future[Any]] = {stopped} if supervisor is None else {stopped, supervisor}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if supervisor is not None and supervisor.done():
        supervisor.result()


async def _open_for_use(
    options: UpOptions,
    settings: Settings,
    names: BusNames,
    inventory: InventoryManifests,
    auth: AuthDir | None,
) -> None:
    """Load the inventory, write ``connection.json`` and print the banner."""
    operator = auth.operator() if auth is not None else None
    async with ApiClient.connect(settings.nats_url, names.prefix, operator) as api:
        applied = await load_inventory(api, inventory)
    print(
        f"inventory: {applied} slice(s) loaded" if applied else "inventory: already loaded",
        flush=True,
    )
    connection = Connection(
        database_url=settings.database_url,
        nats_url=settings.nats_url,
        prefix=names.prefix,
        creds=str(auth.operator_path().resolve()) if auth is not None else None,
    )
    path = write_connection(options.data_dir, connection)
    print(f"connection written to {path}", flush=True)
    nodes = _nodes(options.agents, inventory)  # the agents Stack.running started
    text = banner(
        connection,
        options.data_dir,
        nodes,
        options.metrics_port,
        invocation(),
        ledger_metrics=ledger_port(options),
    )
    print(text, flush=True)


async def up(options: UpOptions, stop: asyncio.Event) -> int:
    """Run everything until ``stop`` is set; returns the exit code.

    Raises :class:`RestartLimitError` when an embedded server died more often than allowed.
    """
    inventory = read_inventory(options.inventory)
    nodes = _nodes(options.agents, inventory)
    names = BusNames(prefix=options.prefix)
    auth = broker_auth(options, inventory, nodes)
    monitor = HealthMonitor(HEALTH_CHECKS)
    metrics = _start_metrics(options.metrics_port, monitor, options.metrics_addr)
    try:
        with quiet_outages(monitor.outage):
            async with _servers(options, load_settings(), monitor, auth) as (settings, supervisor):
                head = await migrating.upgrade_async(settings)
                print(f"migrating the event log to {head}", flush=True)
                settings = await _database_users(options, settings)
                async with Stack.running(
                    settings,
                    names,
                    nodes=nodes,
                    workers=options.workers,
                    auth=auth,
                    subscribers=False,
                ) as stack:
                    ledger = ledger_process(options, settings, names, auth)
                    stack.spawn("ledger", functools.partial(ledger.run, stack.stop))
                    await _open_for_use(options, settings, names, inventory, auth)
                    async with _health_checks(monitor, stack, settings, ledger):
                        await _until_stopped(stop, supervisor)
                print("stopping: services drained", flush=True)
    finally:
        if metrics is not None:
            metrics.shutdown()
    print("stopped", flush=True)
    return ExitCode.OK


def _start_metrics(port: int, monitor: HealthMonitor, addr: str = "127.0.0.1") -> Any:
    """The metrics server with ``/healthz`` and ``/readyz`` (None when ``port`` is 0)."""
    if not port:
        return None
    from services.runtime.ground.metrics import start_metrics_server

    server, _ = start_metrics_server(port, addr=addr)
    serve(server, monitor)
    return server


async def _main(options: UpOptions) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        with long_lived_state():
            return await up(options, stop)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def run(args: argparse.Namespace) -> int:
    eventloop.log_to_stderr()
    options = UpOptions(
        data_dir=Path(args.data_dir),
        inventory=tuple(args.inventory or ["deploy/examples"]),
        agents=args.agents,
        workers=args.workers,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        ledger_metrics_port=args.ledger_metrics_port,
        max_server_restarts=args.max_server_restarts,
        prefix=args.prefix,
        insecure=args.insecure,
    )
    freeze_at_exit()  # the process's own exit: no walk of the fold (gctuning)
    try:
        return eventloop.run(_main(options))
    except (ManifestError, SettingsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except (EmbeddedError, CommandError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.ERROR


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "up",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument(
        "--data-dir",
        default=".dracap",
        metavar="DIR",
        help="embedded server data and connection.json (default: .dracap)",
    )
    parser.add_argument(
        "--inventory",
        action="append",
        metavar="PATH",
        help="DeviceClasses, ResourceSlices and Namespaces to load "
        "(repeatable; default: deploy/examples)",
    )
    parser.add_argument(
        "--agents",
        default="auto",
        metavar="auto|none|NODE,...",
        help="node agents to run (auto: every node of the inventory; none: no agent, they "
        "run as `dracap agent` elsewhere)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="reservation workers (default 1: planning rounds take turns on one lock, so "
        "a second worker in the same process adds lock hand-offs, not capacity)",
    )
    add_metrics_arguments(
        parser,
        port=9400,
        port_help="Prometheus metrics, /healthz and /readyz (0: off; default 9400)",
    )
    parser.add_argument(
        "--ledger-metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="the metrics, /healthz and /readyz of the audit and billing process (0: off; "
        "default: --metrics-port + 2, off when that is off)",
    )
    parser.add_argument(
        "--max-server-restarts",
        type=int,
        default=5,
        metavar="N",
        help="restarts of a dying embedded server within 10 minutes before dracap up "
        "gives up and exits with status 1 (0: never restart; default 5)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="run NATS open: no accounts, no credentials, anonymous actors (experiments "
        "only; default: accounts and per-user credentials in <data-dir>/auth)",
    )
    parser.add_argument("--prefix", default="dracap", help=argparse.SUPPRESS)
    parser.set_defaults(func=run, inventory=None)
