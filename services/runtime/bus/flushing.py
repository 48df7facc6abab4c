"""Flushing a connection so that the server has read every command sent on it before.

``nats.aio.client.Client.flush`` sends a PING and waits for the PONG: the promise is
that the server has read what was sent before it. nats-py (2.16) keeps that promise
only for what its flusher task has already written. A new subscription's ``SUB`` is
queued for that task, while the PING is written to the socket at once, ahead of it;
the PONG can then come back before the server has read the ``SUB``, and a request from
another connection, sent right after, finds nobody subscribed (``NoRespondersError``),
or a message published right after is not delivered to the new subscription. Seen in
``tests/integration/test_large_replies.py`` about once in ten runs of the file, and in
4 of 300 rounds of subscribe, one flush, request from another connection (the rounds of
``tests/integration/test_flushing.py``, which failed every run with one flush).

:func:`flushed` flushes twice. The flusher task is woken when the command is queued,
before the first PING is written, so it has written the queued commands by the time
that PING's PONG is read; the second PING goes out after them, and its PONG says the
server has read them. Every place that makes a subscription for someone else to reach
(a service's request subjects, a watch) flushes with it.
"""

from __future__ import annotations

from typing import Final

from nats.aio.client import Client

__all__ = ["FLUSH_TIMEOUT_S", "flushed"]

#: how long each of the two round trips may take (nats-py's default for ``flush``)
FLUSH_TIMEOUT_S: Final = 10


async def flushed(nc: Client, timeout: int = FLUSH_TIMEOUT_S) -> None:  # noqa: ASYNC109
    """Return once the server has read every command sent on ``nc`` before this call,
    subscriptions included (see the module docstring)."""
    await nc.flush(timeout)  # its PONG may pass commands still queued before it
    await nc.flush(timeout)  # written after them: the server has read them all
