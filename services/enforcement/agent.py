"""The node agent: makes each share's limit real on its node and reports it.

One agent runs per node (``dracap agent --node NAME``). It talks only to NATS: it has
no database login and holds no fold. It reads the events addressed to its node
(``names.node_filter(node)``) from its durable consumer ``agent-<node>``
(:class:`~services.enforcement.consumer.NodeConsumer`), and asks the enforcement
service (:mod:`services.enforcement.service`, through
:class:`~services.enforcement.asking.ControlPlane`) for everything else: a *view* of
the log for each decision (:mod:`services.enforcement.views`: only what that decision
reads, of its own node), and the *report* of what it did, which the service checks
and appends as ``agent:<node>#<epoch>``. With per-node broker permissions a node never
sees another node's instructions and cannot write another node's reports.

* ``AllocationBound`` -> for each share of the allocation that is ``bound`` in the
  folded log: :meth:`Enforcer.apply` -> ``LimitApplied(level, actual)``. The claim
  becomes ``Ready`` in the fold only when every share has its limit (invariant 7);
  scheduling alone never makes it ready. A failing enforcer gives ``LimitFailed``:
  a retryable failure is recorded at once with its next try's time and the claim is
  ``retrying`` (visible, with the reason); the agent tries again when the time comes,
  with back-off, for as long as the class's retry window allows
  (:func:`~services.enforcement.decisions.decide_retries`) — the message is done, so
  retries outlive redeliveries and restarts; a permanent failure (or the window's
  end) fails the claim with the reason.
* ``ReleaseRequested`` -> when the folded log has the claim ``releasing`` at that
  allocation version, for each of its shares on this node that is ``releasing`` (not
  ``unknown``: the reclamation service owns those):
  :meth:`Enforcer.remove` -> ``LimitRemoved`` (node stream) + ``CapacityReleased``
  (device stream).

The message only says *where to look*: the service confirms each message against the
log before it answers the view (one the log does not hold as sent is dropped and
counted; one of an event the fold refuses is acknowledged unhandled, as by every
reader: :mod:`events.folding`), and the handler acts only where the view demands it,
so neither a forged nor a stale message can tear down or set up a limit.

The rules live in :mod:`services.enforcement.decisions` as pure functions; the handler
is the loop around them. It asks for a view of its messages (at least as fresh as the
messages and its own last report), where :func:`~services.enforcement.decisions.
decide_work` says which limits to apply and remove, and the expected versions come
with the view; it runs the enforcers, and hands their outcomes to
:func:`~services.enforcement.decisions.record`, which says what to report.

Exactly once: the service appends the report together with the messages' rows in
``processed_messages`` of the consumer ``agent-<node>`` (one statement), and the view
tells which redelivered messages were handled before (they are acknowledged, not
handled again); the handler also checks each share's state in the view (a share
already ready or released is left alone), and the report expects the node stream's
version read with the view, so a second agent for the same node (or a fence) racing it
makes one of them decide again. ``CapacityReleased`` is itself idempotent in the fold
and the ledger (invariant 5). Enforcers are idempotent, so applying again after a
crash before the report is harmless. A message with nothing to report is acknowledged
without one.

``LimitApplied`` also races the tenant's delete: the fold refuses a limit applied to a
share that is already ``releasing``. So the report that carries ``LimitApplied``
includes an *empty* batch for the claim stream at the version the view had — a pure
version check. If ``ReleaseRequested`` got in first, the append conflicts, the message
is redelivered, and the agent then sees the share releasing and leaves it.

The consumer hands the agent its messages in groups: all events of one group go out in
one report, each event naming the message that caused it. If the group fails (a guard
clashed, an enforcer failed), its messages are handled again one by one, so the
failure stays with its own message; enforcers are idempotent, so a limit applied for a
group whose report failed is simply applied again.

A group is handled in two halves, :meth:`Agent.stage` (view, decide, enforce) and
:meth:`Agent.land` (send the report; a coroutine waits for its answer), and when
messages already wait as a report goes out (a backlog), the consumer stages them
while it is in flight (:class:`~services.enforcement.consumer.NodeConsumer`), under
one hold of the writer: a backlog no longer waits for both round trips of the group
before it, only for its report. The view of the next group may not show that report
yet, so its report expects the node stream at the later of the view's version and the
version the report before left (:meth:`Agent.land`): it still conflicts when anyone
else wrote to the node stream since its view. Only the agent's own reports of groups
with different messages are overlapped; if the report before fails, the next group's
report is never sent and its messages are decided again on a fresh view.

Last line of defense (invariant 12). The agent keeps :attr:`Agent.enforcing`
(:class:`~services.enforcement.enforcing.Enforcing`), the limits it has in force now by
share id with, per device and capacity, the sum they consume: seeded by
:meth:`Agent.reconcile` from what is in force after it (and, where the kernel could
not be read, from the checkpoint's entries), grown by every successful ``apply`` and
shrunk by every successful ``remove``. :func:`~services.enforcement.decisions.
decide_work` refuses a share that would take its device past its total together with
them: the enforcer is never called for it and ``LimitFailed(retryable=False)`` says
why, whatever the control plane asked (a fence that released shares this agent still
enforces, a forged or mistaken reservation). The check reads the kept sums: its cost
does not grow with what the node enforces.

Durable checkpoint. With a :class:`~services.enforcement.checkpointing.Checkpoint`
every kernel or daemon operation is wrapped: ``mark_started`` (written and fsynced)
before ``apply``, ``mark_completed`` after; ``mark_removing`` before ``remove``,
``mark_removed`` after; the limits of one decision are marked in one write per phase
(removals, then applies). A checkpoint that cannot be written raises before the kernel
is touched (the message is nak'd and retried).

Lease. The agent writes only under its node's lease
(:mod:`services.enforcement.leasing`): :meth:`Agent.run` takes the next lease first,
every report names it (``agent:<node>#<epoch>``; the service and the store refuse a
stale epoch), and a task sends a heartbeat every ``ttl / 3``. When a heartbeat finds
the lease lost (it expired while the process was stopped or cut off from NATS, or the
node was fenced), the handler stops taking messages, the agent takes the next lease
and runs :meth:`Agent.reconcile` again, which first decides the node's ``unknown``
shares (:func:`~services.enforcement.reconciling.plan_return`): confirmed when their
limit still runs on the same boot, released (and their claim failed) when the boot id
of the new lease differs from the one before or the limit is gone, released when their
claim was deleted meanwhile.

Retries. No message drives them and the agent does not poll for them: every view and
report answers when the node's next retry is due (``next_retry_at``), and the agent
asks for a view of its retrying shares only then. The due time is wall time on the
agent's :class:`~services.runtime.ground.clock.Clock` (``clock.utcnow()``, also the
``now`` its decisions write into ``retry_at``), and the wait for it, like the health
checks' tick, is a wait on that clock: a test hands the agent a fake clock and advances
it to bring a retry or a check due (``tests/unit/test_agent_timers.py``).

Health and use. Every ``health_interval`` the agent reads the enforcer's health and
use and its last scan; only when what it found differs from what it last reported does
it ask for a view and report the transitions (``DeviceHealthChanged``, ``ShareUsed``);
with no scan and no problem there is nothing to compare, and no view is asked.

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
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from typing import Final

import msgspec

from events.catalog import (
    DeviceHealthChanged,
    EnforcementReconciled,
    Event,
    LimitFailed,
    LimitRemoved,
    MessageDeadLettered,
    ShareConfirmed,
    ShareUsed,
)
from events.envelopes import Envelope, node_stream, stream_of
from events.eventcodec import encode_payload
from events.model import ResourceSlice
from events.state import ClusterState, DeviceKey
from events.transitions import ClaimBound, ClaimReleasing, first, meaning
from services.enforcement.asking import ControlPlane
from services.enforcement.checkpointing import Checkpoint, read_boot_id
from services.enforcement.consumer import Delivery, NodeConsumer
from services.enforcement.decisions import (
    Enforce,
    Failed,
    Release,
    Task,
    Unprepare,
    Written,
    decide_bound,
    decide_retries,
    decide_taken_up,
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
from services.enforcement.enforcing import Enforcing
from services.enforcement.leasing import DEFAULT_TTL_S, NodeLease
from services.enforcement.protocol import Cause, ReportBatch, Reported, ViewAsk, consumer_name
from services.enforcement.protocol import Report as ReportRequest
from services.enforcement.reconciling import plan_reconcile, plan_return
from services.enforcement.scanning import InventoryScanner
from services.enforcement.views import NodeView
from services.runtime.bus.jetstream import DEFAULT_API_PREFIX, prefix_of
from services.runtime.ground.context import ServiceContext
from services.runtime.ground.errors import ConflictError, RetryableError
from services.runtime.ground.metrics import CLAIMS, ENFORCEMENT_LATENCY, TAKE_UP_FAILURES
from services.runtime.ground.outages import one_line
from services.runtime.ops.slos import known_class

__all__ = ["Agent", "consumer_name"]

log = logging.getLogger("dracap.agent")

#: The shortest wait between two retry sweeps (a retry is due at most this late).
RETRY_SWEEP_S: Final = 0.25
#: What an agent acts on: a claim bound (limits to apply) or being released (to remove).
_WORK: Final[tuple[type[ClaimBound | ClaimReleasing], ...]] = (ClaimBound, ClaimReleasing)

#: Called with the events of each report once it is appended.
ReportListener = Callable[[Sequence[Event]], None]


class Outgoing(msgspec.Struct, frozen=True):
    """Events for one stream of a report: at ``version`` (``None``: any; no events: a
    version check), each with its cause when ``causes`` is given."""

    stream: str
    version: int | None
    events: Sequence[Event]
    causes: Sequence[Cause] | None = None

    def batch(self) -> ReportBatch:
        return ReportBatch(
            stream=self.stream,
            expected_version=self.version,
            events=[msgspec.Raw(encode_payload(e)) for e in self.events],
            causes=list(self.causes) if self.causes is not None else None,
        )


class Writer:
    """The node's one writer: held across view, kernel work and report by every path of
    the agent that reports (consumer, retry sweep, kubelet rounds, health and use,
    reconcile), so the agent's own reports never race each other for the node stream's
    version. Re-entrant within one task (a report made while holding it)."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._owner: asyncio.Task[object] | None = None
        self._depth = 0
        self._waiting = 0  # tasks waiting to hold it

    @property
    def contended(self) -> bool:
        """Whether another task waits to hold the writer."""
        return self._waiting > 0

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Hold the writer (at once when this task already holds it)."""
        me = asyncio.current_task()
        if me is not None and self._owner is me:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self._waiting -= 1
        try:
            self._owner, self._depth = me, 1
            yield
        finally:
            self._owner, self._depth = None, 0
            self._lock.release()


class Round(msgspec.Struct, kw_only=True):
    """One decision carried out: the view it was decided on, the tasks, the enforcers'
    outcomes (by share id) and what was reported."""

    state: ClusterState
    tasks: list[Task]
    outcomes: dict[str, AppliedLimit | Failed]
    written: Written


class Staged(msgspec.Struct, kw_only=True):
    """A group of messages decided and enforced, its report not sent yet
    (:meth:`Agent.stage`, :meth:`Agent.land`)."""

    mine: list[Envelope]  #: the messages acted on (confirmed, not handled before)
    unconfirmed: set[str]  #: the ids of those the log does not hold as sent
    tasks: list[Task]
    outcomes: dict[str, AppliedLimit | Failed]
    versions: dict[str, int]  #: the streams' versions as of the view
    classes: dict[str, str]  #: each message's DeviceClass (a metric label)
    now: datetime.datetime
    #: the node stream's version once its report landed (None: not landed, or no events)
    landed: int | None = None


class Agent:
    """The node agent of one node (see the module docstring)."""

    def __init__(
        self,
        context: ServiceContext[None],
        *,
        node: str,
        enforcer: Enforcer,
        plane: ControlPlane | None = None,
        max_deliver: int = 5,
        checkpoint: Checkpoint | None = None,
        scanner: InventoryScanner | None = None,
        scan_interval: float = 60.0,
        lease_ttl: float = DEFAULT_TTL_S,
        boot_id: str | None = None,
        health_interval: float = 10.0,
    ) -> None:
        nc = self.nc = context.nc
        names = self.names = context.names
        #: the clock of the retries' due times and of the health checks' ticks
        self.clock = context.clock
        # the JetStream API of the agent's account: its JetStream context's when it has one
        js = context.jetstream
        api_prefix = prefix_of(js) if js is not None else DEFAULT_API_PREFIX
        self.node = node
        self.enforcer = enforcer
        self.plane = plane if plane is not None else ControlPlane(nc, names, node)
        self.checkpoint = checkpoint
        self.scanner = scanner
        self.scan_interval = scan_interval
        self.lease = NodeLease(
            self.plane,
            node,
            boot_id=read_boot_id() if boot_id is None else boot_id,
            ttl_s=lease_ttl,
            enforcement=enforcer.level,
        )
        #: seconds between device health and use checks (0: none)
        self.health_interval = health_interval
        #: what the last :meth:`reconcile` reported (None: nothing to report)
        self.reconciled: EnforcementReconciled | None = None
        #: the limits in force on this node now (see the module docstring)
        self.enforcing = Enforcing()
        #: held by every path that reports (see :class:`Writer`)
        self.writer = Writer()
        #: when the node's next retry is due, as the service last said (None: none)
        self.next_retry_at: datetime.datetime | None = None
        self._retry_moved = asyncio.Event()
        #: what the last health check found (and reported); None: ask again
        self._health_found: tuple[frozenset[DeviceKey], dict[DeviceKey, str | None]] | None = None
        self._used: set[str] = set()  #: shares known used (reported, or found so)
        self._listeners: list[ReportListener] = []
        self._message_listeners: list[ReportListener] = []
        self.consumer = NodeConsumer(
            nc,
            names,
            node,
            handle=self.handle,
            dead_letter=self.dead_letter,
            wants=self.wants,
            undecodable=self.refused_undecodable,
            missing=self._durable_made_again,
            stages=self,
            api_prefix=api_prefix,
            max_deliver=max_deliver,
        )

    @property
    def previous_boot_id(self) -> str:
        """The boot id of the node's lease before this agent took its own ("": none)."""
        return self.lease.previous_boot_id

    def on_messages(self, listener: ReportListener) -> None:
        """Call ``listener(events)`` with each group of messages the consumer hands in
        (the kubelet plugin wakes a prepare waiting for the bridge's binding)."""
        self._message_listeners.append(listener)

    def on_report(self, listener: ReportListener) -> Callable[[], None]:
        """Call ``listener(events)`` after each report is appended; returns an unsubscriber."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

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
        """Take the node's next lease (the boot id of the one before comes with it)."""
        epoch = await self.lease.acquire()
        self._health_found = None  # report health afresh under the new lease
        return epoch

    async def _retake(self) -> None:
        """The lease was lost: take the next one and decide what happened meanwhile."""
        await self.take_lease()
        await self.reconcile()

    # -- the enforcement service -----------------------------------------------------------

    async def view(self, ask: ViewAsk) -> NodeView:
        """A view of the log for a decision (see :mod:`services.enforcement.views`)."""
        view, viewed = await self.plane.view(ask)
        self._note_retry(viewed.next_retry_at)
        return view

    async def report(self, batches: Sequence[Outgoing], processed: Sequence[str] = ()) -> None:
        """Append ``batches`` under the lease (with ``processed`` messages recorded)."""
        epoch = self.lease.epoch
        assert epoch is not None, "a report before the lease"
        asked = ReportRequest(
            epoch=epoch, batches=[b.batch() for b in batches], processed=list(processed)
        )
        async with self.writer.held():
            await self._send(asked, batches)

    async def _send(self, asked: ReportRequest, batches: Sequence[Outgoing]) -> None:
        """Send a report (the writer held by whoever asked for it) and tell the listeners."""
        await self._reported(self.plane.report(asked), batches)

    async def _sent(
        self, asked: ReportRequest, batches: Sequence[Outgoing]
    ) -> Coroutine[None, None, None]:
        """:meth:`_send` in two steps: the report is on its way once this returns; the
        coroutine returned waits for its answer and tells the listeners."""
        return self._reported(await self.plane.send_report(asked), batches)

    async def _reported(self, answer: Awaitable[Reported], batches: Sequence[Outgoing]) -> None:
        reported = await answer
        self._note_retry(reported.next_retry_at)
        events = [e for b in batches for e in b.events]
        for listener in tuple(self._listeners):
            try:
                listener(events)
            except Exception:
                log.exception("report listener failed")

    async def report_events(self, events: Iterable[Event]) -> None:
        """Report ``events`` (any stream versions), grouped by stream in order."""
        grouped: dict[str, list[Event]] = {}
        for event in events:
            grouped.setdefault(stream_of(event), []).append(event)
        if grouped:
            await self.report([Outgoing(stream, None, evs) for stream, evs in grouped.items()])

    def _note_retry(self, due: datetime.datetime | None) -> None:
        if due != self.next_retry_at:
            self.next_retry_at = due
            self._retry_moved.set()

    # -- retries -------------------------------------------------------------------------

    async def _retry(self, stop: asyncio.Event) -> None:
        """Until ``stop``: when the next retry is due, :meth:`retry_due`.

        The due time is the wall time on the agent's clock (:meth:`Clock.utcnow`), the
        wait for it a wait on that clock: a test's fake clock brings a retry due."""
        stopping = asyncio.ensure_future(stop.wait())
        stopping.add_done_callback(lambda _: self._retry_moved.set())
        try:
            while not stop.is_set():
                due = self.next_retry_at
                if due is None:
                    wait = None
                else:
                    wait = max((due - self.clock.utcnow()).total_seconds(), RETRY_SWEEP_S)
                self._retry_moved.clear()
                if wait is None:
                    await self._retry_moved.wait()
                else:
                    await self.clock.wait(self._retry_moved, wait)
                due = self.next_retry_at
                if stop.is_set() or due is None or due > self.clock.utcnow():
                    continue
                try:
                    await self.retry_due()
                except ConflictError:
                    pass  # the state moved (a delete, a fence): the next sweep decides again
                except RetryableError as exc:  # the service or the bus is away: next sweep
                    log.warning("retrying failed limits not done: %s", exc)
                except Exception:
                    log.exception("retrying failed limits failed")
                await self.clock.wait(stop, RETRY_SWEEP_S)
        finally:
            stopping.cancel()

    async def retry_due(self) -> Written | None:
        """Apply again the limits whose retry time has come; record the outcomes."""
        now = self.clock.utcnow()
        return await self.carry_out(
            ViewAsk(retries=True),
            lambda state: decide_retries(state, self.node, now, self.enforcing),
            now,
        )

    async def carry_out(
        self,
        ask: ViewAsk,
        decide: Callable[[ClusterState], Sequence[Task]],
        now: datetime.datetime | None = None,
    ) -> Written | None:
        """Decide tasks on a view (``ask``), run the enforcers, report the outcomes.

        The report expects the versions read with the view (a delete or a fence that got
        in first makes it conflict: :class:`ConflictError`, decide again).
        """
        done = await self.carry_round(ask, decide, now)
        return done.written if done.tasks else None

    async def carry_round(
        self,
        ask: ViewAsk,
        decide: Callable[[ClusterState], Sequence[Task]],
        now: datetime.datetime | None = None,
        *,
        leased: bool = False,
    ) -> Round:
        """:meth:`carry_out`, under the writer, with all it saw and did (no tasks: nothing
        done or reported). ``leased``: the caller holds the lease already (a reconcile,
        which runs while the lease is being taken back); otherwise this waits for it.

        Apply, then record: when the report is refused (:class:`ConflictError`) or its
        answer is lost, the kernel is brought back to what a fresh view of ``ask`` says
        before this returns or raises (:meth:`_settle`), so kernel and log agree.
        """
        if not leased:
            await self.lease.held.wait()
        async with self.writer.held():
            now = now or self.clock.utcnow()
            view = await self.view(ask)
            state = view.state()
            tasks = list(decide(state))
            if not tasks:
                return Round(state=state, tasks=[], outcomes={}, written=Written())
            versions = _versions(view, streams_to_check(self.node, tasks))
            removed = {s: limit for s in _removals(tasks) if (limit := self.enforcing.get(s))}
            outcomes = await self._enforce(tasks)
            written = record(self.node, tasks, outcomes, versions, now)
            try:
                await self.report(_batches(written, {}))
            except (ConflictError, RetryableError):
                await self._settle(ask, tasks, outcomes, removed)
                raise
            return Round(state=state, tasks=tasks, outcomes=outcomes, written=written)

    async def _settle(
        self,
        ask: ViewAsk,
        tasks: Sequence[Task],
        outcomes: Mapping[str, AppliedLimit | Failed],
        removed: Mapping[str, ShareLimit],
    ) -> None:
        """After a report that did not land (or whose answer was lost): make the kernel
        say what the log says of the shares this round touched. A limit just applied
        whose share the log does not hold ``ready`` is removed; a limit just removed
        whose share the log still holds ``ready`` is put back. Where no view can be had
        now, the agent's next reconcile settles it (:mod:`services.enforcement.reconciling`)."""
        try:
            state = (await self.view(ask)).state()
        except RetryableError as exc:
            log.warning("kernel and log not compared after a lost report: %s", exc)
            return
        applied = [
            limit.share_id
            for task in tasks
            if isinstance(task, Enforce)
            for limit in task.limits
            if isinstance(outcomes.get(limit.share_id), AppliedLimit)
        ]
        for share_id in applied:
            share = state.shares.get(share_id)
            if share is None or share.state != "ready":
                await self._remove(share_id)
        for share_id, limit in removed.items():
            share = state.shares.get(share_id)
            if share is not None and share.state == "ready":
                await self._apply(limit)

    # -- device health and use -------------------------------------------------------------

    async def _watch(self, stop: asyncio.Event) -> None:
        """Check device health and share use every ``health_interval`` s until ``stop``;
        a failed check is logged and tried at the next tick."""
        while not stop.is_set():
            await self.clock.wait(stop, self.health_interval)
            if stop.is_set():
                return
            try:
                await self.check_health()
                await self.check_use()
            except RetryableError as exc:  # the service or the bus is away: next tick
                log.warning("device health or use check not done: %s", exc)
            except Exception:
                log.exception("device health or use check failed")

    async def check_health(self) -> list[DeviceHealthChanged]:
        """Ask the enforcer and the last scan how the node's devices are; report changes.

        Only when the findings differ from the last check's does the agent ask for a view
        and report the transitions the log does not have yet.
        """
        await self.lease.held.wait()
        async with self.writer.held():
            scanner = self.scanner
            found: frozenset[DeviceKey] = frozenset()
            drivers: set[str] = set()
            if scanner is not None and scanner.inventory is not None:
                found = frozenset(
                    (driver, scanner.config.pool_for(driver), device.name)
                    for driver, devices in scanner.inventory.devices.items()
                    for device in devices
                )
                config = scanner.config
                drivers = {c.driver for c in (config.network, config.gpu) if c.enabled}
                drivers |= set(scanner.inventory.devices)
            problems: dict[DeviceKey, str | None] = {}
            try:
                problems = dict(await self.enforcer.health())
            except EnforcementError as exc:
                log.warning("the enforcer's health check failed: %s", exc)
            if self._health_found == (found, problems):
                return []
            if (scanner is None or scanner.inventory is None) and not problems:
                # no scan and no problem: no finding to hold against the log, so no view
                # of the whole node (its cost grows with the node's live shares)
                self._health_found = (found, problems)
                return []
            state = (await self.view(ViewAsk(node=True))).state()
            findings: dict[DeviceKey, str | None] = {}
            if scanner is not None and scanner.inventory is not None:
                findings.update(vanished(state, self.node, drivers, found))
            for key, problem in problems.items():
                if problem is not None or key not in findings:  # a problem wins
                    findings[key] = problem
            changes = health_changes(state, self.node, findings)
            if changes:
                await self.report_events(changes)
                for change in changes:
                    where = f"{change.driver}/{change.pool}/{change.device}"
                    if change.healthy:
                        log.info("device %s is healthy again", where)
                    else:
                        log.warning("device %s is unhealthy: %s", where, change.reason)
            self._health_found = (found, problems)
            return changes

    async def check_use(self) -> list[ShareUsed]:
        """Report each share of the node the enforcer saw traffic through, once."""
        await self.lease.held.wait()
        try:
            usage = await self.enforcer.usage()
        except EnforcementError as exc:
            log.warning("the enforcer's use read-out failed: %s", exc)
            return []
        self._used &= set(usage)  # shares no longer in force are forgotten
        new = sorted(s for s, sent in usage.items() if sent > 0 and s not in self._used)
        if not new:
            return []
        state = (await self.view(ViewAsk(shares=new))).state()
        used = uses(state, self.node, usage)
        if used:
            await self.report_events(used)
        self._used.update(new)
        return used

    # -- return ----------------------------------------------------------------------------

    async def settle_unknown(self, state: ClusterState | None = None) -> bool:
        """Confirm or release the node's unknown shares (see the module docstring); whether
        there were any. ``state``: a view of the whole node already at hand."""
        async with self.writer.held():
            if state is None:
                state = (await self.view(ViewAsk(node=True))).state()
            if not any(state.shares[i].state == "unknown" for i in _node_shares(state, self.node)):
                return False
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
            plan = plan_return(
                state, self.node, rebooted=rebooted, observed=observed, entries=entries
            )
            removed: list[str] = []
            for share_id in plan.remove:
                await self._remove(share_id)  # raises: the lease is retaken and this tried again
                removed.append(share_id)
            events: list[Event] = [ShareConfirmed(share_id=s, node=self.node) for s in plan.confirm]
            events += [
                LimitFailed(share_id=s, node=self.node, retryable=False, reason=why)
                for s, why in sorted(plan.fail.items())
            ]
            events += [LimitRemoved(share_id=s, node=self.node) for s in removed]
            events += [released(share) for share in plan.release]
            await self.report_events(events)
            log.info(
                "node %s returned: %d unknown share(s) confirmed, %d released%s",
                self.node,
                len(plan.confirm),
                len(plan.release),
                " (rebooted)" if rebooted else "",
            )
            return True

    # -- restart -------------------------------------------------------------------------

    async def reconcile(self) -> EnforcementReconciled | None:
        """Make the node's limits match the log (see the module docstring)."""
        async with self.writer.held():
            state = (await self.view(ViewAsk(node=True))).state()
            if await self.settle_unknown(state):  # the node's shares moved: look again
                state = (await self.view(ViewAsk(node=True))).state()
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
                self.enforcing = Enforcing(e.limit for e in entries.values())
                await self.report_events(events)
                # still tried: a bound share has nothing else to apply it, and a kernel
                # that cannot be read is recorded as its failure, retried from there
                await self._apply_bound()
                return None
            if checkpoint is not None and checkpoint.rebooted:
                log.info("node rebooted since the checkpoint was written: limits are put back")
            plan = plan_reconcile(state, self.node, observed, entries)
            removed: list[str] = []
            self.enforcing = Enforcing(limit_of(state.shares[s]) for s in plan.kept)
            for share_id in plan.orphans + plan.stale:
                if share_id in entries:  # still in force until its removal succeeds
                    self.enforcing.add(entries[share_id].limit)
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
                now = self.clock.utcnow()
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
            await self.report_events(events)
            await self._apply_bound()
            return self.reconciled

    async def _apply_bound(self) -> None:
        """Apply and record the node's ``bound`` shares (:func:`decide_bound`): one whose
        message was taken while it was ``unknown`` has nothing else to apply it. A claim
        deleted meanwhile makes the report conflict: its release takes it from there."""
        try:
            done = await self.carry_round(
                ViewAsk(node=True),
                lambda state: decide_bound(state, self.node, self.enforcing),
                leased=True,
            )
        except ConflictError as exc:
            log.info("node %s: bound shares not applied at reconcile (%s)", self.node, exc)
            return
        if done.tasks:
            log.info(
                "node %s: %d bound share(s) applied at reconcile",
                self.node,
                sum(len(t.limits) for t in done.tasks if isinstance(t, Enforce)),
            )

    async def _durable_made_again(self) -> bool:
        """Have the node's durable made again (the consumer's pulls found none); when it
        had to be, take up what its lost messages asked (:meth:`take_up`)."""
        created = await self.plane.consumer()
        if created:
            await self.take_up()
        return created

    async def take_up(self) -> None:
        """Carry out what the log asks of this node that no message may bring any more.

        A broker that lost its store lost the node's durable and every message the agent
        had not taken yet, and the relay republishes a lost stream only from the lowest
        position a consumer recorded (:mod:`services.runtime.delivery.rebuilding`), which
        an agent, with no database, does not record: a binding or a release below it
        would never come. The agent keeps its lease through such a loss, so no reconcile
        follows either. Once its durable is made again it applies its ``bound`` shares
        and carries out its ``releasing`` claims from the log, as their messages would
        have (:func:`~services.enforcement.decisions.decide_taken_up`; ``apply`` and
        ``remove`` are idempotent, and a message that does come again finds the work
        done). A failure is logged: the next reconcile (a new lease, a restart) does it.
        """
        for _ in range(3):  # a delete or a fence that got in first: decide again
            try:
                done = await self.carry_round(
                    ViewAsk(node=True),
                    lambda state: decide_taken_up(state, self.node, self.enforcing),
                )
            except ConflictError:
                continue
            except Exception as exc:
                TAKE_UP_FAILURES.inc()
                log.warning(
                    "node %s: its shares not taken up after its durable was lost (%s)",
                    self.node,
                    one_line(exc),
                )
                return
            if done.tasks:
                log.info(
                    "node %s: %d claim(s) taken up from the log after its durable was lost",
                    self.node,
                    len(done.tasks),
                )
            return
        TAKE_UP_FAILURES.inc()
        log.warning(
            "node %s: its shares not taken up after its durable was lost (conflicts)", self.node
        )

    # -- inventory ---------------------------------------------------------------------------

    async def node_slices(self) -> list[ResourceSlice]:
        """The ResourceSlices the log holds for this node (the scanner's first publication)."""
        state = (await self.view(ViewAsk(node=True))).state()
        return list(state.slices.values())

    async def publish(self, batches: list[tuple[str, list[Event]]]) -> None:
        """Report an inventory scan's publications (the scanner's ``publish``)."""
        await self.report([Outgoing(stream, None, events) for stream, events in batches])

    # -- the kernel, wrapped in the checkpoint -------------------------------------------

    async def _apply(self, limit: ShareLimit) -> AppliedLimit:
        checkpoint = self.checkpoint
        if checkpoint is None:
            applied = await self.enforcer.apply(limit)
        else:
            await asyncio.to_thread(checkpoint.mark_started, limit.share_id, limit)
            applied = await self.enforcer.apply(limit)
            await asyncio.to_thread(checkpoint.mark_completed, limit.share_id, applied)
        self.enforcing.add(limit)
        return applied

    async def _remove(self, share_id: str) -> None:
        checkpoint = self.checkpoint
        if checkpoint is None:
            await self.enforcer.remove(share_id)
        else:
            await asyncio.to_thread(checkpoint.mark_removing, share_id)
            await self.enforcer.remove(share_id)
            await asyncio.to_thread(checkpoint.mark_removed, share_id)
        self.enforcing.discard(share_id)

    # -- messages ------------------------------------------------------------------------

    def wants(self, env: Envelope) -> bool:
        """The messages this agent acts on: its node's bindings and release requests."""
        work = first(meaning(env.event), _WORK)
        return work is not None and work.node == self.node

    async def handle(self, group: list[Delivery]) -> set[str]:
        """Apply or remove limits for a group of messages (see the module docstring);
        the ids of those the log does not hold as sent."""
        async with self.hold():
            return await (await self.land(await self.stage(group), None))

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """What handling messages holds: the lease (waited for) and the writer."""
        await self.lease.held.wait()  # no work while the lease is being taken back
        async with self.writer.held():
            yield

    def going(self) -> bool:
        """Whether the consumer may take one more group while it holds the writer: the
        lease is held and no other path (a retry, a kubelet round, a health check) waits."""
        return self.lease.held.is_set() and not self.writer.contended

    async def stage(self, group: list[Delivery]) -> Staged:
        """The first half of :meth:`handle` (under :meth:`hold`): ask for a view of the
        group, decide, enforce; :meth:`land` reports it."""
        envs = [d.env for d in group]
        redelivered = [d.env.event_id for d in group if d.delivery > 1]
        view, viewed = await self.plane.view(ViewAsk(messages=envs, redelivered=redelivered))
        self._note_retry(viewed.next_retry_at)
        skip = set(viewed.unconfirmed) | set(viewed.handled) | set(viewed.refused)
        mine = [env for env in envs if env.event_id not in skip]
        state = view.state()
        tasks = decide_work(state, self.node, mine, self.enforcing)
        staged = Staged(
            mine=mine,
            unconfirmed=set(viewed.unconfirmed),
            tasks=tasks,
            outcomes={},
            versions={},
            classes={},
            now=self.clock.utcnow(),
        )
        if tasks:
            staged.versions = _versions(view, streams_to_check(self.node, tasks))
            staged.classes = {env.event_id: _class_of(state, env) for env in mine}
            staged.outcomes = await self._enforce(tasks)
            staged.now = self.clock.utcnow()
        return staged

    async def land(self, staged: Staged, after: Staged | None) -> Coroutine[None, None, set[str]]:
        """The second half of :meth:`handle` (under :meth:`hold`): report what ``staged``
        did, with its messages recorded as handled. Once this returns the report is on
        its way; the coroutine returned waits for the answer and gives the ids of the
        messages the log does not hold as sent (the consumer runs it as a task while it
        stages the next group: the report goes out at once, not a turn of the loop later).

        ``after``: the group whose report was in flight while ``staged`` was viewed, and
        which has landed since. The view may not show that report, so the node stream is
        expected at the later of the view's version and the version that report left:
        the append still conflicts if anyone else wrote to the node stream since the
        view (a fence, another agent), as a report decided after the other landed would.
        """
        if not staged.tasks:
            return self._landed(staged, None, Written())
        versions = dict(staged.versions)
        stream = node_stream(self.node)
        if after is not None and after.landed is not None and stream in versions:
            versions[stream] = max(versions[stream], after.landed)
        written = record(self.node, staged.tasks, staged.outcomes, versions, staged.now)
        causes = {env.event_id: _cause(env) for env in staged.mine}
        epoch = self.lease.epoch
        assert epoch is not None, "a report before the lease"
        batches = _batches(written, causes)
        asked = ReportRequest(
            epoch=epoch,
            batches=[b.batch() for b in batches],
            processed=[e.event_id for e in staged.mine],
        )
        return self._landed(staged, await self._sent(asked, batches), written)

    async def _landed(
        self, staged: Staged, answer: Awaitable[None] | None, written: Written
    ) -> set[str]:
        if answer is not None:
            await answer
            stream = node_stream(self.node)
            if stream in written.streams:
                version, events, _ = written.streams[stream]
                staged.landed = (version or 0) + len(events)
            for count in _counters(written, staged.mine, staged.classes):
                count()
        for listener in tuple(self._message_listeners):
            listener([env.event for env in staged.mine])
        return staged.unconfirmed

    async def refused_undecodable(self, event_id: str) -> bool:
        """Whether a message that did not decode is an event of the log the fold refuses
        (acknowledged unhandled; otherwise it is dropped as unconfirmed)."""
        _, viewed = await self.plane.view(ViewAsk(undecodable=[event_id]))
        return event_id in viewed.refused

    async def dead_letter(self, env: Envelope, deliveries: int, reason: str) -> None:
        """Record that the consumer gave up on ``env`` (the message recorded as handled)."""
        await self.lease.held.wait()
        async with self.writer.held():
            event = MessageDeadLettered(
                consumer=self.consumer.name,
                event_id=env.event_id,
                position=env.position,
                deliveries=deliveries,
                reason=reason[:2000],
            )
            batch = Outgoing(stream_of(event), None, [event], [_cause(env)])
            await self.report([batch], processed=[env.event_id])

    async def _enforce(self, tasks: Sequence[Task]) -> dict[str, AppliedLimit | Failed]:
        """Run the enforcers for ``tasks``; the outcome of each apply, by share id.

        The removals first (they only give capacity back, as the decisions counted
        them), then the applies; with a checkpoint, each phase is marked for all its
        shares in one durable write before the kernel is touched and one after (not two
        per share). A failed apply is an outcome (recorded, and retried when it is
        retryable); a failed removal raises: nothing is recorded (the consumer naks its
        messages; a kubelet round answers with the error and the kubelet retries).
        """
        gone = _removals(tasks)
        limits: list[ShareLimit] = []
        for task in tasks:
            if isinstance(task, Enforce):
                for refusal in task.refused:
                    log.error("limit of share %s not applied: %s", refusal.share_id, refusal.reason)
                limits.extend(task.limits)
        checkpoint = self.checkpoint
        if gone:
            if checkpoint is not None:
                await asyncio.to_thread(checkpoint.mark_removing_all, gone)
            done: list[str] = []
            try:
                for share_id in gone:
                    await self.enforcer.remove(share_id)
                    self.enforcing.discard(share_id)
                    done.append(share_id)
            finally:
                if checkpoint is not None and done:
                    await asyncio.to_thread(checkpoint.mark_removed_all, done)
        outcomes: dict[str, AppliedLimit | Failed] = {}
        if not limits:
            return outcomes
        if checkpoint is not None:
            await asyncio.to_thread(checkpoint.mark_started_all, limits)
        applied: dict[str, AppliedLimit] = {}
        try:
            for limit in limits:
                try:
                    applied[limit.share_id] = await self.enforcer.apply(limit)
                except EnforcementError as exc:
                    retryable = isinstance(exc, RetryableEnforcementError)
                    log.error("limit of share %s failed: %s", limit.share_id, exc)
                    outcomes[limit.share_id] = Failed(retryable=retryable, reason=str(exc))
                else:
                    self.enforcing.add(limit)
        finally:
            if checkpoint is not None and applied:
                await asyncio.to_thread(checkpoint.mark_completed_all, applied)
        outcomes.update(applied)
        return outcomes


def _removals(tasks: Sequence[Task]) -> list[str]:
    """The shares whose limits ``tasks`` take down."""
    out: list[str] = []
    for task in tasks:
        if isinstance(task, Unprepare):
            out += task.share_ids
        elif isinstance(task, Release):
            out += [gone.share_id for gone in task.released]
    return out


def _node_shares(state: ClusterState, node: str) -> list[str]:
    """The live shares the view places on ``node``."""
    held = state.nodes.get(node)
    return sorted(held.live_shares) if held is not None else []


def _versions(view: NodeView, streams: Sequence[str]) -> dict[str, int]:
    """The versions of ``streams`` as of the view (0: none known: the stream must be new)."""
    return {stream: view.versions.get(stream, 0) for stream in streams}


def _cause(env: Envelope) -> Cause:
    """The cause of an event reported in reaction to ``env``."""
    return Cause(correlation_id=env.correlation_id, causation_id=env.event_id)


def _batches(written: Written, causes: dict[str, Cause]) -> list[Outgoing]:
    """The report of ``written``, each event caused by its message (none for a retry)."""
    out: list[Outgoing] = []
    for stream, (version, events, caused_by) in written.streams.items():
        given = [causes[m] for m in caused_by if m in causes]
        out.append(Outgoing(stream, version, events, given if len(given) == len(events) else None))
    return out


def _class_of(state: ClusterState, env: Envelope) -> str:
    """The DeviceClass of the claim a message is about (a metric label)."""
    work = first(meaning(env.event), _WORK)
    return known_class(state, (work.namespace, work.name)) if work is not None else ""


def _counters(
    written: Written, messages: Sequence[Envelope], classes: dict[str, str]
) -> list[Callable[[], None]]:
    """The metrics of ``written`` (``classes``: each message's DeviceClass), measured now
    and counted once it has been reported."""
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
