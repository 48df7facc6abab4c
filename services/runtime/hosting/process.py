"""One service as its own process: the wiring every service command shares, written once.

``dracap serve SERVICE``, ``dracap reclaim``, ``dracap agent``, ``dracap audit serve``,
``dracap usage serve`` and ``dracap replay snapshot`` each run one service until a
signal. What surrounds the service is the same for all of them, and lives here:

1. :func:`run_service` is the entry point's part: one line per record to standard
   error, the collector tuned for a long-lived fold (:mod:`services.runtime.ground.gctuning`:
   thresholds, and the survivors of full collections frozen while the loop runs; put
   back as they were when it ends), the service loop
   (:mod:`services.runtime.ground.eventloop`); a bad setting is one line and exit 2, Ctrl-C
   exit 0. A service that ``dracap up`` runs as its child (``dracap serve ledger``) first
   asks to be stopped when ``dracap up`` dies (:func:`~services.runtime.ops.children.
   stop_with_parent`).
2. :func:`hosting` is the process's part, in this order: the servers found as every
   command finds them (:mod:`services.runtime.bus.endpoints`); NATS connected with the
   service's credential (one line and exit 1 when it cannot be reached); only then
   SIGINT and SIGTERM set the stop event (before, a signal ends the command with exit
   130, as any command's: a service stopped while it connects does not hang); every
   known metric series created at 0 (:mod:`services.runtime.ops.series`); ``/metrics``,
   ``/healthz`` and ``/readyz`` served with the service's checks
   (:mod:`services.runtime.ops.health`: ``postgres`` on the service's own login and
   ``nats`` are registered here, the rest by the service as what they check starts).
   On the way out NATS is drained, whatever ended the service.

The process gets everything as one :class:`ProcessContext`; the service is handed its
part, :meth:`ProcessContext.service_context` (a
:class:`~services.runtime.ground.context.ServiceContext`: settings, stores, bus,
metrics, clock). The node agent needs no
more (it has no database, and an import contract keeps the event store out of its
reach); every other service opens the event store as its own login through
:func:`services.runtime.hosting.storehosting.serving`, which adds the store and the fold to the
context. ``dracap up`` runs every service in one process and shares one store, bus and
monitor between them; it does not use these modules.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.js import JetStreamContext

from events.subjects import BusNames
from services.exitcodes import ExitCode
from services.runtime.bus.credentials import Credential
from services.runtime.bus.endpoints import Endpoints, endpoints_from_args, reaching
from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground import eventloop
from services.runtime.ground.context import NotConnectedError, ServiceContext
from services.runtime.ground.gctuning import freeze_at_exit, long_lived_state
from services.runtime.ground.printable import printable
from services.runtime.ground.settings import ServiceKind, Settings, SettingsError, load_settings
from services.runtime.ops.children import log_tag, stop_with_parent
from services.runtime.ops.health import (
    HealthMonitor,
    bus_probe,
    nats_probe,
    service_health,
)
from services.runtime.ops.series import initialise_series

__all__ = ["NotConnectedError", "ProcessContext", "hosting", "run_service"]

log = logging.getLogger("dracap.serve")

StoresT = TypeVar("StoresT")


@dataclass(slots=True)
class ProcessContext:
    """What a service process hands its service (see the module docstring)."""

    service: str  #: the service's name: its health checks and log lines
    endpoints: Endpoints
    settings: Settings
    database_url: str | None  #: the service's own login (None: it has no database)
    names: BusNames
    stop: asyncio.Event  #: set by SIGINT or SIGTERM; the service ends its work then
    health: HealthMonitor
    connection: Client | None
    jetstream: JetStreamContext | None

    @property
    def nc(self) -> Client:
        """The NATS connection, with the service's credential."""
        return self.service_context(None).nc

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context of :attr:`nc`."""
        return self.service_context(None).js

    def service_context(self, stores: StoresT) -> ServiceContext[StoresT]:
        """What the service is handed (:mod:`services.runtime.ground.context`): this
        process's settings, bus and names, with ``stores``."""
        return ServiceContext(
            stores=stores,
            names=self.names,
            settings=self.settings,
            connection=self.connection,
            jetstream=self.jetstream,
            service=self.service,
        )


@contextlib.asynccontextmanager
async def hosting(
    args: argparse.Namespace,
    service: str,
    *,
    login: ServiceKind | None = None,
    nats: bool = False,
    credential: Credential | None = None,
    client_name: str | None = None,
    stream_check: bool = False,
    series: bool = True,
) -> AsyncIterator[ProcessContext]:
    """Service ``service``'s process around the block (see the module docstring).

    ``login``: the service's database login (None: no database; the store is opened by
    :func:`services.runtime.hosting.storehosting.serving`, the ``postgres`` check here);
    ``nats``: connect as ``client_name`` (default ``dracap-<service>``) with
    ``credential`` (default: the command's ``--creds``); its ``nats`` check is a round
    trip to the server, or with ``stream_check`` a look at the stream (its owner, the
    relay); ``series``: create every known metric series at 0."""
    endpoints = endpoints_from_args(args, service=login)
    settings = endpoints.settings(load_settings())
    database_url = endpoints.database() if login is not None else None
    names = BusNames(endpoints.prefix)
    nc = js = None
    if nats:  # before the signal handlers: a signal while connecting ends the command
        nats_url = endpoints.nats()
        with reaching("NATS", nats_url):
            nc, js = await connect_bus(
                nats_url,
                name=client_name or f"dracap-{service}",
                credential=endpoints.credential() if credential is None else credential,
                ping_interval=settings.nats_ping_interval_s,
            )
    try:
        stop = eventloop.stop_on_signals()
        if series:
            initialise_series()
        port, addr = args.metrics_port, args.metrics_addr
        async with service_health(
            service, port, addr, database_url=database_url, stop=stop
        ) as health:
            if nc is not None and js is not None:
                probe = nats_probe(nc, js, names.stream) if stream_check else bus_probe(nc)
                health.register("nats", probe)
            yield ProcessContext(
                service, endpoints, settings, database_url, names, stop, health, nc, js
            )
    finally:
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.drain()


def run_service(
    main: Callable[[], Coroutine[Any, Any, int]],
    *,
    bad_input: tuple[type[Exception], ...] = (),
) -> int:
    """A service command's entry point (see the module docstring): ``main()``'s exit
    code; a bad setting (or one of ``bad_input``) is one line and exit 2, Ctrl-C 0."""
    refused: tuple[type[Exception], ...] = (SettingsError, *bad_input)
    if not stop_with_parent():  # a child of dracap up whose dracap up is gone already
        return ExitCode.OK
    eventloop.log_to_stderr(log_tag())
    freeze_at_exit()  # the process's own exit: no walk of the fold (gctuning)
    try:
        with long_lived_state():
            return eventloop.run(main())
    except refused as exc:
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except KeyboardInterrupt:
        return ExitCode.OK
