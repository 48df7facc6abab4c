"""The node agent: makes each share's limit real on its node and reports it.

One agent runs per node (``dracap agent --node NAME``). It reads only
``names.node_filter(node)`` — the events addressed to its node — through one durable
consumer ``agent-<node>``, so with per-node broker permissions a node never sees
another node's instructions. Its view of shares comes from a
:class:`~services.runtime.livestate.LiveState`.

* ``AllocationBound`` -> for each share of the allocation that is ``bound`` in the
  folded log: :meth:`Enforcer.apply` -> ``LimitApplied(level, actual)``. The claim
  becomes ``Ready`` in the fold only when every share has its limit (invariant 7);
  scheduling alone never makes it ready. A failing enforcer gives ``LimitFailed``:
  a retryable failure is first retried through redelivery (the handler raises, the
  consumer naks with back-off) and recorded only on the last delivery; a permanent
  one is recorded at once and fails the claim.
* ``ReleaseRequested`` -> when the folded log has the claim ``releasing`` at that
  allocation version, for each of its shares on this node that is ``releasing`` (not
  ``unknown``: the reclamation service owns those):
  :meth:`Enforcer.remove` -> ``LimitRemoved`` (node stream) + ``CapacityReleased``
  (device stream).

The message only says *where to look*: the consumer drops what the log does not hold
(:mod:`services.runtime.confirming`), and the handler acts only where the folded state
demands it, so neither a forged nor a stale message can tear down or set up a limit.

Exactly once: the consumer records the message in ``processed_messages`` in the same
commit as these events (one statement, ``one_statement``), so a redelivery is skipped;
the handler also checks each share's state in the live state (a share already ready
or released is left alone), and appends to the node stream with its expected version,
so a second agent for the same node (or a fence) racing it makes one of them re-read.
``CapacityReleased`` is itself idempotent in the fold and the ledger (invariant 5).
Enforcers are idempotent, so applying again after a crash before the commit is
harmless.

``LimitApplied`` also races the tenant's delete: the fold refuses a limit applied to a
share that is already ``releasing``. So the append that carries ``LimitApplied``
includes an *empty* batch for the claim stream at the version the agent read — a pure
version check (``EventStore.append_many`` checks every batch's expected version, with
or without events). If ``ReleaseRequested`` got in first, the append conflicts, the
message is redelivered, and the agent then sees the share releasing and leaves it.

The consumer hands the agent its messages in groups (:mod:`services.runtime.consuming`):
all events of one group go out in one append, atomically with the consumer's
records, each event naming the message that caused it. If the group's append fails
(a guard clashed, an enforcer failed), its messages are handled again one by one, so
the failure stays with its own message; enforcers are idempotent, so a limit applied
for a group whose append failed is simply applied again.

Durable checkpoint. With a :class:`~services.enforcement.checkpointing.Checkpoint`
every kernel or daemon operation is wrapped: ``mark_started`` (written and fsynced)
before ``apply``, ``mark_completed`` after; ``mark_removing`` before ``remove``,
``mark_removed`` after. A checkpoint that cannot be written raises before the kernel
is touched (the message is nak'd and retried).

Restart. :meth:`Agent.run` first runs the inventory scan (when a scanner is given:
the enforcers' device maps come from it), then :meth:`Agent.reconcile`: the log, the
kernel (``Enforcer.observe()``) and the checkpoint are compared
(:mod:`services.enforcement.reconciling`), missing limits of ready shares are put back,
limits no live share owns are removed, limits already in force are left alone (no
second ``LimitApplied``), the checkpoint is rewritten from what is in force now, and
the outcome is recorded as ``EnforcementReconciled``. A checkpoint the loader had to
set aside (corrupt, foreign version) is reported as ``EnforcementCheckpointSetAside``
and rebuilt the same way; only then does the consumer start.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import re
from collections.abc import Callable
from typing import Final

from nats.js import JetStreamContext

from events.catalog import (
    AllocationBound,
    CapacityReleased,
    EnforcementCheckpointSetAside,
    EnforcementReconciled,
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
from services.enforcement.checkpointing import Checkpoint, CheckpointEntry
from services.enforcement.enforcers import AppliedLimit, EnforcementError, Enforcer, ShareLimit
from services.enforcement.reconciling import plan_reconcile
from services.enforcement.scanning import InventoryScanner
from services.runtime.confirming import LogConfirmation
from services.runtime.consuming import Consumer, Handled, HandlerContext
from services.runtime.eventstore import Batch, Cause, EventStore, Metadata
from services.runtime.livestate import HEAD, SEEN, LiveState
from services.runtime.metrics import CLAIMS, ENFORCEMENT_LATENCY

__all__ = ["Agent", "consumer_name"]

log = logging.getLogger("dracap.agent")

_DURABLE_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_-]")
_WORK: Final = (AllocationBound, ReleaseRequested)
#: Share states in which the folded log demands an action (not the message alone).
_APPLICABLE: Final = frozenset({"bound"})
_RELEASABLE: Final = frozenset({"releasing"})


def consumer_name(node: str) -> str:
    """The durable consumer of ``node``'s agent (a JetStream-safe name)."""
    return "agent-" + _DURABLE_UNSAFE.sub("_", node_token(node))


class _Events:
    """Events of one group of messages, per stream, each with the message that caused it."""

    def __init__(self) -> None:
        self.streams: dict[str, tuple[int | None, list[Event], list[Cause]]] = {}

    def add(self, stream: str, version: int | None, event: Event | None, cause: Cause) -> None:
        """Add ``event`` (``None``: only check the stream's version) to ``stream``'s batch."""
        _, events, causes = self.streams.setdefault(stream, (version, [], []))
        if event is not None:
            events.append(event)
            causes.append(cause)

    def batches(self) -> list[Batch]:
        return [Batch(s, v, events, causes) for s, (v, events, causes) in self.streams.items()]


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
        checkpoint: Checkpoint | None = None,
        scanner: InventoryScanner | None = None,
        scan_interval: float = 60.0,
    ) -> None:
        self.store = store
        self.js = js
        self.names = names
        self.node = node
        self.enforcer = enforcer
        self.live = live if live is not None else LiveState(store)
        self.max_deliver = max_deliver
        self.checkpoint = checkpoint
        self.scanner = scanner
        self.scan_interval = scan_interval
        #: what the last :meth:`reconcile` reported (None: nothing to report)
        self.reconciled: EnforcementReconciled | None = None
        self.consumer = Consumer(
            store,
            js,
            names,
            name=consumer_name(node),
            filter_subject=names.node_filter(node),
            group_handler=self.handle,
            wants=self.wants,
            one_statement=True,
            confirmation=LogConfirmation(store, self.live),
            max_deliver=max_deliver,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Scan, reconcile, then consume this node's events until ``stop`` is set."""
        await self.live.fresh(HEAD)
        if self.scanner is not None:
            await self.scanner.scan_once()
        await self.reconcile()
        scans: asyncio.Task[None] | None = None
        if self.scanner is not None and self.scan_interval > 0:
            scans = asyncio.create_task(self.scanner.run(stop, self.scan_interval))
        try:
            await self.consumer.run(stop)
        finally:
            if scans is not None:
                scans.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await scans

    # -- restart -------------------------------------------------------------------------

    async def reconcile(self) -> EnforcementReconciled | None:
        """Make the node's limits match the log (see the module docstring)."""
        await self.live.fresh(HEAD)
        events: list[Event] = []
        checkpoint = self.checkpoint
        if checkpoint is not None and checkpoint.warning is not None:
            warning = checkpoint.warning
            log.warning(
                "checkpoint %s set aside (%s: %s); rebuilding it from the kernel and the log",
                warning.path,
                warning.reason,
                warning.detail,
            )
            events.append(
                EnforcementCheckpointSetAside(
                    node=self.node,
                    path=warning.path,
                    reason=warning.reason,
                    detail=warning.detail[:2000],
                    moved_to=warning.set_aside,
                )
            )
        try:
            observed = await self.enforcer.observe()
        except EnforcementError as exc:
            log.error("cannot read the limits in force (%s); not reconciling", exc)
            await self._report(events)
            return None
        entries = dict(checkpoint.entries) if checkpoint is not None else {}
        if checkpoint is not None and checkpoint.rebooted:
            log.info("node rebooted since the checkpoint was written: limits are put back")
        plan = plan_reconcile(self.live.state, self.node, observed, entries)
        removed: list[str] = []
        for share_id in plan.orphans + plan.stale:
            try:
                await self._remove(share_id)
            except EnforcementError as exc:
                log.error("could not remove the orphaned limit of %s: %s", share_id, exc)
                continue
            if share_id in observed:
                removed.append(share_id)
        in_force = {s: observed[s] for s in plan.kept}
        reapplied: list[str] = []
        failed: list[str] = []
        for share in plan.reapply:
            try:
                in_force[share.share_id] = await self._apply(_limit_of(share))
            except EnforcementError as exc:
                log.error("could not put back the limit of share %s: %s", share.share_id, exc)
                failed.append(share.share_id)
                continue
            reapplied.append(share.share_id)
        if checkpoint is not None:
            await asyncio.to_thread(self._rebuild, checkpoint, in_force, failed)
        report = EnforcementReconciled(
            node=self.node,
            reapplied=reapplied,
            removed_orphans=removed,
            kept=plan.kept,
            failed=failed,
        )
        if reapplied or removed or plan.kept or failed:
            events.append(report)
            self.reconciled = report
            log.info(
                "reconciled node %s: %d kept, %d reapplied, %d orphan(s) removed, %d failed",
                self.node,
                len(plan.kept),
                len(reapplied),
                len(removed),
                len(failed),
            )
        await self._report(events)
        return self.reconciled

    def _rebuild(
        self, checkpoint: Checkpoint, in_force: dict[str, AppliedLimit], failed: list[str]
    ) -> None:
        """The checkpoint, rewritten: what is in force now, and what failed (``started``)."""
        shares = self.live.state.shares
        now = datetime.datetime.now(datetime.UTC)
        entries: dict[str, CheckpointEntry] = {}
        for share_id, applied in in_force.items():
            limit = _limit_of(shares[share_id])
            entries[share_id] = CheckpointEntry(
                share_id=share_id, phase="completed", limit=limit, applied=applied, updated_at=now
            )
        for share_id in failed:
            limit = _limit_of(shares[share_id])
            entries[share_id] = CheckpointEntry(
                share_id=share_id, phase="started", limit=limit, updated_at=now
            )
        checkpoint.entries = entries
        checkpoint.warning = None
        checkpoint.save()

    async def _report(self, events: list[Event]) -> None:
        if events:
            batch = Batch(node_stream(self.node), None, events)
            await self.store.append_many([batch], Metadata(actor=f"agent:{self.node}"))

    # -- the kernel, wrapped in the checkpoint -------------------------------------------

    async def _apply(self, limit: ShareLimit) -> AppliedLimit:
        checkpoint = self.checkpoint
        if checkpoint is None:
            return await self.enforcer.apply(limit)
        await asyncio.to_thread(checkpoint.mark_started, limit.share_id, limit)
        applied = await self.enforcer.apply(limit)
        await asyncio.to_thread(checkpoint.mark_completed, limit.share_id, applied)
        return applied

    async def _remove(self, share_id: str) -> None:
        checkpoint = self.checkpoint
        if checkpoint is None:
            await self.enforcer.remove(share_id)
            return
        await asyncio.to_thread(checkpoint.mark_removing, share_id)
        await self.enforcer.remove(share_id)
        await asyncio.to_thread(checkpoint.mark_removed, share_id)

    def wants(self, env: Envelope) -> bool:
        """The messages this agent acts on: its node's bindings and release requests."""
        event = env.event
        return isinstance(event, _WORK) and event.node == self.node

    async def handle(self, ctx: HandlerContext, envs: list[Envelope]) -> Handled:
        """Apply or remove limits for a group of messages (see the module docstring)."""
        mine = [env for env in envs if self.wants(env)]
        if not mine:
            return Handled()
        # Folded up to these messages and every commit this process made or heard of
        # (its own last append included; a tailed view usually is there already).
        # Anything newer it misses makes the append's expected versions clash.
        positions = [env.position for env in mine]
        await self.live.fresh(SEEN, *positions, connection=ctx.connection)
        out = _Events()
        version = await self.live.stream_version(node_stream(self.node))
        counted: list[Callable[[], None]] = []
        for env in mine:
            if isinstance(env.event, AllocationBound):
                delivery = ctx.deliveries.get(env.event_id, ctx.delivery)
                counted += await self._bound(delivery, env, env.event, out, version)
            elif isinstance(env.event, ReleaseRequested):
                counted += await self._release(env, env.event, out, version)
        return Handled(batches=out.batches(), actor=f"agent:{self.node}", on_commit=counted)

    def _mine(self, share: ShareState | None) -> bool:
        return share is not None and share.node in (None, self.node)

    async def _bound(
        self, delivery: int, env: Envelope, event: AllocationBound, out: _Events, version: int
    ) -> list[Callable[[], None]]:
        state = self.live.state
        stream = node_stream(self.node)
        cause = Cause.of(env)
        applied = failures = 0
        for share_id in event.share_ids:
            share = state.shares.get(share_id)
            if share is None or not self._mine(share) or share.state not in _APPLICABLE:
                continue
            if share.allocation_version != event.allocation_version:
                continue
            try:
                limit = await self._apply(_limit_of(share))
            except EnforcementError as exc:
                if exc.retryable and delivery < self.max_deliver:
                    raise
                log.error("limit of share %s failed: %s", share_id, exc)
                failed = LimitFailed(
                    share_id=share_id, node=self.node, retryable=exc.retryable, reason=str(exc)
                )
                out.add(stream, version, failed, cause)
                failures += 1
                continue
            applied_event = LimitApplied(
                share_id=share_id, node=self.node, level=limit.level, actual=limit.actual
            )
            out.add(stream, version, applied_event, cause)
            applied += 1
        if applied or failures:
            # A guard, no events: append only while the claim stream is where we read it,
            # so a ReleaseRequested that raced us is seen (LimitApplied must never follow
            # it: the share would be "releasing", invariant 7). On a clash the consumer
            # naks and the redelivery finds the share releasing and skips it.
            guard = claim_stream(event.namespace, event.name)
            out.add(guard, await self.live.stream_version(guard), None, cause)
        if not applied:
            return []
        age = max(0.0, (datetime.datetime.now(datetime.UTC) - env.recorded_at).total_seconds())
        ready = applied == len(event.share_ids)

        def count() -> None:
            ENFORCEMENT_LATENCY.observe(age)
            if ready:
                CLAIMS.labels(outcome="ready").inc()

        return [count]

    async def _release(
        self, env: Envelope, event: ReleaseRequested, out: _Events, version: int
    ) -> list[Callable[[], None]]:
        state = self.live.state
        claim = state.claim(event.namespace, event.name)
        if (
            claim is None
            or claim.phase != "releasing"
            or claim.allocation_version != event.allocation_version
        ):
            return []
        stream = node_stream(self.node)
        cause = Cause.of(env)
        released = False
        for share_id in claim.share_ids:
            share = state.shares.get(share_id)
            if share is None or not self._mine(share) or share.state not in _RELEASABLE:
                continue
            if share.allocation_version != event.allocation_version:
                continue
            await self._remove(share_id)
            out.add(stream, version, LimitRemoved(share_id=share_id, node=self.node), cause)
            device = device_stream(share.driver, share.pool, share.device)
            out.add(device, None, _released(share), cause)
            released = True
        if not released:
            return []
        return [CLAIMS.labels(outcome="released").inc]


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
