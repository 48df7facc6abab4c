"""The bus is rebuilt from the log: nats-server comes back without its JetStream store.

A stack with the broker's accounts (every service with its own credential, agents with
the none enforcer) takes claims at a small steady rate. nats-server is killed, its
store directory wiped and a new one started on the same port. Nothing is restarted:
the relay creates the stream and the services' durables again and publishes the log
again from what the consumers still need, the enforcement service creates the agents'
durables again when their pulls find none, and every claim applied before and after the
loss becomes Ready. While the broker is away the stack logs a bounded number of lines
(one per change of state), none with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

from events.state import ClusterState
from events.subjects import BusNames
from services.brokerauth import init_auth, installation_from
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.credentials import AuthDir
from services.runtime.ground.settings import Settings
from services.runtime.ops.embedded import EmbeddedNats
from services.runtime.store.livestate import LiveState
from services.stack import Stack, load_inventory, read_inventory
from tests.integration.test_pipeline import claim_manifest
from tests.integration.waiting import state_reaches

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"
NAMESPACE = "tenant-a"
GPU_MEMORY = "gpu-memory.dracap.io"  #: the examples' class
BEFORE, AFTER = 6, 6  #: claims applied before the loss, and after it


class Records(logging.Handler):
    """Every log record of the stack while the test runs."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        self.logged = asyncio.Event()  # the stack logs from the event loop's thread

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.logged.set()

    async def until(self, text: str, since: int, within: float = 60.0) -> None:
        """Until a record from ``since`` on says ``text``."""
        async with asyncio.timeout(within):
            while not any(text in r.getMessage() for r in self.records[since:]):
                self.logged.clear()
                await self.logged.wait()

    def text(self) -> str:
        return "\n".join(f"{r.name} {r.levelname} {r.getMessage()}" for r in self.records)


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


class Broker(msgspec.Struct):
    server: EmbeddedNats
    auth: AuthDir
    names: BusNames


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    names = BusNames(prefix=f"r{uuid.uuid4().hex[:10]}")
    inventory = read_inventory([str(EXAMPLES)])
    auth = AuthDir(tmp_path / "auth")
    objects = [*inventory.namespaces, *inventory.slices]
    init_auth(auth, installation_from(objects, prefix=names.prefix, users=[f"{NAMESPACE}/alice"]))
    server = EmbeddedNats(tmp_path, config=auth.accounts)
    server.start()
    try:
        yield Broker(server, auth, names)
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def stack_on(broker: Broker, settings: Settings) -> AsyncIterator[Stack]:
    inventory = read_inventory([str(EXAMPLES)])
    settings = msgspec.structs.replace(settings, nats_url=broker.server.url)
    async with Stack.running(
        settings, broker.names, nodes=inventory.nodes, auth=broker.auth
    ) as stack:
        async with ApiClient.connect(
            broker.server.url, broker.names.prefix, broker.auth.operator()
        ) as api:
            await load_inventory(api, inventory)
        yield stack


class Tries:
    """How often a tenant found the broker away."""

    def __init__(self) -> None:
        self.failed = 0
        self.changed = asyncio.Event()

    def fail(self) -> None:
        self.failed += 1
        self.changed.set()

    async def until(self, failed: int, within: float = 60.0) -> None:
        async with asyncio.timeout(within):
            while self.failed < failed:
                self.changed.clear()
                await self.changed.wait()


async def apply(broker: Broker, name: str, stop: asyncio.Event, tries: Tries | None = None) -> bool:
    """Apply claim ``name`` as alice until the API takes it (the broker may be away)."""
    credential = broker.auth.tenant(NAMESPACE, "alice")
    while not stop.is_set():
        try:
            async with ApiClient.connect(broker.server.url, broker.names.prefix, credential) as api:
                claim = claim_manifest(name, NAMESPACE, "5Gi", class_name=GPU_MEMORY)
                reply = await api.claims(NAMESPACE, "apply", claim)
            return bool(reply["ok"])
        except Exception:  # the broker is away: a tenant tries again
            if tries is not None:
                tries.fail()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
    return False


def all_ready(names: list[str]) -> object:
    def check(state: ClusterState) -> bool:
        claims = [state.claim(NAMESPACE, n) for n in names]
        return all(c is not None and c.phase == "ready" for c in claims)

    return check


async def test_new_claims_are_decided_after_the_broker_lost_its_store(
    broker: Broker, settings: Settings, records: Records
) -> None:
    async with stack_on(broker, settings) as stack:
        live = LiveState(stack.store)
        never = asyncio.Event()
        before = [f"before-{i}" for i in range(BEFORE)]
        for name in before:
            assert await apply(broker, name, never)
        await state_reaches(live, all_ready(before), 60)  # type: ignore[arg-type]

        # a load that goes on while the broker is lost: a claim every 0.2 s
        during: list[str] = []
        stop_load = asyncio.Event()
        taken = asyncio.Event()
        tries = Tries()

        async def load() -> None:
            i = 0
            while not stop_load.is_set():
                name = f"during-{i}"
                if await apply(broker, name, stop_load, tries):
                    during.append(name)
                    taken.set()
                i += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop_load.wait(), 0.2)

        loader = asyncio.create_task(load())
        lines_before = len(records.records)
        # the broker dies with its store
        pid = broker.server._process.pid if broker.server._process else None
        assert pid is not None
        broker.server._process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        broker.server._process.wait()  # type: ignore[union-attr]
        shutil.rmtree(broker.server.store)
        await records.until("connection lost", lines_before)  # the stack noticed
        await tries.until(15)  # a tenant found it away, again and again (seconds)
        broker.server.start()  # the same port, an empty store
        async with asyncio.timeout(60):
            while len(during) < 3:  # the API takes claims on the new broker
                taken.clear()
                await taken.wait()
        stop_load.set()
        await loader
        after = [f"after-{i}" for i in range(AFTER)]
        for name in after:
            assert await apply(broker, name, never)

        await state_reaches(live, all_ready([*before, *during, *after]), 120)  # type: ignore[arg-type]
        assert stack.restarts == 0, records.text()

    outage = records.records[lines_before:]
    assert not [r for r in outage if r.exc_info], records.text()
    assert len(outage) < 120, records.text()
    text = records.text()
    assert "the events stream was missing: created it" in text, text
    # each agent's pulls found its durable gone; its owner, the enforcement service, made it
    assert "durable consumer agent-node-a was missing: created it" in text, text
