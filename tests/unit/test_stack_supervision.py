"""How ``dracap up``'s supervisor reports a service that failed and is restarted.

A service that fails because a server is away or slow to answer (a
:class:`~services.runtime.ground.errors.RetryableError`, or a connection refused) is an
expected failure: one warning line naming the service and the error, no traceback (CI
saw an agent's first view time out while a clustered nats-server hung, and the log
carried a traceback for it). Anything else is a bug to find: logged with its
traceback. Both are restarted.
"""

from __future__ import annotations

import logging

import pytest

from events.subjects import BusNames
from services.runtime.ground.errors import RetryableError
from services.stack import Stack


def _stack() -> Stack:
    return Stack(None, None, None, BusNames("t"))  # type: ignore[arg-type]  # no service uses them


async def _run_failing(stack: Stack, error: Exception) -> None:
    """Supervise a service that raises ``error`` once, then returns."""
    calls = 0

    async def service() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise error

    await stack._supervise("agent-node-a", service)  # restarted after its back-off (0.5 s)
    assert calls == 2 and stack.restarts == 1


@pytest.mark.parametrize(
    "error",
    [
        RetryableError("transient bus failure: TimeoutError: nats: timeout (x.node.a.view)"),
        ConnectionRefusedError(111, "Connect call failed"),
    ],
)
async def test_a_service_failing_on_a_server_away_is_one_line_and_restarted(
    caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    stack = _stack()
    caplog.set_level(logging.INFO)
    await _run_failing(stack, error)
    [record] = [r for r in caplog.records if "restarting it" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "agent-node-a failed" in record.getMessage()
    assert type(error).__name__ in record.getMessage()


async def test_any_other_failure_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    stack = _stack()
    caplog.set_level(logging.INFO)
    await _run_failing(stack, KeyError("share-1"))
    [record] = [r for r in caplog.records if "restarting it" in r.getMessage()]
    assert record.levelno == logging.ERROR and record.exc_info is not None
