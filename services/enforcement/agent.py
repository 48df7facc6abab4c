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
  a retryable failure is recorded at once with its next try's time and the claim is
  ``retrying`` (visible, with the reason); the agent's retry sweep tries again when
  the time comes, with back-off, for as long as the class's retry window allows
  (:func:`~services.enforcement.decisions.decide_retries`) — the message is done, so
  retries outlive redeliveries and restarts; a permanent failure (or the window's
  end) fails the claim with the reason.
* ``ReleaseRequested`` -> when the folded log has the claim ``releasing`` at that
  allocation version, for each of its shares on this node that is ``releasing`` (not
  ``unknown``: the reclamation service owns those):
  :meth:`Enforcer.remove` -> ``LimitRemoved`` (node stream) + ``CapacityReleased``
  (device stream).

The message only says *where to look*: the consumer drops what the log does not hold
(:mod:`services.runtime.confirming`), and the handler acts only where the folded state
demands it, so neither a forged nor a stale message can tear down or set up a limit.

The rules live in :mod:`services.enforcement.decisions` as pure functions; the handler
is the loop around them. It asks for a state fresh enough for its messages
(``LiveState.fresh(SEEN, *positions)``: its own earlier appends and the messages
folded), holds it still while :func:`~services.enforcement.decisions.decide_work` says
which limits to apply and remove and the expected versions are read on that same
state, then — with the state free to move on — runs the enforcers, and hands their
outcomes to :func:`~services.enforcement.decisions.record`, which says what to append.

Exactly once: the consumer records the message in ``processed_messages`` in the same
commit as these events (one statement), so a redelivery is skipped;
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

Last line of defense (invariant 12). The agent keeps :attr:`Agent.enforcing`, the
limits it has in force now by share id: seeded by :meth:`Agent.reconcile` from what is
in force after it (and, where the kernel could not be read, from the checkpoint's
entries), grown by every successful ``apply`` and shrunk by every successful
``remove`` — the checkpoint's ``completed`` entries, kept in memory so that it holds
with ``--checkpoint none`` too. :func:`~services.enforcement.decisions.decide_work`
refuses a share that would take its device past its total together with them: the
enforcer is never called for it and ``LimitFailed(retryable=False)`` says why, whatever
the control plane asked (a fence that released shares this agent still enforces, a
forged or mistaken reservation).

Durable checkpoint. With a :class:`~services.enforcement.checkpointing.Checkpoint`
every kernel or daemon operation is wrapped: ``mark_started`` (written and fsynced)
before ``apply``, ``mark_completed`` after; ``mark_removing`` before ``remove``,
``mark_removed`` after. A checkpoint that cannot be written raises before the kernel
is touched (the message is nak'd and retried).

Lease. The agent writes only under its node's lease
(:mod:`services.enforcement.leasing`): :meth:`Agent.run` takes the next lease first,
every append names it (``agent:<node>#<epoch>``; the store refuses and records one of a
stale epoch), and a task renews it every ``ttl / 3``. When a renewal finds the lease
lost (it expired while the process was stopped or cut off, or the node was fenced),
the handler stops taking messages, the agent takes the next lease and runs
:meth:`Agent.reconcile` again, which first decides the node's ``unknown`` shares
(:func:`~services.enforcement.reconciling.plan_return`): confirmed when their limit
still runs on the same boot, released (and their claim failed) when the boot id of the
new lease differs from the one before or the limit is gone, released when their claim
was deleted meanwhile.

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
from collections.abc import Callable, Sequence
from typing import Final

from nats.js import JetStreamContext

from events.catalog import (
    AllocationBound,
    DeviceHealthChanged,
    EnforcementReconciled,
    Envelope,
    Event,
    LimitFailed,
    LimitRemoved,
    ReleaseRequested,
    ShareConfirmed,
    ShareUsed,
    node_stream,
    stream_of,
)
from events.fold import ClusterState, DeviceKey
from events.subjects import BusNames, node_token
from services.enforcement.checkpointing import Checkpoint, read_boot_id
from services.enforcement.decisions import (
    Enforce,
    Failed,
    Task,
    Written,
    decide_retries,
    decide_work,
    health_changes,
    limit_of,
    overcommit,
    rebuilt_entries,
    reconciled,
    record,
    released,
    set_aside,
    streams_to_check,
    uses,
    vanished,
)
from services.enforcement.enforcers import (
    AppliedLimit,
    EnforcementError,
    Enforcer,
    RetryableEnforcementError,
    ShareLimit,
)
from services.enforcement.leasing import DEFAULT_TTL_S, NodeLease
from services.enforcement.reconciling import plan_reconcile, plan_return
from services.enforcement.scanning import InventoryScanner
from services.runtime.confirming import LogConfirmation
from services.runtime.consuming import Consumer, Handled, HandlerContext
from services.runtime.errors import ConflictError
from services.runtime.eventstore import Batch, Cause, EventStore, Metadata
from services.runtime.livestate import HEAD, SEEN, LiveState
from services.runtime.metrics import CLAIMS, ENFORCEMENT_LATENCY
from services.runtime.slos import known_class

__all__ = ["Agent", "consumer_name"]

log = logging.getLogger("dracap.agent")

#: Seconds between the retry sweeps (a retry is due at most this late).
RETRY_SWEEP_S: Final = 0.25

_DURABLE_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_-]")
_WORK: Final = (AllocationBound, ReleaseRequested)


def consumer_name(node: str) -> str:
    """The durable consumer of ``node``'s agent (a JetStream-safe name)."""
    return "agent-" + _DURABLE_UNSAFE.sub("_", node_token(node))


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
        lease_ttl: float = DEFAULT_TTL_S,
        boot_id: str | None = None,
        health_interval: float = 10.0,
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
        if scanner is not None:
            scanner.actor = lambda: self.lease.actor
        self.scan_interval = scan_interval
        self.lease = NodeLease(
            store,
            node,
            boot_id=read_boot_id() if boot_id is None else boot_id,
            ttl_s=lease_ttl,
            enforcement=enforcer.level,
        )
        #: the boot id of the node's lease before this agent took its own ("": none)
        self.previous_boot_id = ""
        #: seconds between device health checks (0: none)
        self.health_interval = health_interval
        #: what the last :meth:`reconcile` reported (None: nothing to report)
        self.reconciled: EnforcementReconciled | None = None
        #: the limits in force on this node now, by share id (see the module docstring)
        self.enforcing: dict[str, ShareLimit] = {}
        self.consumer = Consumer(
            store,
            js,
            names,
            name=consumer_name(node),
            filter_subject=names.node_filter(node),
            group_handler=self.handle,
            wants=self.wants,
            confirmation=LogConfirmation(store, self.live),
            max_deliver=max_deliver,
            actor=lambda: self.lease.actor,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Lease, scan, reconcile, then consume this node's events until ``stop`` is set."""
        await self.take_lease()
        if self.scanner is not None:
            await self.scanner.scan_once()
        await self.reconcile()
        self.lease.held.set()
        tasks = [asyncio.create_task(self.lease.keep(stop, self._retake))]
        if self.scanner is not None and self.scan_interval > 0:
            tasks.append(asyncio.create_task(self.scanner.run(stop, self.scan_interval)))
        if self.health_interval > 0:
            tasks.append(asyncio.create_task(self._watch(stop)))
        tasks.append(asyncio.create_task(self._retry(stop)))
        log.info(
            "node %s: reconciled; taking its events (consumer %s)", self.node, self.consumer.name
        )
        try:
            await self.consumer.run(stop)
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def take_lease(self) -> int:
        """Take the node's next lease, remembering the boot id of the one before."""
        state = await self.live.fresh(HEAD)
        before = state.nodes.get(self.node)
        self.previous_boot_id = before.boot_id if before is not None else ""
        return await self.lease.acquire()

    async def _retake(self) -> None:
        """The lease was lost: take the next one and decide what happened meanwhile."""
        await self.take_lease()
        await self.reconcile()

    # -- retries -------------------------------------------------------------------------

    async def _retry(self, stop: asyncio.Event) -> None:
        """Every :data:`RETRY_SWEEP_S` until ``stop``: :meth:`retry_due`."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), RETRY_SWEEP_S)
            if stop.is_set():
                return
            try:
                await self.retry_due()
            except ConflictError:
                pass  # the state moved (a delete, a fence): the next sweep decides again
            except Exception:
                log.exception("retrying failed limits failed")

    async def retry_due(self) -> Written | None:
        """Apply again the limits whose retry time has come; record the outcomes."""
        now = datetime.datetime.now(datetime.UTC)
        return await self.carry_out(
            lambda state: decide_retries(state, self.node, now, self.enforcing), now
        )

    async def carry_out(
        self,
        decide: Callable[[ClusterState], Sequence[Task]],
        now: datetime.datetime | None = None,
        *,
        also: Sequence[Batch] = (),
    ) -> Written | None:
        """Decide tasks on a frozen, current state, run the enforcers, record the outcomes.

        The append expects the versions read with the state (a delete or a fence that got
        in first makes it conflict: :class:`ConflictError`, decide again). ``also``: more
        batches for the same append (a kubelet unprepare's ``ReleaseRequested``).
        """
        await self.lease.held.wait()
        now = now or datetime.datetime.now(datetime.UTC)
        await self.live.fresh(SEEN)  # its own last append included: versions must be current
        async with self.live.frozen() as state:
            tasks = list(decide(state))
            if not tasks:
                return None
            streams = streams_to_check(self.node, tasks)
            versions = {stream: await self.live.stream_version(stream) for stream in streams}
        outcomes = await self._enforce(tasks)
        written = record(self.node, tasks, outcomes, versions, now)
        batches = list(also) + [
            Batch(stream, version, events)
            for stream, (version, events, _) in written.streams.items()
        ]
        await self.store.append_many(batches, Metadata(actor=self.lease.actor))
        return written

    # -- device health -----------------------------------------------------------------------

    async def _watch(self, stop: asyncio.Event) -> None:
        """Check device health and share use every ``health_interval`` s until ``stop``;
        a failed check is logged and tried at the next tick."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.health_interval)
            if stop.is_set():
                return
            try:
                await self.check_health()
                await self.check_use()
            except Exception:
                log.exception("device health or use check failed")

    async def check_health(self) -> list[DeviceHealthChanged]:
        """Ask the enforcer and the last scan how the node's devices are; record changes."""
        await self.lease.held.wait()
        findings: dict[DeviceKey, str | None] = {}
        state = await self.live.fresh(SEEN)
        scanner = self.scanner
        if scanner is not None and scanner.inventory is not None:
            found = {
                (driver, scanner.config.pool_for(driver), device.name)
                for driver, devices in scanner.inventory.devices.items()
                for device in devices
            }
            config = scanner.config
            drivers = {c.driver for c in (config.network, config.gpu) if c.enabled} | set(
                scanner.inventory.devices
            )
            findings.update(vanished(state, self.node, drivers, found))
        try:
            for key, problem in (await self.enforcer.health()).items():
                if problem is not None or key not in findings:  # a problem wins
                    findings[key] = problem
        except EnforcementError as exc:
            log.warning("the enforcer's health check failed: %s", exc)
        changes = health_changes(state, self.node, findings)
        if changes:
            batch = Batch(node_stream(self.node), None, list(changes))
            await self.store.append_many([batch], Metadata(actor=self.lease.actor))
            for change in changes:
                where = f"{change.driver}/{change.pool}/{change.device}"
                if change.healthy:
                    log.info("device %s is healthy again", where)
                else:
                    log.warning("device %s is unhealthy: %s", where, change.reason)
        return changes

    async def check_use(self) -> list[ShareUsed]:
        """Record each share of the node the enforcer saw traffic through, once."""
        await self.lease.held.wait()
        try:
            usage = await self.enforcer.usage()
        except EnforcementError as exc:
            log.warning("the enforcer's use read-out failed: %s", exc)
            return []
        if not usage:
            return []
        used = uses(await self.live.fresh(SEEN), self.node, usage)
        if used:
            batch = Batch(node_stream(self.node), None, list(used))
            await self.store.append_many([batch], Metadata(actor=self.lease.actor))
        return used

    # -- return ----------------------------------------------------------------------------

    async def settle_unknown(self) -> None:
        """Confirm or release the node's unknown shares (see the module docstring)."""
        state = await self.live.fresh(SEEN)
        if not any(state.shares[i].state == "unknown" for i in _node_shares(state, self)):
            return
        rebooted = None
        boot = self.lease.boot_id
        if self.previous_boot_id and self.previous_boot_id != boot:
            rebooted = (
                f"node {self.node} rebooted (boot id {self.previous_boot_id} -> {boot}): "
                "its limits are gone"
            )
        entries = dict(self.checkpoint.entries) if self.checkpoint is not None else {}
        try:
            observed: dict[str, AppliedLimit] | None = dict(await self.enforcer.observe())
        except EnforcementError as exc:
            log.error("cannot read the limits in force (%s); the checkpoint stands in", exc)
            observed = None
        plan = plan_return(state, self.node, rebooted=rebooted, observed=observed, entries=entries)
        removed: list[str] = []
        for share_id in plan.remove:
            await self._remove(share_id)  # raises: the lease is retaken and this tried again
            removed.append(share_id)
        node_events: list[Event] = [
            ShareConfirmed(share_id=s, node=self.node) for s in plan.confirm
        ]
        node_events += [
            LimitFailed(share_id=s, node=self.node, retryable=False, reason=why)
            for s, why in sorted(plan.fail.items())
        ]
        node_events += [LimitRemoved(share_id=s, node=self.node) for s in removed]
        batches = [Batch(node_stream(self.node), None, node_events)] if node_events else []
        by_stream: dict[str, list[Event]] = {}
        for share in plan.release:
            event = released(share)
            by_stream.setdefault(stream_of(event), []).append(event)
        batches += [Batch(stream, None, events) for stream, events in by_stream.items()]
        if batches:
            await self.store.append_many(batches, Metadata(actor=self.lease.actor))
        log.info(
            "node %s returned: %d unknown share(s) confirmed, %d released%s",
            self.node,
            len(plan.confirm),
            len(plan.release),
            " (rebooted)" if rebooted else "",
        )

    # -- restart -------------------------------------------------------------------------

    async def reconcile(self) -> EnforcementReconciled | None:
        """Make the node's limits match the log (see the module docstring)."""
        await self.settle_unknown()
        state = await self.live.fresh(HEAD)
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
            events.append(set_aside(self.node, warning))
        entries = dict(checkpoint.entries) if checkpoint is not None else {}
        try:
            observed = await self.enforcer.observe()
        except EnforcementError as exc:
            log.error("cannot read the limits in force (%s); not reconciling", exc)
            # what the checkpoint says was started or done may all be in force
            self.enforcing = {s: e.limit for s, e in entries.items()}
            await self._report(events)
            return None
        if checkpoint is not None and checkpoint.rebooted:
            log.info("node rebooted since the checkpoint was written: limits are put back")
        plan = plan_reconcile(state, self.node, observed, entries)
        removed: list[str] = []
        self.enforcing = {s: limit_of(state.shares[s]) for s in plan.kept}
        for share_id in plan.orphans + plan.stale:
            if share_id in entries:  # still in force until its removal succeeds
                self.enforcing[share_id] = entries[share_id].limit
            try:
                await self._remove(share_id)
            except EnforcementError as exc:
                log.error("could not remove the orphaned limit of %s: %s", share_id, exc)
                continue
            removed.append(share_id)
        in_force = {s: observed[s] for s in plan.kept}
        reapplied: list[str] = []
        failed: list[str] = []
        for share in plan.reapply:
            limit = limit_of(share)
            refusal = overcommit(state, self.enforcing, limit)
            if refusal is not None:
                log.error("limit of share %s not put back: %s", share.share_id, refusal)
                failed.append(share.share_id)
                continue
            try:
                in_force[share.share_id] = await self._apply(limit)
            except EnforcementError as exc:
                log.error("could not put back the limit of share %s: %s", share.share_id, exc)
                failed.append(share.share_id)
                continue
            reapplied.append(share.share_id)
        if checkpoint is not None:
            now = datetime.datetime.now(datetime.UTC)
            checkpoint.entries = rebuilt_entries(state.shares, in_force, failed, now)
            checkpoint.warning = None
            await asyncio.to_thread(checkpoint.save)
        report = reconciled(self.node, plan, observed, removed, reapplied, failed)
        if report is not None:
            events.append(report)
            self.reconciled = report
            log.info(
                "reconciled node %s: %d kept, %d reapplied, %d orphan(s) removed, %d failed",
                self.node,
                len(report.kept),
                len(report.reapplied),
                len(report.removed_orphans),
                len(report.failed),
            )
        await self._report(events)
        return self.reconciled

    async def _report(self, events: list[Event]) -> None:
        if events:
            batch = Batch(node_stream(self.node), None, events)
            await self.store.append_many([batch], Metadata(actor=self.lease.actor))

    # -- the kernel, wrapped in the checkpoint -------------------------------------------

    async def _apply(self, limit: ShareLimit) -> AppliedLimit:
        checkpoint = self.checkpoint
        if checkpoint is None:
            applied = await self.enforcer.apply(limit)
        else:
            await asyncio.to_thread(checkpoint.mark_started, limit.share_id, limit)
            applied = await self.enforcer.apply(limit)
            await asyncio.to_thread(checkpoint.mark_completed, limit.share_id, applied)
        self.enforcing[limit.share_id] = limit
        return applied

    async def _remove(self, share_id: str) -> None:
        checkpoint = self.checkpoint
        if checkpoint is None:
            await self.enforcer.remove(share_id)
        else:
            await asyncio.to_thread(checkpoint.mark_removing, share_id)
            await self.enforcer.remove(share_id)
            await asyncio.to_thread(checkpoint.mark_removed, share_id)
        self.enforcing.pop(share_id, None)

    def wants(self, env: Envelope) -> bool:
        """The messages this agent acts on: its node's bindings and release requests."""
        event = env.event
        return isinstance(event, _WORK) and event.node == self.node

    async def handle(self, ctx: HandlerContext, envs: list[Envelope]) -> Handled:
        """Apply or remove limits for a group of messages (see the module docstring)."""
        mine = [env for env in envs if self.wants(env)]
        if not mine:
            return Handled()
        await self.lease.held.wait()  # no work while the lease is being taken back
        # Folded up to these messages and every commit this process made or heard of
        # (its own last append included; a tailed view usually is there already).
        # Anything newer it misses makes the append's expected versions clash.
        positions = [env.position for env in mine]
        await self.live.fresh(SEEN, *positions, connection=ctx.connection)
        async with self.live.frozen() as state:
            tasks = decide_work(state, self.node, mine, self.enforcing)
            streams = streams_to_check(self.node, tasks)
            versions = {stream: await self.live.stream_version(stream) for stream in streams}
            classes = {env.event_id: _class_of(state, env) for env in mine}
        outcomes = await self._enforce(tasks)
        written = record(self.node, tasks, outcomes, versions)
        return Handled(
            batches=_batches(written, mine),
            actor=self.lease.actor,
            on_commit=_counters(written, mine, classes),
        )

    async def _enforce(self, tasks: Sequence[Task]) -> dict[str, AppliedLimit | Failed]:
        """Run the enforcers for ``tasks``; the outcome of each apply, by share id.

        A failed apply is an outcome (recorded, and retried by the sweep when it is
        retryable); a failed removal raises: the consumer naks the messages and nothing
        is recorded.
        """
        outcomes: dict[str, AppliedLimit | Failed] = {}
        for task in tasks:
            if isinstance(task, Enforce):
                for refusal in task.refused:
                    log.error("limit of share %s not applied: %s", refusal.share_id, refusal.reason)
                for limit in task.limits:
                    try:
                        outcomes[limit.share_id] = await self._apply(limit)
                    except EnforcementError as exc:
                        retryable = isinstance(exc, RetryableEnforcementError)
                        log.error("limit of share %s failed: %s", limit.share_id, exc)
                        outcomes[limit.share_id] = Failed(retryable=retryable, reason=str(exc))
            else:
                for released in task.released:
                    await self._remove(released.share_id)
        return outcomes


def _node_shares(state: ClusterState, agent: Agent) -> list[str]:
    """The live shares the fold places on the agent's node."""
    node = state.nodes.get(agent.node)
    return sorted(node.live_shares) if node is not None else []


def _batches(written: Written, messages: Sequence[Envelope]) -> list[Batch]:
    """The append of ``written``, each event caused by its message."""
    causes = {env.event_id: Cause.of(env) for env in messages}
    return [
        Batch(stream, version, events, [causes[m] for m in caused_by])
        for stream, (version, events, caused_by) in written.streams.items()
    ]


def _class_of(state: ClusterState, env: Envelope) -> str:
    """The DeviceClass of the claim a message is about (a metric label)."""
    event = env.event
    return known_class(state, (event.namespace, event.name)) if isinstance(event, _WORK) else ""


def _counters(
    written: Written, messages: Sequence[Envelope], classes: dict[str, str]
) -> list[Callable[[], None]]:
    """The metrics of ``written`` (``classes``: each message's DeviceClass), measured now
    and counted once it has committed."""
    now = datetime.datetime.now(datetime.UTC)
    recorded = {env.event_id: env.recorded_at for env in messages}
    counted: list[Callable[[], None]] = []
    for message, ready in written.ready.items():
        age = max(0.0, (now - recorded[message]).total_seconds())

        def count(age: float = age, ready: bool = ready, cls: str = classes[message]) -> None:
            ENFORCEMENT_LATENCY.labels(cls).observe(age)
            if ready:
                CLAIMS.labels(outcome="ready").inc()

        counted.append(count)
    counted += [CLAIMS.labels(outcome="released").inc for _ in written.released]
    return counted
