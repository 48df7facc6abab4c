"""A hosted service with the event store: :func:`hosting` plus the store and its fold.

Every service process but the node agent's reads and appends the event log:
:func:`serving` is :func:`services.runtime.hosting.process.hosting` with the event store
opened first, as the service's own database login (one line and exit 1 when PostgreSQL
cannot be reached, or its schema is older than this release needs:
:mod:`services.runtime.store.schema`), and closed on the way out.
:meth:`StoreProcessContext.live_state` loads the fold (the newest snapshot, then the log
up to its head) and registers the ``state`` check; :meth:`StoreProcessContext.tailing`
keeps that fold following the log while the service runs, and stops both together.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from services.runtime.bus.endpoints import ServerUnavailable, endpoints_from_args, reaching, redact
from services.runtime.ground.settings import ServiceKind, load_settings
from services.runtime.hosting.process import ProcessContext, hosting
from services.runtime.ops.health import live_probe
from services.runtime.store.eventstore import EventStore
from services.runtime.store.livestate import HEAD, LiveState
from services.runtime.store.schema import SchemaBehind, require_schema

__all__ = ["StoreProcessContext", "serving"]


@dataclass(slots=True)
class StoreProcessContext(ProcessContext):
    """A :class:`~services.runtime.hosting.process.ProcessContext` with the event store."""

    store: EventStore

    async def live_state(self, *, fresh: bool = True) -> LiveState:
        """The service's fold: from the newest snapshot, up to the log's head unless
        ``fresh`` is False; its ``state`` check registered."""
        live = LiveState(self.store)
        await live.load_snapshot()
        if fresh:
            await live.fresh(HEAD)
        self.health.register("state", live_probe(live))
        return live

    async def tailing(
        self, live: LiveState, work: Awaitable[None], *, on_demand: bool = False
    ) -> None:
        """Await ``work`` while ``live`` follows the log (tails it, or ``on_demand``:
        :meth:`~services.runtime.store.livestate.LiveState.follow_on_demand`), stopped
        when ``work`` ends. A tailing that fails first leaves ``work`` running: the
        ``state`` check says the view is not tailing (the process is not ready), and the
        tailing's error is raised once ``work`` ends."""
        follow = live.follow_on_demand if on_demand else live.run
        tail = asyncio.create_task(follow(self.stop))
        try:
            await work
        finally:
            self.stop.set()
            await tail


@contextlib.asynccontextmanager
async def serving(
    args: argparse.Namespace, service: str, *, login: ServiceKind, **process: Any
) -> AsyncIterator[StoreProcessContext]:
    """:func:`~services.runtime.hosting.process.hosting` (``process``: its options) with the event
    store opened as ``login``."""
    endpoints = endpoints_from_args(args, service=login)
    # before the process's signal handlers, as NATS (see hosting)
    url = endpoints.database()
    with reaching("PostgreSQL", url):
        store = await EventStore.open(endpoints.settings(load_settings()))
    try:
        with reaching("PostgreSQL", url):
            await require_schema(store.pool)
    except SchemaBehind as exc:
        await store.close()
        raise ServerUnavailable(f"PostgreSQL at {redact(url)}: {exc}") from None
    except BaseException:
        await store.close()
        raise
    try:
        async with hosting(args, service, login=login, **process) as context:
            fields = {f.name: getattr(context, f.name) for f in dataclasses.fields(context)}
            yield StoreProcessContext(**fields, store=store)
    finally:
        await store.close()
