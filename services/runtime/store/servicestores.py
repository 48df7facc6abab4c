"""The event stores of one process: one per database role its services connect as.

``dracap up`` runs every service in one process, yet each kind of service connects to
PostgreSQL as its own user (migration 0006, :mod:`services.runtime.store.dbroles`): the claims
API as a member of ``dracap_claims``, the reservation workers of
``dracap_reservation``, the relay of ``dracap_relay``, the enforcement service (the
node agents' way to the log; they have no database user) of ``dracap_enforcement``, the
snapshot writer of ``dracap_snapshots``, and the live state — which only reads — of
``dracap_readonly``. A role is a
session's, so each needs a pool of its own: :class:`ServiceStores` opens one
:class:`~services.runtime.store.eventstore.EventStore` per distinct connection
(:meth:`~services.runtime.ground.settings.Settings.for_service` says which), and one only when
no kind has a URL of its own — today's single store acting as ``DRACAP_APP_ROLE``.

The stores *share their commits* (``EventStore.open(..., sharing=reader)``): the live
state and the relay follow the reader's and the relay's store, and an append made
through any other store of the process is handed over to them and raises the head they
know, exactly as an append through their own store would. Read-your-writes
(``LiveState.fresh(SEEN)``) therefore holds across roles.

The relay, the enforcement service, the subscribers and the snapshot writer get small pools
(:data:`SMALL_POOL`): each does one thing at a time, and every pool counts against the
server's ``max_connections``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Final

import msgspec

from services.runtime.ground.settings import ServiceKind, Settings
from services.runtime.store.eventstore import EventStore

__all__ = ["SMALL_POOL", "ServiceStores"]

SMALL_POOL: Final = 4
_SMALL: Final = frozenset(
    {
        ServiceKind.RELAY,
        ServiceKind.RECLAMATION,
        ServiceKind.LEDGER,
        ServiceKind.SNAPSHOTS,
        ServiceKind.ENFORCEMENT,
    }
)


class ServiceStores:
    """Which store each service uses (see the module docstring)."""

    def __init__(self, reader: EventStore) -> None:
        #: the live state's store (read-only role when roles are configured)
        self.reader = reader
        self._chosen: dict[ServiceKind, EventStore] = {}
        self._opened: list[EventStore] = [reader]

    @classmethod
    def single(cls, store: EventStore) -> ServiceStores:
        """Every service on ``store``."""
        return cls(store)

    @classmethod
    async def open(
        cls, settings: Settings, *, without: Collection[ServiceKind] = ()
    ) -> ServiceStores:
        """A store per distinct connection of the services (but those of ``without``:
        services of those kinds run elsewhere)."""
        reader_settings = settings.for_service(ServiceKind.READONLY)
        stores = cls(await EventStore.open(reader_settings))
        by_connection = {_connection(reader_settings): stores.reader}
        try:
            for kind in ServiceKind:
                if kind == ServiceKind.READONLY or kind in without:
                    continue
                own = settings.for_service(kind)
                store = by_connection.get(_connection(own))
                if store is None:
                    if kind in _SMALL:
                        own = _small(own)
                    store = await EventStore.open(own, sharing=stores.reader)
                    by_connection[_connection(own)] = store
                    stores._opened.append(store)
                stores._chosen[kind] = store
        except BaseException:
            await stores.close()
            raise
        return stores

    def of(self, kind: ServiceKind) -> EventStore:
        """The store of a service of ``kind``."""
        return self._chosen.get(kind) or self.reader

    @property
    def opened(self) -> tuple[EventStore, ...]:
        """Every distinct store, the reader first."""
        return tuple(self._opened)

    async def close(self) -> None:
        """Close every store this object opened (the reader last)."""
        for store in reversed(self._opened):
            await store.close()


def _connection(settings: Settings) -> tuple[str, str]:
    return settings.database_url, settings.app_role


def _small(settings: Settings) -> Settings:
    size = min(settings.pool_max_size, SMALL_POOL)
    return msgspec.structs.replace(
        settings, pool_max_size=size, pool_min_size=min(settings.pool_min_size, size)
    )
