"""``dracap serve SERVICE``: relay, claims, reservation, enforcement or the Kubernetes bridge
as its own process.

``dracap up`` runs every service in one process; a deployment (compose, Kubernetes)
runs each as its own, so each can be scaled, restarted and given its own credentials.
The node agent (``dracap agent``) and the reclamation service (``dracap reclaim``) have
their commands already; this module gives the others theirs:

* ``relay``: the transactional outbox, from the event log to the JetStream stream
  (:class:`~services.runtime.delivery.relaying.Relay`); run one or more: one is active at a
  time, the others stand by and take over when it dies
  (:mod:`services.runtime.ops.leadership`). It owns the stream and the
  services' durable consumers and puts them back if the broker loses them
  (:mod:`services.runtime.delivery.rebuilding`); ``--stream-replicas N`` (else
  ``DRACAP_STREAM_REPLICAS``, else 1) is how many servers of a clustered NATS keep the
  stream and its consumers;
* ``claims``: the claims and admin API (:class:`~services.claims.api.ClaimsApi`) with
  its live state; instances share the load in their NATS queue group. It uses no
  JetStream at all;
* ``reservation``: a reservation worker (:class:`~services.reservation.service.
  ReservationService`); workers share the durable consumers, which the relay creates;
* ``enforcement``: the node agents' only way to the log
  (:class:`~services.enforcement.service.EnforcementService`): answers their requests on
  ``{prefix}.node.*.>`` (queue group ``enforcement``), appends their reports, renews
  their leases in batches and creates (and recreates) their durable consumers; run any
  number, each with one small connection pool whatever the number of nodes;
* ``ledger``: the audit and billing subscribers with their query endpoints
  (:class:`~services.audit.service.AuditService`, :class:`~services.billing.service.
  BillingService`) in one process sharing one fold of the log, as the ``ledger`` login
  (database and NATS). ``dracap up`` runs this one as a child process of its own, so
  their batches never hold up the services that decide; ``dracap audit serve`` and
  ``dracap usage serve`` run each alone (as compose does);
* ``kubernetes-bridge``: Kubernetes mode's intake (:class:`~services.claims.bridge.Bridge`):
  mirrors the ResourceClaims kube-scheduler allocated on ``--driver`` devices into the log
  and writes their ``status.devices`` back; run one per cluster. It reaches the API
  server in-cluster (its ServiceAccount) or through ``--kubeconfig``.

With ``--metrics-port`` each serves ``/metrics``, ``/healthz`` and ``/readyz``
(:mod:`services.runtime.ops.health`: its checks are ``SERVICE_CHECKS[service]``). The claims
API's process also serves the metrics derived from the log (capacity
gauges, the SLO tracker of :mod:`services.runtime.ops.slos`), as ``dracap up`` does.

Servers are found as every command finds them (:mod:`services.runtime.bus.endpoints`):
``--database-url`` / ``--nats``, else ``DRACAP_DATABASE_URL_<KIND>`` (the service's own
database user) / ``DRACAP_NATS_URL``, else ``DRACAP_DATABASE_URL``, else
``<data-dir>/connection.json``. The NATS login is ``--creds`` / ``DRACAP_NATS_CREDS``,
else the service's file in ``<data-dir>/auth`` (``dracap auth init``), else none. The
claims API and the enforcement service require the broker's identity on every request
when they find the broker's directory (``<data-dir>/auth/directory.json``, or
``--directory``), and serve anonymously only with ``--insecure``. Each stops on SIGINT
or SIGTERM; a server that cannot be reached at start is one line and exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.credentials import AUTH_DIR, AuthDir, Credential, read_directory
from services.runtime.bus.endpoints import Endpoints, add_endpoint_arguments, endpoints_from_args
from services.runtime.ground.context import ServiceContext
from services.runtime.ground.settings import ServiceKind, SettingsError, stream_replicas
from services.runtime.hosting.process import run_service
from services.runtime.hosting.storehosting import StoreProcessContext, serving
from services.runtime.ops.health import consumers_probe
from services.runtime.store.livestate import LiveState
from services.runtime.store.logandfold import LogAndFold

log = logging.getLogger("dracap.serve")

#: The services this command runs, with the database role each connects as.
SERVICES: Final = {
    "relay": ServiceKind.RELAY,
    "claims": ServiceKind.CLAIMS,
    "reservation": ServiceKind.RESERVATION,
    "enforcement": ServiceKind.ENFORCEMENT,
    "ledger": ServiceKind.LEDGER,  # the audit and billing subscribers
    "kubernetes-bridge": ServiceKind.CLAIMS,  # claim intake: the claims API's role
}
#: The services that name each request's sender from the broker's directory.
_AUTHENTICATED: Final = ("claims", "enforcement", "ledger")


def _login(args: argparse.Namespace, endpoints: Endpoints) -> Credential | None:
    """``--creds`` / ``DRACAP_NATS_CREDS``, else the service's own file, else none."""
    if args.creds or os.environ.get("DRACAP_NATS_CREDS"):
        return endpoints.credential()
    auth = AuthDir(Path(args.data_dir) / AUTH_DIR)
    user = "claims" if args.service == "kubernetes-bridge" else args.service
    return auth.service(user) if auth.has_service(user) else None


def _directory_path(args: argparse.Namespace) -> Path | None:
    if args.directory:
        return Path(args.directory)
    path = AuthDir(Path(args.data_dir) / AUTH_DIR).directory
    return path if path.exists() else None


async def serve(args: argparse.Namespace) -> int:
    """Run ``args.service`` until a signal arrives."""
    directory = None
    if args.service in _AUTHENTICATED and not args.insecure:
        path = _directory_path(args)
        if path is None:
            raise CommandError(
                f"{args.service} needs the broker's directory to know who sends each request "
                "(dracap auth init writes <data-dir>/auth/directory.json; --directory FILE); "
                "--insecure serves anonymous requests",
                ExitCode.BAD_INPUT,
            )
        directory = read_directory(path)
    credential = _login(args, endpoints_from_args(args))
    async with serving(
        args,
        args.service,
        login=SERVICES[args.service],
        nats=True,
        credential=credential,
        # the relay owns the stream: it may ask JetStream; the others ask the server only
        stream_check=args.service == "relay",
    ) as context:
        run = await _service(context, directory, args)
        log.info("%s started (prefix %s)", args.service, context.names.prefix)
        await run(context.stop)
    return ExitCode.OK


async def _service(
    context: StoreProcessContext, directory: Any, args: argparse.Namespace
) -> Callable[[asyncio.Event], Awaitable[None]]:
    """The ``run(stop)`` of the service of ``context``, started; its checks registered."""
    name, store, names = context.service, context.store, context.names
    if name == "relay":
        from services import durables
        from services.runtime.delivery.rebuilding import BusKeeper
        from services.runtime.delivery.relaying import Relay
        from services.runtime.ops.leadership import RELAY_KEY, Leadership

        replicas = args.stream_replicas or context.settings.stream_replicas
        carried = durables.carried(names)  # the bus carries what some durable reads
        keeper = BusKeeper(
            store,
            context.js,
            names,
            durables.relay_owned(names),
            replicas=replicas,
            carried=carried,
        )
        lease = Leadership(context.settings, RELAY_KEY, "relay")
        relay = Relay(
            context.service_context(store), keeper=keeper, leased=lease.check, carried=carried
        )

        async def relay_while_leased(stop: asyncio.Event) -> None:
            await lease.run(stop, relay.run)

        return relay_while_leased
    live = await context.live_state()
    if name == "kubernetes-bridge":
        return await _bridge(context.service_context(LogAndFold(store, live)), args)
    if name == "enforcement":
        from services.enforcement.service import EnforcementService

        enforcement = EnforcementService(
            context.service_context(LogAndFold(store, live)),
            directory=directory,
            authenticated=directory is not None,
            tail=True,  # nobody else folds the log in this process
        )
        await enforcement.start()
        return enforcement.run
    if name == "ledger":
        return _ledger(context, live, directory)
    if name == "claims":
        from services.claims.api import ClaimsApi

        api = ClaimsApi(
            context.service_context(LogAndFold(store, live)),
            directory=directory,
            authenticated=directory is not None,
            tail=True,  # nobody else folds the log in this process
        )
        await api.start()
        _derive_metrics(live)
        return api.run
    from services.reservation.service import ReservationService

    service = ReservationService(context.service_context(LogAndFold(store, live)), owner=False)
    context.health.register("consumers", consumers_probe(lambda: service.running))

    async def reservation(stop: asyncio.Event) -> None:
        await context.tailing(live, service.run(stop))

    return reservation


async def _bridge(
    context: ServiceContext[LogAndFold], args: argparse.Namespace
) -> Callable[[asyncio.Event], Awaitable[None]]:
    from services.claims.bridge import Bridge
    from services.runtime.kube.client import KubeApi
    from services.runtime.kube.errors import KubeApiError, Permanent

    if not args.driver:
        raise CommandError(
            "kubernetes-bridge needs --driver NAME (each DRA driver whose devices dracap "
            "manages; repeat for several)",
            ExitCode.BAD_INPUT,
        )
    try:
        api = await KubeApi.from_environment(kubeconfig=args.kubeconfig)
    except KubeApiError as exc:
        raise CommandError(f"Kubernetes API: {exc}", ExitCode.BAD_INPUT) from exc
    bridge = Bridge(context, api, drivers=args.driver)

    async def run(stop: asyncio.Event) -> None:
        async with api:
            try:
                await bridge.run(stop)
            except Permanent as exc:  # RBAC, a bad server address: no retry helps
                raise CommandError(f"Kubernetes API: {exc}", ExitCode.ERROR) from exc

    return run


def _ledger(
    context: StoreProcessContext, live: LiveState, directory: Any
) -> Callable[[asyncio.Event], Awaitable[None]]:
    """Audit and billing on one fold of the log (``live``), each with its ``audit`` or
    ``billing`` check."""
    from services.audit.service import AuditService
    from services.billing.service import BillingService
    from services.runtime.ground.waiting import all_of
    from services.runtime.ops.health import projector_probe

    subscribers = [
        make(
            context.service_context(context.store),
            directory=directory,
            authenticated=directory is not None,
            live=live,
        )
        for make in (AuditService, BillingService)
    ]
    for subscriber in subscribers:
        context.health.register(subscriber.projector.name, projector_probe(subscriber.projector))

    async def ledger(stop: asyncio.Event) -> None:
        # the subscribers ask their view for each batch: it reads then, not per commit
        await context.tailing(live, all_of(*(s.run(stop) for s in subscribers)), on_demand=True)

    return ledger


def _derive_metrics(live: LiveState) -> None:
    """Serve the metrics derived from the log (capacity, SLOs) from this live state, as
    ``dracap up`` does: the claims API folds every event, the other services may not."""
    from services.runtime.ops.gauges import CapacityGauges
    from services.runtime.ops.holdings import HeldCapacity
    from services.runtime.ops.slos import SloTracker

    CapacityGauges(live).start()
    SloTracker(live).start()
    HeldCapacity(live).start()


def run(args: argparse.Namespace) -> int:
    """Entry point of ``dracap serve``."""
    return run_service(lambda: serve(args))


def register(sub: Any) -> None:
    """Add ``dracap serve`` to the command line."""
    parser = sub.add_parser(
        "serve",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("service", choices=sorted(SERVICES), help="the service to run")
    add_endpoint_arguments(parser, database=True, nats=True)
    parser.add_argument(
        "--directory",
        metavar="FILE",
        help="the broker's directory of users (claims, enforcement, ledger; default "
        "<data-dir>/auth/directory.json)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="claims, enforcement, ledger: serve requests without the broker's identity "
        "(experiments only)",
    )
    parser.add_argument(
        "--driver",
        action="append",
        default=[],
        metavar="NAME",
        help="kubernetes-bridge: a DRA driver whose claims dracap mirrors (repeatable)",
    )
    parser.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="kubernetes-bridge: the kubeconfig (default: in-cluster, else $KUBECONFIG, "
        "else ~/.kube/config)",
    )
    parser.add_argument(
        "--stream-replicas",
        type=_replicas,
        default=None,
        metavar="N",
        help="relay: copies of the events stream and its consumers on a clustered NATS "
        "(default $DRACAP_STREAM_REPLICAS, else 1; 3 rides out the loss of a server)",
    )
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: off)")
    parser.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR")
    parser.set_defaults(func=run)


def _replicas(text: str) -> int:
    try:
        return stream_replicas(int(text), "--stream-replicas")
    except (ValueError, SettingsError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
