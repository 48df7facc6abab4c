"""The watchdog's restart policy: restart a dead server, back off, give up past the limit.

The server here is an in-memory stand-in with the embedded servers' interface, so the
policy can be driven exactly (how many starts fail); killing real servers under
``dracap up`` is ``tests/integration/test_supervision.py``.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from services.runtime.ground.metrics import REGISTRY
from services.runtime.ops.embedded import EmbeddedError
from services.runtime.ops.supervising import RestartLimitError, RestartPolicy, Watchdog
from tests.fixtures.polling import until

FAST = {"first_delay_s": 0.001, "max_delay_s": 0.004}


class StandIn:
    """A server that runs until told to die; its next ``failures`` starts fail."""

    name = "nats"
    log = Path("/data/nats.log")

    def __init__(self, failures: int = 0) -> None:
        self.running = True
        self.failures = failures
        self.starts = 0

    def alive(self) -> bool:
        return self.running

    def down_reason(self) -> str:
        return "killed by SIGKILL"

    def start(self) -> str:
        self.starts += 1
        if self.failures:
            self.failures -= 1
            raise EmbeddedError("port 4222 is in use")
        self.running = True
        return "nats://127.0.0.1:4222"


def _restarts() -> float:
    sample = REGISTRY.get_sample_value("dracap_embedded_server_restarts_total", {"server": "nats"})
    return sample or 0.0


def test_the_delay_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=8.0)
    assert [policy.delay(n) for n in range(7)] == [0.5, 1, 2, 4, 8, 8, 8]


@pytest.fixture
def lines(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> pytest.LogCaptureFixture:
    """caplog for ``dracap.supervising`` (import-linter's run in test_architecture disables the
    loggers that exist by then)."""
    monkeypatch.setattr(logging.getLogger("dracap.supervising"), "disabled", False)
    caplog.set_level(logging.INFO, logger="dracap.supervising")
    return caplog


async def test_a_dead_server_is_started_again_with_a_line_each_way(
    lines: pytest.LogCaptureFixture,
) -> None:
    server, stop = StandIn(), asyncio.Event()
    watchdog = Watchdog([server], RestartPolicy(**FAST), interval=0.005)
    before = _restarts()
    task = asyncio.create_task(watchdog.run(stop))
    server.running = False
    await until(lambda: server.running and not watchdog.down)
    stop.set()
    await task
    assert server.starts == 1 and watchdog.restarts == {"nats": 1}
    assert _restarts() == before + 1
    said = [r.getMessage() for r in lines.records if r.name == "dracap.supervising"]
    assert said[0].startswith("embedded nats: killed by SIGKILL; restarting it (1 of 5")
    assert said[1].startswith("embedded nats: running again")
    assert len(said) == 2 and not any(r.exc_info for r in lines.records)


async def test_failed_starts_are_retried_until_the_limit_then_it_gives_up() -> None:
    server = StandIn(failures=10)
    watchdog = Watchdog([server], RestartPolicy(limit=3, **FAST), interval=0.005)
    server.running = False
    with pytest.raises(RestartLimitError) as raised:
        await watchdog.run(asyncio.Event())
    assert server.starts == 3
    message = str(raised.value)
    assert message == watchdog.gave_up and "\n" not in message
    assert message.startswith("embedded nats: did not start again: port 4222 is in use;")
    assert "gave up after 3 restarts within 600 s" in message and str(server.log) in message


async def test_a_failed_start_then_a_good_one_recovers() -> None:
    server, stop = StandIn(failures=2), asyncio.Event()
    watchdog = Watchdog([server], RestartPolicy(limit=3, **FAST), interval=0.005)
    task = asyncio.create_task(watchdog.run(stop))
    server.running = False
    await until(lambda: server.running and not watchdog.down)
    stop.set()
    await task
    assert server.starts == 3 and watchdog.gave_up is None


async def test_with_restarts_off_the_first_death_gives_up() -> None:
    server = StandIn()
    watchdog = Watchdog([server], RestartPolicy(limit=0), interval=0.005)
    server.running = False
    with pytest.raises(RestartLimitError, match="killed by SIGKILL; restarts are off"):
        await watchdog.run(asyncio.Event())
    assert server.starts == 0
