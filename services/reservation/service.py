"""The reservation service: admitted claims in, capacity reservations out.

One worker is a :class:`ReservationService`: a few durable JetStream consumers that
share one handler, over a :class:`~services.runtime.store.livestate.LiveState`. Several
workers (in one process or many) bind the *same* durable consumers, so each message
goes to one of them (a work queue); correctness never depends on that, because every
decision is appended with expected stream versions.

What wakes it (consumer ``{name}-{feed}``, :data:`FEEDS`):

* ``admissions``: ``ClaimAdmitted`` (the consumer filters on that one tag: the hot path
  delivers a worker nothing else) — a new claim to place;
* ``reclamation`` (the category): ``CapacityReleased``, ``NodeFenced``,
  ``NodeLeaseAcquired`` and ``DeviceHealthChanged`` — capacity came back, or a lost
  node's (or an unhealthy device's) devices take shares again, so unschedulable claims
  may fit now;
* ``inventory`` (the category): classes, slices, request policies — the same;
* ``admin`` (the category): ``NamespaceAccessSet`` — adminAccess may have been granted.

Other events of those categories are acknowledged without a transaction (``wants``).
The consumers commit in groups (:mod:`services.runtime.delivery.consuming`): the messages that
arrived while the previous group was handled are planned for *once*, and the plan and
the group's ``processed_messages`` rows commit in one statement —
which is also why a burst of admissions costs few commits.

The decision
------------
A round is the pure :func:`services.reservation.rounds.decide_round` (its module
docstring lists the rules): pending claims (phase ``admitted`` or ``unschedulable``)
in admission order, first come first served, each decided by the pure
:class:`~services.reservation.allocating.Allocator` with the grants of the claims
before it committed tentatively; an ``unschedulable`` claim is tried again only when
the *capacity epoch* moved since its last try. The service's part
(:meth:`ReservationService.plan`) is the loop around it: it hands the round the state
(held still with ``LiveState.frozen``), the allocator and its backlog, reads the
expected versions of the streams the round writes on that same state, and remembers
what the round says about the claims (waiting for a selector; tried at this epoch —
the latter only once the round's append has committed: a try that found a claim
unschedulable because a claim before it took the capacity tentatively is void when
that append conflicts, a tenant having deleted the claim before it, say, and the round
planned again must try it on the freed capacity, not skip it until the next release).

Per allocated claim the round appends ``CapacityReserved`` on each device's stream
(expected version: the device stream's version in the live state) and
``AllocationBound`` on the claim stream (expected version likewise), all in **one**
append, which the consumer commits with its records; a newly admitted claim that does
not fit gets ``ClaimUnschedulable`` instead.

Concurrency: planning rounds are serialised across all workers (in this process or
others) by an advisory lock (:data:`PLANNER_LOCK`, the consumer's ``lock_key``) taken
before the worker asks for a fresh state (``LiveState.fresh`` at the lock's head) and
given back only once its append committed (a lone worker keeps it between rounds until
another worker, or its own round without a message, asks for it:
:mod:`services.runtime.delivery.consuming`), so a worker plans on a state that includes
the previous round's commit — several workers give availability, not parallel planning
(a round plans *every* pending claim; two rounds at once would only collide). If
anything else (a release, the tenant's delete) appended to one of the streams since
the live state read them, the store raises ``ConflictError``: nothing is written and
the consumer handles the messages again (alone, then by redelivery with back-off),
each time on a fresh view. Should a message still be dead-lettered (it failed on every
delivery), the worker plans again without it (:meth:`ReservationService.replan`): a
round plans every pending claim, so no claim waits on a lost trigger. The database
ledger's ``CHECK (allocated <= total)`` and
the exclusive-hold key are the last line: even a wrong plan can never oversubscribe
a device.

Allocator state is kept incrementally: a listener on the live state adds a grant for
every ``CapacityReserved`` and removes it when the share is released (release or
fence); the inventory is rebuilt only when an inventory event arrives. A round undoes
its tentative commits before it returns, so between rounds the allocator's state is
exactly the log's.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from events.actors import Actor
from events.catalog import (
    ClaimAdmitted,
)
from events.envelopes import Envelope
from events.errors import SelectorDeadlineExceeded, SelectorError
from events.features import DEFAULT_GATES, FeatureGates
from events.inventory import SelectorResult, build_inventory
from events.model import AllocationResult
from events.selectors import DeviceView
from events.state import ClaimKey, ClusterState
from events.subjects import BusNames
from events.transitions import (
    AccessChanged,
    ClaimDecided,
    ClaimEntered,
    DeviceHealth,
    NodeFencedOff,
    NodeReturned,
    ShareHeld,
    ShareReleased,
    Transition,
    events_meaning,
    first,
    meaning,
)
from services.reservation.allocating import Allocator
from services.reservation.deriving import grant_of, live_grants
from services.reservation.outcomes import Allocated, Grant
from services.reservation.rounds import PENDING_PHASES, Backlog, Round, decide_round
from services.runtime.bus.jetstream import Durable
from services.runtime.delivery.confirming import LogConfirmation
from services.runtime.delivery.consuming import Consumer, close_session, take_lock
from services.runtime.delivery.handlers import Handled, HandlerContext
from services.runtime.ground.context import ServiceContext
from services.runtime.ground.errors import ConflictError, RuntimeServiceError
from services.runtime.ground.metrics import CLAIMS, REPLAN_FAILURES, SELECTOR_JOBS
from services.runtime.ground.waiting import all_of, first_of
from services.runtime.ops.selectorpool import SelectorPool
from services.runtime.store import recorded
from services.runtime.store.appends import Batch, Cause, Metadata
from services.runtime.store.eventstore import Connection
from services.runtime.store.livestate import HEAD, INVENTORY_EVENTS
from services.runtime.store.logandfold import LogAndFold

__all__ = ["FEEDS", "TRIGGERS", "Plan", "ReservationService", "durables"]

log = logging.getLogger("dracap.reservation")

#: Seconds before a replan that failed (the database or the bus away) is tried again.
REPLAN_RETRY_S: Final = 1.0

#: What a worker consumes: feed name -> the tag (with a dot) or category it reads.
FEEDS: Final = {
    "admissions": "claims.admitted",  # ClaimAdmitted's tag
    "reclamation": "reclamation",
    "inventory": "inventory",
    "admin": "admin",
}


def durables(names: BusNames, name: str = "reservation") -> list[Durable]:
    """The durable consumers every worker named ``name`` shares: one per feed."""
    return [
        Durable(
            f"{name}-{feed}",
            names.tag_filter(source) if "." in source else names.category_filter(source),
        )
        for feed, source in FEEDS.items()
    ]


#: Events that make a worker plan.
#: What a worker plans for besides the inventory's changes: an admission, and what gives
#: capacity back (a release, a fence), lets a lost node's or an unhealthy device's
#: devices take shares again (a new lease, health) or may grant adminAccess (a
#: namespace's access) — as event classes, for the feeds (:data:`FEEDS`).
TRIGGERS: Final = (
    ClaimAdmitted,
    *sorted(
        events_meaning(ShareReleased, NodeFencedOff, NodeReturned, DeviceHealth, AccessChanged),
        key=lambda cls: cls.__name__,
    ),
)
#: The advisory lock that serialises planning rounds of all workers.
PLANNER_LOCK: Final = 0x64726163_61700001  # "dracap" + 1
#: Cost units a tenant's selector may spend in the decision per candidate set; beyond
#: that it is evaluated in the selector pool (cel-python: 35-80 µs per unit, so the
#: decision spends at most about 7-16 ms on one tenant selector per candidate set).
INLINE_BUDGET: Final = 200
_FREEING: Final = INVENTORY_EVENTS | events_meaning(ShareReleased, NodeFencedOff, AccessChanged)
#: Every event class a worker plans for.
_WANTED: Final = INVENTORY_EVENTS | frozenset(TRIGGERS)


class Plan:
    """The append one planning round wants: its events, per stream, at the versions read.

    Every event carries its :class:`Cause`: the ``ClaimAdmitted`` message of its claim
    when that message is among those being handled, else the first trigger of them.
    """

    def __init__(
        self,
        decided: Round,
        versions: Mapping[str, int],
        causes: Callable[[ClaimKey], Cause],
        epoch: int,
    ) -> None:
        self.decided = decided
        self.epoch = epoch  #: the capacity epoch the round decided at
        self.batches = [
            Batch(stream, versions[stream], events, [causes(claim) for claim in claims])
            for stream, events, claims in decided.by_stream()
        ]
        self.allocated = decided.allocated
        self.unschedulable = decided.unschedulable


class ReservationService:
    """One reservation worker (see the module docstring)."""

    def __init__(
        self,
        context: ServiceContext[LogAndFold],
        *,
        worker: int = 0,
        name: str = "reservation",
        gates: FeatureGates = DEFAULT_GATES,
        new_share_id: Callable[[], str] = lambda: str(uuid.uuid4()),
        inline_budget: int = INLINE_BUDGET,
        selectors: SelectorPool | None = None,
        owner: bool = True,
    ) -> None:
        store = self.store = context.stores.store
        live = self.live = context.stores.live
        self.js = context.js
        self.names = context.names
        self.clock = context.clock  #: the clock of the retry of a failed replan
        self.worker = worker
        #: the consumers :meth:`run` pulls with (a health check asks them)
        self.running: list[Consumer] = []
        self.name = name
        #: whether the workers create their durables (False: the relay owns them)
        self.owner = owner
        self._actor = str(Actor.system(f"{name}-{worker}"))
        self.gates = gates
        self.new_share_id = new_share_id
        self._allocator: Allocator | None = None
        self._counted: dict[str, Grant] = {}
        self._counted_on: dict[str, set[str]] = {}  # node -> its shares in _counted
        self._pending: dict[ClaimKey, datetime.datetime | None] = {}
        self._tried: dict[ClaimKey, int] = {}
        self._epoch = 0
        self.inline_budget = inline_budget
        #: where tenants' expensive selectors are evaluated (services.runtime.ops.selectorpool)
        self.selectors = selectors if selectors is not None else SelectorPool()
        #: claims waiting for a selector's results: why they were planned, and the selector
        self._deferred: dict[ClaimKey, tuple[Cause, str]] = {}
        self._owners: dict[str, str] = {}  # heavy expression -> namespace that asked for it
        self._evaluating: set[str] = set()  # heavy expressions being evaluated now
        self._jobs: set[asyncio.Task[None]] = set()
        self._replan = asyncio.Event()
        self._seed(live.state)
        live.subscribe(self.observe)
        live.on_replaced(self._reseed)
        self._confirmation = LogConfirmation(store, live)

    # -- allocator state, kept from the live state -------------------------------------

    def _seed(self, state: ClusterState) -> None:
        for share_id, grant in live_grants(state):
            self._count(state, share_id, grant)
        for key, claim in state.claims.items():
            if claim.phase in PENDING_PHASES:
                self._pending[key] = None

    def _reseed(self, state: ClusterState) -> None:
        """The live state was replaced (its snapshot did not check out): start over from it."""
        self._counted.clear()
        self._pending.clear()
        self._allocator = None
        self._seed(state)
        self._replan.set()

    def _allocator_for(self, state: ClusterState) -> Allocator:
        if self._allocator is None:
            inventory = build_inventory(state, self.gates, inline_budget=self.inline_budget)
            allocator = Allocator(inventory, new_share_id=self.new_share_id)
            allocator.add_grants(self._counted.values())
            self._allocator = allocator
        return self._allocator

    def _count(self, state: ClusterState, share_id: str, grant: Grant) -> None:
        self._counted[share_id] = grant
        node = state.shares[share_id].node
        if node is not None:
            self._counted_on.setdefault(node, set()).add(share_id)

    def _forget(self, share_id: str, node: str | None) -> None:
        grant = self._counted.pop(share_id, None)
        if node is not None:
            self._counted_on.get(node, set()).discard(share_id)
        if grant is not None and self._allocator is not None:
            self._allocator.release(_as_allocated([grant]))

    def observe(self, env: Envelope) -> None:
        """Live-state listener: keep grants, pending claims and the epoch current."""
        event, state = env.event, self.live.state
        transitions = meaning(event)
        for t in transitions:
            match t:
                case ShareHeld():
                    share = state.shares.get(t.share_id)
                    if share is not None and share.live and t.share_id not in self._counted:
                        grant = grant_of(share)
                        self._count(state, t.share_id, grant)
                        if self._allocator is not None:
                            self._allocator.add_grants([grant])
                case ShareReleased():
                    share = state.shares.get(t.share_id)
                    if share is not None and not share.live:
                        self._forget(t.share_id, share.node)
                case NodeFencedOff():  # the node's counted shares, not every one
                    on_node = self._counted_on.get(t.node, set())
                    for share_id in [s for s in on_node if not state.shares[s].live]:
                        self._forget(share_id, t.node)
        if type(event) in INVENTORY_EVENTS:
            self._allocator = None
        if type(event) in _FREEING:
            self._epoch += 1
        self._track_claim(env, state, transitions)

    def _track_claim(
        self, env: Envelope, state: ClusterState, transitions: tuple[Transition, ...]
    ) -> None:
        event = env.event
        if (entered := first(transitions, ClaimEntered)) is not None:
            key = (entered.namespace, entered.name)
        else:
            namespace, name = getattr(event, "namespace", None), getattr(event, "name", None)
            if not isinstance(namespace, str) or not isinstance(name, str):
                return
            key = (namespace, name)
        claim = state.claims.get(key)
        decided = first(transitions, ClaimDecided)
        if decided is not None and decided.outcome == "admitted":
            self._pending.pop(key, None)  # re-admission goes to the back of the queue
            self._tried.pop(key, None)
        if claim is not None and claim.phase in PENDING_PHASES:
            self._pending.setdefault(key, env.recorded_at)
        else:
            self._pending.pop(key, None)
            self._tried.pop(key, None)
            self._deferred.pop(key, None)

    # -- planning -----------------------------------------------------------------------

    async def plan(
        self, causes: Callable[[ClaimKey], Cause], connection: Connection | None = None
    ) -> Plan:
        """One round on the live state (:func:`decide_round`), as an append; the
        configuration of the claims it binds is read from the log on ``connection``.

        The claims it tried and found unschedulable count as tried only once the append
        has committed (:meth:`_record_tries`): see the module docstring.
        """
        async with self.live.frozen() as state:
            backlog = self._backlog()
            decided = decide_round(state, self._allocator_for(state), backlog, self.new_share_id)
            versions = {s: await self.live.stream_version(s) for s in decided.writes}
            position = state.position
        if decided.configured:
            reader = connection if connection is not None else self.store.pool
            found = await recorded.manifests(reader, decided.configured, position)
            for key in decided.configure(found):
                log.error("claim %s/%s: the log holds no manifest to configure it from", *key)
        self._remember(decided, causes)
        return Plan(decided, versions, causes, backlog.epoch)

    def _backlog(self) -> Backlog:
        return Backlog(
            order=list(self._pending),
            epoch=self._epoch,
            tried=self._tried,
            waiting={key: expression for key, (_, expression) in self._deferred.items()},
            evaluating=self._evaluating,
        )

    def _remember(self, decided: Round, causes: Callable[[ClaimKey], Cause]) -> None:
        """Keep what ``decided`` says about claims waiting for selectors."""
        for key in decided.settled:
            self._deferred.pop(key, None)
        for key, expression in decided.deferred.items():
            waiting = self._deferred.get(key)
            cause = waiting[0] if waiting is not None else causes(key)
            self._deferred[key] = (cause, expression)
            self._owners.setdefault(expression, key[0])

    def _record_tries(self, plan: Plan) -> Callable[[], None]:
        """Record the claims ``plan`` found unschedulable as tried at its epoch: call once
        its append has committed (a round that did not commit tried nothing)."""

        def record() -> None:
            for key in plan.decided.tried:
                if key in self._pending:  # not re-admitted, withdrawn or placed meanwhile
                    self._tried[key] = plan.epoch

        return record

    # -- the handler --------------------------------------------------------------------

    async def handle(self, ctx: HandlerContext, envs: list[Envelope]) -> Handled:
        """Plan once for a group of messages; the consumer commits the plan.

        A lost race (``ConflictError``) writes nothing; the consumer handles the
        messages again (see the module docstring).
        """
        triggers = [e for e in envs if type(e.event) in _WANTED]
        if not triggers:
            return Handled()
        admissions = {
            (d.namespace, d.name): Cause.of(e)
            for e in triggers
            if (d := first(meaning(e.event), ClaimDecided)) is not None and d.outcome == "admitted"
        }
        earliest = Cause.of(triggers[0])

        def cause(key: ClaimKey) -> Cause:
            return admissions.get(key, earliest)

        # The consumer holds PLANNER_LOCK while this runs and until its append has
        # committed: one planner at a time, in any process (a round plans every
        # pending claim, so two at once would only fight over the same devices and
        # claims). A state fresh as of the lock sees every earlier planner's commit.
        at_least = HEAD if ctx.locked_head is None else ctx.locked_head
        await self.live.fresh(at_least, connection=ctx.connection)
        plan = await self.plan(cause, ctx.connection)
        self._evaluate_wanted()
        batches = plan.batches
        if not batches:
            return Handled(on_commit=[self._record_tries(plan)])
        return Handled(
            batches=batches,
            actor=self._actor,
            on_commit=[self._counter(plan), self._record_tries(plan)],
        )

    def _counter(self, plan: Plan) -> Callable[[], None]:
        """The outcomes of ``plan``, counted once it has committed. (Its latency is the
        log's: ``dracap_scheduling_latency_seconds`` is observed from the folded log,
        :mod:`services.runtime.ops.slos`, as ``dracap report`` reads it.)"""
        allocated, unschedulable = len(plan.allocated), len(plan.unschedulable)

        def count() -> None:
            if allocated:
                CLAIMS.labels(outcome="allocated").inc(allocated)
            if unschedulable:
                CLAIMS.labels(outcome="unschedulable").inc(unschedulable)

        return count

    # -- tenants' expensive selectors ---------------------------------------------------

    def _evaluate_wanted(self) -> None:
        """Send the heavy selectors the last plan lacked to the pool (once each)."""
        allocator = self._allocator
        if allocator is None:
            return
        for expression, indices in list(allocator.inventory.wanted.items()):
            if expression in self._evaluating:
                continue
            self._evaluating.add(expression)
            owner = self._owners.get(expression, "")
            job = asyncio.create_task(self._evaluate(allocator, expression, sorted(indices), owner))
            self._jobs.add(job)
            job.add_done_callback(self._jobs.discard)

    async def _evaluate(
        self, allocator: Allocator, expression: str, indices: list[int], owner: str
    ) -> None:
        inventory = allocator.inventory
        results: dict[int, SelectorResult] = {}
        devices: list[tuple[int, DeviceView]] = []
        for index in indices:
            try:
                devices.append((index, inventory.devices[index].view()))
            except SelectorError as exc:  # the device's own attributes are malformed
                results[index] = SelectorError(expression, exc.message)
        try:
            results.update(
                await self.selectors.evaluate(
                    expression,
                    devices,
                    owner=owner,
                    consumable_capacity=self.gates.consumable_capacity,
                )
            )
        finally:
            self._evaluating.discard(expression)
            self._owners.pop(expression, None)
        if self._allocator is allocator and results:  # the same inventory: still valid
            inventory.record_results(expression, results)
            deadline = any(isinstance(r, SelectorDeadlineExceeded) for r in results.values())
            SELECTOR_JOBS.labels(outcome="deadline" if deadline else "evaluated").inc()
        self._replan.set()

    async def _replanner(self, stop: asyncio.Event) -> None:
        """Plan again whenever evaluated selectors came in or a trigger was dead-lettered
        (see :meth:`replan`)."""
        while not stop.is_set():
            await first_of(self._replan.wait(), stop.wait())
            if stop.is_set():
                return
            self._replan.clear()
            try:
                await self.replan()
            except ConflictError:
                self._replan.set()  # a concurrent append: plan again on a fresh view
            except (OSError, RuntimeServiceError) as exc:
                REPLAN_FAILURES.inc()
                log.warning("could not plan after a selector evaluation: %s", exc)
                await self.clock.wait(stop, REPLAN_RETRY_S)
                self._replan.set()

    async def replan(self) -> None:
        """One planning round without a message, under the planner lock."""
        async with self.store.pool.acquire() as connection:
            try:
                head, _ = await take_lock(connection, PLANNER_LOCK)  # asked of an idle holder
            except BaseException:
                close_session(connection)  # the lock may have been granted as the call failed
                raise
            try:
                await self.live.fresh(head, connection=connection)
                plan = await self.plan(self._deferred_cause, connection)
                self._evaluate_wanted()
                if plan.batches:
                    actor = self._actor
                    await self.store.append_many(
                        plan.batches, Metadata(actor=actor), connection=connection
                    )
                    self._counter(plan)()
                self._record_tries(plan)()
            finally:
                try:
                    await connection.execute("SELECT pg_advisory_unlock($1)", PLANNER_LOCK)
                except BaseException:
                    close_session(connection)  # the pool resets nothing: it must not get the lock
                    raise

    def _deferred_cause(self, key: ClaimKey) -> Cause:
        waiting = self._deferred.get(key)
        return waiting[0] if waiting is not None else Cause(None, None)

    # -- running ------------------------------------------------------------------------

    def consumers(self) -> list[Consumer]:
        """The durable consumers of this worker (shared by every worker of ``name``)."""
        return [
            Consumer(
                self.store,
                self.js,
                self.names,
                name=durable.name,
                filter_subject=durable.filter_subject,
                group_handler=self.handle,
                wants=_wanted,
                lock_key=PLANNER_LOCK,
                confirmation=self._confirmation,
                on_dead_letter=self._trigger_lost,
                owner=self.owner,
            )
            for durable in durables(self.names, self.name)
        ]

    def _trigger_lost(self, _event_id: str) -> None:
        """A planning trigger was dead-lettered: plan again without it (a round plans every
        pending claim, so what the message would have planned is planned)."""
        self._replan.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set (a failed consumer stops its siblings too)."""
        started = time.perf_counter()
        await self.live.fresh(HEAD)
        log.info("reservation worker %d ready in %.3fs", self.worker, time.perf_counter() - started)
        try:
            self.running = self.consumers()
            await all_of(*(c.run(stop) for c in self.running), self._replanner(stop))
        finally:
            await self.selectors.close()
            for job in list(self._jobs):
                job.cancel()
            await asyncio.gather(*self._jobs, return_exceptions=True)


def _wanted(env: Envelope) -> bool:
    return type(env.event) in _WANTED


def _as_allocated(grants: Sequence[Grant]) -> Allocated:
    """Grants wrapped as an outcome, for the allocator's commit/release."""
    return Allocated(claim="", node=None, allocation=AllocationResult(), grants=list(grants))
