"""How a benchmark that starts processes and servers ends when it is stopped.

A benchmark that starts ``dracap up``, agents, embedded servers or a database of its
own stops them in its ``finally`` blocks. Ctrl-C (``KeyboardInterrupt`` under
:func:`asyncio.run`) cancels the run so those blocks run; SIGTERM — what ``timeout``
and a CI runner send — would end the process at once and leave them all behind, so
:func:`run` makes it cancel the run the same way
(:func:`services.runtime.ground.eventloop.cancel_on_sigterm`). Either way the command
then ends with one line on standard error (:func:`say_interrupted`) and status
:data:`INTERRUPTED`, never a traceback. A server it cannot use (an
:class:`~services.runtime.bus.endpoints.EndpointError`: PostgreSQL or NATS not
reachable, a login refused) ends it with one line naming the server and status 1.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import Final, TypeVar

from services.runtime.bus.endpoints import EndpointError
from services.runtime.ground.eventloop import cancel_on_sigterm

__all__ = ["INTERRUPTED", "run", "say_interrupted", "stoppable"]

T = TypeVar("T")

#: the exit status of a run stopped by Ctrl-C or SIGTERM (as a shell reports SIGINT)
INTERRUPTED: Final = 130


async def stoppable(main: Awaitable[T]) -> T:
    """``main``, cancelled by SIGTERM as by Ctrl-C (run it as the loop's main task)."""
    cancel_on_sigterm()
    return await main


def say_interrupted(name: str) -> None:
    """The one line a stopped benchmark ``name`` ends with."""
    print(f"{name}: interrupted; what it started is stopped", file=sys.stderr)


def run(name: str, main: Awaitable[T]) -> T:
    """Run ``main`` with :func:`asyncio.run`; stopped by Ctrl-C or SIGTERM, exit with
    :func:`say_interrupted` and :data:`INTERRUPTED` once its ``finally`` blocks ran; a
    server it cannot use ends it with one line and status 1."""
    try:
        return asyncio.run(stoppable(main))
    except (KeyboardInterrupt, asyncio.CancelledError):
        say_interrupted(name)
        raise SystemExit(INTERRUPTED) from None
    except EndpointError as exc:  # a server it cannot use: one line, status 1
        print(f"{name}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
