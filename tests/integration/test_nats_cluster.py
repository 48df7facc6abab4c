"""A clustered NATS loses a server under load: nothing acknowledged is lost (issue 29,
item 2).

Three nats-servers with JetStream (:func:`tests.fixtures.replicas.nats_cluster`), the
in-process stack given all three (a comma-separated list) and the events stream with
three replicas (``stream_replicas``; its durables take the stream's). A burst of claims
is applied; in its middle the server that leads the events stream is killed (SIGKILL),
or hangs (SIGSTOP: its connections stay open, only pings tell). Then:

* every claim is acknowledged (a request lost with its server is asked again, as any
  client does: applying a claim twice changes nothing);
* every acknowledged claim is decided: reserved and made ready, which needs the relay,
  the reservation consumers and the node agent to go on through the loss;
* the stream holds every event of the log exactly once, in the log's order.
"""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import msgspec
import nats
import nats.js.errors
import pytest
from nats.aio.client import Server
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import Header

from events.subjects import BusNames
from services import durables
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.endpoints import EndpointError
from services.runtime.bus.jetstream import (
    ACK_WAIT_S,
    Durable,
    connect_bus,
    durable_config,
    ensure_stream,
)
from services.runtime.delivery import pulling
from services.runtime.delivery.pulling import MAX_EXPIRES_S, Puller
from services.runtime.delivery.rebuilding import BusKeeper
from services.runtime.delivery.relaying import outgoing
from services.runtime.ground.errors import RetryableError
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import EventStore
from tests.fixtures.polling import until
from tests.fixtures.replicas import NatsCluster, NatsNode, nats_binary, nats_cluster
from tests.integration.cluster import Cluster, running_cluster
from tests.integration.test_failover import INVENTORY, _claim, _tracebacks
from tests.integration.test_policy import NAMESPACE, view_when

_T = TypeVar("_T")

BURST = 40
CONCURRENCY = 8
KILL_AFTER = 10

pytestmark = pytest.mark.skipif(nats_binary() is None, reason="no nats-server binary")


@pytest.fixture
def nats3() -> Iterator[NatsCluster]:
    with nats_cluster(3) as started:
        yield started


@pytest.fixture
async def cluster(settings: Settings, nats3: NatsCluster, tmp_path: Path) -> AsyncIterator[Cluster]:
    replicated = msgspec.structs.replace(settings, stream_replicas=3, nats_ping_interval_s=1.0)
    async with running_cluster(replicated, nats3.url, tmp_path, INVENTORY) as running:
        yield running
    gc.collect()  # what nats-py leaked (see _NATS_PY_LEAK) is collected in this test


async def _apply(api: ApiClient, name: str) -> None:
    """Apply until acknowledged: a request lost with its server is asked again."""
    deadline = time.monotonic() + 45
    while True:
        try:
            await api.claims(NAMESPACE, "apply", _claim(name))
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def _ready(api: ApiClient, name: str, deadline: float) -> None:
    """Until the claim is ready (by ``deadline``, monotonic); a watch lost with its
    server is started again."""
    while True:
        try:
            within = max(1.0, deadline - time.monotonic())
            await view_when(api, name, lambda v: bool(v.get("ready")), within=within)
            return
        except EndpointError:  # no reply: the request went to the lost server
            if time.monotonic() > deadline:
                raise


async def _burst(api: ApiClient, names: list[str], acked: list[str]) -> None:
    slots = asyncio.Semaphore(CONCURRENCY)

    async def one(name: str) -> None:
        async with slots:
            await _apply(api, name)
            acked.append(name)

    await asyncio.gather(*(one(name) for name in names))


async def _stream_ids(cluster: Cluster, url: str) -> list[str]:
    """The ``Nats-Msg-Id`` of every message of the events stream, in stream order."""
    nc, js = await connect_bus(url)
    try:
        stream = cluster.stack.names.stream
        info = await js.stream_info(stream)
        ids = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            message = await js.get_msg(stream, seq)
            ids.append((message.headers or {}).get(Header.MSG_ID.value, ""))
        return ids
    finally:
        await nc.close()


async def _consumers(cluster: Cluster, faulted: float) -> str:
    """Each durable of the events stream: delivered, pending, waiting for an ack, and
    the time since the fault; for a failure's message."""
    lines = [f"{time.monotonic() - faulted:.1f} s after the fault:"]
    try:
        for info in await cluster.stack.js.consumers_info(cluster.stack.names.stream):
            lines.append(
                f"  {info.name}: delivered {info.delivered.stream_seq if info.delivered else '?'}"
                f", pending {info.num_pending}, ack pending {info.num_ack_pending}"
                f", redelivered {info.num_redelivered}, waiting {info.num_waiting}"
                f", leader {info.cluster.leader if info.cluster else '?'}"
            )
    except Exception as exc:  # the diagnosis must not hide the failure
        lines.append(f"  (consumers not read: {exc!r})")
    return "\n".join(lines)


async def _log_ids(cluster: Cluster) -> list[str]:
    """The ids of the log's events the relay publishes, in position order."""
    ids = []
    carried = durables.carried(cluster.stack.names)
    async for page in cluster.stack.store.read_rows(0):
        for row in page:
            if outgoing(cluster.stack.names, row, carried) is not None:
                ids.append(str(row["event_id"]))
    return ids


#: nats-py (2.x) leaks the socket of a reconnect attempt that reached a hung server
#: but never got its INFO: the StreamWriter is replaced without being closed, and
#: asyncio warns when it is collected. Not dracap's to close; collected at teardown.
_NATS_PY_LEAK = [
    pytest.mark.filterwarnings("ignore:unclosed <StreamWriter:ResourceWarning"),
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <function StreamWriter.__del__"
        ":pytest.PytestUnraisableExceptionWarning"
    ),
]


@pytest.mark.parametrize("fault", ["kill", pytest.param("pause", marks=_NATS_PY_LEAK)])
async def test_losing_the_stream_leader_mid_burst_loses_nothing(
    cluster: Cluster, nats3: NatsCluster, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    """``kill``: the leader's process is gone (its sockets closed at once); ``pause``: it
    hangs (SIGSTOP), its sockets open, and only the clients' pings tell it is lost."""
    with _tracebacks(caplog) as tracebacks:
        await _lose_the_leader(cluster, nats3, fault)
    assert not tracebacks, "\n".join(tracebacks)


async def _lose_the_leader(cluster: Cluster, nats3: NatsCluster, fault: str) -> None:
    api, stack = cluster.api, cluster.stack
    info = await stack.js.stream_info(stack.names.stream)
    assert info.config.num_replicas == 3
    names = [f"burst-{i:02d}-{uuid.uuid4().hex[:6]}" for i in range(BURST)]
    acked: list[str] = []
    burst = asyncio.create_task(_burst(api, names, acked))
    await until(lambda: len(acked) >= KILL_AFTER or burst.done(), 30, "the first acks")
    assert not burst.done(), "the burst ended before the server was lost"
    leader = (await stack.js.stream_info(stack.names.stream)).cluster
    assert leader is not None and leader.leader
    lost = nats3.node(leader.leader)
    await asyncio.to_thread(nats3.kill if fault == "kill" else nats3.pause, lost)
    # a message handed to a client of a hung server before its routes are dropped is
    # counted delivered: it comes again after the durable's ack wait, not before
    # (test_a_message_handed_to_a_hung_servers_client_comes_again_after_the_ack_wait)
    decided_by = time.monotonic() + ACK_WAIT_S + 30
    await asyncio.wait_for(burst, 90)

    assert sorted(acked) == sorted(names)
    faulted = decided_by - ACK_WAIT_S - 30
    for name in names:
        try:
            await _ready(api, name, decided_by)
        except AssertionError as exc:  # say where each consumer stands (CI saw this once)
            raise AssertionError(f"{exc}\n{await _consumers(cluster, faulted)}") from None
    survivors = ",".join(n.url for n in nats3.nodes if n is not lost)
    deadline = time.monotonic() + 30
    while True:  # the relay may still be publishing the newest events
        log_ids = await _log_ids(cluster)
        stream_ids = await _once_answered(lambda: _stream_ids(cluster, survivors))
        if stream_ids == log_ids or time.monotonic() > deadline:
            break
        if len(stream_ids) >= len(log_ids):
            break  # all there: what differs now is order or duplicates
        await asyncio.sleep(0.2)
    assert len(set(stream_ids)) == len(stream_ids), "an event is in the stream twice"
    assert stream_ids == log_ids, "the stream holds the log, in order"


@_NATS_PY_LEAK[0]
@_NATS_PY_LEAK[1]
async def test_the_first_check_asks_again_until_the_bus_answers(
    settings: Settings, nats3: NatsCluster
) -> None:
    """``dracap up``'s check before its services start (:meth:`BusKeeper.first_check`)
    waits out a server that answers nothing, as a cluster still electing its JetStream
    leader does, and creates the stream once answered (CI saw the check fail at once)."""
    node = nats3.nodes[0]
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:8]}")
    nc, js = await connect_bus(node.url)
    store = await EventStore.open(settings)
    keeper = BusKeeper(store, js, names)
    try:
        await asyncio.to_thread(nats3.pause, node)
        try:
            check = asyncio.create_task(keeper.first_check(0, within=120))
            await until(lambda: keeper.unanswered >= 2, 60, "two checks unanswered")
            assert not check.done(), "asked again"
        finally:
            await asyncio.to_thread(nats3.resume, node)
        assert await check is None, "a new stream: nothing to publish again"
        assert keeper.streams_created == 1
        info = await _once_answered(lambda: js.stream_info(names.stream))
        assert info.config.name == names.stream
    finally:
        await nc.close()
        await store.close()


async def test_the_stream_keeps_its_replicas_unless_told(nats3: NatsCluster) -> None:
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:8]}")
    nc, js = await connect_bus(nats3.url)

    async def replicas(wanted: int | None) -> int:  # the cluster may still be regrouping
        info = await _once_answered(lambda: ensure_stream(js, names, replicas=wanted))
        return info.config.num_replicas or 0

    try:  # (after the tests that kill or pause a server of the cluster)
        assert await replicas(3) == 3
        assert await replicas(None) == 3, "kept"
        assert await replicas(1) == 1
        await _once_answered(lambda: js.delete_stream(names.stream))
        assert await replicas(None) == 1, "a new one: 1"
    finally:
        await _once_answered(lambda: js.delete_stream(names.stream))
        await nc.close()


#: JetStream's "no suitable peers for placement" (a replica's server is not back yet)
NO_PEERS = 10005
#: "JetStream system temporarily unavailable" (the cluster's meta leader is being chosen)
UNAVAILABLE = 10008


def _not_now(exc: BaseException) -> bool:
    """Whether the cluster answered "not now": a server an earlier test of the module
    killed or paused has not rejoined yet, or its meta leader is being chosen (then
    the API does not answer at all, or nobody answers on it yet). ``ensure_stream``
    wraps the server's answer in the runtime's error, whose type says "retryable"."""
    if isinstance(exc, RetryableError):
        return True
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        return True  # a publish found nobody taking the stream's subjects (yet)
    cause = exc.__cause__ or exc
    return isinstance(cause, nats.errors.TimeoutError | nats.errors.NoRespondersError) or getattr(
        cause, "err_code", None
    ) in (NO_PEERS, UNAVAILABLE)


async def _once_answered(call: Callable[[], Awaitable[_T]], within: float = 30) -> _T:
    """``call()``'s result once the cluster answers it (:func:`_not_now`)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await call()
        except Exception as exc:
            if not _not_now(exc) or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.25)


async def _publish_once(js: JetStreamContext, subject: str, stream: str) -> None:
    """Publish ``b"x"`` to ``subject`` with a message ID, so that a retry after an
    unanswered try (stored, the answer lost) is not stored twice."""
    await js.publish(subject, b"x", stream=stream, headers={Header.MSG_ID: subject})


async def _a_follower(nats3: NatsCluster, names: BusNames, durable: Durable) -> NatsNode:
    """Make the 3-replica stream and ``durable``; the node that leads neither: a
    puller's server whose loss only costs the puller its request (chosen after both
    are made, as their leaders are only known then)."""
    first, *_ = nats3.nodes
    admin, js = await connect_bus(first.url)
    try:
        await _once_answered(lambda: ensure_stream(js, names, replicas=3))
        await _once_answered(lambda: js.add_consumer(names.stream, durable_config(durable)))
        clusters = [
            (await js.stream_info(names.stream)).cluster,
            (await js.consumer_info(names.stream, durable.name)).cluster,
        ]
    finally:
        await admin.close()
    leading = {info.leader for info in clusters if info is not None}
    return next(node for node in reversed(nats3.nodes) if node.name not in leading)


async def test_a_pull_request_lost_with_its_server_is_asked_again_at_once(
    nats3: NatsCluster,
) -> None:
    """The server a puller is connected to is killed and a message comes before the
    puller is back on another server: the consumer's leader finds nobody to give it to
    and drops the request (its reply subject lost its interest). The puller, back, asks
    again at once: the message comes while the lost request would still be waiting, not
    when it expires (20 s: a node agent's)."""
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:8]}")
    subject = f"{names.prefix}.ev.x"
    durable = Durable(name="probe", filter_subject=f"{names.prefix}.ev.>")
    lost = await _a_follower(nats3, names, durable)
    survivors = ",".join(node.url for node in nats3.nodes if node is not lost)
    admin, js = await connect_bus(survivors)
    try:
        order = [lost.url] + [node.url for node in nats3.nodes if node is not lost]
        held = True  # the puller's reconnect is held (tried on the lost server) until False

        def reconnect_to(servers: list[Server], _: object) -> tuple[Server, float]:
            return next(s for s in servers if (s.uri.port == lost.port) == held), 0.05

        nc = await nats.connect(
            servers=order, dont_randomize=True, reconnect_to_server_handler=reconnect_to
        )
        try:
            puller = Puller(nc, names.stream, durable.name, batch=4, expires=MAX_EXPIRES_S)
            await puller.start()
            # the old code asks again only when renewing the lost request, just before it
            # would expire: a message that comes before then came by a new request
            renewal = time.monotonic() + MAX_EXPIRES_S - pulling._RENEW_S
            async with asyncio.timeout(30):  # its request out (once the server knows the
                # durable: a request before then is answered 503, and asked again)
                while (await js.consumer_info(names.stream, durable.name)).num_waiting < 1:
                    assert await puller.next(0.05, 1) == []
            await asyncio.to_thread(nats3.kill, lost)
            await _once_answered(lambda: _publish_once(js, subject, names.stream), 2)
            async with asyncio.timeout(30):  # dropped: nobody to give the message to
                while (await js.consumer_info(names.stream, durable.name)).num_waiting:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            held = False
            await until(lambda: nc.stats["reconnects"] >= 1, 30, "the puller on another server")
            got: list[Msg] = []
            while not got and time.monotonic() < renewal + 10:
                got = await puller.next(1.0, 1)
            assert got, "the message never came"
            assert time.monotonic() < renewal, "it came only when the lost request was renewed"
            await puller.stop()
        finally:
            await nc.close()
    finally:  # (the cluster, and the stream with it, goes with the test)
        await admin.close()


@pytest.mark.filterwarnings(*_NATS_PY_LEAK[0].args)
@pytest.mark.filterwarnings(*_NATS_PY_LEAK[1].args)
async def test_a_message_handed_to_a_hung_servers_client_comes_again_after_the_ack_wait(
    nats3: NatsCluster,
) -> None:
    """The server a puller is connected to hangs (SIGSTOP) while its request waits at
    the consumer's leader elsewhere. Until the hung server's routes are dropped (a few
    missed pings), the leader still sees the request's interest and hands it a message,
    which is lost on the way and counted delivered. Nothing is lost for good: the
    puller, back on another server, gets it again once the durable's ack wait has
    passed (short here; 30 s for dracap's durables) and not sooner. This is the delay
    a hung nats-server can cost (docs/operations.md, "Under faults")."""
    ack_wait = 4.0
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:8]}")
    subject = f"{names.prefix}.ev.x"
    durable = Durable(name="probe", filter_subject=f"{names.prefix}.ev.>", ack_wait=ack_wait)
    hung = await _a_follower(nats3, names, durable)
    admin, js = await connect_bus(",".join(n.url for n in nats3.nodes if n is not hung))
    nc = await nats.connect(
        servers=[hung.url], ping_interval=1, max_outstanding_pings=2, reconnect_time_wait=0.1
    )
    try:
        puller = Puller(nc, names.stream, durable.name, batch=4, expires=MAX_EXPIRES_S)
        await puller.start()
        async with asyncio.timeout(30):  # its request waits at the consumer's leader
            while (await js.consumer_info(names.stream, durable.name)).num_waiting < 1:
                assert await puller.next(0.05, 1) == []
        await asyncio.to_thread(nats3.pause, hung)
        try:
            # (retried: the stream's leader may still be taking up its subjects, as it
            # was once seen to on a loaded machine: "no response from stream")
            await _once_answered(lambda: _publish_once(js, subject, names.stream), 2)
            handed = time.monotonic()
            pending = 0
            while not pending and time.monotonic() < handed + 2.0:  # before the routes drop
                pending = (await js.consumer_info(names.stream, durable.name)).num_ack_pending
                if not pending:
                    await asyncio.sleep(0.05)
            if not pending:  # the leader dropped the request first: nothing was handed out
                pytest.skip("the cluster dropped the hung server's request before the publish")
            got: list[Msg] = []
            while not got and time.monotonic() < handed + ack_wait + 30:
                got = await puller.next(1.0, 1)
            assert got, "the message never came again"
            assert time.monotonic() - handed >= ack_wait - 0.5, "it came before the ack wait"
            assert got[0].metadata.num_delivered == 2
            await puller.stop()
        finally:
            nats3.resume(hung)
    finally:
        await nc.close()
        await admin.close()
        gc.collect()  # what nats-py leaked (see _NATS_PY_LEAK) is collected in this test
