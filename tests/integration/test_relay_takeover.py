"""Two relay processes: one publishes, the other stands by and takes over when the first
is killed (issue 29, item 1).

``dracap serve relay`` twice, as a deployment with two replicas runs it (each with the
relay's own database login, a member of ``dracap_relay``), against the real PostgreSQL
and nats-server; the test appends bursts from a third store meanwhile.
While the first relay lives, the second publishes nothing (its
``dracap_relay_messages_total`` stays 0: one active publisher, not two racing ones
that lean on JetStream's duplicate window). The first is killed (SIGKILL) in the
middle of the load; the second is granted the lease, publishes the rest, and the
stream holds every event of the log exactly once, in the log's order.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError

from events.subjects import BusNames
from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground.settings import ServiceKind, Settings
from services.runtime.ops.embedded import free_port
from services.runtime.store.eventstore import EventStore
from tests.fixtures.logins import login_users
from tests.integration.test_bus import append_burst
from tests.integration.test_serve import Processes
from tests.integration.test_two_relays import log_ids, stream_ids

BURSTS = 8
PER_BURST = 200
_ACTIVE = "relay active"


def _metric(port: int, name: str) -> float:
    """The sum of a metric's samples on a process's ``/metrics`` (0 when it has none)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


async def _log_says(procs: Processes, name: str, words: str) -> None:
    log = procs.tmp / f"{name}.log"
    async with asyncio.timeout(60):
        while words not in log.read_text(errors="replace"):
            assert procs.running[name].returncode is None, procs.logs()
            await asyncio.sleep(0.05)


async def _stream_holds(nats_url: str, names: BusNames, count: int) -> None:
    nc, js = await connect_bus(nats_url)
    try:
        async with asyncio.timeout(90):
            while True:
                with contextlib.suppress(NotFoundError):  # the relay creates the stream
                    if (await js.stream_info(names.stream)).state.messages >= count:
                        return
                await asyncio.sleep(0.1)
    finally:
        await nc.close()


@pytest.fixture
async def relay_login(database_url: str, postgres_admin_url: str) -> AsyncIterator[str]:
    """The URL of a login user of ``dracap_relay``, the relay's own (dropped afterwards)."""
    async with login_users(database_url, postgres_admin_url, [ServiceKind.RELAY]) as urls:
        yield urls[ServiceKind.RELAY.value]


async def test_a_standby_relay_takes_over_when_the_active_one_is_killed(
    settings: Settings, nats_url: str, tmp_path: Path, relay_login: str
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    names = BusNames(prefix=prefix)
    procs = Processes(settings, nats_url, prefix, tmp_path)
    # each relay as deployed: the relay's own database login, nothing else
    env = {k: v for k, v in procs.without_database().items() if k != "DRACAP_APP_ROLE"}
    env["DRACAP_DATABASE_URL_RELAY"] = relay_login
    ports = {"first": free_port(), "second": free_port()}

    def relay(name: str) -> list[str]:
        return procs.argv("serve", "relay", "--metrics-port", str(ports[name]), database=False)

    writer = await EventStore.open(settings)
    try:
        await procs.start("first", relay("first"), env)
        await _log_says(procs, "first", _ACTIVE)
        await procs.start("second", relay("second"), env)
        await _log_says(procs, "second", " started")
        for _ in range(BURSTS // 2):
            await append_burst(writer, PER_BURST, 25)
        await _stream_holds(nats_url, names, BURSTS // 2 * PER_BURST)
        assert _metric(ports["second"], "dracap_relay_messages_total") == 0, procs.logs()
        assert _metric(ports["second"], "dracap_service_active") == 0
        assert _metric(ports["first"], "dracap_service_active") == 1

        load = asyncio.gather(*(append_burst(writer, PER_BURST, 25) for _ in range(BURSTS // 2)))
        procs.running["first"].send_signal(signal.SIGKILL)  # in the middle of the load
        await load
        await _log_says(procs, "second", _ACTIVE)
        await _stream_holds(nats_url, names, BURSTS * PER_BURST)
        stored, logged = await stream_ids(nats_url, names), await log_ids(writer, names)
        assert len(logged) == BURSTS * PER_BURST
        assert len(set(stored)) == len(stored), "an event was published twice"
        assert stored == logged, "the stream holds the log, in order, nothing skipped"
        assert _metric(ports["second"], "dracap_service_active") == 1
        assert _metric(ports["second"], "dracap_relay_messages_total") > 0
    finally:
        await writer.close()
        codes = await procs.stop()
    assert codes["first"] == -signal.SIGKILL
    assert codes["second"] == 0, procs.logs()
