"""What every service is handed: one :class:`ServiceContext`.

A service needs the same five things whatever it does: the process's settings, its
stores, its bus handles, the metrics registry and the clock its timers run on. Each
took them its own way (a store, a fold, a connection, a JetStream context and the
stream's names as five positional parameters; a clock here, none there); now every
service's constructor takes one ``ServiceContext`` first and then only what is truly
its own (a worker's index, a tick, a feature gate, whom to trust).

* ``stores`` is typed by the service: ``ServiceContext[EventStore]`` for the relay and
  the audit and billing subscribers, ``ServiceContext[LogAndFold]`` (the store and the
  live state, :mod:`services.runtime.store.logandfold`) for the services that decide on
  the fold, ``ServiceContext[None]`` for the node agent, which has no database (an
  import contract keeps the store out of its reach: this module names no store type).
* the bus: the stream's :class:`~events.subjects.BusNames`, the NATS connection and its
  JetStream context; a service that asks for a handle its process did not connect gets
  :class:`NotConnectedError` (a wiring defect), not ``None``.
* ``metrics``: the registry every ``dracap_`` series lives in
  (:data:`services.runtime.ground.metrics.REGISTRY`); ``clock``: the
  :class:`~services.runtime.ground.clock.Clock` of the service's timers (a test hands
  a fake one and advances it).

Who builds one: ``dracap up`` and the integration stack (:mod:`services.stack`), one per
service from the stack's shared settings and clients; a service run as its own process
gets one from :mod:`services.runtime.hosting` (``ProcessContext.service_context``). A
test builds one with the fields it needs: :meth:`ServiceContext.with_stores` hands the
same bus, settings and clock to another service with other stores.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from nats.aio.client import Client
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry

from events.subjects import BusNames
from services.runtime.ground.clock import SYSTEM, Clock
from services.runtime.ground.errors import PermanentError
from services.runtime.ground.metrics import REGISTRY
from services.runtime.ground.settings import Settings

__all__ = ["NotConnectedError", "ServiceContext"]

StoresT = TypeVar("StoresT")
OtherT = TypeVar("OtherT")


class NotConnectedError(PermanentError):
    """A service asked for a server its process did not connect to (a wiring defect)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceContext(Generic[StoresT]):
    """A service's settings, stores, bus handles, metrics registry and clock."""

    stores: StoresT  #: the service's stores (typed by the service)
    names: BusNames  #: the events stream's subjects and names
    settings: Settings = field(default_factory=Settings)
    connection: Client | None = None  #: the service's NATS connection (None: none)
    jetstream: JetStreamContext | None = None  #: its JetStream context (None: none)
    metrics: CollectorRegistry = REGISTRY
    clock: Clock = SYSTEM
    service: str = "service"  #: the service's name (messages of a wiring defect)

    @property
    def nc(self) -> Client:
        """The NATS connection, with the service's credential."""
        if self.connection is None:
            raise NotConnectedError(f"{self.service} was started without NATS")
        return self.connection

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context of :attr:`nc`."""
        if self.jetstream is None:
            raise NotConnectedError(f"{self.service} was started without NATS")
        return self.jetstream

    def with_stores(self, stores: OtherT) -> ServiceContext[OtherT]:
        """This context with other stores (for another service of the same process)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["stores"] = stores
        return ServiceContext(**fields)
