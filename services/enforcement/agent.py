"""The node agent: makes each share's limit real on its node and reports it.

One agent runs per node (``dracap agent --node NAME``). It reads only
``names.node_filter(node)`` — the events addressed to its node — through one durable
consumer ``agent-<node>``, so with per-node broker permissions a node never sees
another node's instructions. Its view of shares comes from a
:class:`~services.runtime.livestate.LiveState`.

* ``AllocationBound`` -> for each share of the allocation that is still ``reserved``
  or ``bound``: :meth:`Enforcer.apply` -> ``LimitApplied(level, actual)``. The claim
  becomes ``Ready`` in the fold only when every share has its limit (invariant 7);
  scheduling alone never makes it ready. A failing enforcer gives ``LimitFailed``:
  a retryable failure is first retried through redelivery (the handler raises, the
  consumer naks with back-off) and recorded only on the last delivery; a permanent
  one is recorded at once and fails the claim.
* ``ReleaseRequested`` -> for each share of that allocation version that still holds
  capacity and is not ``unknown`` (the reclamation service owns those):
  :meth:`Enforcer.remove` -> ``LimitRemoved`` (node stream) + ``CapacityReleased``
  (device stream).

Exactly once: the consumer records the message in ``processed_messages`` in the same
transaction as these events, so a redelivery is skipped; the handler also checks each
share's state in the live state (a share already ready or released is left alone),
and appends to the node stream with its expected version, so a second agent for the
same node (or a fence) racing it makes one of them re-read. ``CapacityReleased`` is
itself idempotent in the fold and the ledger (invariant 5). Enforcers are idempotent,
so applying again after a crash before the commit is harmless.

``LimitApplied`` also races the tenant's delete: the fold refuses a limit applied to a
share that is already ``releasing``. So the append that carries ``LimitApplied``
includes an *empty* batch for the claim stream at the version the agent read — a pure
version check (``EventStore.append_many`` checks every batch's expected version, with
or without events). If ``ReleaseRequested`` got in first, the append conflicts, the
message is redelivered, and the agent then sees the share releasing and leaves it.

All events of one message go out in one append, atomically with the consumer's
checkpoint.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import re
from typing import Final

from nats.js import JetStreamContext

from events.catalog import (
    AllocationBound,
    CapacityReleased,
    Envelope,
    Event,
    LimitApplied,
    LimitFailed,
    LimitRemoved,
    ReleaseRequested,
    claim_stream,
    device_stream,
    node_stream,
)
from events.fold import ShareState
from events.subjects import BusNames, node_token
from services.enforcement.enforcers import EnforcementError, Enforcer, ShareLimit
from services.runtime.consuming import Consumer, Handled, HandlerContext
from services.runtime.eventstore import Batch, EventStore
from services.runtime.livestate import LiveState
from services.runtime.metrics import CLAIMS, ENFORCEMENT_LATENCY

__all__ = ["Agent", "consumer_name"]

log = logging.getLogger("dracap.agent")

_DURABLE_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_-]")
_APPLICABLE: Final = frozenset({"reserved", "bound"})
_RELEASABLE: Final = frozenset({"reserved", "bound", "ready", "releasing"})


def consumer_name(node: str) -> str:
    """The durable consumer of ``node``'s agent (a JetStream-safe name)."""
    return "agent-" + _DURABLE_UNSAFE.sub("_", node_token(node))


class _Events:
    """Events of one message, grouped per stream (node stream at its expected version)."""

    def __init__(self) -> None:
        self.streams: dict[str, tuple[int | None, list[Event]]] = {}

    def add(self, stream: str, version: int | None, event: Event | None) -> None:
        """Add ``event`` (``None``: only check the stream's version) to ``stream``'s batch."""
        events = self.streams.setdefault(stream, (version, []))[1]
        if event is not None:
            events.append(event)

    def batches(self) -> list[Batch]:
        return [Batch(s, v, events) for s, (v, events) in self.streams.items()]


class Agent:
    """The node agent of one node (see the module docstring)."""

    def __init__(
        self,
        store: EventStore,
        js: JetStreamContext,
        names: BusNames,
        *,
        node: str,
        enforcer: Enforcer,
        live: LiveState | None = None,
        max_deliver: int = 5,
    ) -> None:
        self.store = store
        self.js = js
        self.names = names
        self.node = node
        self.enforcer = enforcer
        self.live = live if live is not None else LiveState(store)
        self.max_deliver = max_deliver
        self.consumer = Consumer(
            store,
            js,
            names,
            name=consumer_name(node),
            filter_subject=names.node_filter(node),
            handler=self.handle,
            max_deliver=max_deliver,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Consume this node's events until ``stop`` is set."""
        await self.live.catch_up()
        await self.consumer.run(stop)

    async def handle(self, ctx: HandlerContext, env: Envelope) -> Handled:
        """Apply or remove limits for one message (see the module docstring)."""
        event = env.event
        if isinstance(event, AllocationBound) and event.node == self.node:
            await self.live.catch_up(ctx.connection)
            return await self._bound(ctx, env, event)
        if isinstance(event, ReleaseRequested) and event.node == self.node:
            await self.live.catch_up(ctx.connection)
            return await self._release(event)
        return Handled()

    def _mine(self, share: ShareState | None) -> bool:
        return share is not None and share.node in (None, self.node)

    async def _bound(self, ctx: HandlerContext, env: Envelope, event: AllocationBound) -> Handled:
        state = self.live.state
        out = _Events()
        stream = node_stream(self.node)
        version = await self.live.stream_version(stream)
        applied = 0
        for share_id in event.share_ids:
            share = state.shares.get(share_id)
            if share is None or not self._mine(share) or share.state not in _APPLICABLE:
                continue
            if share.allocation_version != event.allocation_version:
                continue
            try:
                limit = await self.enforcer.apply(_limit_of(share))
            except EnforcementError as exc:
                if exc.retryable and ctx.delivery < self.max_deliver:
                    raise
                log.error("limit of share %s failed: %s", share_id, exc)
                failed = LimitFailed(
                    share_id=share_id, node=self.node, retryable=exc.retryable, reason=str(exc)
                )
                out.add(stream, version, failed)
                continue
            out.add(
                stream,
                version,
                LimitApplied(
                    share_id=share_id, node=self.node, level=limit.level, actual=limit.actual
                ),
            )
            applied += 1
        if out.streams:
            # A guard, no events: append only while the claim stream is where we read it,
            # so a ReleaseRequested that raced us is seen (LimitApplied must never follow
            # it: the share would be "releasing", invariant 7). On a clash the consumer
            # naks and the redelivery finds the share releasing and skips it.
            guard = claim_stream(event.namespace, event.name)
            out.add(guard, await self.live.stream_version(guard), None)
        if applied:
            age = datetime.datetime.now(datetime.UTC) - env.recorded_at
            ENFORCEMENT_LATENCY.observe(max(0.0, age.total_seconds()))
            if applied == len(event.share_ids):
                CLAIMS.labels(outcome="ready").inc()
        return Handled(batches=out.batches(), actor=f"agent:{self.node}")

    async def _release(self, event: ReleaseRequested) -> Handled:
        state = self.live.state
        claim = state.claim(event.namespace, event.name)
        if claim is None or claim.allocation_version != event.allocation_version:
            return Handled()
        out = _Events()
        stream = node_stream(self.node)
        version = await self.live.stream_version(stream)
        for share_id in claim.share_ids:
            share = state.shares.get(share_id)
            if share is None or not self._mine(share) or share.state not in _RELEASABLE:
                continue
            if share.allocation_version != event.allocation_version:
                continue
            await self.enforcer.remove(share_id)
            out.add(stream, version, LimitRemoved(share_id=share_id, node=self.node))
            out.add(device_stream(share.driver, share.pool, share.device), None, _released(share))
        if out.streams:
            CLAIMS.labels(outcome="released").inc()
        return Handled(batches=out.batches(), actor=f"agent:{self.node}")


def _limit_of(share: ShareState) -> ShareLimit:
    return ShareLimit(
        share_id=share.share_id,
        driver=share.driver,
        pool=share.pool,
        device=share.device,
        consumed=dict(share.consumed),
        admin_access=share.admin_access,
    )


def _released(share: ShareState) -> CapacityReleased:
    return CapacityReleased(
        share_id=share.share_id,
        driver=share.driver,
        pool=share.pool,
        device=share.device,
        allocation_version=share.allocation_version,
        consumed=dict(share.consumed),
        admin_access=share.admin_access,
    )
