"""The durable consumers of the events stream, and who owns each.

Every durable consumer is created (and created again, should the broker lose it) by
exactly one owner; everyone else only pulls from it and acknowledges. Creating a
consumer is a power beyond reading: nats-server accepts a *push* consumer whose deliver
subject is a JetStream API subject of the stream's account. So the owner of a durable
is a service whose job already includes changing the stream, or the one the design
names for it:

======================================== ============== ================== ===============
durable                                  filter          read by            owned by
======================================== ============== ================== ===============
``reservation-<feed>`` (:data:`~services ``{p}.ev.<tag    reservation        relay
.reservation.service.FEEDS`)             or category>``  workers
``agent-<node>``                         ``{p}.ev.*.      the node's agent   enforcement
                                         <node>.>``                         service (at the
                                                                            agent's lease,
                                                                            and when the
                                                                            agent finds it
                                                                            missing)
======================================== ============== ================== ===============

The relay owns the stream as well (:mod:`services.runtime.delivery.rebuilding`), and the broker's
accounts (:mod:`services.brokerauth`) grant exactly these powers: the owner may create
and read its durables, the reader may pull and acknowledge. The audit and billing
subscribers have none: they read the log (:mod:`services.runtime.delivery.projecting`).
"""

from __future__ import annotations

from events.subjects import BusNames
from services.enforcement import consumer
from services.reservation.service import durables as reservation_durables
from services.runtime.bus.jetstream import Durable

__all__ = ["agent", "relay_owned", "reservation"]


def reservation(names: BusNames) -> list[Durable]:
    """The reservation workers' durables, one per feed."""
    return reservation_durables(names)


def relay_owned(names: BusNames) -> list[Durable]:
    """Every durable the relay creates and keeps: the services'."""
    return reservation(names)


def agent(names: BusNames, node: str) -> Durable:
    """The durable of ``node``'s agent: the events addressed to that node."""
    return consumer.durable(names, node)
