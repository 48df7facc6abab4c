"""The stack: every service of the control plane as supervised asyncio tasks in one loop.

:class:`Stack` is what ``dracap up`` runs once its servers, migrations, database users
and bus are in place (:mod:`services.commands.up`), and what the integration tests,
``dracap prove`` and ``benchmarks/pipeline.py`` start on their own database and subject
prefix. :func:`start_services` starts, in order: the relay (which owns the stream and
the services' durable consumers), the live state from the newest snapshot that
verifies, the snapshot writer, the claims and admin APIs, the reservation workers, the
reclamation service, the audit and billing subscribers, the enforcement service and
one node agent per node (NATS only). :func:`read_inventory` and
:func:`load_inventory` load the example inventory through the admin API.

Supervision
-----------
Each service runs as a supervised task: if its ``run(stop)`` raises, the error is logged
with its traceback and the service is started again after a back-off (0.5 s doubling
to 30 s; cut short and started over when a health check passes again, so a service
that failed during an outage restarts as soon as the server is back). Services keep no
state that a restart loses (consumers resume from JetStream and the processed-message
table, the live state re-folds), so one failing consumer degrades the stack instead of
ending it.

Stopping
--------
SIGINT and SIGTERM set one ``stop`` event. Every task's ``run(stop)`` drains and
returns; the stack waits for them (cancelling stragglers after a grace period), closes
the NATS connection and the store; the caller stops its servers after that (``dracap
up``: the embedded ones, nats-server first, then a fast PostgreSQL shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import msgspec

from events import model
from events.manifests import load_paths
from events.subjects import BusNames
from services.claims.objects import apply_objects
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.credentials import AuthDir, Credential, Directory, read_directory
from services.runtime.ground.clock import SYSTEM, Clock
from services.runtime.ground.context import ServiceContext
from services.runtime.ground.outages import is_outage, one_line
from services.runtime.ground.settings import ServiceKind, Settings
from services.runtime.ground.waiting import wait_for
from services.runtime.store.eventstore import EventStore
from services.runtime.store.servicestores import ServiceStores

if TYPE_CHECKING:
    from services.runtime.ops.gauges import CapacityGauges

STOP_GRACE_S: Final = 10.0
RESTART_MIN_S: Final = 0.5
RESTART_MAX_S: Final = 30.0

log = logging.getLogger("dracap.up")


# --- inventory -----------------------------------------------------------------------------


class InventoryManifests(msgspec.Struct, frozen=True, kw_only=True):
    """The DRA objects of ``--inventory`` that ``dracap up`` loads through the admin API."""

    classes: list[model.DeviceClass]
    slices: list[model.ResourceSlice]
    namespaces: list[model.Namespace]

    @property
    def nodes(self) -> list[str]:
        return sorted({s.spec.node_name for s in self.slices if s.spec.node_name})


def read_inventory(paths: Sequence[str]) -> InventoryManifests:
    """DeviceClasses, ResourceSlices and Namespaces of ``paths`` (claims are ignored)."""
    objects = [obj for _, obj in load_paths(paths)] if paths else []
    return InventoryManifests(
        classes=[o for o in objects if isinstance(o, model.DeviceClass)],
        slices=[o for o in objects if isinstance(o, model.ResourceSlice)],
        namespaces=[o for o in objects if isinstance(o, model.Namespace)],
    )


async def load_inventory(api: ApiClient, inventory: InventoryManifests) -> int:
    """Apply what is missing; returns how many slices were applied (0: already loaded).

    A slice counts as loaded when the admin API lists every one of its devices. Classes
    and namespace access are applied together with the first missing slice, so a
    restart on an already loaded data directory appends nothing (and keeps what an
    operator changed since). The objects go through :func:`services.claims.objects.
    apply_objects`, what ``dracap apply`` runs.
    """
    listed = (await api.admin("devices.list"))["devices"]
    known = {(d["driver"], d["pool"], d["device"]) for d in listed}
    missing = [
        s
        for s in inventory.slices
        if any((s.spec.driver, s.spec.pool.name, d.name) not in known for d in s.spec.devices or [])
    ]
    if not missing and listed:
        return 0  # (an inventory without slices is applied each time: its writes are no-ops)
    await apply_objects(api, [*inventory.classes, *inventory.namespaces, *missing])
    return len(missing)


# --- the stack -----------------------------------------------------------------------------


StoresT = TypeVar("StoresT")


class Stack:
    """Relay, live state, claims API, reservation workers and agents as asyncio tasks.

    ``async with Stack.running(settings, names, nodes=[...]) as stack:`` starts them and
    stops them on exit (see the module docstring for the order).
    """

    def __init__(
        self,
        store: EventStore,
        nc: Any,
        js: Any,
        names: BusNames,
        *,
        stores: ServiceStores | None = None,
        logins: dict[str, tuple[Any, Any]] | None = None,
        directory: Directory | None = None,
    ) -> None:
        self.store = store  #: the live state's (the reader's) store
        #: each service's store: its database role's (see :func:`start_services`)
        self.stores = stores or ServiceStores.single(store)
        self.nc = nc  #: the relay's connection (every service's without credentials)
        self.js = js
        self.names = names
        #: each service's own connection, by role; none: all share ``nc``
        self.logins = logins or {}
        #: the broker's users, when requests carry their identity (None: --insecure)
        self.directory = directory
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.restarts = 0  #: service failures so far (each was logged and restarted)
        self.failing: dict[str, str] = {}  #: services waiting to be restarted, and why
        self._retry = asyncio.Event()  # set by retry_now(): back-offs end early
        self.gauges: CapacityGauges | None = None  #: the capacity gauges (set on start)
        self.slos: Any = None  #: the service-level tracker (set on start)
        self.holdings: Any = None  #: capacity held per tenant (set on start)
        #: the events stream's replicas (DRACAP_STREAM_REPLICAS; None: 1, or as it is)
        self.stream_replicas: int | None = None
        self.settings = Settings()  #: the process's settings (set by :meth:`running`)
        self.clock: Clock = SYSTEM  #: the services' timers' clock

    def spawn(self, name: str, start: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``start()`` as a supervised task: restarted with back-off if it fails."""
        self.tasks.append(asyncio.create_task(self._supervise(name, start), name=name))

    async def _supervise(self, name: str, start: Callable[[], Coroutine[Any, Any, None]]) -> None:
        delay = RESTART_MIN_S
        while not self.stop.is_set():
            try:
                await start()
                return
            except Exception as exc:
                self.restarts += 1
                self.failing[name] = one_line(exc)
                if is_outage(exc):
                    # a server away or slow to answer: expected, one line (no traceback)
                    log.warning(
                        "%s failed (%s); restarting it in %.1fs", name, self.failing[name], delay
                    )
                else:
                    log.exception("%s failed; restarting it in %.1fs", name, delay)
            retried = await self._back_off(delay)
            self.failing.pop(name, None)
            delay = RESTART_MIN_S if retried else min(delay * 2, RESTART_MAX_S)

    async def _back_off(self, delay: float) -> bool:
        """Wait ``delay``, or less on stop or :meth:`retry_now`; whether retry_now ended it."""
        retry = self._retry
        waits = {asyncio.ensure_future(self.stop.wait()), asyncio.ensure_future(retry.wait())}
        try:
            await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
        return retry.is_set()

    def retry_now(self, check: str = "") -> None:
        """End every service's back-off now and start it over (``check``, a health check
        that passes again, is not needed): a service that failed while a server was
        away must not wait out a delay that grew during the outage."""
        self._retry.set()
        self._retry = asyncio.Event()

    def bus(self, role: str) -> tuple[Any, Any]:
        """The NATS connection and JetStream context of ``role``: ``claims``,
        ``reservation``, ``ledger``, ``enforcement`` or ``agent:<node>`` (the shared one
        without credentials)."""
        return self.logins.get(role, (self.nc, self.js))

    def context(
        self, service: str, stores: StoresT, *, bus: str | None = None
    ) -> ServiceContext[StoresT]:
        """What ``service`` is handed (:mod:`services.runtime.ground.context`): the stack's
        settings, names and clock, ``stores``, and the connection of the ``bus`` role
        (:meth:`bus`; None: none)."""
        nc, js = self.bus(bus) if bus is not None else (None, None)
        return ServiceContext(
            stores=stores,
            names=self.names,
            settings=self.settings,
            connection=nc,
            jetstream=js,
            clock=self.clock,
            service=service,
        )

    async def trouble(self) -> str | None:
        """Why not every service runs (None when they all do): the ``services`` check."""
        problems = [f"{name} restarting after {why}" for name, why in self.failing.items()]
        if not self.stop.is_set():
            problems += [f"{task.get_name()} ended" for task in self.tasks if task.done()]
        return "; ".join(problems) or None

    @classmethod
    @contextlib.asynccontextmanager
    async def running(
        cls,
        settings: Settings,
        names: BusNames,
        *,
        nodes: Sequence[str] = (),
        workers: int = 1,
        auth: AuthDir | None = None,
        subscribers: bool = True,
    ) -> AsyncIterator[Stack]:
        """``auth``: connect each service as its own broker user (:mod:`services.brokerauth`)
        and require the broker's identity on API requests; None: one anonymous connection.
        ``subscribers``: run audit and billing here (False: they run elsewhere, as
        ``dracap up`` runs them: ``dracap serve ledger``, a process of their own)."""
        from services.runtime.bus.jetstream import connect_bus

        elsewhere = () if subscribers else (ServiceKind.LEDGER,)
        stores = await ServiceStores.open(settings, without=elsewhere)
        connections: list[Any] = []
        try:

            async def login(role: str, credential: Credential | None) -> tuple[Any, Any]:
                nc, js = await connect_bus(
                    settings.nats_url,
                    name=f"dracap-{role}",
                    credential=credential,
                    ping_interval=settings.nats_ping_interval_s,
                )
                connections.append(nc)
                return nc, js

            nc, js = await login("relay", auth.service("relay") if auth else None)
            logins: dict[str, tuple[Any, Any]] = {}
            directory = None
            if auth is not None:
                directory = read_directory(auth.directory)
                for service in ("claims", "reservation", "ledger", "enforcement"):
                    if service == "ledger" and not subscribers:
                        continue
                    logins[service] = await login(service, auth.service(service))
                for node in nodes:
                    logins[f"agent:{node}"] = await login(f"agent-{node}", auth.agent(node))
            stack = cls(
                stores.reader, nc, js, names, stores=stores, logins=logins, directory=directory
            )
            stack.stream_replicas = settings.stream_replicas
            stack.settings = settings
            try:
                await start_services(stack, nodes=nodes, workers=workers, subscribers=subscribers)
                yield stack
            finally:
                await stack.shutdown()
        finally:
            for connection in reversed(connections):
                await _bounded(_close_bus(connection), "closing a NATS connection")
            await _bounded(stores.close(), "closing the event stores")

    async def shutdown(self) -> None:
        """Set ``stop``, wait for every task, cancel what is left after the grace period."""
        self.stop.set()
        if self.gauges is not None:
            self.gauges.stop()
        if self.slos is not None:
            self.slos.stop()
        if self.holdings is not None:
            self.holdings.stop()
        if not self.tasks:
            return
        _, pending = await asyncio.wait(self.tasks, timeout=STOP_GRACE_S)
        for task in pending:
            log.warning("task %s did not stop in time; cancelling it", task.get_name())
            task.cancel()
        results = await asyncio.gather(*self.tasks, return_exceptions=True)
        for task, result in zip(self.tasks, results, strict=True):
            if isinstance(result, Exception):
                log.error("task %s failed: %r", task.get_name(), result)
        self.tasks.clear()


async def _bounded(work: Coroutine[Any, Any, object], what: str) -> None:
    """Await ``work`` for at most :data:`STOP_GRACE_S`: shutdown must never hang."""
    try:
        await wait_for(work, STOP_GRACE_S)
    except TimeoutError:
        log.warning("%s took longer than %.0fs; going on", what, STOP_GRACE_S)


async def _close_bus(nc: Any) -> None:
    """Drain a connected client; close one that is not (draining needs the server)."""
    if nc.is_connected:
        await nc.drain()
    else:
        await nc.close()


async def start_services(
    stack: Stack, *, nodes: Sequence[str], workers: int, subscribers: bool = True
) -> None:
    """Start the relay, the live state (from the newest snapshot that verifies), the
    snapshot writer (as ``dracap_snapshots``' user when roles are set up), the APIs,
    reservation workers, the reclamation service, the audit and billing subscribers
    (unless ``subscribers`` is False), the enforcement service and the agents (which
    reach only NATS: each its own connection, and the enforcement service for
    everything of the log)."""
    from services import durables
    from services.audit.service import AuditService
    from services.billing.service import BillingService
    from services.claims.api import ClaimsApi
    from services.enforcement.agent import Agent
    from services.enforcement.enforcers import NoneEnforcer
    from services.enforcement.service import STORE_KIND, EnforcementService
    from services.reclamation.service import ReclamationService
    from services.reservation.service import ReservationService
    from services.runtime.delivery.rebuilding import BusKeeper
    from services.runtime.delivery.relaying import Relay
    from services.runtime.ops.gauges import CapacityGauges, initialise_series
    from services.runtime.ops.holdings import HeldCapacity
    from services.runtime.ops.slos import SloTracker
    from services.runtime.store.livestate import HEAD, LiveState
    from services.runtime.store.logandfold import LogAndFold
    from services.runtime.store.snapshots import serve_snapshots

    js, names, stop, stores = stack.js, stack.names, stack.stop, stack.stores
    relay_store = stores.of(ServiceKind.RELAY)
    # the relay owns the stream and the services' durables: in place before they pull
    carried = durables.carried(names)  # the bus carries what some durable reads
    keeper = BusKeeper(
        relay_store,
        js,
        names,
        durables.relay_owned(names),
        replicas=stack.stream_replicas,
        carried=carried,
    )
    relay = Relay(stack.context("relay", relay_store, bus="relay"), keeper=keeper, carried=carried)
    within = stack.settings.failover_timeout_s  # a cluster electing its leader: a failover
    await keeper.first_check(await relay.load_checkpoint(), within=within)
    stack.spawn("relay", functools.partial(relay.run, stop))
    live = LiveState(stack.store)
    await live.load_snapshot()
    await live.fresh(HEAD)
    snapshots = stores.of(ServiceKind.SNAPSHOTS)
    stack.spawn("snapshots", functools.partial(serve_snapshots, snapshots.pool, live, stop))
    stack.gauges = CapacityGauges(live)
    stack.gauges.start()
    stack.slos = SloTracker(live)
    stack.slos.start()
    stack.holdings = HeldCapacity(live)
    stack.holdings.start()
    stack.spawn("livestate", functools.partial(live.run, stop))
    api = ClaimsApi(
        stack.context("claims", LogAndFold(stores.of(ServiceKind.CLAIMS), live), bus="claims"),
        directory=stack.directory,
        authenticated=stack.directory is not None,
    )
    await api.start()
    stack.spawn("claims-api", functools.partial(api.run, stop))
    consumers: set[str] = set()
    for i in range(workers):
        store = stores.of(ServiceKind.RESERVATION)
        context = stack.context(f"reservation-{i}", LogAndFold(store, live), bus="reservation")
        service = ReservationService(context, worker=i, owner=False)
        consumers.update(c.name for c in service.consumers())
        stack.spawn(f"reservation-{i}", functools.partial(service.run, stop))
    reclamation = ReclamationService(
        stack.context("reclamation", LogAndFold(stores.of(ServiceKind.RECLAMATION), live))
    )
    stack.spawn("reclamation", functools.partial(reclamation.run, stop))
    for subscriber in (AuditService, BillingService) if subscribers else ():  # and queries
        ledger = subscriber(
            stack.context(subscriber.service, stores.of(ServiceKind.LEDGER), bus="ledger"),
            directory=stack.directory,
            authenticated=stack.directory is not None,
            live=live,
        )
        stack.spawn(ledger.projector.name, functools.partial(ledger.run, stop))
    enforcement = EnforcementService(
        stack.context("enforcement", LogAndFold(stores.of(STORE_KIND), live), bus="enforcement"),
        directory=stack.directory,
        authenticated=stack.directory is not None,
    )
    await enforcement.start()
    stack.spawn("enforcement", functools.partial(enforcement.run, stop))
    for node in nodes:
        agent = Agent(
            stack.context(f"agent-{node}", None, bus=f"agent:{node}"),
            node=node,
            enforcer=NoneEnforcer(),
        )
        consumers.add(agent.consumer.name)
        stack.spawn(f"agent-{node}", functools.partial(agent.run, stop))
    initialise_series(sorted(consumers))
