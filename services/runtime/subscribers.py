"""What the log's subscribers that answer queries (audit, billing) share.

Each is a durable consumer of every event (:class:`~services.runtime.consuming.Consumer`,
confirmed against the log) that writes its own tables in the consumer's commit — from
the log read in order, less the events the fold refuses (:mod:`services.runtime.inorder`,
which asks the subscriber's live view: the process's own, given one, else a
:class:`~services.runtime.livestate.LiveState` the subscriber keeps and tails itself) — and,
given a NATS connection, serves its queries on ``<prefix>.<service>...`` while it
consumes (:func:`~services.runtime.queries.serving_queries`: a tenant's subject answers
for that tenant's namespace only). :class:`QueryingSubscriber` is that shell; a
subscriber adds ``handle`` (its writes for a group of messages) and ``query`` (its
answer to a decoded filter). :func:`decode_query` reads a query's filter, naming the
field that is wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client
from nats.js import JetStreamContext

from events.catalog import Envelope
from events.subjects import BusNames
from services.runtime.confirming import LogConfirmation
from services.runtime.consuming import Consumer, Handled, HandlerContext
from services.runtime.credentials import Directory
from services.runtime.eventstore import EventStore
from services.runtime.livestate import LiveState
from services.runtime.queries import QueryError, serving_queries

__all__ = ["QueryingSubscriber", "decode_query"]

F = TypeVar("F")


def decode_query(data: bytes, typ: type[F]) -> F:
    """The filter ``typ`` of a query payload; :class:`QueryError` naming the field otherwise."""
    try:
        return msgspec.json.decode(data or b"{}", type=typ)
    except msgspec.ValidationError as exc:
        text = str(exc)
        field = text.split("`$.", 1)[1].split("`", 1)[0] if "`$." in text else "request"
        raise QueryError(field, text) from None
    except msgspec.DecodeError as exc:
        raise QueryError("request", f"must be a JSON object: {exc}") from None


class QueryingSubscriber:
    """A consumer of every event that serves queries on ``service`` (module docstring)."""

    #: the queries' subject word (``audit``, ``usage``)
    service: str = ""
    #: the durable consumer's name, unless one is given
    consumer_name: str = ""
    #: the envelopes the handler acts on (``None``: every one)
    wants: Callable[[Envelope], bool] | None = None

    def __init__(
        self,
        store: EventStore,
        js: JetStreamContext,
        names: BusNames,
        *,
        name: str | None = None,
        nc: Client | None = None,
        directory: Directory | None = None,
        authenticated: bool = False,
        live: LiveState | None = None,
    ) -> None:
        self.store = store
        #: the view that says which events the fold refused (the process's, or its own)
        self.live = live if live is not None else LiveState(store)
        self._own_live = live is None
        self.names = names
        self.nc = nc
        self.directory = directory
        self.authenticated = authenticated
        self.consumer = Consumer(
            store,
            js,
            names,
            name=name or self.consumer_name,
            filter_subject=names.events_subjects,
            group_handler=self.handle,
            wants=self.wants,
            confirmation=LogConfirmation(store),
        )

    async def handle(self, ctx: HandlerContext, envs: list[Envelope]) -> Handled:
        """The subscriber's writes for ``envs``, committed with their message records."""
        raise NotImplementedError

    async def query(self, namespace: str | None, data: bytes) -> dict[str, Any]:
        """The answer to a query; ``namespace``: the tenant it is limited to."""
        raise NotImplementedError

    async def run(self, stop: asyncio.Event) -> None:
        """Consume (and serve queries, with ``nc``) until ``stop`` is set."""
        tail: asyncio.Task[None] | None = None
        if self._own_live:  # nobody else tails it: its tailer lives as long as this run
            if not self.live.state.position:
                await self.live.load_snapshot()
            tail = asyncio.create_task(self.live.run(asyncio.Event()))
        try:
            await serving_queries(
                lambda: self.consumer.run(stop),
                self.nc,
                self.names,
                service=self.service,
                query=self.query,
                directory=self.directory,
                authenticated=self.authenticated,
            )
        finally:
            if tail is not None:
                tail.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await tail
