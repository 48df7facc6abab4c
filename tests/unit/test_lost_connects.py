"""A connect's leftover future, failed as its server went away, is one warning line.

asyncpg leaves a bare future behind when a connect is cancelled as its TCP connection
comes up; the connection's loss then fails it, and asyncio logged "Future exception was
never retrieved" as an error with a traceback — during a failover (seen once in
``tests/integration/test_failover.py``). ``quiet_pool_log`` (every store's open) puts a
handler on the running loop that makes such a future one warning line and leaves every
other report to the handler that was there.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from services.runtime.store.failover import quiet_pool_log

NEVER_RETRIEVED = "Future exception was never retrieved"


def _report(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], exc: Exception) -> None:
    loop.call_exception_handler({"message": NEVER_RETRIEVED, "exception": exc, "future": future})


async def test_a_lost_connects_future_is_one_warning_and_the_rest_goes_on_as_before(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.get_running_loop()
    before = loop.get_exception_handler()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        quiet_pool_log()
        quiet_pool_log()  # once per loop: not wrapped twice
        caplog.set_level(logging.WARNING)
        lost = loop.create_future()
        _report(loop, lost, ConnectionError("unexpected connection_lost() call"))
        [line] = [r for r in caplog.records if r.name == "dracap.failover"]
        assert line.levelno == logging.WARNING and line.exc_info is None
        assert "unexpected connection_lost() call" in line.getMessage()
        assert seen == []
        # a bug is still the previous handler's: another error, or a task's
        _report(loop, loop.create_future(), ValueError("a bug"))
        task = asyncio.ensure_future(asyncio.sleep(0))
        await task
        _report(loop, task, ConnectionError("a task's"))
        assert [type(c["exception"]).__name__ for c in seen] == ["ValueError", "ConnectionError"]
    finally:
        loop.set_exception_handler(before)
