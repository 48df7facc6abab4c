"""The stores of a service that decides on the fold: the event store and its live state.

The claims API, the reservation and enforcement services and the reclamation service
append to the log and decide on what the log says now; they are handed both as
``ServiceContext[LogAndFold]`` (:mod:`services.runtime.ground.context`). Several
services of one process may share one live state (``dracap up`` folds the log once).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.runtime.store.eventstore import EventStore
from services.runtime.store.livestate import LiveState

__all__ = ["LogAndFold"]


@dataclass(frozen=True, slots=True)
class LogAndFold:
    """A service's event store (its own login) and the live state it decides on."""

    store: EventStore
    live: LiveState
