"""Health checks, their one line per change, the endpoints, and quiet outages in the log."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import asyncpg
import nats.errors
import pytest

from services.runtime.ground.errors import RetryableError
from services.runtime.ground.metrics import REGISTRY, start_metrics_server
from services.runtime.ground.outages import QuietOutages, is_unreachable, one_line
from services.runtime.ops import health
from services.runtime.ops.health import (
    HealthMonitor,
    consumers_probe,
    live_probe,
    projector_probe,
    serve,
)


class Switch:
    """A probe whose answer the test sets."""

    def __init__(self) -> None:
        self.failure: Exception | None = None

    async def __call__(self) -> str | None:
        if self.failure is not None:
            raise self.failure
        return None


def _gauge(check: str) -> float | None:
    return REGISTRY.get_sample_value("dracap_health_check_up", {"check": check})


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """caplog for ``dracap.health`` (tests/conftest.py re-enables the loggers)."""
    caplog.set_level(logging.INFO, logger="dracap.health")
    return caplog


async def test_each_change_of_a_check_is_one_line(lines: pytest.LogCaptureFixture) -> None:
    monitor, postgres = HealthMonitor(["postgres", "nats"]), Switch()
    status, body = monitor.readiness()
    assert status == 503 and body.down == ["postgres", "nats"]  # declared: starting
    monitor.register("postgres", postgres)
    monitor.register("nats", Switch())
    recovered: list[str] = []
    monitor.on_recovery(recovered.append)
    await monitor.check_once()
    assert monitor.readiness()[0] == 200 and not monitor.outage()
    postgres.failure = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    for _ in range(3):
        await monitor.check_once()
    status, body = monitor.readiness()
    assert status == 503 and body.down == ["postgres"] and monitor.outage()
    assert (
        body.checks["postgres"].reason == "ConnectionRefusedError: [Errno 111] Connection refused"
    )
    assert _gauge("postgres") == 0.0 and _gauge("nats") == 1.0
    postgres.failure = None
    await monitor.check_once()
    await monitor.check_once()
    assert monitor.readiness()[0] == 200 and _gauge("postgres") == 1.0
    assert recovered == ["postgres"]
    said = [r.getMessage() for r in lines.records if r.name == "dracap.health"]
    assert said[0] == "postgres is down: ConnectionRefusedError: [Errno 111] Connection refused"
    assert said[1].startswith("postgres is up again (down ")
    assert len(said) == 2


async def test_a_probe_that_hangs_is_down_after_the_timeout() -> None:
    monitor = HealthMonitor(["nats"], timeout=0.01)

    async def hangs() -> str | None:
        await asyncio.Event().wait()
        return None

    monitor.register("nats", hangs)
    await monitor.check_once()
    status, body = monitor.readiness()
    assert status == 503 and body.checks["nats"].reason == "no answer within 0 s"


def test_liveness_says_alive_until_the_watchdog_gives_up() -> None:
    from services.runtime.ops.supervising import Watchdog

    monitor = HealthMonitor(["postgres"])
    monitor.watchdog = Watchdog([])
    assert monitor.liveness()[0] == 200
    monitor.watchdog.gave_up = "embedded nats: killed by SIGKILL; restarts are off"
    status, body = monitor.liveness()
    assert status == 503 and body.reason == monitor.watchdog.gave_up and not body.alive


@pytest.fixture
def served() -> Iterator[tuple[HealthMonitor, int]]:
    monitor = HealthMonitor(["postgres", "nats", "services"])
    server, _ = start_metrics_server(0, addr="127.0.0.1")
    serve(server, monitor)
    try:
        yield monitor, server.server_port
    finally:
        server.shutdown()
        server.server_close()


def _get(port: int, path: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


def test_the_endpoints_sit_beside_the_metrics(served: tuple[HealthMonitor, int]) -> None:
    _, port = served
    status, kind, body = _get(port, "/readyz")
    assert (status, kind) == (503, "application/json")
    ready: dict[str, Any] = json.loads(body)
    assert ready["ready"] is False and ready["down"] == ["postgres", "nats", "services"]
    assert ready["checks"]["nats"] == {"up": False, "reason": "starting"}
    status, _, body = _get(port, "/healthz")
    assert status == 200 and json.loads(body)["alive"] is True
    status, _, body = _get(port, "/metrics")
    assert status == 200 and b"dracap_build_info" in body


def test_any_other_path_is_not_found(served: tuple[HealthMonitor, int]) -> None:
    """Only ``/metrics`` (and ``/``), ``/healthz`` and ``/readyz`` answer: a probe on a
    mistyped path fails instead of reading the metrics as healthy."""
    _, port = served
    for path in ("/readyz/", "/health", "/nope", "/metrics/x"):
        status, _, _ = _get(port, path)
        assert status == 404, path


def test_a_metrics_server_without_a_monitor_has_no_health_to_tell() -> None:
    server, _ = start_metrics_server(0, addr="127.0.0.1")
    try:
        assert _get(server.server_port, "/readyz")[0] == 404
        assert _get(server.server_port, "/metrics")[0] == 200
    finally:
        server.shutdown()
        server.server_close()


class _Consumer:
    def __init__(self, name: str, why: str | None) -> None:
        self.name, self.why = name, why

    def detached(self) -> str | None:
        return self.why


async def test_a_consumer_that_does_not_pull_is_not_ready() -> None:
    found: list[_Consumer] = []
    probe = consumers_probe(lambda: found)
    assert await probe() == "no consumer started yet"
    found += [_Consumer("a", None), _Consumer("b", "not pulling")]
    assert await probe() == "b: not pulling"
    found[1].why = None
    assert await probe() is None


class _Store:
    known_head = 0


class _State:
    position = 0


class _View:
    """A live view as the probe sees it."""

    def __init__(self) -> None:
        self.tailing = True
        self.store, self.state = _Store(), _State()


async def test_a_live_view_is_stale_when_it_stays_behind_a_head_it_heard_of() -> None:
    clock = [100.0]
    view = _View()
    probe = live_probe(view, clock=lambda: clock[0])
    assert await probe() is None
    view.store.known_head = 10  # heard of; not folded yet
    assert await probe() is None
    clock[0] += health.STALE_STATE_S - 1
    assert await probe() is None
    view.state.position = 10  # reached it; a newer head starts a new wait
    view.store.known_head = 12
    clock[0] += 5
    assert await probe() is None
    clock[0] += health.STALE_STATE_S + 1
    reason = await probe()
    assert reason is not None and "position 10" in reason
    view.state.position = 12
    assert await probe() is None
    view.tailing = False
    assert await probe() == "the live view is not tailing the log"


class _Projector:
    name = "billing"
    position = 0
    failing: str | None = None

    def __init__(self) -> None:
        self.store = _Store()


async def test_a_projector_whose_batches_fail_is_not_ready() -> None:
    projector = _Projector()
    probe = projector_probe(projector)
    assert await probe() is None
    projector.failing = "ValueError: bad payload"
    assert await probe() == "batches fail: ValueError: bad payload"


# --- quiet outages -------------------------------------------------------------------------


def _record(msg: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("t", logging.ERROR, __file__, 1, msg, args, exc_info)


def _raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise exc from cause
    except BaseException as caught:
        return caught


def test_what_counts_as_unreachable() -> None:
    refused = OSError(errno.ECONNREFUSED, "Connect call failed")  # several addresses tried
    assert is_unreachable(refused)
    assert is_unreachable(asyncpg.CannotConnectNowError("the database system is starting up"))
    assert is_unreachable(nats.errors.ConnectionReconnectingError())
    assert is_unreachable(_raised(RetryableError("transient"), ConnectionResetError()))
    assert not is_unreachable(ValueError("a bug"))
    assert not is_unreachable(FileNotFoundError(errno.ENOENT, "missing"))
    assert not is_unreachable(asyncpg.UniqueViolationError("duplicate key"))


def test_outside_an_outage_an_unreachable_error_is_one_line() -> None:
    quiet = QuietOutages(lambda: False)
    exc = _raised(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"))
    record = _record("relay failed after position %d; retrying", 7, exc=exc)
    assert quiet.filter(record)
    assert record.exc_info is None
    assert record.getMessage() == (
        "relay failed after position 7; retrying "
        "(ConnectionRefusedError: [Errno 111] Connection refused)"
    )


def test_during_an_outage_unreachable_errors_are_dropped_and_bugs_kept() -> None:
    quiet = QuietOutages(lambda: True)
    refused = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    assert not quiet.filter(_record("nats: encountered error", exc=_raised(refused)))
    assert not quiet.filter(_record("live state could not read the log: %s", refused))
    bug = _record("handler failed", exc=_raised(KeyError("x")))
    assert quiet.filter(bug) and bug.exc_info is not None
    assert quiet.filter(_record("plain message"))
    assert quiet.dropped == 2


def test_one_line() -> None:
    assert one_line(ValueError("two\n  lines")) == "ValueError: two lines"
    assert (
        one_line(nats.errors.ConnectionClosedError())
        == "ConnectionClosedError: nats: connection closed"
    )
