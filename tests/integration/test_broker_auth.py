"""The tenant boundary on the bus: a nats-server started from `dracap auth init`'s files.

Every refusal here is the server's (a permissions violation or a refused login), not
dracap's: the test talks to nats-server directly wherever it can.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import nkeys
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from events.actors import parse_actor
from events.state import ClusterState
from services import brokerauth, durables
from services.enforcement.protocol import consumer_name
from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.credentials import (
    JS_API_PREFIX,
    Credential,
    read_credential,
    read_directory,
)
from services.runtime.bus.jetstream import connect_bus, durable_config
from services.runtime.delivery.pulling import Puller
from services.runtime.ground.settings import Settings
from services.runtime.store.livestate import LiveState
from services.stack import Stack, load_inventory, read_inventory
from tests.fixtures.blobs import blob_endpoint
from tests.fixtures.brokers import EXAMPLES, Broker, secure_broker
from tests.integration.waiting import state_reaches

USERS = ("tenant-a/alice", "tenant-b/bob")
SPARE = "node-z"  #: a node no stack of these tests runs an agent for


def _claim(namespace: str, name: str) -> bytes:
    return json.dumps(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": "gpu-memory.dracap.io",
                                "capacity": {"requests": {"memory": "1Gi"}},
                            },
                        }
                    ]
                }
            },
        }
    ).encode()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """A nats-server run with the accounts `dracap auth init` wrote for the examples."""
    with secure_broker(tmp_path_factory.mktemp("broker"), users=USERS, nodes=[SPARE]) as running:
        yield running


class Violations:
    """The permissions violations the server reported to one connection."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.arrived = asyncio.Event()

    async def error(self, exc: Exception) -> None:
        if "permissions violation" in str(exc).lower():
            self.seen.append(str(exc).lower())
            self.arrived.set()

    async def of(self, subject: str, within: float = 30.0) -> str:
        """The violation naming ``subject`` (waits for it)."""
        async with asyncio.timeout(within):
            while True:
                for text in self.seen:
                    if f'"{subject.lower()}"' in text:
                        return text
                self.arrived.clear()
                await self.arrived.wait()


@contextlib.asynccontextmanager
async def connected(broker: Broker, credential: Credential | None) -> AsyncIterator[Any]:
    violations = Violations()
    login = credential.connect_options() if credential is not None else {}
    nc = await nats.connect(broker.url, error_cb=violations.error, allow_reconnect=False, **login)
    nc.violations = violations
    try:
        yield nc
    finally:
        await nc.close()


async def stream_messages(broker: Broker) -> int:
    nc, js = await connect_bus(broker.url, credential=broker.auth.service("relay"))
    try:
        return int((await js.stream_info(broker.names.stream)).state.messages)
    finally:
        await nc.close()


# --- the stack, secure ----------------------------------------------------------------------


@pytest.fixture
async def stack(broker: Broker, settings: Settings) -> AsyncIterator[Stack]:
    inventory = read_inventory([str(EXAMPLES)])
    settings = msgspec.structs.replace(settings, nats_url=broker.url)
    async with Stack.running(
        settings, broker.names, nodes=inventory.nodes, auth=broker.auth
    ) as running:
        operator = broker.auth.operator()
        async with ApiClient.connect(broker.url, broker.names.prefix, operator) as api:
            await load_inventory(api, inventory)
        yield running


# --- tenants ------------------------------------------------------------------------------


async def test_a_tenant_cannot_publish_to_another_namespaces_api(broker: Broker) -> None:
    alice = broker.auth.tenant("tenant-a", "alice")
    async with ApiClient.connect(broker.url, broker.names.prefix, alice) as api:
        with pytest.raises(CommandError, match="does not let this user publish") as refused:
            await api.claims("tenant-b", "list")
    assert refused.value.exit_code == ExitCode.REJECTED
    async with connected(broker, alice) as nc:
        subject = broker.names.api("tenant-b", "apply")
        await nc.publish(subject, _claim("tenant-b", "stolen"))
        assert "publish" in await nc.violations.of(subject)


async def test_a_tenant_cannot_read_another_tenants_replies(broker: Broker) -> None:
    alice = broker.auth.tenant("tenant-a", "alice")
    bob = broker.auth.tenant("tenant-b", "bob")
    async with connected(broker, alice) as nc:
        for inbox in (f"{bob.inbox_prefix}.>", "_INBOX.>", f"{broker.names.prefix}.>"):
            await nc.subscribe(inbox)
            assert "subscription" in await nc.violations.of(inbox)


async def test_a_tenant_cannot_call_the_admin_api(broker: Broker) -> None:
    alice = broker.auth.tenant("tenant-a", "alice")
    async with ApiClient.connect(broker.url, broker.names.prefix, alice) as api:
        with pytest.raises(CommandError, match="does not let this user publish") as refused:
            await api.admin("devices.list")
    assert refused.value.exit_code == ExitCode.REJECTED


async def test_a_tenant_cannot_publish_onto_the_event_stream(broker: Broker) -> None:
    names = broker.names
    alice = broker.auth.tenant("tenant-a", "alice")
    async with connected(broker, alice) as nc:
        forged = names.subject_of("reservation.allocation_bound", "node-a")
        await nc.publish(forged, b"{}")
        assert "publish" in await nc.violations.of(forged)
        api = f"$JS.API.STREAM.INFO.{names.stream}"
        await nc.publish(api, b"")
        assert "publish" in await nc.violations.of(api)


# --- agents -------------------------------------------------------------------------------


async def test_a_node_agent_cannot_act_for_another_node(broker: Broker) -> None:
    names = broker.names
    agent = broker.auth.agent("node-a")
    async with connected(broker, agent) as nc:
        report = names.subject_of("enforcement.limit_applied", "node-b")
        await nc.publish(report, b"{}")
        assert "publish" in await nc.violations.of(report)
        other = names.node_request("node-b", "report")  # node-b's requests: not node-a's
        await nc.publish(other, b"{}")
        assert "publish" in await nc.violations.of(other)
        for prefix in ("$JS.API", JS_API_PREFIX):  # the server's own, and its account's
            js = nc.jetstream(prefix=prefix, timeout=2)
            for name, wanted in (
                (consumer_name("node-b"), names.node_filter("node-b")),
                (consumer_name("node-a"), names.node_filter("node-a")),  # not even its own
            ):
                config = ConsumerConfig(
                    name=name,
                    durable_name=name,
                    ack_policy=AckPolicy.EXPLICIT,
                    filter_subject=wanted,
                )
                with pytest.raises(nats.errors.TimeoutError):
                    await js.add_consumer(names.stream, config)
                create = f"{prefix}.CONSUMER.CREATE.{names.stream}.{name}.{wanted}"
                assert "publish" in await nc.violations.of(create)
            pull = f"{prefix}.CONSUMER.MSG.NEXT.{names.stream}.{consumer_name('node-b')}"
            await nc.publish(pull, b"{}", reply=f"{agent.inbox_prefix}.x")
            assert "publish" in await nc.violations.of(pull)


async def test_a_node_agent_pulls_the_consumer_the_enforcement_service_made(
    broker: Broker,
) -> None:
    names = broker.names
    relay, relay_js = await connect_bus(broker.url, credential=broker.auth.service("relay"))
    try:
        from services.runtime.bus.jetstream import ensure_stream

        await ensure_stream(relay_js, names)
        service, service_js = await connect_bus(
            broker.url, credential=broker.auth.service("enforcement")
        )
        try:
            info = await service_js.add_consumer(
                names.stream, durable_config(durables.agent(names, SPARE))
            )
            assert info.config.filter_subject == names.node_filter(SPARE)
        finally:
            await service.close()
        subject = names.subject_of("reclamation.node_fenced", SPARE)
        await relay_js.publish(subject, b"{}")  # the relay publishes; the agent is offered it
    finally:
        await relay.close()
    agent = broker.auth.agent(SPARE)
    nc, _ = await connect_bus(broker.url, credential=agent)
    try:  # across the accounts: its pull's reply is rewritten by the server, then comes back
        puller = Puller(
            nc,
            names.stream,
            consumer_name(SPARE),
            batch=8,
            expires=1.0,
            prefix=agent.js_api_prefix,
        )
        await puller.start()
        got = await puller.next(10.0, 8)
        assert [m.subject for m in got] == [subject]
        await got[0].ack()
        await puller.stop()
    finally:
        await nc.close()


# --- no login, forged events --------------------------------------------------------------


async def refused_login(url: str) -> str:
    """Connect without credentials; the error the server answers with."""
    nc = nats.NATS()

    async def quiet(_: Exception) -> None:
        pass

    try:
        await nc.connect(url, allow_reconnect=False, max_reconnect_attempts=1, error_cb=quiet)
    except (nats.errors.Error, nats.errors.NoServersError) as exc:
        return str(exc).lower() or type(exc).__name__.lower()
    finally:
        await nc.close()
    raise AssertionError("the server accepted a client without credentials")


async def test_an_unauthenticated_client_is_refused(broker: Broker) -> None:
    refused = await refused_login(broker.url)
    assert "authoriz" in refused or "authentic" in refused


async def test_a_forged_event_never_reaches_a_consumer(broker: Broker, stack: Stack) -> None:
    names = broker.names
    subject = names.subject_of("reservation.allocation_bound", "node-a")
    forged = b'{"type": "reservation.allocation_bound", "node": "node-a"}'
    alice = broker.auth.tenant("tenant-a", "alice")
    async with connected(broker, alice) as nc:
        await nc.publish(subject, forged)
        await nc.violations.of(subject)
    agent_b = broker.auth.agent("node-b")
    async with connected(broker, agent_b) as nc:
        await nc.publish(subject, forged)
        await nc.violations.of(subject)
    await refused_login(broker.url)
    # no claim was applied, so no binding exists: the stream holds none on that subject,
    # and node-a's agent was offered nothing
    info = await stack.js.stream_info(names.stream, subjects_filter=subject)
    assert not info.state.subjects  # no message on that subject at all
    _, service_js = stack.bus("enforcement")  # the agents' consumers are the service's
    offered = await service_js.consumer_info(names.stream, consumer_name("node-a"))
    assert offered.num_pending == 0 and offered.delivered.consumer_seq == 0


# --- actors -------------------------------------------------------------------------------


async def test_every_event_names_its_authenticated_actor(broker: Broker, stack: Stack) -> None:
    names, auth = broker.names, broker.auth
    alice, bob = auth.tenant("tenant-a", "alice"), auth.tenant("tenant-b", "bob")
    async with ApiClient.connect(broker.url, names.prefix, alice) as api:
        # a header claiming to be the operator changes nothing: the server replaces it
        forged = {"Nats-Request-Info": json.dumps({"acc": "OPERATORS", "user": "x"})}
        reply = await api.nc.request(
            names.api("tenant-a", "apply"), _claim("tenant-a", "a1"), timeout=10, headers=forged
        )
        assert json.loads(reply.data)["ok"], reply.data
    async with ApiClient.connect(broker.url, names.prefix, bob) as api:
        await api.claims("tenant-b", "apply", json.loads(_claim("tenant-b", "b1")))
    live = LiveState(stack.store)

    def ready(state: ClusterState) -> bool:
        claims = [state.claim("tenant-a", "a1"), state.claim("tenant-b", "b1")]
        return all(c is not None and c.phase == "ready" for c in claims)

    await state_reaches(live, ready, 30)
    async with ApiClient.connect(broker.url, names.prefix, alice) as api:
        await api.claims("tenant-a", "delete", {"name": "a1"})

    def released(state: ClusterState) -> bool:
        claim = state.claim("tenant-a", "a1")
        return claim is not None and claim.phase == "released"

    await state_reaches(live, released, 30)

    async with stack.store.pool.acquire() as connection:
        rows = await connection.fetch("SELECT type, stream, actor FROM events ORDER BY position")
    actors = {(row["type"], row["stream"]): parse_actor(row["actor"]) for row in rows}
    assert all(actor.kind != "anonymous" for actor in actors.values())
    by_type: dict[str, set[str]] = {}
    for (tag, _), actor in actors.items():
        by_type.setdefault(tag, set()).add(str(actor))
    stream_a = "claim:tenant-a/a1"
    stream_b = "claim:tenant-b/b1"
    assert str(actors[("claims.submitted", stream_a)]) == "tenant:alice@tenant-a"
    assert str(actors[("claims.submitted", stream_b)]) == "tenant:bob@tenant-b"
    assert str(actors[("reclamation.release_requested", stream_a)]) == "tenant:alice@tenant-a"
    assert by_type["inventory.device_class_applied"] == {"operator:operator"}
    assert by_type["admin.namespace_access_set"] == {"operator:operator"}
    assert by_type["reservation.allocation_bound"] == {"system:reservation-0"}
    assert by_type["enforcement.limit_applied"] == {"agent:node-a#1"}  # under its lease
    assert by_type["reclamation.node_lease_acquired"] == {"agent:node-a#1", "agent:node-b#1"}

    # no generated secret reached the log of events or the server's log
    seeds = [read_credential(path).seed for path in (auth.path / "creds").glob("*.nk")]
    async with stack.store.pool.acquire() as connection:
        logged = " ".join(await connection.fetchval("SELECT array_agg(payload::text) FROM events"))
    server_log = (auth.path.parent / "nats.log").read_text()
    assert seeds and not [seed for seed in seeds if seed in logged or seed in server_log]


async def test_a_tenant_sees_devices_through_its_own_namespace_only(
    broker: Broker, stack: Stack
) -> None:
    alice = broker.auth.tenant("tenant-a", "alice")
    async with ApiClient.connect(broker.url, broker.names.prefix, alice) as api:
        devices = (await api.claims("tenant-a", "devices"))["devices"]
        assert devices  # the classes tenant-a may use have devices
        with pytest.raises(CommandError, match="does not let this user publish"):
            await api.claims("tenant-b", "devices")


async def test_nats_py_logs_in_with_the_seed_file_through_its_own_option(
    broker: Broker, stack: Stack
) -> None:
    """The file `dracap auth init` writes is a standard NKey seed file: nats-py's own
    ``nkeys_seed=FILE`` logs in with it, and the user's inbox follows from its key —
    no dracap code between the file and the server."""
    seed_file = broker.auth.path / "creds" / "tenant-tenant-a-alice.nk"
    key = nkeys.from_seed(bytearray(seed_file.read_bytes().strip())).public_key.decode()
    directory = json.loads(broker.auth.directory.read_text())["principals"]
    assert {"name": "alice", "kind": "tenant", "namespace": "tenant-a", "public_key": key} in [
        {k: p.get(k) for k in ("name", "kind", "namespace", "public_key")} for p in directory
    ]
    nc = await nats.connect(
        broker.url, nkeys_seed=str(seed_file), inbox_prefix=f"_INBOX_{key}", allow_reconnect=False
    )
    try:
        reply = await nc.request(broker.names.api("tenant-a", "devices"), b"{}", timeout=10)
        assert json.loads(reply.data)["ok"] is True
    finally:
        await nc.close()


def test_a_credential_file_of_an_earlier_version_is_one_line_saying_what_to_do(
    broker: Broker, tmp_path: Path
) -> None:
    old = tmp_path / "tenant-tenant-a-alice.creds"
    seed = broker.auth.tenant("tenant-a", "alice").seed
    old.write_text(json.dumps({"principal": {"name": "alice"}, "seed": seed}))
    argv = ["claim", "list", "-n", "tenant-a", "--creds", str(old)]
    argv += ["--nats", broker.url, "--prefix", broker.names.prefix, "--data-dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *argv], capture_output=True, text=True, check=False
    )
    assert done.returncode == ExitCode.BAD_INPUT, done
    assert done.stderr.count("\n") == 1 and "dracap auth init" in done.stderr, done.stderr


async def test_a_tenant_reads_audit_and_usage_of_its_own_namespace_only(
    broker: Broker, stack: Stack
) -> None:
    alice = broker.auth.tenant("tenant-a", "alice")
    bob = broker.auth.tenant("tenant-b", "bob")
    async with (
        ApiClient.connect(broker.url, broker.names.prefix, alice) as a,
        ApiClient.connect(broker.url, broker.names.prefix, bob) as b,
    ):
        await b.claims("tenant-b", "apply", _claim("tenant-b", "audited-b"))
        await a.claims("tenant-a", "apply", _claim("tenant-a", "audited-a"))
        # each projector applies the log in order: once the audit has alice's reservation
        # it has bob's submission (recorded before) too; billing follows on its own
        async with asyncio.timeout(60):
            while True:
                records = (await a.claims("tenant-a", "audit", {"claim": "audited-a"}))["records"]
                usage = (await a.claims("tenant-a", "usage", {}))["usage"]
                if usage and any(r["decision"] == "capacity_reserved" for r in records):
                    break
                await asyncio.sleep(0.05)
        for op, rows in (("audit", "records"), ("usage", "usage")):
            mine = (await a.claims("tenant-a", op, {}))[rows]
            assert mine and {r["namespace"] for r in mine} == {"tenant-a"}, op
            with pytest.raises(CommandError, match="does not let this user publish"):
                await a.claims("tenant-b", op, {})
            with pytest.raises(CommandError, match="does not let this user publish"):
                await a.admin(f"{op}.list", {})
    async with ApiClient.connect(broker.url, broker.names.prefix, broker.auth.operator()) as op:
        everyone = (await op.admin("audit.list", {}))["records"]
        assert {"tenant-a", "tenant-b"} <= {r["namespace"] for r in everyone}


# --- replies in parts ---------------------------------------------------------------------


async def test_a_reply_larger_than_one_message_passes_the_broker_in_parts(
    broker: Broker,
) -> None:
    """The ledger user may send a reply in parts (``allow_responses: {max: 64}``); with a
    single allowed response only the first part would get through."""
    size = 3 * 1024 * 1024  # three times the server's default max_payload
    nc, _ = await connect_bus(broker.url, credential=broker.auth.service("ledger"))
    directory = read_directory(broker.auth.directory)
    try:
        async with blob_endpoint(
            nc, broker.names, service="audit", directory=directory, authenticated=True
        ):
            operator = broker.auth.operator()
            async with ApiClient.connect(broker.url, broker.names.prefix, operator) as api:
                assert size > api.nc.max_payload
                assert len((await api.admin("audit.list", {"size": size}))["blob"]) == size
            alice = broker.auth.tenant("tenant-a", "alice")
            async with ApiClient.connect(broker.url, broker.names.prefix, alice) as api:
                assert len((await api.claims("tenant-a", "audit", {"size": size}))["blob"]) == size
    finally:
        await nc.close()


# --- the reply window ---------------------------------------------------------------------

#: the test's own reply window (the installation's is ``REPLY_WINDOW_S``, 30 s)
WINDOW_S = 3


async def test_a_reply_is_let_through_within_the_window_and_refused_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker keeps a service's right to reply for ``REPLY_WINDOW_S`` only
    (``allow_responses.expires``): without it, it kept a record of every request the
    service ever received (docs/security.md). A broker of its own, its window shortened
    to three seconds through the same configuration: the prompt reply has all of it, the
    late one comes a second and a half after it ended, on the broker's clock."""
    monkeypatch.setattr(brokerauth, "REPLY_WINDOW_S", WINDOW_S)
    with secure_broker(tmp_path, users=USERS) as broker:
        subject = broker.names.api("tenant-a", "window")
        alice = broker.auth.tenant("tenant-a", "alice")
        async with (
            connected(broker, broker.auth.service("claims")) as service,
            connected(broker, alice) as tenant,
        ):
            requests: asyncio.Queue[Any] = asyncio.Queue()
            await service.subscribe(subject, cb=requests.put)
            await service.flush()
            in_time = asyncio.ensure_future(tenant.request(subject, b"1", timeout=30))
            request = await requests.get()
            await request.respond(b"in time")
            assert (await in_time).data == b"in time"

            too_late = asyncio.ensure_future(tenant.request(subject, b"2", timeout=30))
            request = await requests.get()
            await asyncio.sleep(WINDOW_S + 1.5)  # the window is the broker's to end
            await request.respond(b"too late")
            refused = await service.violations.of(request.reply)  # the broker's refusal
            assert "publish" in refused, refused
            assert not too_late.done()
            too_late.cancel()
