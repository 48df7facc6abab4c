"""Crashes in the middle of a burst lose nothing and duplicate nothing.

A burst of :data:`CLAIMS` claims goes through the whole pipeline (claims API, relay,
one reservation worker, the enforcement service and the node agent) on real PostgreSQL
and nats-server. While it
runs, one service is killed by cancelling its task abruptly (and closing its own NATS
connection, as a dead process would), then a fresh instance (new store, new live
state, new connection: a restarted process) is started:

* ``worker``: the reservation worker, at a random point of its loop;
* ``worker-between-plan-and-commit``: the reservation worker after its handler
  planned reservations and before the consumer committed them; nothing of them may
  be left, and they are planned again, once, after the messages are redelivered;
* ``worker-between-commit-and-ack``: after the plan committed (one statement with the
  consumer's ``processed_messages`` rows) and before the acks; the redelivered
  messages are found handled and nothing is written twice;
* ``relay``: the relay, at a random point;
* ``relay-after-acks``: the relay after JetStream acknowledged a window and before
  the checkpoint was stored: the restarted relay publishes that window again and
  JetStream's de-duplication drops it.

Afterwards every claim is ``ready`` exactly once (one allocation, one share reserved
and one limit applied per claim), no device is over capacity, the stream holds each
event once, nothing was dead-lettered, and ``services.replay.verify`` is clean.

The devices hold exactly :data:`CLAIMS` shares, so a reservation written twice would
leave a claim without room (or break the ledger's CHECK) instead of going unnoticed.
JetStream redelivers an unacknowledged message after the consumer's ack wait; the
worker here uses :data:`ACK_WAIT_S` instead of 30 s so a test run stays short.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import pytest
import yaml
from nats.aio.client import Client
from nats.js import JetStreamContext

from events.catalog import (
    AllocationBound,
    CapacityReserved,
    ClaimAdmitted,
    LimitApplied,
    MessageDeadLettered,
)
from events.envelopes import Envelope
from events.state import ClusterState
from events.subjects import BusNames
from services.claims.api import ClaimsApi
from services.enforcement.agent import Agent
from services.enforcement.enforcers import NoneEnforcer
from services.enforcement.service import EnforcementService
from services.replay.verify import summary, verify
from services.reservation.service import ReservationService
from services.runtime.bus.jetstream import connect_bus, ensure_stream
from services.runtime.delivery import highwater
from services.runtime.delivery.consuming import Consumer
from services.runtime.delivery.handlers import Handled, HandlerContext
from services.runtime.delivery.relaying import Relay
from services.runtime.ground.metrics import CONSUMER_REDELIVERIES
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import EventStore
from services.runtime.store.livestate import HEAD, LiveState
from tests.fixtures.contexts import folded, handed
from tests.integration.waiting import bus_idle, state_reaches

CLAIMS = 100
DEVICES = 10  # 10 x 50Gi = exactly 100 claims of 5Gi
NODE = "node-a"
CLASS = "crash-memory.dracap.io"
DRIVER = "crash.dracap.io"
NAMESPACE = "tenant-a"
ACK_WAIT_S = 2.0
KILL_AFTER = 30  # claims allocated before the victim is killed
CONCURRENCY = 20  # tenant requests in flight during the burst
PACE_S = 0.1  # each request slot waits this long after its reply: ~200 claims/s

DEVICE_CLASS = f"""
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {{name: {CLASS}}}
spec:
  selectors: [{{cel: {{expression: device.driver == "{DRIVER}"}}}}]
"""
RESOURCE_SLICE = f"""
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {{name: node-a-crash}}
spec:
  driver: {DRIVER}
  nodeName: {NODE}
  pool: {{name: node-a-crash, generation: 1, resourceSliceCount: 1}}
  devices:
""" + "".join(
    f"""
    - name: dev-{i}
      allowMultipleAllocations: true
      capacity:
        memory:
          value: 50Gi
          requestPolicy: {{default: 5Gi, validRange: {{min: 5Gi, step: 5Gi, max: 50Gi}}}}"""
    for i in range(DEVICES)
)


def manifest(name: str) -> bytes:
    request = {"deviceClassName": CLASS, "capacity": {"requests": {"memory": "5Gi"}}}
    doc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "mem", "exactly": request}]}},
    }
    return yaml.safe_dump(doc).encode()


class Worker(ReservationService):
    """A reservation worker whose unacknowledged messages come back after ACK_WAIT_S."""

    def consumers(self) -> list[Consumer]:
        consumers = super().consumers()
        for consumer in consumers:
            consumer._ack_wait = ACK_WAIT_S
        return consumers


class Incarnation:
    """One run of a killable service: its task, store and NATS connection."""

    def __init__(self, task: asyncio.Task[None], store: EventStore, nc: Client) -> None:
        self.task = task
        self.store = store
        self.nc = nc

    async def kill(self) -> None:
        """What a crash does: the task stops where it is, its connection goes away."""
        self.task.cancel()
        # bounded: a service that lost its cancellation fails the test, not hangs the suite
        done, _ = await asyncio.wait([self.task], timeout=30)
        assert done, "the killed service went on running (its cancellation was lost)"
        if not self.task.cancelled() and self.task.exception() is not None:
            raise self.task.exception()  # type: ignore[misc]
        await self.nc.close()


class Cluster:
    """The pipeline of one test, with a relay and a worker that can be killed."""

    def __init__(self, settings: Settings, nats_url: str, names: BusNames) -> None:
        self.settings = settings
        self.nats_url = nats_url
        self.names = names
        self.stop = asyncio.Event()
        self.stores: list[EventStore] = []
        self.connections: list[Client] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def store(self) -> EventStore:
        store = await EventStore.open(self.settings)
        self.stores.append(store)
        return store

    async def bus(self) -> tuple[Client, JetStreamContext]:
        nc, js = await connect_bus(self.nats_url)
        self.connections.append(nc)
        return nc, js

    def spawn(self, work: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        self.tasks.append(task)
        return task

    async def start(self) -> None:
        self.nc, self.js = await self.bus()
        await ensure_stream(self.js, self.names)
        api_store = await self.store()
        self.api = ClaimsApi(folded(api_store, self.names, self.nc), tail=True)
        await self.api.start()
        self.spawn(self.api.run(self.stop))
        enforcement_store = await self.store()
        live = LiveState(enforcement_store)
        enforcement = EnforcementService(
            folded(enforcement_store, self.names, self.nc, self.js, live=live), tail=True
        )
        await enforcement.start()
        self.spawn(enforcement.run(self.stop))
        self.agent = Agent(handed(None, self.names, self.nc), node=NODE, enforcer=NoneEnforcer())
        self.spawn(self.agent.run(self.stop))
        self.view = LiveState(await self.store())
        self.relay, self.relay_run = await self.start_relay()
        self.worker, self.worker_run = await self.start_worker()

    async def start_relay(self) -> tuple[Relay, Incarnation]:
        store = await self.store()
        nc, js = await self.bus()
        relay = Relay(handed(store, self.names, js=js))
        return relay, Incarnation(self.spawn(relay.run(self.stop)), store, nc)

    async def start_worker(
        self, wrap: Callable[[ReservationService], None] | None = None
    ) -> tuple[Worker, Incarnation]:
        store = await self.store()
        nc, js = await self.bus()
        worker = Worker(folded(store, self.names, js=js), worker=0)
        if wrap is not None:
            wrap(worker)
        return worker, Incarnation(self.spawn(worker.run(self.stop)), store, nc)

    async def close(self) -> None:
        self.stop.set()
        live = [t for t in self.tasks if not t.done()]
        if live:
            _, pending = await asyncio.wait(live, timeout=15)
            for task in pending:
                task.cancel()
        for task in self.tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        for store in self.stores:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(store.close(), 10)
        for nc in self.connections:
            with contextlib.suppress(Exception):
                await nc.close()

    # -- requests and waiting
    async def call(self, subject: str, payload: bytes | dict[str, Any]) -> dict[str, Any]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        reply = await self.nc.request(subject, body, timeout=10)
        out: dict[str, Any] = json.loads(reply.data)
        assert out["ok"], out
        return out

    async def state(self) -> ClusterState:
        return await self.view.fresh(HEAD)

    async def until(self, check: Callable[[ClusterState], bool], within: float = 60) -> None:
        await state_reaches(self.view, check, within)

    async def idle(self, within: float = 60) -> None:
        """The relay published everything and every consumer acknowledged it."""
        consumers = [c.name for c in self.worker.consumers()] + [self.agent.consumer.name]
        await bus_idle(self.stores[0], self.js, self.names, consumers, within)


@pytest.fixture
async def cluster(settings: Settings, nats_url: str) -> AsyncIterator[Cluster]:
    settings = msgspec.structs.replace(settings, pool_max_size=4)
    names = BusNames(f"t{uuid.uuid4().hex[:12]}")
    cluster = Cluster(settings, nats_url, names)
    try:
        await cluster.start()
        await cluster.call(names.admin("deviceclasses.apply"), DEVICE_CLASS.encode())
        await cluster.call(names.admin("slices.apply"), RESOURCE_SLICE.encode())
        access = {"namespace": NAMESPACE, "classes": ["*"], "admin_access": False}
        await cluster.call(names.admin("namespaces.access"), access)
        yield cluster
    finally:
        try:
            await cluster.close()
        finally:
            nc, js = await connect_bus(nats_url)
            with contextlib.suppress(Exception):
                await js.delete_stream(names.stream)
            await nc.close()


def allocated(count: int) -> Callable[[ClusterState], bool]:
    def check(state: ClusterState) -> bool:
        done = sum(1 for c in state.claims.values() if c.phase in ("allocated", "ready"))
        return done >= count

    return check


def all_ready(state: ClusterState) -> bool:
    claims = [c for c in state.claims.values() if c.namespace == NAMESPACE]
    return len(claims) == CLAIMS and all(c.phase == "ready" for c in claims)


async def burst(cluster: Cluster) -> None:
    """Apply every claim, CONCURRENCY requests at a time, paced to last ~PACE_S * 5.

    Unpaced, the pipeline can place all of them between two looks of the test, and
    the kill would no longer fall in the middle of the burst.
    """
    gate = asyncio.Semaphore(CONCURRENCY)

    async def apply(i: int) -> None:
        async with gate:
            await cluster.call(cluster.names.api(NAMESPACE, "apply"), manifest(f"c{i:03d}"))
            await asyncio.sleep(PACE_S)

    await asyncio.gather(*(apply(i) for i in range(CLAIMS)))


class Trap:
    """Holds a service still at a chosen point so the test can kill it there."""

    def __init__(self, after: int) -> None:
        self.after = after  #: spring on the after-th time the point is reached
        self.reached = 0
        self.sprung = asyncio.Event()
        self.planned: list[str] = []  #: share ids of the reservations planned, not committed
        self.written: list[str] = []  #: event ids the trapped worker had committed

    async def spring(self) -> None:
        self.sprung.set()
        await asyncio.sleep(60)  # cancelled by the test long before


def trap_plan(trap: Trap) -> Callable[[ReservationService], None]:
    """Spring after the handler planned reservations, before they are committed."""

    def wrap(worker: ReservationService) -> None:
        original = worker.handle

        async def handle(ctx: HandlerContext, envs: list[Envelope]) -> Handled:
            handled = await original(ctx, envs)
            planned = [
                e.share_id
                for batch in handled.batches
                for e in batch.events
                if isinstance(e, CapacityReserved)
            ]
            if planned and not trap.sprung.is_set():
                trap.reached += 1
                if trap.reached >= trap.after:
                    trap.planned = planned
                    await trap.spring()
            return handled

        worker.handle = handle  # type: ignore[method-assign]

    return wrap


def trap_commit(trap: Trap) -> Callable[[ReservationService], None]:
    """Spring after the worker's reservations committed, before the messages are acked."""

    def wrap(worker: ReservationService) -> None:
        original = worker.store.append_many

        async def append_many(*args: Any, **kwargs: Any) -> list[Envelope]:
            stored = await original(*args, **kwargs)
            if not trap.sprung.is_set() and any(
                isinstance(e.event, CapacityReserved) for e in stored
            ):
                trap.reached += 1
                if trap.reached >= trap.after:
                    trap.written = [e.event_id for e in stored]
                    await trap.spring()
            return stored

        worker.store.append_many = append_many  # type: ignore[method-assign]

    return wrap


def trap_checkpoint(relay: Relay, trap: Trap) -> None:
    """Spring after a window's acknowledgements, before its checkpoint is stored."""
    assert hasattr(relay, "_save_checkpoint"), "the relay's checkpoint step was renamed"
    original = relay._save_checkpoint

    async def save(position: int) -> None:
        if not trap.sprung.is_set():
            trap.reached += 1
            if trap.reached >= trap.after:
                await trap.spring()
        await original(position)

    relay._save_checkpoint = save  # type: ignore[method-assign]


async def unfinished(cluster: Cluster) -> int:
    """How many claims are not yet allocated (the work a killed service leaves)."""
    state = await cluster.state()
    done = sum(1 for c in state.claims.values() if c.phase in ("allocated", "ready"))
    return CLAIMS - done


async def while_down(cluster: Cluster, submitting: asyncio.Task[None]) -> None:
    """Until the burst appended ten more events (or ended) while a service is down."""
    store = cluster.stores[0]
    goal = await store.head() + 10
    async with asyncio.timeout(60):
        while not submitting.done() and await store.wait_for_new(goal - 1, 0.5) < goal:
            pass


def redeliveries() -> float:
    """``dracap_consumer_redeliveries_total`` summed over every consumer."""
    return sum(
        sample.value
        for metric in CONSUMER_REDELIVERIES.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


async def check_exactly_once(cluster: Cluster, settings: Settings) -> None:
    """Every claim ready once, each share reserved once, no device over capacity."""
    await cluster.until(all_ready)
    await cluster.idle()
    state = await cluster.state()
    assert not cluster.view.violations, cluster.view.violations
    envelopes = [e async for e in cluster.stores[0].read_all(0)]
    events = collections.Counter(type(e.event).__name__ for e in envelopes)
    assert events[MessageDeadLettered.__name__] == 0, events
    assert state.dead_letters == 0

    admitted = collections.Counter(
        (e.event.namespace, e.event.name) for e in envelopes if isinstance(e.event, ClaimAdmitted)
    )
    bound = collections.Counter(
        (e.event.namespace, e.event.name) for e in envelopes if isinstance(e.event, AllocationBound)
    )
    reserved = collections.Counter(
        e.event.share_id for e in envelopes if isinstance(e.event, CapacityReserved)
    )
    applied = collections.Counter(
        e.event.share_id for e in envelopes if isinstance(e.event, LimitApplied)
    )
    assert len(admitted) == CLAIMS and set(admitted.values()) == {1}
    assert len(bound) == CLAIMS and set(bound.values()) == {1}, bound.most_common(3)
    assert len(reserved) == CLAIMS and set(reserved.values()) == {1}, reserved.most_common(3)
    assert set(applied) == set(reserved) and set(applied.values()) == {1}
    for claim in state.claims.values():
        assert claim.phase == "ready" and len(claim.share_ids) == 1, claim
        assert state.shares[claim.share_ids[0]].state == "ready"

    consumed = 0
    for key, device in state.devices.items():
        assert device.consumed_nanos["memory"] <= device.total["memory"].nanos, key
        consumed += device.consumed_nanos["memory"]
    assert consumed == CLAIMS * 5 * 2**30 * 10**9  # every device full, none over

    # the bus holds each event once
    head = await cluster.stores[0].head()
    info = await cluster.js.stream_info(cluster.names.stream)
    assert info.state.messages == head == info.state.last_seq

    report = await verify(settings, from_start=True)
    assert report.ok, summary(report)


async def test_killed_worker_loses_and_duplicates_nothing(
    cluster: Cluster, settings: Settings
) -> None:
    submitting = asyncio.create_task(burst(cluster))
    await cluster.until(allocated(KILL_AFTER))
    await cluster.worker_run.kill()
    assert await unfinished(cluster) > 0, "the burst was over before the kill"
    await while_down(cluster, submitting)  # the burst goes on without a worker
    cluster.worker, cluster.worker_run = await cluster.start_worker()
    await submitting
    await check_exactly_once(cluster, settings)


async def kill_when_trapped(
    cluster: Cluster, trap: Trap, wrap: Callable[[ReservationService], None]
) -> tuple[asyncio.Task[None], float]:
    """Replace the worker by a trapped one, burst, kill it where the trap holds it.

    Returns the burst still submitting and the redeliveries counted before the kill.
    """
    await cluster.worker_run.kill()
    cluster.worker, cluster.worker_run = await cluster.start_worker(wrap)
    submitting = asyncio.create_task(burst(cluster))
    await asyncio.wait_for(trap.sprung.wait(), 20)
    redelivered = redeliveries()
    await cluster.worker_run.kill()
    assert await unfinished(cluster) > 0, "the burst was over before the kill"
    return submitting, redelivered


async def test_worker_killed_between_plan_and_commit(cluster: Cluster, settings: Settings) -> None:
    trap = Trap(after=2)  # the second plan with reservations (groups: few)
    submitting, redelivered = await kill_when_trapped(cluster, trap, trap_plan(trap))
    assert trap.planned, "the trapped plan reserved nothing"
    state = await cluster.state()
    assert not set(trap.planned) & set(state.shares), "an uncommitted plan left shares"
    cluster.worker, cluster.worker_run = await cluster.start_worker()
    await submitting
    await check_exactly_once(cluster, settings)
    # the messages whose plan was lost came back after the ack wait
    assert redeliveries() > redelivered


async def test_worker_killed_between_commit_and_ack(cluster: Cluster, settings: Settings) -> None:
    trap = Trap(after=2)
    submitting, redelivered = await kill_when_trapped(cluster, trap, trap_commit(trap))
    assert trap.written, "the trapped commit had written nothing"
    async with cluster.stores[0].pool.acquire() as connection:
        survived = await connection.fetchval(
            "SELECT count(*) FROM events WHERE event_id = ANY($1::uuid[])", trap.written
        )
    assert survived == len(trap.written), "a committed plan was lost"
    cluster.worker, cluster.worker_run = await cluster.start_worker()
    await submitting
    await check_exactly_once(cluster, settings)  # the redelivery wrote nothing again
    assert redeliveries() > redelivered


async def test_killed_relay_loses_and_duplicates_nothing(
    cluster: Cluster, settings: Settings
) -> None:
    submitting = asyncio.create_task(burst(cluster))
    await cluster.until(allocated(KILL_AFTER))
    await cluster.relay_run.kill()
    assert await unfinished(cluster) > 0, "the burst was over before the kill"
    await while_down(cluster, submitting)  # events pile up in the log meanwhile
    cluster.relay, cluster.relay_run = await cluster.start_relay()
    await submitting
    await check_exactly_once(cluster, settings)


async def test_relay_killed_between_acks_and_checkpoint(
    cluster: Cluster, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a checkpoint every 100 ms, not every second: the fifth comes while the burst goes on
    monkeypatch.setattr(highwater, "INTERVAL_S", 0.1)
    await cluster.relay_run.kill()
    relay, incarnation = await cluster.start_relay()
    trap = Trap(after=5)
    trap_checkpoint(relay, trap)
    submitting = asyncio.create_task(burst(cluster))
    await asyncio.wait_for(trap.sprung.wait(), 20)
    published = relay.published
    await incarnation.kill()
    assert published > 0 and await unfinished(cluster) > 0
    cluster.relay, cluster.relay_run = await cluster.start_relay()
    await submitting
    await check_exactly_once(cluster, settings)
    # the window whose checkpoint was lost went out again and JetStream dropped it
    assert cluster.relay.duplicates >= 1
