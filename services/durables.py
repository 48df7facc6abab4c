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

The bus carries what these durables read and nothing else (:func:`carried`): every event
addressed to a node, and the events of the tags a reservation feed reads. The log holds
every event; the relay leaves the others off the stream (an event no durable reads would
be stored by JetStream, acknowledged to the relay and read by nobody).

The relay owns the stream as well (:mod:`services.runtime.delivery.rebuilding`), and the broker's
accounts (:mod:`services.brokerauth`) grant exactly these powers: the owner may create
and read its durables, the reader may pull and acknowledge. The audit and billing
subscribers have none: they read the log (:mod:`services.runtime.delivery.projecting`).
"""

from __future__ import annotations

from events.catalog import EVENT_TYPES
from events.subjects import BusNames, Carried, subject_matches
from services.enforcement import consumer
from services.reservation.service import durables as reservation_durables
from services.runtime.bus.jetstream import Durable

__all__ = ["agent", "carried", "relay_owned", "reservation"]


def reservation(names: BusNames) -> list[Durable]:
    """The reservation workers' durables, one per feed."""
    return reservation_durables(names)


def relay_owned(names: BusNames) -> list[Durable]:
    """Every durable the relay creates and keeps: the services'."""
    return reservation(names)


def agent(names: BusNames, node: str) -> Durable:
    """The durable of ``node``'s agent: the events addressed to that node."""
    return consumer.durable(names, node)


def carried(names: BusNames) -> Carried:
    """The events some durable reads: each tag whose subject (under no node) a reservation
    feed's filter matches; an agent's filter matches every event addressed to its node."""
    filters = [durable.filter_subject for durable in reservation(names)]
    return Carried(
        frozenset(
            tag
            for tag in EVENT_TYPES
            if any(subject_matches(f, names.subject_of(tag, None)) for f in filters)
        )
    )
