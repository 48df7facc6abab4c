"""The event loop the long-running service processes run on.

``dracap up`` and ``dracap agent`` spend most of their time moving small messages
between Postgres, NATS and Python: a claim costs a few statements and bus messages,
each a socket write and a wake-up. With the standard library's selector loop that
plumbing — its transports are Python code — took a quarter of a service process's
CPU in ``benchmarks/pipeline.py``. uvloop runs the same asyncio API on libuv, with
the transports in C; asyncpg and nats-py use it as they use the standard loop.

:func:`run` is :func:`asyncio.run` on uvloop where uvloop is installed (a dependency
on Linux), else on the standard loop; ``DRACAP_EVENT_LOOP=asyncio`` forces the
standard one (to rule the loop out when chasing a problem).

:func:`log_to_stderr` is how every long-running process logs: INFO and above, one
line each, to standard error (what a container runtime collects); :func:`stop_on_signals`
is how it learns to stop: SIGINT or SIGTERM sets an event its services watch, so each
ends its work cleanly instead of being interrupted. A command that runs once and owns
child processes meanwhile (a benchmark) uses :func:`cancel_on_sigterm` instead: SIGTERM
cancels it as Ctrl-C does, and its ``finally`` blocks stop what it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["cancel_on_sigterm", "log_to_stderr", "loop_name", "run", "stop_on_signals"]

T = TypeVar("T")


def log_to_stderr(tag: str | None = None) -> None:
    """Log INFO and above to standard error, one timestamped line per record; ``tag``
    (a child process's name) follows the time as ``[tag]``."""
    named = f"[{tag}] " if tag else ""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {named}%(name)s %(levelname)s %(message)s",
    )
    # the migration step says itself which revision it migrates to; alembic's own
    # per-revision lines are for `alembic` users
    logging.getLogger("alembic").setLevel(logging.WARNING)
    # asyncpg (0.32 and later) logs each pool's failed try to restore its minimum
    # size during an outage, once per pool and try; the health monitor and each loop
    # already say once that the database is down and once that it is back
    logging.getLogger("asyncpg.pool").setLevel(logging.ERROR)


def stop_on_signals() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets (handlers on the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


def cancel_on_sigterm() -> None:
    """Let SIGTERM cancel the running task as Ctrl-C does under :func:`asyncio.run`.

    For the commands that own child processes and servers for the length of one run
    (the benchmarks): their ``finally`` blocks stop what they started, which SIGTERM's
    default action (the process ends at once) would skip."""
    task = asyncio.current_task()
    if task is None:
        return
    with contextlib.suppress(NotImplementedError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: what :func:`run` will use."""
    if os.environ.get("DRACAP_EVENT_LOOP", "").strip().lower() == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on the service event loop (see the module docstring)."""
    if loop_name() == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)
