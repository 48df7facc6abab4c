"""Whether what a reader read of the log is still the log, after a failover.

A reader of the log goes on from the last position it read (``position > last``). That
is sound on one server, whose committed rows never change. Across a failover it is not:
a commit can become visible on a primary before its synchronous standby has it — a
backend waiting for the standby's confirmation stops waiting when its postmaster dies
(or when its session is terminated or its wait cancelled) and its transaction becomes
visible to the sessions still alive. A reader may read such an event; the promoted
standby never got it, and hands its position to the next append. A reader that went on
from where it was would never read that append: a claim admitted right after a
failover would never be reserved, and a relay would never publish it (CI, 2026-12-07:
a claim of the fault harness never became Ready after a failover;
``docs/operations.md``, "High availability").

So a reader keeps the rows it read last (:class:`Continuity`, the last
:data:`KEPT` of them: the events a failover can lose are the few commits in flight when
the primary died, all at the log's end) and, whenever its store has opened a database
session since it last looked (:attr:`EventStore.sessions
<services.runtime.store.eventstore.EventStore.sessions>`: a session lost with its server
is opened again, on whichever server is the primary now), compares their event ids
with the ones the database holds at those positions — one indexed range query, before
the reader takes anything more. A difference raises
:class:`~services.runtime.ground.errors.LogDiverged` with the first position that
differs: everything before it is the database's, and the reader reads again from
there (the relay, :mod:`services.runtime.delivery.relaying`) or folds the log again
(the live state, :mod:`services.runtime.store.livestate`, which cannot unfold). Each
difference is counted (``dracap_log_divergences_total``; the alert
``DracapLogDiverged``): the readers recover, but the log lost commits that were seen.

Cost: nothing per row read (a page is kept by reference); one query after a session
was opened — at the start, when the pool grows, after an idle session expired, and
after a failover.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Final

import asyncpg

from services.runtime.ground.errors import LogDiverged
from services.runtime.ground.metrics import LOG_DIVERGENCES
from services.runtime.store.rows import EVENT_ID, POSITION

__all__ = ["KEPT", "Continuity"]

#: rows compared after a new session: many more than the commits a failover can catch
#: in flight (one per pooled session of every process, a few events each)
KEPT: Final = 1024

_HELD: Final = "SELECT position, event_id::text FROM events WHERE position BETWEEN $1 AND $2"


class Continuity:
    """The last rows a reader of the log read, and the store's session count when they
    were last compared with the database (see the module docstring)."""

    def __init__(self) -> None:
        self._pages: deque[Sequence[asyncpg.Record]] = deque()
        self._rows = 0  #: rows in ``_pages``
        #: ``EventStore.sessions`` when the rows were last compared (or read)
        self.checked = 0

    def saw(self, rows: Sequence[asyncpg.Record]) -> None:
        """Keep ``rows`` (a page handed out, in position order) as the newest read."""
        if not rows:
            return
        if len(rows) > KEPT:
            rows = rows[-KEPT:]
        self._pages.append(rows)
        self._rows += len(rows)
        while self._rows - len(self._pages[0]) >= KEPT:
            self._rows -= len(self._pages.popleft())

    def forget(self) -> None:
        """Nothing read yet (a reader that starts again from elsewhere)."""
        self._pages.clear()
        self._rows = 0

    def due(self, sessions: int) -> bool:
        """Whether rows were read and a session was opened since they were compared."""
        return self._rows > 0 and sessions != self.checked

    def last(self) -> list[tuple[int, str]]:
        """The newest :data:`KEPT` rows read: (position, event id), in position order."""
        kept = [(row[POSITION], row[EVENT_ID]) for page in self._pages for row in page]
        return kept[-KEPT:]

    async def check(
        self, connection: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy, sessions: int
    ) -> None:
        """Compare the rows read last with the database's, if a session was opened since
        (``sessions``: the store's count now; :meth:`due`); raise :class:`LogDiverged` at
        the first that differs."""
        if not self.due(sessions):
            return
        kept = self.last()
        rows = await connection.fetch(_HELD, kept[0][0], kept[-1][0])
        held: dict[int, str] = {row[0]: row[1] for row in rows}
        for position, event_id in kept:
            if held.get(position) != str(event_id):  # (a row read as a UUID: the same id)
                self.forget()
                LOG_DIVERGENCES.inc()
                raise LogDiverged(
                    f"the event read at position {position} ({event_id}) is not in the log "
                    f"now ({held.get(position) or 'no event there'}): a failover lost it",
                    position=position,
                )
        self.checked = sessions
