"""Replies larger than the NATS server's ``max_payload`` arrive whole, in parts.

A nats-server started here with ``max_payload`` 16 KiB (instead of 1 MiB) makes
ordinary lists span several messages: the claims of a namespace (the claims API), the
audit records (a subscriber's query endpoint). A reply of more than 64 parts is refused
with ``too_large``, naming the rule; a request nobody answers still fails at once. The
broker's permissions for parts are checked in ``test_broker_auth``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import pytest
from nats.aio.msg import Msg

from events.subjects import BusNames
from services.exitcodes import ExitCode
from services.runtime.bus.apiclient import ApiClient, ApiError, Inbox
from services.runtime.bus.endpoints import ServerUnavailable
from services.runtime.bus.flushing import flushed
from services.runtime.bus.jetstream import connect_bus
from services.runtime.bus.replies import HEADROOM, MAX_REPLY_PARTS, split
from services.runtime.ground.settings import Settings
from services.runtime.ops.embedded import EmbeddedNats
from services.stack import Stack, load_inventory, read_inventory
from tests.fixtures.blobs import blob_endpoint

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"
MAX_PAYLOAD = 16 * 1024
CLAIMS = 40


def _claim(name: str) -> bytes:
    request = {
        "deviceClassName": "vnic-bandwidth.dracap.io",
        "capacity": {"requests": {"bandwidth": "100M"}},
    }
    doc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "tenant-a"},
        "spec": {"devices": {"requests": [{"name": "net", "exactly": request}]}},
    }
    return json.dumps(doc).encode()


@pytest.fixture
def small_nats(tmp_path: Path) -> Iterator[str]:
    """A nats-server that takes messages of at most 16 KiB."""
    config = tmp_path / "nats.conf"
    config.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    server = EmbeddedNats(tmp_path / "nats", config=config)
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture
async def api(settings: Settings, small_nats: str) -> AsyncIterator[ApiClient]:
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:10]}")
    inventory = read_inventory([str(EXAMPLES)])
    settings = msgspec.structs.replace(settings, nats_url=small_nats)
    async with (
        Stack.running(settings, names, nodes=inventory.nodes, workers=1),
        ApiClient.connect(small_nats, names.prefix) as client,
    ):
        assert client.nc.max_payload == MAX_PAYLOAD
        await load_inventory(client, inventory)
        for i in range(CLAIMS):
            await client.claims("tenant-a", "apply", _claim(f"net-{i:02d}"))
        yield client


def _size(reply: dict[str, Any]) -> int:
    return len(json.dumps(reply).encode())


async def test_a_namespace_of_many_claims_is_listed_whole(api: ApiClient) -> None:
    reply = await api.claims("tenant-a", "list")
    assert sorted(c["name"] for c in reply["claims"]) == [f"net-{i:02d}" for i in range(CLAIMS)]
    assert _size(reply) > MAX_PAYLOAD  # more than one message could carry


async def test_an_api_client_takes_every_reply_on_one_subscription(api: ApiClient) -> None:
    """The client's requests share one :class:`Inbox`: asking again subscribes to nothing
    more (each request used to make a subscription of its own and drop it)."""
    made: list[str] = []
    subscribe = api.nc.subscribe

    async def counted(subject: str, *args: Any, **kwargs: Any) -> Any:
        made.append(subject)
        return await subscribe(subject, *args, **kwargs)

    api.nc.subscribe = counted  # type: ignore[method-assign]
    listed = [await api.claims("tenant-a", "list") for _ in range(3)]
    assert all(len(reply["claims"]) == CLAIMS for reply in listed)  # whole, in parts
    assert made == []  # the fixture's requests made the one subscription already


async def test_audit_records_beyond_one_message_arrive_whole(api: ApiClient) -> None:
    async with asyncio.timeout(60):  # the audit subscriber follows the log
        while True:
            reply = await api.admin("audit.list", {"namespace": "tenant-a"})
            records = reply["records"]
            ready = {r["claim"] for r in records if r["type"] == "enforcement.limit_applied"}
            if len(ready) == CLAIMS:
                break
            await asyncio.sleep(0.1)
    assert {r["namespace"] for r in records} == {"tenant-a"}
    assert [r["position"] for r in records] == sorted(r["position"] for r in records)
    assert _size(reply) > MAX_PAYLOAD


async def test_a_reply_past_the_most_parts_is_refused_with_the_rule(small_nats: str) -> None:
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:10]}")
    most = MAX_REPLY_PARTS * (MAX_PAYLOAD - HEADROOM)

    nc, _ = await connect_bus(small_nats)
    try:
        async with (
            blob_endpoint(nc, names),
            ApiClient.connect(small_nats, names.prefix) as client,
        ):
            fits = await client.admin("blob.list", {"size": most - 100})
            assert len(fits["blob"]) == most - 100
            with pytest.raises(ApiError) as refused:
                await client.admin("blob.list", {"size": most})
            assert refused.value.code == "too_large"
            assert refused.value.exit_code == ExitCode.BAD_INPUT
            assert (
                refused.value.rule
                == f"at most {MAX_REPLY_PARTS} messages of the server's max_payload"
            )
            assert "ask for less" in str(refused.value)
    finally:
        await nc.close()


async def test_a_request_nobody_answers_fails_at_once(small_nats: str) -> None:
    """The server's no-responders status ends the wait (not the 10 s timeout)."""
    async with ApiClient.connect(small_nats, f"t{uuid.uuid4().hex[:10]}") as client:
        client.timeout = 120  # a wait for the timeout would fail the test's own bound
        async with asyncio.timeout(30):
            with pytest.raises(ServerUnavailable, match="no dracap API answers on"):
                await client.admin("devices.list")


async def test_one_inbox_takes_the_parts_of_many_replies_at_once(small_nats: str) -> None:
    """:class:`Inbox` (the node agents' views and reports): replies in parts to requests
    in flight together come back whole, each to its own request, on one subscription."""
    subject = f"t{uuid.uuid4().hex[:10]}.echo"
    server, _ = await connect_bus(small_nats)
    client, _ = await connect_bus(small_nats)
    try:

        async def echo(msg: Msg) -> None:  # a reply of several parts, the request repeated
            reply = msg.data * 5
            for data, headers in split(reply, server.max_payload) or []:
                await server.publish(msg.reply, data, headers=headers)

        await server.subscribe(subject, cb=echo)
        await flushed(server)
        inbox = Inbox(client)
        bodies = [bytes([i]) * (MAX_PAYLOAD - i) for i in range(8)]  # 5 parts each
        replies = await asyncio.gather(*(inbox.ask(subject, b, 30) for b in bodies))
        assert replies == [b * 5 for b in bodies]
        subscriptions = len(client._subs)  # nats-py's own table: none made per request
        assert await inbox.ask(subject, b"again", 30) == b"again" * 5
        assert len(client._subs) == subscriptions
        with pytest.raises(nats.errors.NoRespondersError):
            await inbox.ask(f"{subject}.nobody", b"", 30)
    finally:
        await client.close()
        await server.close()
