"""The permissions matrix: every credential against every JetStream operation and subject.

A nats-server runs with the accounts `dracap auth init` writes. For every kind of
credential a deployment hands out, the test tries every JetStream API operation — under
its own name (`$JS.API.…`) and under the local prefix the accounts import it as
(`JS.API.…`) — on the events stream, another stream and every durable consumer,
acknowledges on every consumer, and publishes and subscribes on every subject class.
nats-server must allow exactly what the table in docs/security.md says, nothing more:
the test reads that table, so the two cannot drift.

What counts as *reaching* an operation: JetStream answered the request (whatever it
answered). A permissions violation, "JetStream not enabled for account" (the server's
answer to `$JS.API.…` in an account without JetStream) and "no responders" (nobody
imports that subject) are refusals. A publish or subscription is allowed when the
server reports no violation for it: the server handles a connection's commands in
order and reports violations in that order, so once the violation of a sentinel (a
subject nobody may use, sent last) has arrived, every earlier one has. No test here
waits for a time to pass.

Then pull requests (and acknowledgements, and the relay's publishes) whose reply
subject names every other JetStream operation, another consumer, another node's
requests or the event subjects must change nothing: the stream holds what it held,
every consumer is there with what it had delivered, and no request appears to come
from another node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from events.subjects import BusNames
from services import durables
from services.brokerauth import Installation, init_auth
from services.runtime.bus.credentials import (
    JS_API_PREFIX,
    AuthDir,
    Credential,
    principal_of,
    read_directory,
)
from services.runtime.bus.flushing import flushed
from services.runtime.bus.jetstream import (
    Durable,
    connect_bus,
    durable_config,
    ensure_stream,
    stream_config,
)
from services.runtime.ops.embedded import EmbeddedNats

ROOT = Path(__file__).resolve().parents[2]
SECURITY = ROOT / "docs" / "security.md"
MARKER = "<!-- matrix: read by tests/integration/test_broker_permissions.py -->"
PREFIXES = ("$JS.API", JS_API_PREFIX)
OTHER_STREAM = "OTHER_EVENTS"
NEW_CONSUMER = "probe"


# --- the specification: docs/security.md's table ---------------------------------------------


@dataclass(frozen=True)
class Row:
    """One credential's row: the (operation, target) pairs and subject classes it may use."""

    reaches: frozenset[tuple[str, str]]
    publishes: frozenset[str]
    subscribes: frozenset[str]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _reaches(cell: str, consumers: dict[str, list[str]]) -> frozenset[tuple[str, str]]:
    """``CONSUMER.INFO`` on `audit`, ...; clauses apart by ``;``; targets named as in the
    table's notes (`reservation-*`, `agent-*`, `agent-own`, `events`)."""
    pairs: set[tuple[str, str]] = set()
    for clause in cell.split(";"):
        tokens = _ticked(clause)
        operations = [t for t in tokens if re.fullmatch(r"[A-Z][A-Z.]*", t)]
        for target in (t for t in tokens if t not in operations):
            for name in consumers.get(target, [target]):
                pairs.update((op, name) for op in operations)
    return frozenset(pairs)


def read_table(consumers: dict[str, list[str]]) -> dict[str, Row]:
    """docs/security.md's matrix, by credential."""
    lines = SECURITY.read_text().split(MARKER, 1)[1].strip().splitlines()
    rows: dict[str, Row] = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        credential, reaches, publishes, subscribes = (c.strip() for c in line.strip("|").split("|"))
        rows[credential] = Row(
            _reaches(reaches, consumers),
            frozenset(_ticked(publishes)),
            frozenset(_ticked(subscribes)),
        )
    return rows


# --- the installation under test -------------------------------------------------------------


class Broker(msgspec.Struct, frozen=True):
    url: str
    auth: AuthDir
    names: BusNames
    credentials: dict[str, Credential]  #: by the table's credential names

    def consumers(self) -> dict[str, list[str]]:
        """The table's consumer names, as the durables of this installation."""
        return {
            "reservation-*": [d.name for d in durables.reservation(self.names)],
            "agent-*": [durables.agent(self.names, n).name for n in ("node-a", "node-b")],
            "agent-own": [durables.agent(self.names, "node-a").name],
            "events": [self.names.stream],
        }

    def all_consumers(self) -> list[str]:
        names = [d.name for d in durables.relay_owned(self.names)]
        return [*names, *self.consumers()["agent-*"]]


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    data_dir = tmp_path_factory.mktemp("matrix")
    names = BusNames(prefix=f"m{uuid.uuid4().hex[:10]}")
    auth = AuthDir(data_dir / "auth")
    installation = Installation(
        prefix=names.prefix,
        namespaces={"tenant-a": ["alice"], "tenant-b": ["bob"]},
        nodes=["node-a", "node-b"],
    )
    init_auth(auth, installation)
    credentials = {
        **{name: auth.service(name) for name in ("relay", "claims", "reservation", "ledger")},
        "enforcement": auth.service("enforcement"),
        "agent": auth.agent("node-a"),
        "operator": auth.operator(),
        "tenant": auth.tenant("tenant-a", "alice"),
    }
    server = EmbeddedNats(data_dir, config=auth.accounts)
    url = server.start()
    try:
        asyncio.run(_set_up(url, auth, names))
        yield Broker(url, auth, names, credentials)
    finally:
        server.stop()


async def _set_up(url: str, auth: AuthDir, names: BusNames) -> None:
    """The stream and every durable, created by their owners; a few events in the stream."""
    nc, js = await connect_bus(url, credential=auth.service("relay"))
    try:
        await ensure_stream(js, names)
        for durable in durables.relay_owned(names):
            await js.add_consumer(names.stream, durable_config(durable))
        for node in ("node-a", "node-b", None):
            for tag in ("reservation.allocation_bound", "reclamation.release_requested"):
                await js.publish(names.subject_of(tag, node), b"{}", stream=names.stream)
    finally:
        await nc.close()
    nc, js = await connect_bus(url, credential=auth.service("enforcement"))
    try:
        for node in ("node-a", "node-b"):
            await js.add_consumer(names.stream, durable_config(durables.agent(names, node)))
    finally:
        await nc.close()


@dataclass
class Session:
    """One credential's connection: the violations and answers the server sends it."""

    nc: Client
    violations: set[str] = field(default_factory=set)
    answers: dict[str, Msg] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def error(self, exc: Exception) -> None:
        text = str(exc).lower()
        if "permissions violation" in text:
            self.violations.update(m.lower() for m in re.findall(r'"([^"]+)"', text))
            self.changed.set()

    def refused(self, subject: str) -> bool:
        return subject.lower() in self.violations

    async def settled(self, *, subscribing: bool = False, within: float = 30.0) -> None:
        """Until every violation of what was sent so far has arrived (module docstring)."""
        sentinel = f"matrix-sentinel.{uuid.uuid4().hex}"
        if subscribing:
            await self.nc.subscribe(sentinel)
        else:
            await self.nc.publish(sentinel, b"")
        await flushed(self.nc)
        async with asyncio.timeout(within):
            while not self.refused(sentinel):
                self.changed.clear()
                await self.changed.wait()

    async def answer_to(self, inbox: str) -> None:
        """Keep the first answer arriving on ``inbox`` (a pulled message keeps its own
        subject, so each request gets a subscription of its own)."""

        async def keep(msg: Msg) -> None:
            self.answers.setdefault(inbox, msg)
            self.changed.set()

        await self.nc.subscribe(inbox, cb=keep)

    async def answers_for(self, inboxes: list[str], within: float = 30.0) -> None:
        """Wait until each of ``inboxes`` has an answer."""
        try:
            async with asyncio.timeout(within):
                while not all(i in self.answers for i in inboxes):
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            missing = [i for i in inboxes if i not in self.answers]
            raise AssertionError(f"no answer to {missing}") from None


@contextlib.asynccontextmanager
async def session(broker: Broker, credential: Credential) -> AsyncIterator[Session]:
    box = Session(nc=nats.NATS())
    await box.nc.connect(
        broker.url, error_cb=box.error, allow_reconnect=False, **credential.connect_options()
    )
    try:
        yield box
    finally:
        await box.nc.close()


# --- every JetStream operation ---------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    operation: str  #: as the table names it
    target: str  #: a stream or consumer name
    subject: str
    body: bytes = b""


STREAM_OPERATIONS = (
    "STREAM.INFO",
    "STREAM.CREATE",
    "STREAM.UPDATE",
    "STREAM.DELETE",
    "STREAM.PURGE",
    "STREAM.MSG.GET",
    "STREAM.MSG.DELETE",
    "STREAM.SNAPSHOT",
    "STREAM.RESTORE",
    "STREAM.LEADER.STEPDOWN",
    "STREAM.PEER.REMOVE",
    "STREAM.PEER.EVACUATE",
    "STREAM.CANCEL_MOVE",
    "DIRECT.GET",
    "CONSUMER.NAMES",
    "CONSUMER.LIST",
    "ACCOUNT.STREAM.MOVE",
    "ACCOUNT.STREAM.CANCEL_MOVE",
)
CONSUMER_OPERATIONS = (
    "CONSUMER.CREATE",
    "CONSUMER.DURABLE.CREATE",
    "CONSUMER.INFO",
    "CONSUMER.DELETE",
    "CONSUMER.MSG.NEXT",
    "CONSUMER.PAUSE",
    "CONSUMER.UNPIN",
    "CONSUMER.RESET",
    "CONSUMER.LEADER.STEPDOWN",
    "CONSUMER.PEER.REMOVE",
    "CONSUMER.PEER.EVACUATE",
)
ACCOUNT_OPERATIONS = (
    "INFO",
    "STREAM.NAMES",
    "STREAM.LIST",
    "ACCOUNT.PURGE.JETSTREAM",
    "META.LEADER.STEPDOWN",
    "SERVER.REMOVE",
)


def _stream_body(names: BusNames, operation: str, stream: str) -> bytes:
    if operation in ("STREAM.CREATE", "STREAM.UPDATE"):
        config = stream_config(names)
        if stream != names.stream:
            config = config.evolve(name=stream, subjects=[f"{names.prefix}.other.>"])
        return json.dumps(config.as_dict()).encode()
    if operation in ("STREAM.MSG.GET", "STREAM.MSG.DELETE", "DIRECT.GET"):
        return b'{"seq": 1}'
    return b"{}"


def probes(broker: Broker) -> list[Probe]:
    """Every JetStream operation on every stream and consumer, and on the account."""
    names = broker.names
    filters = {d.name: d for d in durables.relay_owned(names)}
    for node in ("node-a", "node-b"):
        agent = durables.agent(names, node)
        filters[agent.name] = agent
    out: list[Probe] = []
    for prefix in PREFIXES:
        for stream in (names.stream, OTHER_STREAM):
            for operation in STREAM_OPERATIONS:
                subject = f"{prefix}.{operation}.{stream}"
                out.append(
                    Probe(operation, stream, subject, _stream_body(names, operation, stream))
                )
        for operation in ACCOUNT_OPERATIONS:
            out.append(Probe(operation, "account", f"{prefix}.{operation}", b"{}"))
        for consumer in [*broker.all_consumers(), NEW_CONSUMER]:
            durable = filters.get(consumer) or Durable(consumer, names.events_subjects)
            config = json.dumps(
                {"stream_name": names.stream, "config": durable_config(durable).as_dict()}
            ).encode()
            base = f"{prefix}.%s.{names.stream}.{consumer}"
            for operation in CONSUMER_OPERATIONS:
                body = config if "CREATE" in operation else b"{}"
                if operation == "CONSUMER.MSG.NEXT":
                    body = b'{"batch": 1, "no_wait": true}'
                out.append(Probe(operation, consumer, base % operation, body))
            create = f"{base % 'CONSUMER.CREATE'}.{durable.filter_subject}"
            out.append(Probe("CONSUMER.CREATE", consumer, create, config))
    return out


def ack_probes(broker: Broker) -> list[Probe]:
    stream = broker.names.stream
    return [
        Probe("ACK", consumer, f"$JS.ACK.{stream}.{consumer}.1.1.1.1.0")
        for consumer in [*broker.all_consumers(), NEW_CONSUMER]
    ]


def _refused_answer(msg: Msg) -> bool:
    """An answer that says the operation was not reached: nobody took the request, or the
    server's own "JetStream is not enabled" of an account without JetStream."""
    if (msg.headers or {}).get("Status") == "503":
        return True
    try:
        error = json.loads(msg.data or b"{}").get("error") or {}
    except ValueError:
        return False
    return bool(error.get("err_code") == 10039)


async def reached(broker: Broker, credential: Credential) -> set[tuple[str, str]]:
    """The (operation, target) pairs this credential reaches."""
    async with session(broker, credential) as box:
        inbox = f"{credential.inbox_prefix}.matrix"
        tried = probes(broker)
        for i, probe in enumerate(tried):
            await box.answer_to(f"{inbox}.{i}")
            await box.nc.publish(probe.subject, probe.body, reply=f"{inbox}.{i}")
        acks = ack_probes(broker)
        for probe in acks:
            await box.nc.publish(probe.subject, b"")
        await box.settled()
        waiting = [f"{inbox}.{i}" for i, p in enumerate(tried) if not box.refused(p.subject)]
        await box.answers_for(waiting)
        out = {
            (p.operation, p.target)
            for i, p in enumerate(tried)
            if not box.refused(p.subject) and not _refused_answer(box.answers[f"{inbox}.{i}"])
        }
        out |= {(p.operation, p.target) for p in acks if not box.refused(p.subject)}
        return out


KINDS = ("relay", "claims", "reservation", "ledger", "enforcement", "agent", "operator", "tenant")


def test_the_table_names_every_credential_a_deployment_creates(broker: Broker) -> None:
    assert set(read_table(broker.consumers())) == set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
async def test_each_credential_reaches_exactly_the_jetstream_operations_of_the_table(
    broker: Broker, kind: str
) -> None:
    expected = read_table(broker.consumers())[kind].reaches
    assert await reached(broker, broker.credentials[kind]) == expected


# --- every subject class ---------------------------------------------------------------------


def subject_classes(broker: Broker, credential: Credential) -> dict[str, frozenset[str]]:
    """Probe subjects, each with the table's subject classes it belongs to ({}: none)."""
    p = broker.names.prefix
    own = credential.inbox_prefix
    claims, relay = (
        broker.credentials["claims"].inbox_prefix,
        broker.credentials["relay"].inbox_prefix,
    )
    other = claims if own != claims else relay  # another user's inbox (named by its key)
    return {
        f"{p}.ev.claims._.claims.submitted": frozenset({"events"}),
        f"{p}.ev.reservation.node-a.reservation.allocation_bound": frozenset({"events"}),
        f"{p}.api.tenant-a.claims.list": frozenset({"api", "api own"}),
        f"{p}.api.tenant-b.claims.list": frozenset({"api"}),
        f"{p}.api.tenant-a.claims.audit": frozenset({"api", "api own", "ledger queries"}),
        f"{p}.api.tenant-b.claims.usage": frozenset({"api", "ledger queries"}),
        f"{p}.admin.devices.list": frozenset({"admin"}),
        f"{p}.admin.audit.list": frozenset({"admin", "ledger queries"}),
        f"{p}.watch.tenant-a.claims": frozenset({"watch", "watch own"}),
        f"{p}.watch.tenant-b.claims": frozenset({"watch"}),
        f"{p}.node.node-a.heartbeat": frozenset({"node", "node own"}),
        f"{p}.node.node-b.heartbeat": frozenset({"node"}),
        "$SRV.PING": frozenset({"$SRV"}),
        "$SYS.REQ.SERVER.PING": frozenset({"$SYS"}),
        f"{own}.x": frozenset({"own inbox"}),
        f"{other}.x": frozenset({"other inboxes"}),
        "_INBOX.x": frozenset({"other inboxes"}),
        f"{p}.>": frozenset(),
        ">": frozenset(),
    }


@pytest.mark.parametrize("kind", KINDS)
async def test_each_credential_publishes_and_subscribes_exactly_as_the_table_says(
    broker: Broker, kind: str
) -> None:
    row = read_table(broker.consumers())[kind]
    credential = broker.credentials[kind]
    classes = subject_classes(broker, credential)
    async with session(broker, credential) as box:
        for subject in classes:
            if "*" not in subject and ">" not in subject:
                await box.nc.publish(subject, b"")
        await box.settled()
        published = {s for s in classes if "*" not in s and ">" not in s and not box.refused(s)}
        box.violations.clear()
        for subject in classes:
            await box.nc.subscribe(subject)
        await box.settled(subscribing=True)
        subscribed = {s for s in classes if not box.refused(s)}
    assert published == {s for s, c in classes.items() if c & row.publishes and ">" not in s}
    assert subscribed == {s for s, c in classes.items() if c & row.subscribes}


# --- reply redirection -------------------------------------------------------------------------


class Snapshot(msgspec.Struct, frozen=True):
    messages: int
    deny: tuple[bool, bool]
    consumers: dict[str, tuple[int, int]]  #: delivered stream sequence, acks pending


async def snapshot(broker: Broker) -> Snapshot:
    """The stream and every consumer, as their owners read them."""
    names = broker.names
    nc, js = await connect_bus(broker.url, credential=broker.credentials["relay"])
    enc, ejs = await connect_bus(broker.url, credential=broker.credentials["enforcement"])
    try:
        info = await js.stream_info(names.stream)
        consumers: dict[str, tuple[int, int]] = {}
        for name in broker.all_consumers():
            reader = ejs if name.startswith("agent-") else js
            c = await reader.consumer_info(names.stream, name)
            consumers[name] = (c.delivered.stream_seq, c.num_ack_pending)
        deny = (bool(info.config.deny_purge), bool(info.config.deny_delete))
        return Snapshot(info.state.messages, deny, consumers)
    finally:
        await nc.close()
        await enc.close()


def redirect_targets(broker: Broker, *, events: bool = True) -> list[str]:
    """Reply subjects a hostile holder of a credential would name (``events``: the event
    subjects too)."""
    p = broker.names.prefix
    targets = [probe.subject for probe in probes(broker)]
    targets += [
        f"{p}.node.node-a.report",
        f"{p}.node.node-b.report",
        f"{p}.api.tenant-a.claims.delete",
        f"{p}.admin.devices.list",
        f"{p}.watch.tenant-a.claims",
        "$SYS.REQ.SERVER.PING",
    ]
    if events:
        targets.append(f"{p}.ev.reservation.node-b.reservation.allocation_bound")
    return targets


PULLERS = {"reservation": "reservation-admissions", "agent": "agent-node-a"}


@pytest.mark.parametrize("kind", sorted(PULLERS))
async def test_a_pull_request_with_any_reply_subject_changes_nothing_else(
    broker: Broker, kind: str
) -> None:
    names, own = broker.names, PULLERS[kind]
    credential = broker.credentials[kind]
    next_subject = f"{JS_API_PREFIX}.CONSUMER.MSG.NEXT.{names.stream}.{own}"
    heard = await _listening_on_node_subjects(broker)
    before = await snapshot(broker)
    async with session(broker, credential) as box:
        for target in redirect_targets(broker):
            await box.nc.publish(next_subject, b'{"batch": 1, "no_wait": true}', reply=target)
            await box.nc.publish(next_subject, b'{"batch": 2, "expires": 50000000}', reply=target)
        inbox = f"{credential.inbox_prefix}.last"
        sentinel = await box.nc.subscribe(inbox)
        await box.nc.publish(next_subject, b'{"batch": 1, "expires": 50000000}', reply=inbox)
        await sentinel.next_msg(timeout=30)  # served after every request before it
        await box.settled()
        assert not box.refused(next_subject)
    after = await snapshot(broker)
    assert (after.messages, after.deny) == (before.messages, before.deny)
    assert after.deny == (True, True)
    others = {name for name in before.consumers if name != own}
    assert {n: after.consumers[n] for n in others} == {n: before.consumers[n] for n in others}
    await _no_request_from_another_node(broker, heard)


@pytest.mark.parametrize("kind", ["relay", "enforcement"])
async def test_a_request_of_a_stream_or_consumer_owner_with_any_reply_changes_nothing_else(
    broker: Broker, kind: str
) -> None:
    """The owners' reads, answered onto every other operation (onto the event subjects
    too for the enforcement service; the relay may publish events anyway)."""
    names = broker.names
    credential = broker.credentials[kind]
    if kind == "relay":
        asked = (f"{JS_API_PREFIX}.STREAM.INFO.{names.stream}", b"")
    else:
        agent = durables.agent(names, "node-a").name
        asked = (f"{JS_API_PREFIX}.CONSUMER.INFO.{names.stream}.{agent}", b"")
    before = await snapshot(broker)
    async with session(broker, credential) as box:
        for target in redirect_targets(broker, events=kind != "relay"):
            await box.nc.publish(*asked, reply=target)
        inbox = f"{credential.inbox_prefix}.last"
        sentinel = await box.nc.subscribe(inbox)
        await box.nc.publish(*asked, reply=inbox)
        await sentinel.next_msg(timeout=30)
        await box.settled()
        assert not box.refused(asked[0])
    after = await snapshot(broker)
    assert after == before


# --- who a request comes from -----------------------------------------------------------------


@dataclass
class Heard:
    nc: Client
    requests: list[Msg] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


async def _listening_on_node_subjects(broker: Broker) -> Heard:
    nc = await nats.connect(
        broker.url, allow_reconnect=False, **broker.credentials["enforcement"].connect_options()
    )
    heard = Heard(nc)

    async def keep(msg: Msg) -> None:
        heard.requests.append(msg)
        heard.arrived.set()

    await nc.subscribe(f"{broker.names.prefix}.node.*.>", cb=keep)
    await flushed(nc)
    return heard


async def _no_request_from_another_node(broker: Broker, heard: Heard) -> None:
    """Whatever reached the enforcement service's subjects names no node agent but the
    one whose subject it is, and none of another node's subject names node-a."""
    try:
        await heard.nc.flush()
        directory = read_directory(broker.auth.directory).index()
        for msg in heard.requests:
            sender = principal_of(msg.headers, directory)
            node = msg.subject.split(".")[2]
            assert sender is None or (sender.kind == "agent" and sender.node == node), (
                msg.subject,
                msg.headers,
            )
    finally:
        await heard.nc.close()


async def test_a_node_agent_is_known_by_its_key_on_its_own_subjects_only(broker: Broker) -> None:
    heard = await _listening_on_node_subjects(broker)
    p = broker.names.prefix
    async with session(broker, broker.credentials["agent"]) as box:
        await box.nc.publish(f"{p}.node.node-a.heartbeat", b"{}", headers={"x": "1"})
        await box.nc.publish(f"{p}.node.node-b.heartbeat", b"{}")
        await box.settled()
        assert box.refused(f"{p}.node.node-b.heartbeat")
    async with asyncio.timeout(30):
        await heard.arrived.wait()
    [request] = heard.requests
    directory = read_directory(broker.auth.directory).index()
    sender = principal_of(request.headers, directory)
    assert sender is not None and sender.kind == "agent" and sender.node == "node-a"
    await heard.nc.close()
