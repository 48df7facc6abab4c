"""What nats-server does with pull requests, which services.runtime.delivery.pulling counts on
(and tests/unit/test_pulling.py models): waiting requests are served round robin."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import nats
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from services.runtime.delivery.pulling import MAX_EXPIRES_S, PULL_SUBJECT, Puller


async def test_waiting_pull_requests_are_served_round_robin(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    stream = f"PULLING_{uuid.uuid4().hex[:8].upper()}"
    await js.add_stream(name=stream, subjects=[f"{stream.lower()}.>"])
    try:
        await js.add_consumer(
            stream, ConsumerConfig(durable_name="c", ack_policy=AckPolicy.EXPLICIT)
        )
        got: list[bytes] = []
        arrived = asyncio.Event()
        inbox = nc.new_inbox()

        async def received(msg: Msg) -> None:
            if msg.data:  # a message (a status has none); which request brought it, it does not say
                got.append(msg.data)
                arrived.set()

        await nc.subscribe(f"{inbox}.*", cb=received)
        subject = PULL_SUBJECT.format(prefix="$JS.API", stream=stream, durable="c")
        for token in ("first", "second"):
            request = json.dumps({"batch": 4, "expires": int(30e9)}).encode()
            await nc.publish(subject, request, reply=f"{inbox}.{token}")
        async with asyncio.timeout(30):
            while (await js.consumer_info(stream, "c")).num_waiting < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.02)  # the server's state, polled
            for i in range(4):
                await js.publish(f"{stream.lower()}.x", b"%d" % i)
            while len(got) < 4:
                arrived.clear()
                await arrived.wait()
        info = await js.consumer_info(stream, "c")
        # the first request, served first, would have had all four and ended: both wait on
        assert info.num_waiting == 2
        assert info.delivered.consumer_seq == 4
    finally:
        await js.delete_stream(stream)
        await nc.close()


async def test_a_request_nobody_received_is_asked_again_within_seconds(nats_url: str) -> None:
    """A ``503`` (no durable to take the request: one not made yet, or a clustered one
    between two leaders) quiets the puller a short while, not a whole ``expires``: the
    message that comes once the durable is there is taken before a 20 s request would
    have been asked again."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    stream = f"PULLING_{uuid.uuid4().hex[:8].upper()}"
    await js.add_stream(name=stream, subjects=[f"{stream.lower()}.>"])
    try:
        puller = Puller(nc, stream, "later", batch=4, expires=MAX_EXPIRES_S)
        await puller.start()
        quiet_until = time.monotonic() + MAX_EXPIRES_S  # the old wait, at the soonest
        while not puller.missing:
            assert await puller.next(1.0, 1) == []
        await js.add_consumer(
            stream, ConsumerConfig(durable_name="later", ack_policy=AckPolicy.EXPLICIT)
        )
        await js.publish(f"{stream.lower()}.x", b"x")
        got: list[Msg] = []
        while not got and time.monotonic() < quiet_until + 10:
            got = await puller.next(1.0, 1)
        assert got, "the message never came"
        assert time.monotonic() < quiet_until, "asked again only after a whole expires"
        await puller.stop()
    finally:
        await js.delete_stream(stream)
        await nc.close()
