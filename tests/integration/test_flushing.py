"""A subscription made and flushed is in place for another connection's request.

nats-py's ``flush`` can return before the server has read a ``SUB`` queued just
before it (:mod:`services.runtime.bus.flushing`); with a plain ``flush`` some rounds
below find nobody subscribed (4 of 300 here), with :func:`flushed` none does.
"""

from __future__ import annotations

import uuid

import nats.errors
from nats.aio.msg import Msg

from services.runtime.bus.flushing import flushed
from services.runtime.bus.jetstream import connect_bus

ROUNDS = 300


async def test_a_flushed_subscription_answers_the_next_request_from_another_connection(
    nats_url: str,
) -> None:
    server, _ = await connect_bus(nats_url)
    client, _ = await connect_bus(nats_url)
    missed = 0
    try:

        async def echo(msg: Msg) -> None:
            await server.publish(msg.reply, msg.data)

        for i in range(ROUNDS):
            subject = f"flushing.{uuid.uuid4().hex}"
            sub = await server.subscribe(subject, cb=echo)
            await flushed(server)
            try:
                reply = await client.request(subject, str(i).encode(), timeout=10)
            except nats.errors.NoRespondersError:
                missed += 1
            else:
                assert reply.data == str(i).encode()
            await sub.unsubscribe()
    finally:
        await client.close()
        await server.close()
    assert missed == 0, f"{missed} of {ROUNDS} requests found nobody subscribed"
