"""The reclamation service: records expired node leases and runs the fence hook.

It owns no lease and no state of its own: every tick it asks the database, in one
statement, for the leases past their expiry whose epoch has not been recorded as
expired yet (``node_epochs`` holds the newest expired or fenced epoch, written by the
guard of the very event this service appends), together with the version of each
node's ``lease:<node>`` stream at that moment. For each it appends, decided on the live
state (:func:`~services.reclamation.decisions.decide_expiry`),
``NodeLeaseExpired`` to ``lease:<node>`` *at that version* and one
``ShareMarkedUnknown`` per live share to ``node:<node>``.

Exactly once, with any number of replicas: the lease stream receives only lease
transitions (a new lease, an expiry, a fence), so two replicas that read the same
expired lease append at the same version and the store lets exactly one of them in;
the other gets a :class:`~services.runtime.ground.errors.ConflictError`, and its next tick no
longer finds the lease (its epoch is now recorded). An agent that takes a new lease in
between moves the version too, so an expiry is never recorded over a fresh lease. A
renewal cannot revive an expired lease (``dracap_renew_lease`` refuses it), so a lease
seen expired stays expired until somebody appends to its stream.

Not started: every tick also looks for Ready claims that nobody reserved and whose
agent saw no use, past their DeviceClass's ``dracap.io/not-started-timeout`` (counted
from the time the event that made the claim Ready was recorded), and appends their
class's action (:func:`~services.reclamation.decisions.decide_not_started`):
``ReleaseRequested`` with the reason, or ``ClaimStalled``, on the claim's stream *at
the version read* — so with several replicas, or a tenant's delete or reservation
racing it, it is recorded once or not at all. The tick costs what is due, not what is
live: the service queues the candidates as the live state folds the events that name
them (:class:`NotStartedQueue`: per timeout, the claims by the log position their clock
starts at), and a tick asks the database the waited time of the oldest few of each
timeout only; a claim that stopped being a candidate (reserved, used, released) leaves
the queue when it comes up. Only a change of the DeviceClasses re-reads every claim.

Fence hook (``--fence-hook CMD``): a node whose lease has been expired for
``--fence-after`` seconds, and that no agent took back nor anybody fenced, gets
``CMD`` run with ``DRACAP_NODE`` and ``DRACAP_EPOCH`` in its environment (a BMC
power-off, a cloud API call). Exit status 0 means "the node is off": the service
appends ``NodeFenced`` at the expired epoch, actor ``system:fence-hook``, at the
version read before the hook ran — so with two replicas the hook may run twice (a
power-off is idempotent) but the fence is recorded once. Any other status, or a run
longer than ``--fence-hook-timeout``, is logged and tried again after another
``--fence-after``.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import os
from collections.abc import Sequence
from typing import Final

import asyncpg
import msgspec

from events.actors import Actor
from events.envelopes import Envelope, claim_stream, lease_stream, node_stream
from events.state import ClaimKey, ClusterState
from events.tenancy import not_started as class_not_started
from events.transitions import ClaimEntered, ClassDefined, ClassRemoved, first, meaning
from services.reclamation.decisions import (
    NotStarted,
    candidate_of,
    decide_expiry,
    decide_not_started,
    fence_by_hook,
    not_started,
)
from services.runtime.ground.context import ServiceContext
from services.runtime.ground.errors import ConflictError, RetryableError
from services.runtime.ground.metrics import CLAIMS, FENCE_HOOK_RUNS, NODE_TRANSITIONS
from services.runtime.ground.outages import is_unreachable, one_line
from services.runtime.ground.waiting import wait_for
from services.runtime.store.appends import Batch, Metadata
from services.runtime.store.livestate import HEAD, SEEN
from services.runtime.store.logandfold import LogAndFold

__all__ = ["DEFAULT_POLL_S", "DUE_PER_TICK", "NotStartedQueue", "ReclamationService"]

log = logging.getLogger("dracap.reclamation")

DEFAULT_POLL_S: Final = 0.25
#: Not-started candidates of one timeout whose waited time a tick asks for, oldest first.
DUE_PER_TICK: Final = 256
_LEASE_VERSION: Final = (
    "coalesce((SELECT max(e.stream_version) FROM events e WHERE e.stream = 'lease:' || l.node), 0)"
)
#: Leases past their expiry whose epoch nobody recorded as expired (or fenced) yet.
EXPIRED: Final = f"""
SELECT l.node, l.epoch, {_LEASE_VERSION} AS version
  FROM node_leases l
 WHERE l.expires_at < clock_timestamp()
   AND l.epoch > coalesce((SELECT n.epoch FROM node_epochs n WHERE n.node = l.node), 0)
 ORDER BY l.node
"""
#: Leases recorded as expired (not fenced, not taken again) for longer than $1 seconds.
LONG_EXPIRED: Final = f"""
SELECT l.node, l.epoch, {_LEASE_VERSION} AS version
  FROM node_leases l JOIN node_epochs n ON n.node = l.node AND n.epoch = l.epoch
 WHERE l.expires_at < clock_timestamp() - make_interval(secs => $1)
 ORDER BY l.node
"""


#: Seconds since the events at the positions $1 were recorded (the database's clock).
_WAITED: Final = """
SELECT position, extract(epoch FROM clock_timestamp() - recorded_at)::float8
  FROM events WHERE position = ANY($1::bigint[])
"""


class NotStartedQueue:
    """The claims that may be not-started candidates, per timeout, oldest clock first.

    Kept from the folded events (:meth:`observe`): an event that names a claim (its own
    fields, or its share's) queues it when :func:`~services.reclamation.decisions.
    candidate_of` says it is a candidate; a change of the DeviceClasses (timeouts come
    from them) re-reads every claim. An entry is checked again when it comes up
    (:meth:`oldest`), so a claim that stopped being a candidate costs nothing before.
    """

    def __init__(self, state: ClusterState) -> None:
        self._heaps: dict[float, list[tuple[int, ClaimKey]]] = {}
        self._queued: dict[ClaimKey, tuple[float, int]] = {}
        self.rescan(state)

    def __len__(self) -> int:
        return len(self._queued)

    def rescan(self, state: ClusterState) -> None:
        """Queue every candidate of ``state`` afresh (the classes changed)."""
        self._heaps, self._queued = {}, {}
        for candidate in not_started(state):
            self._put(candidate)

    def observe(self, state: ClusterState, env: Envelope) -> None:
        """Queue the claim ``env`` names if it is a candidate now (after the fold)."""
        event = env.event
        transitions = meaning(event)
        if first(transitions, (ClassDefined, ClassRemoved)) is not None:
            self.rescan(state)
            return
        if (entered := first(transitions, ClaimEntered)) is not None:
            key: ClaimKey | None = (entered.namespace, entered.name)
        elif isinstance(share_id := getattr(event, "share_id", None), str):
            share = state.shares.get(share_id)
            key = share.claim if share is not None else None
        else:
            namespace, name = getattr(event, "namespace", None), getattr(event, "name", None)
            ok = isinstance(namespace, str) and isinstance(name, str)
            key = (namespace, name) if ok else None  # type: ignore[assignment]
        if key is not None:
            candidate = candidate_of(state, key)
            if candidate is not None:
                self._put(candidate)

    def _put(self, candidate: NotStarted) -> None:
        entry = (candidate.timeout_s, candidate.since_position)
        if self._queued.get(candidate.key) == entry:
            return
        self._queued[candidate.key] = entry
        heap = self._heaps.setdefault(candidate.timeout_s, [])
        heapq.heappush(heap, (candidate.since_position, candidate.key))

    def oldest(self, state: ClusterState, most: int = DUE_PER_TICK) -> list[NotStarted]:
        """Per timeout, the ``most`` candidates whose clock started first, checked on
        ``state`` (entries that are no longer candidates leave the queue)."""
        out: list[NotStarted] = []
        for timeout, heap in self._heaps.items():
            kept: list[tuple[int, ClaimKey]] = []
            while heap and len(kept) < most:
                position, key = heapq.heappop(heap)
                if self._queued.get(key) != (timeout, position):
                    continue  # queued again since, under another clock or timeout
                candidate = candidate_of(state, key)
                if candidate is None or (candidate.timeout_s, candidate.since_position) != (
                    timeout,
                    position,
                ):
                    del self._queued[key]
                    if candidate is not None:
                        self._put(candidate)
                    continue
                kept.append((position, key))
                out.append(candidate)
            for entry in kept:
                heapq.heappush(heap, entry)
        return out

    def done(self, key: ClaimKey) -> None:
        """``key`` was released or marked stalled: no longer queued."""
        self._queued.pop(key, None)


class _Lease(msgspec.Struct, frozen=True):
    node: str
    epoch: int
    version: int


class ReclamationService:
    """Records lease expiries and hook fences (see the module docstring)."""

    def __init__(
        self,
        context: ServiceContext[LogAndFold],
        *,
        name: str = "reclamation-0",
        poll_s: float = DEFAULT_POLL_S,
        fence_hook: Sequence[str] = (),
        fence_after_s: float = 60.0,
        fence_hook_timeout_s: float = 60.0,
    ) -> None:
        self.store = context.stores.store
        live = self.live = context.stores.live
        self.name = name
        self.poll_s = poll_s
        self.fence_hook = tuple(fence_hook)
        self.fence_after_s = fence_after_s
        self.fence_hook_timeout_s = fence_hook_timeout_s
        self.clock = context.clock  #: the ticks' and the hook's retries' clock
        self.expired = 0  #: expiries this replica recorded
        self.lost_races = 0  #: expiries or fences another writer recorded first
        self.fenced = 0  #: fences this replica recorded for the hook
        self.ticks = 0  #: ticks done to the end
        self._hook_tried: dict[tuple[str, int], float] = {}
        self.queue = NotStartedQueue(live.state)
        live.subscribe(lambda env: self.queue.observe(live.state, env))

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``poll_s`` until ``stop`` is set; an outage only skips ticks."""
        while not stop.is_set():
            try:
                await self.tick()
            except Exception as exc:
                # asyncpg.InterfaceError: a pooled session closed under the query (failover)
                expected = (RetryableError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError)
                if not (isinstance(exc, expected) or is_unreachable(exc)):
                    raise
                log.warning("%s: tick skipped: %s", self.name, one_line(exc))
            await self.clock.wait(stop, self.poll_s)

    async def tick(self) -> int:
        """Record every expired lease found now; run the fence hook where due.

        Returns how many transitions this replica recorded.
        """
        recorded = 0
        for row in await self.store.pool.fetch(EXPIRED):
            recorded += await self._expire(_Lease(row["node"], row["epoch"], row["version"]))
        if self.fence_hook:
            for row in await self.store.pool.fetch(LONG_EXPIRED, self.fence_after_s):
                recorded += await self._run_hook(_Lease(row["node"], row["epoch"], row["version"]))
        recorded += await self._not_started()
        self.ticks += 1
        return recorded

    async def _not_started(self) -> int:
        """Release or mark stalled each claim not started within its class's timeout."""
        # the classes as far as this process heard of the log (no read while the live
        # view's tailer keeps up: this ran 4 times a second, and each read of the head
        # held the tailer's fold of the process's own commits for a round trip); the log
        # itself is read only when a class sets a timeout
        state = await self.live.fresh(SEEN)
        if not any(class_not_started(c.device_class) for c in state.classes.values()):
            return 0  # the usual case, in O(classes)
        state = await self.live.fresh(HEAD)
        candidates = self.queue.oldest(state)
        if not candidates:
            return 0
        rows = await self.store.pool.fetch(_WAITED, [c.since_position for c in candidates])
        waited = {row[0]: float(row[1]) for row in rows}
        recorded = 0
        for candidate in candidates:
            if waited.get(candidate.since_position, 0.0) < candidate.timeout_s:
                continue
            stream = claim_stream(*candidate.key)
            async with self.live.frozen() as state:
                now = candidate_of(state, candidate.key)
                if now is None or now.allocation_version != candidate.allocation_version:
                    continue  # reserved, used or released meanwhile
                claim = state.claims[candidate.key]
                event = decide_not_started(now, waited[candidate.since_position], claim.node)
                version = await self.live.stream_version(stream)
            if event is None:
                continue
            try:
                await self.store.append(
                    stream, version, [event], actor=str(Actor.system(self.name))
                )
            except ConflictError:
                self.lost_races += 1
                continue
            recorded += 1
            self.queue.done(candidate.key)
            CLAIMS.labels(outcome=f"not_started_{now.action}").inc()
            log.warning(
                "claim %s/%s not started within %gs: %s",
                *candidate.key,
                now.timeout_s,
                "released" if now.action == "release" else "marked stalled",
            )
        return recorded

    async def _expire(self, lease: _Lease) -> int:
        state: ClusterState = await self.live.fresh(HEAD)
        events = decide_expiry(state, lease.node, lease.epoch)
        batches = [Batch(lease_stream(lease.node), lease.version, events[:1])]
        if events[1:]:
            batches.append(Batch(node_stream(lease.node), None, events[1:]))
        try:
            await self.store.append_many(batches, Metadata(actor=str(Actor.system(self.name))))
        except ConflictError:
            self.lost_races += 1
            return 0
        self.expired += 1
        NODE_TRANSITIONS.labels(transition="expired").inc()
        log.warning(
            "node %s: lease of epoch %d expired; %d share(s) unknown, capacity held",
            lease.node,
            lease.epoch,
            len(events) - 1,
        )
        return 1

    async def _run_hook(self, lease: _Lease) -> int:
        node = (await self.live.fresh(HEAD)).nodes.get(lease.node)
        if node is None or node.lease != "expired" or node.lease_epoch != lease.epoch:
            return 0  # fenced already (the table does not tell a fence from an expiry)
        key = (lease.node, lease.epoch)
        tried = self._hook_tried.get(key)
        if tried is not None and self.clock.monotonic() - tried < self.fence_after_s:
            return 0
        self._hook_tried[key] = self.clock.monotonic()
        command = " ".join(self.fence_hook)
        env = {**os.environ, "DRACAP_NODE": lease.node, "DRACAP_EPOCH": str(lease.epoch)}
        try:
            process = await asyncio.create_subprocess_exec(
                *self.fence_hook,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            FENCE_HOOK_RUNS.labels(outcome="failed").inc()
            log.error("fence hook for node %s could not start: %s", lease.node, exc)
            return 0
        try:
            _, err = await wait_for(process.communicate(), self.fence_hook_timeout_s)
        except TimeoutError:
            process.kill()
            await process.wait()
            FENCE_HOOK_RUNS.labels(outcome="timeout").inc()
            log.error("fence hook for node %s ran past its timeout; not fenced", lease.node)
            return 0
        if process.returncode != 0:
            FENCE_HOOK_RUNS.labels(outcome="failed").inc()
            detail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            log.error(
                "fence hook for node %s exited %s (%s); not fenced",
                lease.node,
                process.returncode,
                detail[0],
            )
            return 0
        FENCE_HOOK_RUNS.labels(outcome="off").inc()
        fence = fence_by_hook(lease.node, lease.epoch, command)
        try:
            await self.store.append(
                lease_stream(lease.node),
                lease.version,
                [fence],
                actor=str(Actor.system("fence-hook")),
            )
        except ConflictError:
            self.lost_races += 1
            return 0
        self._hook_tried.pop(key, None)
        self.fenced += 1
        NODE_TRANSITIONS.labels(transition="fenced_by_hook").inc()
        log.warning("node %s fenced by the hook at epoch %d", lease.node, lease.epoch)
        return 1
