"""Node agents off the database: they reach the log only through the enforcement service.

A nats-server runs with the accounts of ``dracap auth init`` (agents in ``NODES``, each
with its own credential); the relay, claims API, a reservation worker, the enforcement
service and the reclamation service run in-process on real PostgreSQL, each with its
own broker credential (the enforcement service on its own database login,
``dracap_enforcement``, so the database checks what it appends as well). Then:

* ``dracap agent`` as a subprocess, with no database URL and none in its environment,
  and every way asyncpg opens a connection replaced by a tripwire: a claim goes Ready
  and is released, and the tripwire never fires;
* a request on another node's subject is refused: by the broker (the credential may not
  publish there) and by the service (the broker's stamp names another node, or none);
* reports with a stale epoch, another node's share, an undecodable payload (the
  ``"level": 5`` of issue 24) or an event no agent writes are refused, and nothing of them
  reaches the log;
* the heartbeats of many nodes renew in a few statements, not one each;
* an agent cut off from NATS (a proxy between it and the broker stops forwarding) loses
  its lease: its share goes Unknown; when the proxy forwards again the agent takes the
  next lease and confirms the share.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest

from events import catalog as c
from events.envelopes import claim_stream, node_stream
from events.state import ClusterState
from services import durables
from services.claims.api import ClaimsApi
from services.enforcement.agent import Agent
from services.enforcement.asking import ControlPlane, Refused
from services.enforcement.enforcers import NoneEnforcer
from services.enforcement.protocol import Report, ReportBatch
from services.enforcement.service import EnforcementService
from services.reclamation.service import ReclamationService
from services.reservation.service import ReservationService
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.credentials import REQUEST_INFO_HEADER, read_directory
from services.runtime.bus.jetstream import connect_bus
from services.runtime.delivery.rebuilding import BusKeeper
from services.runtime.delivery.relaying import Relay
from services.runtime.ground.errors import StaleEpoch
from services.runtime.ground.settings import ServiceKind, Settings
from services.runtime.store.eventstore import EventStore
from services.runtime.store.livestate import HEAD, LiveState
from services.stack import load_inventory, read_inventory
from tests.fixtures.brokers import EXAMPLES, Broker, secure_broker
from tests.fixtures.contexts import folded, handed
from tests.fixtures.logins import login_users
from tests.integration.waiting import state_reaches

ROOT = Path(__file__).resolve().parents[2]
FLEET = [f"hb-{i}" for i in range(60)]  #: nodes that only beat
CUT = "node-c"  #: the node cut off from NATS
WITHIN = 60.0


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    with secure_broker(
        tmp_path_factory.mktemp("nodes"), users=["tenant-a/alice"], nodes=[*FLEET, CUT]
    ) as running:
        yield running


class Services:
    """The control plane of one test, every service with its own broker credential."""

    def __init__(self, broker: Broker, settings: Settings) -> None:
        self.broker, self.settings = broker, settings
        self.names = broker.names
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.stores: list[EventStore] = []
        self.connections: list[Any] = []
        self.directory = read_directory(broker.auth.directory)

    async def _store(self, kind: ServiceKind | None = None) -> EventStore:
        settings = self.settings if kind is None else self.settings.for_service(kind)
        store = await EventStore.open(settings)
        self.stores.append(store)
        return store

    async def _bus(self, service: str) -> tuple[Any, Any]:
        nc, js = await connect_bus(self.broker.url, credential=self.broker.auth.service(service))
        self.connections.append(nc)
        return nc, js

    def _run(self, run: Callable[[asyncio.Event], Awaitable[None]]) -> None:
        self.tasks.append(asyncio.ensure_future(run(self.stop)))

    async def start(self) -> None:
        _, relay_js = await self._bus("relay")
        relay_store = await self._store()
        # the relay owns the stream and the services' durables (the agents' are the
        # enforcement service's): in place before anyone pulls
        keeper = BusKeeper(relay_store, relay_js, self.names, durables.relay_owned(self.names))
        await keeper.ensure(0, None)
        self._run(Relay(handed(relay_store, self.names, js=relay_js), keeper=keeper).run)
        claims_nc, _ = await self._bus("claims")
        store = await self._store()
        api = ClaimsApi(
            folded(store, self.names, claims_nc),
            directory=self.directory, authenticated=True, tail=True,
        )  # fmt: skip
        await api.start()
        self._run(api.run)
        _, reservation_js = await self._bus("reservation")
        store = await self._store()
        worker = ReservationService(folded(store, self.names, js=reservation_js), owner=False)
        self._run(worker.run)
        nc, js = await self._bus("enforcement")
        store = await self._store(ServiceKind.ENFORCEMENT)
        self.enforcement = EnforcementService(
            folded(store, self.names, nc, js),
            directory=self.directory, authenticated=True, tail=True, tick_s=0.5,
        )  # fmt: skip
        await self.enforcement.start()
        self._run(self.enforcement.run)
        store = await self._store()
        self._run(ReclamationService(folded(store, self.names), poll_s=0.1).run)
        self.store = await self._store()
        self.view = LiveState(self.store)
        operator = self.broker.auth.operator()
        async with ApiClient.connect(self.broker.url, self.names.prefix, operator) as admin:
            await load_inventory(admin, read_inventory([str(EXAMPLES)]))

    async def close(self) -> None:
        self.stop.set()
        if self.tasks:
            _, pending = await asyncio.wait(self.tasks, timeout=15)
            for task in pending:
                task.cancel()
        for nc in self.connections:
            with contextlib.suppress(Exception):
                await nc.close()
        for store in self.stores:
            await store.close()

    async def apply(self, name: str, memory: str = "40Gi") -> None:
        alice = self.broker.auth.tenant("tenant-a", "alice")
        request = {"deviceClassName": "gpu-memory.dracap.io"}
        request["capacity"] = {"requests": {"memory": memory}}  # type: ignore[assignment]
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "tenant-a"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}},
        }
        async with ApiClient.connect(self.broker.url, self.names.prefix, alice) as api:
            await api.claims("tenant-a", "apply", json.dumps(claim).encode())

    async def delete(self, name: str) -> None:
        alice = self.broker.auth.tenant("tenant-a", "alice")
        async with ApiClient.connect(self.broker.url, self.names.prefix, alice) as api:
            await api.claims("tenant-a", "delete", {"name": name})

    async def until(self, check: Callable[[ClusterState], bool], within: float = WITHIN) -> None:
        await state_reaches(self.view, check, within)

    async def head(self) -> int:
        return await self.store.head()


@pytest.fixture
async def services(
    broker: Broker, settings: Settings, postgres_admin_url: str
) -> AsyncIterator[Services]:
    settings = msgspec.structs.replace(settings, nats_url=broker.url, pool_max_size=4)
    # the enforcement service on its own login (dracap_enforcement): what it appends is
    # checked by the database as well (migration 0011)
    kinds = [ServiceKind.ENFORCEMENT]
    async with login_users(settings.database_url, postgres_admin_url, kinds) as urls:
        running = Services(broker, msgspec.structs.replace(settings, database_urls=urls))
        try:
            await running.start()
            yield running
        finally:
            await running.close()


def placed(*names: str) -> Callable[[ClusterState], bool]:
    """Every claim of ``names`` has its shares (reserved somewhere)."""

    def check(state: ClusterState) -> bool:
        claims = [state.claim("tenant-a", name) for name in names]
        return all(claim is not None and claim.share_ids for claim in claims)

    return check


def gpu_slice(node: str) -> bytes:
    """A ResourceSlice of one shareable 40Gi GPU on ``node``."""
    memory = {"value": "40Gi", "requestPolicy": {"default": "5Gi", "validRange": {
        "min": "5Gi", "step": "5Gi", "max": "40Gi"}}}  # fmt: skip
    device = {"name": "gpu-0", "allowMultipleAllocations": True, "capacity": {"memory": memory}}
    return json.dumps({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-gpu"},
        "spec": {"driver": "gpu.dracap.io", "nodeName": node, "devices": [device],
                 "pool": {"name": f"{node}-gpus", "generation": 1, "resourceSliceCount": 1}},
    }).encode()  # fmt: skip


def phase(name: str, want: str) -> Callable[[ClusterState], bool]:
    def check(state: ClusterState) -> bool:
        claim = state.claim("tenant-a", name)
        return claim is not None and claim.phase == want

    return check


# --- the agent has no database access -----------------------------------------------------

TRIPWIRE = """
import sys
import asyncpg, asyncpg.connection, asyncpg.pool

def tripped(*args, **kwargs):
    with open(sys.argv[1], "w") as marker:
        marker.write("the agent opened a PostgreSQL connection")
    raise RuntimeError("the agent opened a PostgreSQL connection")

asyncpg.connect = asyncpg.connection.connect = tripped
asyncpg.create_pool = asyncpg.pool.create_pool = tripped
from services.cli import main
sys.exit(main(sys.argv[2:]))
"""


async def test_the_agent_runs_with_no_database_access_at_all(
    services: Services, tmp_path: Path
) -> None:
    broker = services.broker
    marker = tmp_path / "tripped"
    creds = broker.auth.creds_path(broker.auth.agent("node-a").principal)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRACAP_")}
    argv = [sys.executable, "-c", TRIPWIRE, str(marker), "agent", "--node", "node-a",
            "--nats", broker.url, "--prefix", broker.names.prefix, "--creds", str(creds),
            "--data-dir", str(tmp_path / "nothing-here"), "--checkpoint", "none",
            "--metrics-port", "0", "--lease-ttl", "3"]  # fmt: skip
    log = (tmp_path / "agent.log").open("wb")
    agent = await asyncio.create_subprocess_exec(*argv, cwd=ROOT, env=env, stdout=log, stderr=log)
    log.close()
    try:
        await services.apply("held")
        await services.until(phase("held", "ready"))
        await services.delete("held")
        await services.until(phase("held", "released"))
    finally:
        agent.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            code = await agent.wait()
    text = (tmp_path / "agent.log").read_text()
    assert code == 0, text
    assert not marker.exists(), text
    state = await services.view.fresh(HEAD)
    [share] = state.claim("tenant-a", "held").share_ids  # type: ignore[union-attr]
    assert state.shares[share].node == "node-a"


# --- requests for another node -----------------------------------------------------------------


def _stamp(broker: Broker, node: str) -> dict[str, str]:
    """The header the broker writes on a request of ``node``'s agent."""
    key = broker.auth.agent(node).principal.public_key
    return {REQUEST_INFO_HEADER: json.dumps({"acc": "NODES", "user": key})}


async def test_a_request_on_another_nodes_subject_is_refused(services: Services) -> None:
    broker, names = services.broker, services.names
    # the broker: node-a's credential may not even publish on node-b's subjects
    refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def error(exc: Exception) -> None:
        if "permissions violation" in str(exc).lower() and not refused.done():
            refused.set_result(str(exc))

    login = broker.auth.agent("node-a").connect_options()
    nc = await nats.connect(broker.url, error_cb=error, allow_reconnect=False, **login)
    try:
        subject = names.node_request("node-b", "heartbeat")
        await nc.publish(subject, b'{"epoch": 1}', reply=nc.new_inbox())
        async with asyncio.timeout(WITHIN):
            assert subject in await refused
    finally:
        await nc.close()
    # the service: a request the broker stamped as node-a's, on node-b's subject (or none)
    service = services.enforcement
    body = msgspec.json.encode({"epoch": 1})
    for headers, why in (
        (_stamp(broker, "node-a"), "the agent of node 'node-a' may not ask for node 'node-b'"),
        (None, "no node agent's identity"),
    ):
        verb, outcome, reply = await service.answer(
            names.node_request("node-b", "heartbeat"), headers, body
        )
        assert (verb, outcome) == ("heartbeat", "forbidden") and why in reply.decode()


# --- reports the service refuses --------------------------------------------------------------


async def test_reports_that_are_not_the_agents_to_write_are_refused(services: Services) -> None:
    broker, names = services.broker, services.names
    for name in ("a1", "a2", "b1"):  # three whole GPUs: node-a has two, node-b one
        await services.apply(name)
    await services.until(placed("a1", "a2", "b1"))
    state = await services.view.fresh(HEAD)
    shares = {s.node: sid for sid, s in state.shares.items()}
    nc, _ = await connect_bus(broker.url, credential=broker.auth.agent("node-a"))
    try:
        plane = ControlPlane(nc, names, "node-a")
        first = (await plane.lease("boot-1", 60, "none")).epoch
        epoch = (await plane.lease("boot-1", 60, "none")).epoch  # the first one is stale now
        head = await services.head()

        def applied(share: str) -> bytes:
            return msgspec.json.encode(
                c.LimitApplied(share_id=share, node="node-a", level="none", actual={})
            )

        stream = node_stream("node-a")
        cases: list[tuple[int, str, bytes, type[Exception], str]] = [
            (first, stream, applied(shares["node-a"]), StaleEpoch, "stale"),
            (epoch, stream, applied(shares["node-b"]), Refused, "forbidden"),
            (
                epoch,
                stream,
                b'{"type": "enforcement.limit_applied", "share_id": "'
                + shares["node-a"].encode()
                + b'", "node": "node-a", "level": 5, "actual": {}}',
                Refused,
                "invalid",
            ),
            (
                epoch,
                claim_stream("tenant-a", "a1"),
                msgspec.json.encode(c.ClaimAdmitted(namespace="tenant-a", name="a1")),
                Refused,
                "invalid",
            ),
        ]
        for used, on, raw, error, says in cases:
            batch = ReportBatch(stream=on, events=[msgspec.Raw(raw)])
            with pytest.raises(error, match=says):
                await plane.report(Report(epoch=used, batches=[batch]))
        assert await services.head() == head, "nothing refused reached the log"
        # and the same agent's own report, under its lease, is appended
        batch = ReportBatch(stream=stream, events=[msgspec.Raw(applied(shares["node-a"]))])
        reported = await plane.report(Report(epoch=epoch, batches=[batch]))
        assert reported.position == head + 1
    finally:
        await nc.close()
    [stored] = await services.store.read_positions([head + 1])
    assert stored.actor == f"agent:node-a#{epoch}"


# --- heartbeats in batches --------------------------------------------------------------------


async def test_heartbeats_of_many_nodes_renew_in_one_statement_per_tick(
    services: Services,
) -> None:
    broker, names = services.broker, services.names
    connections = [
        (await connect_bus(broker.url, credential=broker.auth.agent(node)))[0] for node in FLEET
    ]
    try:
        planes = [
            ControlPlane(nc, names, node) for nc, node in zip(connections, FLEET, strict=True)
        ]
        epochs = [(await p.lease("b", 60, "none")).epoch for p in planes]
        renewals = services.enforcement.renewals
        before, started = renewals.statements, time.monotonic()
        rounds = 3
        for _ in range(rounds):
            held = await asyncio.gather(
                *(p.heartbeat(e) for p, e in zip(planes, epochs, strict=True))
            )
            assert all(held)
        statements = renewals.statements - before
        ticks = (time.monotonic() - started) / renewals.tick_s
        # 180 heartbeats; each statement renewed every beat of its tick (a round may
        # straddle two ticks), never one statement per beat
        assert statements <= min(2 * rounds, int(ticks) + rounds), (statements, ticks)
    finally:
        for nc in connections:
            await nc.close()


# --- an agent cut off from NATS ---------------------------------------------------------------


class Proxy:
    """TCP between an agent and the broker, that can stop forwarding (a cut-off node)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server: asyncio.Server | None = None
        self.port = 0
        self.links: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._link, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()
        for writer in list(self.links):
            writer.transport.abort()
        self.links.clear()

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.links |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def test_an_agent_cut_off_from_nats_goes_unknown_and_confirms_on_return(
    services: Services,
) -> None:
    broker, names = services.broker, services.names
    host, port = broker.url.removeprefix("nats://").split(":")
    proxy = Proxy((host, int(port)))
    await proxy.start()
    operator = broker.auth.operator()
    async with ApiClient.connect(broker.url, names.prefix, operator) as admin:
        await admin.admin("slices.apply", gpu_slice(CUT))
    nc, js = await connect_bus(f"nats://127.0.0.1:{proxy.port}", credential=broker.auth.agent(CUT))
    stop = asyncio.Event()
    agent = Agent(
        handed(None, names, nc, js), node=CUT, enforcer=NoneEnforcer(), lease_ttl=2.0,
        boot_id="boot-c",
    )  # fmt: skip
    running = asyncio.ensure_future(agent.run(stop))
    try:
        names_ = ("w1", "w2", "w3", "w4")  # a whole GPU each: one of the four is the cut node's
        for name in names_:
            await services.apply(name)
        await services.until(placed(*names_))
        [share] = [s for s, held in services.view.state.shares.items() if held.node == CUT]
        await services.until(lambda st: st.shares[share].state == "ready")
        await proxy.cut()  # the node still runs, its NATS is gone
        await services.until(lambda st: st.shares[share].state == "unknown")
        assert services.view.state.nodes[CUT].lease == "expired"
        await proxy.start()  # the network is back on the same port
        await services.until(
            lambda st: st.shares[share].state == "ready" and st.nodes[CUT].lease_epoch == 2
        )
        confirmed = [
            e.event for e in await services.store.read_stream(node_stream(CUT))
            if isinstance(e.event, c.ShareConfirmed)
        ]  # fmt: skip
        assert [e.share_id for e in confirmed] == [share]
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(15):
                await running
        await nc.close()
        await proxy.cut()
