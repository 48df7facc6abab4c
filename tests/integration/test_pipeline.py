"""The whole pipeline on real PostgreSQL and nats-server.

Relay, claims API, two reservation workers, the enforcement service and a node agent
(which reaches the log only through the enforcement service, over NATS) run in-process
as asyncio tasks under a unique subject prefix; the inventory goes in through the admin API and
claims through the tenant API, exactly as a CLI would send them. Every test ends with
``services.replay.verify``: the fold of the log equals the projections and no
invariant was broken.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import msgspec
import nats.js.errors
import pytest
import yaml
from nats.aio.client import Client
from nats.js import JetStreamContext

from events.actors import Actor
from events.catalog import (
    AllocationBound,
    CapacityReleased,
    CapacityReserved,
    ClaimAdmitted,
    LimitApplied,
    LimitFailed,
    LimitRemoved,
    NamespaceAccessSet,
    NodeFenced,
    ReleaseRequested,
)
from events.envelopes import Envelope, claim_stream, stream_of
from events.eventcodec import encode_event
from events.quantities import Quantity
from events.state import ClusterState
from events.subjects import BusNames
from services import durables
from services.claims.api import ClaimsApi
from services.enforcement.agent import Agent
from services.enforcement.consumer import Delivery
from services.enforcement.enforcers import (
    AppliedLimit,
    EnforcementError,
    NoneEnforcer,
    PermanentEnforcementError,
    RetryableEnforcementError,
    ShareLimit,
)
from services.enforcement.protocol import Report, Reported, ViewAsk, Viewed
from services.enforcement.service import EnforcementService
from services.enforcement.views import NodeView
from services.replay.verify import summary, verify
from services.reservation.service import ReservationService
from services.runtime.bus.jetstream import connect_bus, ensure_stream
from services.runtime.delivery.handlers import HandlerContext
from services.runtime.delivery.rebuilding import BusKeeper
from services.runtime.delivery.relaying import Relay
from services.runtime.ground.clock import SYSTEM, Clock
from services.runtime.ground.errors import ConflictError
from services.runtime.ground.metrics import REGISTRY
from services.runtime.ground.settings import Settings
from services.runtime.ops.selectorpool import SelectorPool
from services.runtime.store.appends import Batch, Metadata
from services.runtime.store.eventstore import EventStore
from services.runtime.store.livestate import HEAD, LiveState
from tests.fixtures.clock import FakeClock
from tests.fixtures.contexts import folded, handed
from tests.fixtures.polling import until
from tests.integration.waiting import bus_idle, state_reaches

GPU = "gpu-memory.dracap.io"
RACE = "race-memory.dracap.io"
NODE = "node-a"
RACE_ROUNDS = 200

INVENTORY_CLASSES = f"""
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {{name: {GPU}}}
spec:
  selectors: [{{cel: {{expression: device.driver == "gpu.dracap.io"}}}}]
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {{name: {RACE}}}
spec:
  selectors: [{{cel: {{expression: device.driver == "race.dracap.io"}}}}]
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {{name: other.dracap.io}}
spec: {{}}
"""


def _slice(driver: str, name: str, devices: list[str]) -> str:
    items = "".join(
        f"""
    - name: {d}
      allowMultipleAllocations: true
      capacity:
        memory:
          value: 40Gi
          requestPolicy: {{default: 5Gi, validRange: {{min: 5Gi, step: 5Gi, max: 40Gi}}}}"""
        for d in devices
    )
    return f"""
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {{name: {name}}}
spec:
  driver: {driver}
  nodeName: {NODE}
  pool: {{name: {name}, generation: 1, resourceSliceCount: 1}}
  devices:{items}
"""


INVENTORY_SLICES = (
    _slice("gpu.dracap.io", "node-a-gpu", ["gpu-0", "gpu-1"])
    + "---"
    + _slice("race.dracap.io", "node-a-race", ["race-0"])
)


def claim_manifest(
    name: str,
    namespace: str | None,
    memory: str | None = "10Gi",
    class_name: str = GPU,
    **exactly: Any,
) -> bytes:
    request: dict[str, Any] = {"deviceClassName": class_name, **exactly}
    if memory is not None:
        request["capacity"] = {"requests": {"memory": memory}}
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    doc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": meta,
        "spec": {"devices": {"requests": [{"name": "mem", "exactly": request}]}},
    }
    return yaml.safe_dump(doc).encode()


class Pipeline:
    """The running services of one test, and helpers to talk to them."""

    def __init__(
        self,
        settings: Settings,
        nc: Client,
        js: JetStreamContext,
        names: BusNames,
        agent_clock: Clock = SYSTEM,
    ):
        self.settings = settings
        self.agent_clock = agent_clock
        self.nc = nc
        self.js = js
        self.names = names
        self.stores: list[EventStore] = []
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.workers: list[ReservationService] = []
        self.agents: list[Agent] = []
        self.view: LiveState | None = None

    async def store(self) -> EventStore:
        store = await EventStore.open(self.settings)
        self.stores.append(store)
        return store

    def spawn(self, work: Awaitable[None]) -> None:
        self.tasks.append(asyncio.ensure_future(work))

    async def start(self) -> None:
        relay_store = await self.store()
        # the relay keeps the stream and the reservation's durables, as in `dracap up`
        keeper = BusKeeper(relay_store, self.js, self.names, durables.relay_owned(self.names))
        await keeper.ensure(0, None)
        self.spawn(Relay(handed(relay_store, self.names, js=self.js), keeper=keeper).run(self.stop))
        api_store = await self.store()
        api_live = LiveState(api_store)
        self.api = ClaimsApi(folded(api_store, self.names, self.nc, live=api_live), tail=True)
        await self.api.start()
        self.spawn(self.api.run(self.stop))
        for i in range(2):
            store = await self.store()
            # a long deadline: an expensive selector keeps the pool busy for the whole test
            pool = SelectorPool(deadline_s=120, job_budget_s=240)
            worker = ReservationService(
                folded(store, self.names, js=self.js), worker=i, selectors=pool
            )
            self.workers.append(worker)
            self.spawn(worker.run(self.stop))
        enforcement_store = await self.store()
        enforcement = EnforcementService(
            folded(enforcement_store, self.names, self.nc, self.js), tail=True
        )
        await enforcement.start()
        self.spawn(enforcement.run(self.stop))
        agent = Agent(
            handed(None, self.names, self.nc, clock=self.agent_clock),
            node=NODE,
            enforcer=NoneEnforcer(),
        )
        self.agents.append(agent)
        self.spawn(agent.run(self.stop))
        self.view = LiveState(await self.store())

    async def close(self) -> None:
        self.stop.set()
        done, pending = await asyncio.wait(self.tasks, timeout=15)
        for task in pending:
            task.cancel()
        if pending:  # their cleanup (the selector pools: a thread waits on each) runs
            await asyncio.wait(pending, timeout=15)
        for task in done:
            failure = None if task.cancelled() else task.exception()
            if failure is not None:
                raise failure
        for store in self.stores:
            await store.close()

    # -- API calls
    async def call(self, subject: str, payload: bytes | dict[str, Any]) -> dict[str, Any]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        reply = await self.nc.request(subject, body, timeout=10)
        out: dict[str, Any] = json.loads(reply.data)
        return out

    async def tenant(self, namespace: str, op: str, payload: bytes | dict[str, Any]) -> Any:
        return await self.call(self.names.api(namespace, op), payload)

    async def admin(self, op: str, payload: bytes | dict[str, Any]) -> dict[str, Any]:
        reply = await self.call(self.names.admin(op), payload)
        assert reply["ok"], reply
        return reply

    # -- waiting on the log
    async def state(self) -> ClusterState:
        assert self.view is not None
        return await self.view.fresh(HEAD)

    # Deadlines only bound a failure: generous, so a machine whose cores another process
    # keeps busy still passes
    async def until(self, check: Callable[[ClusterState], bool], within: float = 60) -> None:
        assert self.view is not None
        await state_reaches(self.view, check, within)

    async def idle(self, within: float = 60) -> None:
        """Wait until the relay published everything and every consumer acked it."""
        consumers = [c.name for w in self.workers[:1] for c in w.consumers()]
        consumers += [a.consumer.name for a in self.agents]
        await bus_idle(self.stores[0], self.js, self.names, consumers, within)


@pytest.fixture
def agent_clock() -> Clock:
    """The node agent's clock (a test parametrizes it with a FakeClock to move it)."""
    return SYSTEM


@pytest.fixture
async def pipeline(
    settings: Settings, nats_url: str, agent_clock: Clock
) -> AsyncIterator[Pipeline]:
    settings = msgspec.structs.replace(settings, pool_max_size=4)
    nc, js = await connect_bus(nats_url)
    names = BusNames(f"t{uuid.uuid4().hex[:12]}")
    await ensure_stream(js, names)
    pipe = Pipeline(settings, nc, js, names, agent_clock)
    try:
        await pipe.start()
        await pipe.admin("deviceclasses.apply", INVENTORY_CLASSES.encode())
        await pipe.admin("slices.apply", INVENTORY_SLICES.encode())
        for namespace in ("tenant-a", "tenant-b"):
            access = {"namespace": namespace, "classes": ["*"], "admin_access": False}
            await pipe.admin("namespaces.access", access)
        await pipe.admin("namespaces.access", {"namespace": "tenant-c", "classes": [RACE]})
        yield pipe
    finally:
        await pipe.close()
        with contextlib.suppress(Exception):
            await js.delete_stream(names.stream)
        await nc.close()


def phase_is(namespace: str, name: str, *phases: str) -> Callable[[ClusterState], bool]:
    """A condition: the claim exists and is in one of ``phases``."""

    def check(state: ClusterState) -> bool:
        claim = state.claim(namespace, name)
        return claim is not None and claim.phase in phases

    return check


async def assert_verified(settings: Settings) -> None:
    report = await verify(settings, from_start=True)
    assert report.ok, summary(report)


async def _api_until_ready(pipeline: Pipeline, namespace: str, name: str) -> dict[str, Any]:
    """The claims API's ``get`` once it says the claim is ready (bounded at 60 s)."""
    async with asyncio.timeout(60):
        while True:
            got: dict[str, Any] = await pipeline.tenant(namespace, "get", {"name": name})
            if got["claim"]["ready"]:
                return got
            await asyncio.sleep(0.05)


# --- the happy path ------------------------------------------------------------------------


async def test_claim_becomes_ready_then_releases(pipeline: Pipeline, settings: Settings) -> None:
    applied = await pipeline.tenant("tenant-a", "apply", claim_manifest("train", "tenant-a"))
    assert applied["ok"], applied
    assert applied["claim"]["namespace"] == "tenant-a" and not applied["claim"]["ready"]
    await pipeline.until(phase_is("tenant-a", "train", "ready"))

    # the API answers from its own view, which hears of the agent's commit on its own time
    got = await _api_until_ready(pipeline, "tenant-a", "train")
    claim = got["claim"]
    assert claim["ready"] and claim["phase"] == "ready" and claim["node"] == NODE, claim
    (share,) = claim["shares"]
    assert uuid.UUID(share["share_id"]).version == 4
    assert share["consumed"] == {"memory": "10Gi"} and share["level"] == "none"
    assert share["state"] == "ready" and share["device"] == "gpu-0"
    (result,) = claim["allocation"]["devices"]["results"]
    assert result["shareID"] == share["share_id"]
    assert result["consumedCapacity"] == {"memory": "10Gi"}

    listed = await pipeline.tenant("tenant-a", "list", {})
    assert [c["name"] for c in listed["claims"]] == ["train"]
    assert (await pipeline.tenant("tenant-b", "list", {}))["claims"] == []
    devices = (await pipeline.admin("devices.list", {}))["devices"]
    gpu0 = next(d for d in devices if d["device"] == "gpu-0")
    assert gpu0["capacity"]["memory"] == {"total": "40Gi", "consumed": "10Gi", "free": "30Gi"}
    assert gpu0["shares"] == 1 and gpu0["tenants"] == ["tenant-a"]

    deleted = await pipeline.tenant("tenant-a", "delete", {"name": "train"})
    assert deleted == {"ok": True, "phase": "releasing"}
    await pipeline.until(phase_is("tenant-a", "train", "released"))

    async def gpu0_now() -> dict[str, Any]:
        devices = (await pipeline.admin("devices.list", {}))["devices"]
        return next(d for d in devices if d["device"] == "gpu-0")

    # the API answers from what its process has heard of: it may hear of the release a
    # moment after this test's own view did
    async with asyncio.timeout(30):
        while (gpu0 := await gpu0_now())["shares"]:  # noqa: ASYNC110 (asks the API)
            await asyncio.sleep(0.05)
    assert gpu0["capacity"]["memory"]["consumed"] == "0"
    again = await pipeline.tenant("tenant-a", "delete", {"name": "train"})
    assert again == {"ok": True, "phase": "released"}  # the wish is done: not "not found"
    await assert_verified(settings)


async def test_an_agent_whose_durable_was_lost_with_its_messages_takes_up_its_node(
    pipeline: Pipeline,
) -> None:
    """A broker that lost its store lost the agent's durable and the messages the agent
    had not taken; the relay publishes a lost stream again only from the lowest position
    a consumer recorded, which an agent does not record, and the agent keeps its lease
    (no reconcile). Here the agent is held at the moment its pulls found its durable
    gone; a claim is bound and another deleted meanwhile; every consumer's mark passes
    both (as the reservation's feeds' do once they handle later messages) and the stream
    is lost. Once the durable is made again, the bound claim must go Ready and the
    deleted one released (``Agent.take_up``; without it they stayed bound and releasing:
    no message of theirs came again)."""
    applied = await pipeline.tenant("tenant-a", "apply", claim_manifest("before", "tenant-a"))
    assert applied["ok"], applied
    await pipeline.until(phase_is("tenant-a", "before", "ready"))
    consumer = pipeline.agents[0].consumer
    noticed, go = asyncio.Event(), asyncio.Event()
    make_again = consumer._missing
    assert make_again is not None

    async def held_back() -> object:
        noticed.set()
        await go.wait()
        return await make_again()

    consumer._missing = held_back
    await pipeline.js.delete_consumer(pipeline.names.stream, consumer.name)
    async with asyncio.timeout(60):  # its pulls find nobody (at the latest as they expire)
        await noticed.wait()
    applied = await pipeline.tenant("tenant-a", "apply", claim_manifest("during", "tenant-a"))
    assert applied["ok"], applied
    deleted = await pipeline.tenant("tenant-a", "delete", {"name": "before"})
    assert deleted == {"ok": True, "phase": "releasing"}

    def bound(state: ClusterState) -> bool:
        claim = state.claim("tenant-a", "during")
        shares = [state.shares[s] for s in claim.share_ids] if claim is not None else []
        return bool(shares) and all(share.state == "bound" for share in shares)

    await pipeline.until(bound)
    head = await pipeline.stores[0].head()
    await pipeline.stores[0].pool.execute("UPDATE consumer_checkpoints SET position = $1", head)
    await pipeline.js.delete_stream(pipeline.names.stream)  # the broker lost its store

    async def stream_again() -> bool:
        try:
            await pipeline.js.stream_info(pipeline.names.stream)
        except nats.js.errors.NotFoundError:
            return False
        return True

    async with asyncio.timeout(60):  # the relay makes it again, from after the marks
        while not await stream_again():  # noqa: ASYNC110 (asks the broker)
            await asyncio.sleep(0.1)
    go.set()
    await pipeline.until(phase_is("tenant-a", "during", "ready"))
    await pipeline.until(phase_is("tenant-a", "before", "released"))


class FailingEnforcer(NoneEnforcer):
    """Raises ``errors`` from ``apply``, one per call, then applies as NoneEnforcer does."""

    def __init__(self, *errors: EnforcementError) -> None:
        super().__init__()
        self.errors = list(errors)

    async def apply(self, limit: ShareLimit) -> AppliedLimit:
        if self.errors:
            raise self.errors.pop(0)
        return await super().apply(limit)


@pytest.mark.parametrize("agent_clock", [FakeClock(start=0.0)])
async def test_the_type_of_an_enforcement_error_decides_retry_or_failure(
    pipeline: Pipeline, settings: Settings, agent_clock: FakeClock
) -> None:
    agent = pipeline.agents[0]
    agent.enforcer = FailingEnforcer(*[RetryableEnforcementError("daemon still starting")] * 2)
    assert (await pipeline.tenant("tenant-a", "apply", claim_manifest("again", "tenant-a")))["ok"]

    def tried(attempts: int) -> Callable[[ClusterState], bool]:
        def check(state: ClusterState) -> bool:
            shares = [s for s in state.shares.values() if s.claim[1] == "again"]
            return bool(shares) and shares[0].attempts >= attempts

        return check

    # each retry comes when the agent's clock reaches its retry_at (0.5 s, then 1 s
    # later): the test moves the clock instead of waiting for the back-off to pass, in
    # steps until the try is seen (the agent may start its wait on the clock after a
    # step: the view can show a try before the agent heard when the next one is due)
    async def advance_until(check: Callable[[ClusterState], bool]) -> None:
        deadline = time.monotonic() + 60
        while not check(await pipeline.state()):
            assert time.monotonic() < deadline, "the agent's clock moved, no try came"
            await agent_clock.advance(0.25)
            await asyncio.sleep(0.05)  # real time for the try to reach the log

    await pipeline.until(tried(1))
    await advance_until(tried(2))
    await advance_until(phase_is("tenant-a", "again", "ready"))
    (share,) = [s for s in (await pipeline.state()).shares.values() if s.claim[1] == "again"]
    assert share.last_error == "daemon still starting"  # visible: recorded at once
    store = pipeline.stores[0]
    tries = [
        e.event
        async for e in store.read_all()
        if isinstance(e.event, LimitFailed) and e.event.share_id == share.share_id
    ]
    assert [(f.retryable, f.attempt) for f in tries] == [(True, 1), (True, 2)]
    assert tries[0].retry_at is not None and tries[1].retry_at is not None
    assert tries[1].retry_at - tries[1].failing_since > tries[0].retry_at - tries[0].failing_since
    phases = [
        e.event
        async for e in store.read_all()
        if isinstance(e.event, LimitFailed | LimitApplied) and e.event.share_id == share.share_id
    ]
    assert isinstance(phases[-1], LimitApplied)  # the sweep's third try applied it

    agent.enforcer = FailingEnforcer(PermanentEnforcementError("no such GPU"))
    assert (await pipeline.tenant("tenant-a", "apply", claim_manifest("never", "tenant-a")))["ok"]
    await pipeline.until(phase_is("tenant-a", "never", "failed"))
    claim = (await pipeline.state()).claim("tenant-a", "never")
    assert claim is not None and claim.reason == "no such GPU"
    await assert_verified(settings)


async def test_watch_publishes_changes(pipeline: Pipeline, settings: Settings) -> None:
    reply = await pipeline.tenant("tenant-b", "watch", {"name": "w1"})
    assert reply["subject"].endswith(".watch.tenant-b.w1")
    phases: list[str] = []
    ready = asyncio.Event()

    async def seen(msg: Any) -> None:
        view = json.loads(msg.data)
        phases.append(view["phase"])
        if view["ready"]:
            ready.set()

    subscription = await pipeline.nc.subscribe(reply["subject"], cb=seen)
    try:
        assert (await pipeline.tenant("tenant-b", "apply", claim_manifest("w1", None)))["ok"]
        await asyncio.wait_for(ready.wait(), 30)
    finally:
        await subscription.unsubscribe()
    # in life-cycle order, ending ready; a fast pipeline may fold several changes into one
    # view, so which intermediate phases were seen is not fixed
    order = ["submitted", "admitted", "allocated", "ready"]
    assert phases[-1] == "ready"
    assert [order.index(p) for p in phases] == sorted(order.index(p) for p in phases)


# --- the race ------------------------------------------------------------------------------


async def test_last_capacity_race(pipeline: Pipeline, settings: Settings) -> None:
    """Two namespaces ask for the last 10Gi at once: one gets it, never both."""
    filler = claim_manifest("filler", "tenant-a", "30Gi", RACE)
    assert (await pipeline.tenant("tenant-a", "apply", filler))["ok"]
    await pipeline.until(phase_is("tenant-a", "filler", "ready"))
    device = ("race.dracap.io", "node-a-race", "race-0")
    wins = {"tenant-a": 0, "tenant-b": 0}
    started = time.monotonic()
    for k in range(RACE_ROUNDS):
        a = claim_manifest(f"r{k}", None, "10Gi", RACE)
        replies = await asyncio.gather(
            pipeline.tenant("tenant-a", "apply", a), pipeline.tenant("tenant-b", "apply", a)
        )
        assert all(r["ok"] for r in replies), replies

        def decided(state: ClusterState, k: int = k) -> bool:
            phases = {state.claim(ns, f"r{k}").phase for ns in wins}  # type: ignore[union-attr]
            return "unschedulable" in phases and phases & {"allocated", "ready"} != set()

        await pipeline.until(decided)
        state = await pipeline.state()
        dev = state.devices[device]
        assert dev.consumed_nanos["memory"] <= dev.total["memory"].nanos
        assert dev.free("memory").canonical() == "0"
        winner = next(ns for ns in wins if state.claim(ns, f"r{k}").phase != "unschedulable")  # type: ignore[union-attr]
        loser = next(ns for ns in wins if ns != winner)
        wins[winner] += 1
        assert (await pipeline.tenant(loser, "delete", {"name": f"r{k}"}))["phase"] == "withdrawn"
        assert (await pipeline.tenant(winner, "delete", {"name": f"r{k}"}))["ok"]
        await pipeline.until(phase_is(winner, f"r{k}", "released"))
    elapsed = time.monotonic() - started
    assert sum(wins.values()) == RACE_ROUNDS
    state = await pipeline.state()
    assert not pipeline.view.violations  # type: ignore[union-attr]
    assert state.devices[device].free("memory").canonical() == "10Gi"
    print(f"{RACE_ROUNDS} race rounds in {elapsed:.1f}s; wins {wins}")
    await assert_verified(settings)


# --- bad input -----------------------------------------------------------------------------

BAD: list[tuple[str, str, bytes, str, str, str]] = [
    ("malformed-yaml", "tenant-a", b"kind: [oops\n", "invalid", "line 2 column 1", "invalid YAML"),
    (
        "unknown-class",
        "tenant-a",
        claim_manifest("c1", "tenant-a", class_name="nope.dracap.io"),
        "rejected",
        "spec.devices.requests[0].exactly.deviceClassName",
        "DeviceClass 'nope.dracap.io' does not exist",
    ),
    (
        "above-every-maximum",
        "tenant-a",
        claim_manifest("c2", "tenant-a", "64Gi"),
        "rejected",
        "spec.devices.requests[0].exactly.capacity.requests[memory]",
        "must be at most 40Gi",
    ),
    (
        "quantity-does-not-parse",
        "tenant-a",
        claim_manifest("c3", "tenant-a", "ten gigs"),
        "invalid",
        "spec.devices.requests[0].exactly.capacity.requests[memory]",
        "quantity 'ten gigs'",
    ),
    (
        "class-not-allowed",
        "tenant-c",
        claim_manifest("c4", "tenant-c"),
        "rejected",
        "spec.devices.requests[0].exactly.deviceClassName",
        "may not use DeviceClass",
    ),
    (
        "no-access-record",
        "tenant-z",
        claim_manifest("c5", None),
        "rejected",
        "spec.devices.requests[0].exactly.deviceClassName",
        "has no access to any DeviceClass",
    ),
    (
        "another-namespace",
        "tenant-a",
        claim_manifest("c6", "tenant-b"),
        "invalid",
        "metadata.namespace",
        "namespace of the request subject",
    ),
    (
        "admin-access",
        "tenant-a",
        claim_manifest("c7", "tenant-a", None, adminAccess=True),
        "rejected",
        "spec.devices.requests[0].exactly.adminAccess",
        "adminAccess is not allowed",
    ),
]


async def test_bad_input_is_refused_with_field_and_rule(
    pipeline: Pipeline, settings: Settings
) -> None:
    for case, namespace, body, code, field, rule in BAD:
        head = await pipeline.stores[0].head()
        reply = await pipeline.tenant(namespace, "apply", body)
        assert not reply["ok"], case
        error = reply["error"]
        assert (error["code"], error["field"]) == (code, field), (case, error)
        assert rule in error["rule"] + error["message"], (case, error)
        assert field in error["message"], (case, error)
        new = [e async for e in pipeline.stores[0].read_all(head)]
        tags = [type(e.event).__name__ for e in new]
        if code == "rejected":
            assert tags == ["ClaimSubmitted", "ClaimRejected"], case
            assert new[0].stream == claim_stream(namespace, new[1].event.name)  # type: ignore[union-attr]
            got = await pipeline.tenant(namespace, "get", {"name": new[1].event.name})  # type: ignore[union-attr]
            assert got["claim"]["phase"] == "rejected" and field in got["claim"]["reason"]
        else:
            assert tags == [], case
    # nothing was recorded in the namespace the mismatching manifest named
    assert (await pipeline.tenant("tenant-b", "get", {"name": "c6"}))["error"]["code"] == (
        "not_found"
    )
    # a live claim's name cannot take another spec
    assert (await pipeline.tenant("tenant-a", "apply", claim_manifest("x", None)))["ok"]
    again = await pipeline.tenant("tenant-a", "apply", claim_manifest("x", None))
    assert again["ok"]  # same spec: a no-op
    other = await pipeline.tenant("tenant-a", "apply", claim_manifest("x", None, "20Gi"))
    assert other["error"]["code"] == "conflict" and other["error"]["field"] == "metadata.name"
    bad_get = await pipeline.tenant("tenant-a", "get", {"nom": "x"})
    assert bad_get["error"]["code"] == "invalid"
    await pipeline.idle()
    await assert_verified(settings)


# --- redelivery ----------------------------------------------------------------------------


async def test_redelivery_changes_nothing(pipeline: Pipeline, settings: Settings) -> None:
    """Every message delivered again (bus duplicates and direct handler calls): no change."""
    for i, ns in enumerate(["tenant-a", "tenant-b", "tenant-a"]):
        manifest = claim_manifest(f"d{i}", None, "20Gi", RACE)
        assert (await pipeline.tenant(ns, "apply", manifest))["ok"]
        if i == 1:
            await pipeline.until(phase_is("tenant-b", "d1", "ready"))
    await pipeline.until(phase_is("tenant-a", "d2", "unschedulable"))
    assert (await pipeline.tenant("tenant-a", "delete", {"name": "d0"}))["ok"]
    await pipeline.until(phase_is("tenant-a", "d2", "ready"))
    await pipeline.idle()
    head = await pipeline.stores[0].head()
    envelopes = [e async for e in pipeline.stores[0].read_all(0)]
    tags = {type(e.event).__name__ for e in envelopes}
    assert {"ClaimAdmitted", "ClaimUnschedulable", "AllocationBound", "LimitApplied"} <= tags
    assert {"ReleaseRequested", "LimitRemoved", "CapacityReleased"} <= tags

    # 1. the bus delivers every event again (a new message id defeats JetStream's dedup)
    for env in envelopes:
        subject = pipeline.names.event_subject(env)
        await pipeline.js.publish(
            subject, encode_event(env), headers={"Nats-Msg-Id": f"again-{env.event_id}"}
        )
    await pipeline.idle()
    assert await pipeline.stores[0].head() == head

    # 2. the handlers themselves, called again without the idempotency record (the agent's
    # as a first delivery: the enforcement service does not look the message up)
    store = pipeline.stores[0]
    for env in envelopes:
        for agent in pipeline.agents:
            if agent.wants(env):
                assert await agent.handle([Delivery(env, 1)]) == set()
            assert await store.head() == head, type(env.event).__name__
        for handle in [w.handle for w in pipeline.workers]:
            async with store.pool.acquire() as connection:
                transaction = connection.transaction()
                await transaction.start()
                try:
                    ctx = HandlerContext(connection, store, "redelivery-test", 2)
                    handled = await handle(ctx, [env])
                    assert handled.batches == [], (type(env.event).__name__, handled)
                    moved = await connection.fetchval("SELECT position FROM event_log_head")
                    assert moved == head, type(env.event).__name__
                finally:
                    await transaction.rollback()
    assert await store.head() == head
    await assert_verified(settings)


# --- forged messages -----------------------------------------------------------------------


def _subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` the rest."""
    wanted, tokens = pattern.split("."), subject.split(".")
    for i, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > i
        if i >= len(tokens) or token not in ("*", tokens[i]):
            return False
    return len(wanted) == len(tokens)


def forged_envelopes(real: list[Envelope], victim: tuple[str, str]) -> list[Envelope]:
    """Envelopes of every event type a consumer acts on, none of them in the log."""
    by_type = {type(e.event): e for e in real}
    bound = by_type[AllocationBound]
    reserved = by_type[CapacityReserved]
    assert isinstance(bound.event, AllocationBound) and isinstance(reserved.event, CapacityReserved)
    share, version = reserved.event.share_id, bound.event.allocation_version
    device = {k: getattr(reserved.event, k) for k in ("driver", "pool", "device")}
    consumed = reserved.event.consumed
    events: list[Any] = [
        ReleaseRequested(
            namespace=victim[0], name=victim[1], allocation_version=version, node=NODE
        ),
        msgspec.structs.replace(bound.event, allocation_version=version + 1),
        LimitApplied(share_id=share, node=NODE, level="none", actual={}),
        LimitRemoved(share_id=share, node=NODE),
        CapacityReleased(
            share_id=share,
            allocation_version=version,
            consumed=consumed,
            admin_access=False,
            **device,
        ),
        ClaimAdmitted(namespace=victim[0], name="never-submitted"),
        NodeFenced(node=NODE, epoch=7),
        NamespaceAccessSet(namespace="tenant-c", classes=["*"], admin_access=True),
    ]
    head = max(e.position for e in real)
    forged = [
        msgspec.structs.replace(
            bound, event=event, event_id=str(uuid.uuid4()), position=head + 1 + i, stream="x:y"
        )
        for i, event in enumerate(events)
    ]
    # a real event's id and position with another payload
    return [*forged, msgspec.structs.replace(bound, event=events[1])]


async def test_forged_events_on_the_bus_change_nothing(
    pipeline: Pipeline, settings: Settings
) -> None:
    """Events published straight onto the bus, never logged: dropped, counted, no effect."""
    assert (await pipeline.tenant("tenant-a", "apply", claim_manifest("victim", None)))["ok"]
    await pipeline.until(phase_is("tenant-a", "victim", "ready"))
    await pipeline.idle()
    store = pipeline.stores[0]
    real = [e async for e in store.read_all()]
    before = await pipeline.state()
    consumed_before = dict(before.devices[("gpu.dracap.io", "node-a-gpu", "gpu-0")].consumed_nanos)
    consumers = [c for w in pipeline.workers[:1] for c in w.consumers()]
    agents = pipeline.agents
    names = [c.name for c in consumers] + [a.consumer.name for a in agents]
    counted_before = sum(metric_of(name) for name in names)

    expected = 0
    for env in forged_envelopes(real, ("tenant-a", "victim")):
        subject = pipeline.names.event_subject(env)
        expected += sum(_subject_matches(c._filter, subject) for c in consumers)
        # an agent confirms (through the enforcement service) what it would act on; the
        # rest of its node's messages it acknowledges unread
        expected += sum(a.wants(env) for a in agents)
        headers = {"Nats-Msg-Id": str(uuid.uuid4())}
        await pipeline.js.publish(subject, encode_event(env), headers=headers)
    # every forged event reaches a consumer that confirms it, but the forged NodeFenced:
    # only the agent receives it, and it acts on none of that kind (nothing to confirm)
    assert expected >= 8

    async with asyncio.timeout(60):
        while sum(metric_of(name) for name in names) - counted_before < expected:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    await pipeline.idle()
    assert sum(metric_of(name) for name in names) - counted_before == expected
    assert [e async for e in store.read_all()] == real  # nothing appended
    after = await pipeline.state()
    victim = after.claim("tenant-a", "victim")
    assert victim is not None and victim.phase == "ready"
    assert all(after.shares[s].state == "ready" for s in victim.share_ids)
    assert after.devices[("gpu.dracap.io", "node-a-gpu", "gpu-0")].consumed_nanos == consumed_before
    await assert_verified(settings)


def metric_of(consumer: str) -> float:
    sample = REGISTRY.get_sample_value("dracap_unconfirmed_messages_total", {"consumer": consumer})
    return sample or 0.0


# --- the last line of defense -----------------------------------------------------------------


class RecordingEnforcer(NoneEnforcer):
    """Applies as :class:`NoneEnforcer` does and remembers every share it was asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    async def apply(self, limit: ShareLimit) -> AppliedLimit:
        self.asked.append(limit.share_id)
        return await super().apply(limit)


async def forge_grant(
    store: EventStore, like: list[Envelope], name: str, memory: str
) -> tuple[str, list[Envelope]]:
    """Append, as a reservation worker would, a grant of ``memory`` for claim ``name``.

    A copy of the reservation and binding in ``like`` (one share) with a new claim,
    ShareID and amount: the allocator and its view of the device are bypassed; the
    database's guards still run. Returns the ShareID and the appended envelopes.
    """
    reserved = next(e.event for e in like if isinstance(e.event, CapacityReserved))
    bound = next(e.event for e in like if isinstance(e.event, AllocationBound))
    assert isinstance(reserved, CapacityReserved) and isinstance(bound, AllocationBound)
    share_id = str(uuid.uuid4())
    consumed = {"memory": Quantity.parse(memory)}
    devices = bound.allocation.devices
    assert devices is not None and devices.results is not None
    results = [
        msgspec.structs.replace(r, share_id=share_id, consumed_capacity=consumed)
        for r in devices.results
    ]
    allocation = msgspec.structs.replace(
        bound.allocation, devices=msgspec.structs.replace(devices, results=results)
    )
    events: list[Any] = [
        msgspec.structs.replace(reserved, name=name, share_id=share_id, consumed=consumed),
        msgspec.structs.replace(bound, name=name, share_ids=[share_id], allocation=allocation),
    ]
    batches = [
        Batch(stream_of(events[0]), None, events[:1]),
        Batch(stream_of(events[1]), 0, events[1:]),
    ]
    actor = str(Actor.system("reservation-0"))
    return share_id, await store.append_many(batches, Metadata(actor=actor))


async def test_the_agent_refuses_to_overcommit_whatever_it_is_asked(
    pipeline: Pipeline, settings: Settings
) -> None:
    """Invariant 12: the control plane asks for more than the device holds; the agent says no.

    The forgery the database cannot stop: a mistaken release (written as a reclamation
    service would, without asking the node) gives back a 30Gi share the agent still
    enforces, so the log and the ledger free it. (A fence would not do: it makes the
    agent's epoch stale, and the agent, taking its next lease, removes the limit as an
    orphan.) A reservation worker then grants 20Gi of the same 40Gi device (the ledger
    sees 20Gi of 40Gi used: its CHECK passes). The agent counts what it enforces: 30Gi +
    20Gi > 40Gi, so it never calls the enforcer for that share, records a terminal
    ``LimitFailed`` with the amounts, and the claim fails. A grant that fits what is
    enforced (10Gi: exactly 40Gi) is applied as usual.
    """
    agent = pipeline.agents[0]
    enforcer = agent.enforcer = RecordingEnforcer()
    held_manifest = claim_manifest("held", "tenant-a", "30Gi")
    assert (await pipeline.tenant("tenant-a", "apply", held_manifest))["ok"]
    await pipeline.until(phase_is("tenant-a", "held", "ready"))
    state = await pipeline.state()
    held_claim = state.claim("tenant-a", "held")
    assert held_claim is not None
    (held,) = held_claim.share_ids
    where = "/".join(state.shares[held].device_key)
    assert held in agent.enforcing and enforcer.asked == [held]
    store = pipeline.stores[0]
    like = [e async for e in store.read_all() if getattr(e.event, "name", None) == "held"]

    reserved = next(e.event for e in like if isinstance(e.event, CapacityReserved))
    mistaken = CapacityReleased(
        share_id=held,
        driver=reserved.driver,
        pool=reserved.pool,
        device=reserved.device,
        allocation_version=reserved.allocation_version,
        consumed=dict(reserved.consumed),
        admin_access=False,
    )
    reclaimer = Metadata(actor=str(Actor.system("reclamation-0")))
    await store.append_many([Batch(stream_of(mistaken), None, [mistaken])], reclaimer)
    await pipeline.until(lambda st: st.shares[held].state == "released")
    assert held in agent.enforcing  # nobody told the agent: the limit is still in force

    over, _ = await forge_grant(store, like, "over", "20Gi")
    await pipeline.until(phase_is("tenant-a", "over", "failed", "ready"))
    fits, _ = await forge_grant(store, like, "fits", "10Gi")
    await pipeline.until(phase_is("tenant-a", "fits", "failed", "ready"))
    assert (await pipeline.state()).claim("tenant-a", "fits").phase == "ready"  # type: ignore[union-attr]

    assert enforcer.asked == [held, fits]  # never asked to apply the share that overcommits
    log = [e.event async for e in store.read_all()]
    assert not [e for e in log if isinstance(e, LimitApplied) and e.share_id == over]
    (failed,) = [e for e in log if isinstance(e, LimitFailed) and e.share_id == over]
    assert not failed.retryable
    assert failed.reason == (
        f"refused: device {where} memory: enforcing 30Gi (1 share(s)) + asked 20Gi = 50Gi "
        "> total 40Gi"
    )
    claim = (await pipeline.state()).claim("tenant-a", "over")
    assert claim is not None and claim.phase == "failed" and claim.reason == failed.reason
    await assert_verified(settings)


# --- one tenant's expensive selector ---------------------------------------------------------


def _nested(n: int) -> str:
    items = "[" + ",".join(str(i) for i in range(1, n + 1)) + "]"
    return f"{items}.all(x, {items}.all(y, x*y >= 0))"


async def test_an_expensive_selector_delays_nobody_else(pipeline: Pipeline) -> None:
    """Tenant A's selector just under the cost limit runs in the pool; B's claims go on."""
    heavy = claim_manifest("heavy", None, selectors=[{"cel": {"expression": _nested(370)}}])
    assert (await pipeline.tenant("tenant-a", "apply", heavy))["ok"]
    pools = [w.selectors for w in pipeline.workers]
    async with asyncio.timeout(30):
        while not any(p.busy for p in pools):  # noqa: ASYNC110 (the pool's own flag)
            await asyncio.sleep(0.02)

    names = [f"b{i}" for i in range(10)]
    replies = await asyncio.gather(
        *(pipeline.tenant("tenant-b", "apply", claim_manifest(n, None, "5Gi")) for n in names)
    )
    assert all(r["ok"] for r in replies), replies
    await pipeline.until(lambda st: all(phase_is("tenant-b", n, "ready")(st) for n in names), 30)

    # the expensive claim is still being evaluated: not decided, the loop was never held
    state = await pipeline.state()
    assert state.claim("tenant-a", "heavy").phase == "admitted"  # type: ignore[union-attr]
    assert any(p.busy for p in pools)


async def test_a_deferred_claim_is_decided_once_its_selector_is_in(pipeline: Pipeline) -> None:
    """Above the inline budget, below any deadline: evaluated in the pool, then planned."""
    before = REGISTRY.get_sample_value("dracap_selector_jobs_total", {"outcome": "evaluated"}) or 0
    selector = {"cel": {"expression": f"{_nested(12)} && device.driver == 'gpu.dracap.io'"}}
    body = claim_manifest("deferred", None, selectors=[selector])
    assert (await pipeline.tenant("tenant-a", "apply", body))["ok"]
    await pipeline.until(phase_is("tenant-a", "deferred", "ready"), 60)
    after = REGISTRY.get_sample_value("dracap_selector_jobs_total", {"outcome": "evaluated"})
    assert (after or 0) > before


class GatedPool(SelectorPool):
    """The real pool, whose compile checks wait for a gate (to hold them in flight)."""

    def __init__(self) -> None:
        super().__init__(niceness=0)
        self.gate = asyncio.Event()

    async def check(self, *args: Any, **kwargs: Any) -> dict[str, str | None]:
        await self.gate.wait()
        return await super().check(*args, **kwargs)


async def test_one_tenant_cannot_hold_every_api_slot_with_long_selectors(
    pipeline: Pipeline,
) -> None:
    await pipeline.api.selectors.close()
    pool = pipeline.api.selectors = GatedPool()
    long_selector = "device.driver == 'gpu.dracap.io' && " + " && ".join(["true"] * 60)

    def body(i: int) -> bytes:
        selector = {"cel": {"expression": f"{long_selector} && {i} == {i}"}}
        return claim_manifest(f"long-{i}", None, selectors=[selector])

    waiting = [
        asyncio.ensure_future(pipeline.tenant("tenant-a", "apply", body(i))) for i in range(5)
    ]
    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED, timeout=30)
    [refused] = [task.result() for task in done]
    assert refused["error"]["code"] == "conflict"
    assert "has 4 claims whose selectors are being compiled" in refused["error"]["message"]
    # another tenant is not held up meanwhile
    assert (await pipeline.tenant("tenant-b", "apply", claim_manifest("other", None)))["ok"]
    pool.gate.set()
    replies = [await task for task in waiting if task not in done]
    assert len(replies) == 4 and all(r["ok"] for r in replies), replies


# --- the agent decides the next group while the last report is in flight -----------------


class HeldReports:
    """The agent's requests to the enforcement service, watched: its first view of
    messages waits for ``view_gate``, its message reports for ``gate``; the views asked
    while a report is in flight are kept; a report may be made to fail (``fail``)
    instead of being sent."""

    def __init__(self, agent: Agent) -> None:
        self.view_of = agent.plane.view
        self.send_report_of = agent.plane.send_report
        agent.plane.view = self.view  # type: ignore[method-assign]
        agent.plane.send_report = self.send_report  # type: ignore[method-assign]
        self.view_gate = asyncio.Event()
        self.views_held = 0
        self.gate = asyncio.Event()
        self.in_flight = 0
        self.beside: list[ViewAsk] = []  #: views asked while a report was in flight
        self.sent: list[list[str]] = []  #: the messages of each report sent
        self.fail: Exception | None = None

    async def view(self, ask: ViewAsk) -> tuple[NodeView, Viewed]:
        if self.in_flight and ask.messages:
            self.beside.append(ask)
        if ask.messages and not self.view_gate.is_set():
            self.views_held += 1
            await self.view_gate.wait()
        return await self.view_of(ask)

    async def send_report(self, report: Report) -> Coroutine[None, None, Reported]:
        if not report.processed:
            return await self.send_report_of(report)
        self.in_flight += 1
        return self.held(report)

    async def held(self, report: Report) -> Reported:
        try:
            await self.gate.wait()
            if self.fail is not None:
                failure, self.fail = self.fail, None
                raise failure
            self.sent.append(list(report.processed))
            return await (await self.send_report_of(report))
        finally:
            self.in_flight -= 1


async def _bound_event_id(pipeline: Pipeline, name: str) -> str:
    (event_id,) = [
        e.event_id
        async for e in pipeline.stores[0].read_all()
        if isinstance(e.event, AllocationBound) and e.event.name == name
    ]
    return event_id


async def _decided_beside_a_report(pipeline: Pipeline, held: HeldReports) -> None:
    """A backlog: claim p1's binding waits at the agent while p0 is being decided; p0's
    report is held, and p1 is viewed meanwhile."""
    assert (await pipeline.tenant("tenant-a", "apply", claim_manifest("p0", None)))["ok"]
    await until(lambda: held.views_held == 1, 60, "p0's view held")
    assert (await pipeline.tenant("tenant-a", "apply", claim_manifest("p1", None)))["ok"]
    durable = pipeline.agents[0].consumer.name

    async def both_delivered() -> bool:
        info = await pipeline.js.consumer_info(pipeline.names.stream, durable)
        return info.num_ack_pending == 2

    async with asyncio.timeout(60):
        while not await both_delivered():  # noqa: ASYNC110 (asks the broker)
            await asyncio.sleep(0.01)
    held.view_gate.set()
    await until(lambda: held.in_flight == 1, 60, "p0's report in flight")
    # with one group at a time, p1 would be viewed only once p0's report is answered
    await until(lambda: bool(held.beside), 60, "a view of p1 while p0's report is held")
    assert not phase_is("tenant-a", "p0", "ready")(await pipeline.state())


async def test_the_next_group_is_decided_while_the_last_report_is_in_flight(
    pipeline: Pipeline, settings: Settings
) -> None:
    held = HeldReports(pipeline.agents[0])
    await _decided_beside_a_report(pipeline, held)
    held.gate.set()
    await pipeline.until(phase_is("tenant-a", "p0", "ready"))
    await pipeline.until(phase_is("tenant-a", "p1", "ready"))
    # p1's report expected the node stream as p0's report left it (its view did not
    # show p0's events): it landed at once, with no conflict and no second try
    p0, p1 = [await _bound_event_id(pipeline, n) for n in ("p0", "p1")]
    assert held.sent == [[p0], [p1]]
    applied = [
        e.event async for e in pipeline.stores[0].read_all() if isinstance(e.event, LimitApplied)
    ]
    assert len(applied) == 2
    await assert_verified(settings)


async def test_a_group_decided_beside_a_failed_report_is_decided_again(
    pipeline: Pipeline, settings: Settings
) -> None:
    held = HeldReports(pipeline.agents[0])
    await _decided_beside_a_report(pipeline, held)
    held.fail = ConflictError("the state moved")
    held.gate.set()
    await pipeline.until(phase_is("tenant-a", "p0", "ready"))
    await pipeline.until(phase_is("tenant-a", "p1", "ready"))
    # p1's report, decided beside p0's that failed, was never sent: p1 was viewed and
    # decided again on its own, and reported once
    p1 = await _bound_event_id(pipeline, "p1")
    assert [sent for sent in held.sent if p1 in sent] == [[p1]]
    applied = [
        e.event async for e in pipeline.stores[0].read_all() if isinstance(e.event, LimitApplied)
    ]
    assert len(applied) == 2
    await assert_verified(settings)
