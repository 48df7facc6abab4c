"""In log order, exactly once: a subscriber that keeps tables of its own reads the log.

JetStream delivers at least once and, after a crash or a nak, not in order: a message
a dead consumer held comes back only after the ack wait, while later ones flow to its
successor at once. A subscriber whose rows depend on order (the audit names shares
from their reservation; billing closes stretches a reservation opened; an expiry or a
fence acts on the shares live *at that point*) therefore treats a message as a
wake-up, never as the unit of work: :func:`catch_up`, run inside the transaction of
``Handled.writes`` (:mod:`services.runtime.consuming`),

1. locks the subscriber's row in ``ledger_positions`` (``FOR UPDATE``: two instances
   take turns),
2. reads the log from that position up to the newest position of the messages in hand
   (every position below a published one is committed: positions are gap-free, in
   commit order) and returns those envelopes, in order,
3. moves the position there.

Refused events (:mod:`events.folding`) are left out of what it returns, as every reader
of the log leaves them out: a row whose payload the fold's driver does not decode, and,
given the subscriber's live view, an event the fold refused there (the view is brought
up to the newest position first). Each is counted and logged once per process
(:mod:`services.runtime.refusals`).

The subscriber applies what it returns and the transaction commits it all together:
the rows, the position and the messages' ``processed_messages``. A message whose
position is already behind the subscriber's changes nothing; a crash anywhere leaves
the position where the rows are. The first message after a long pause (or on a long
log) reads everything since, in one transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from events.catalog import Envelope
from events.folding import Refusal
from services.runtime.eventstore import Connection, iter_rows
from services.runtime.livestate import LiveState
from services.runtime.refusals import note
from services.runtime.rows import ACTOR, EVENT_ID, POSITION, decoded, envelope_with

__all__ = ["catch_up"]

_ENSURE: Final = (
    "INSERT INTO ledger_positions (subscriber, position) VALUES ($1, 0) ON CONFLICT DO NOTHING"
)
_LOCK: Final = "SELECT position FROM ledger_positions WHERE subscriber = $1 FOR UPDATE"
_MOVE: Final = "UPDATE ledger_positions SET position = $2 WHERE subscriber = $1"


async def catch_up(
    connection: Connection,
    subscriber: str,
    envs: Sequence[Envelope],
    live: LiveState | None = None,
) -> list[Envelope]:
    """The log's envelopes after ``subscriber``'s position up to the newest of ``envs``,
    refused events left out (see the module docstring); call it inside the transaction
    that writes their rows."""
    await connection.execute(_ENSURE, subscriber)
    done = int(await connection.fetchval(_LOCK, subscriber))
    target = max((e.position for e in envs), default=0)
    if target <= done:
        return []
    refused: dict[int, str] = {}
    if live is not None:
        refused = (await live.fresh(target)).refused
    out: list[Envelope] = []
    async for rows in iter_rows(connection, done, 1000, target):
        for row in rows:
            event = decoded(row)
            if isinstance(event, Refusal):
                note(event, str(row[EVENT_ID]), row[ACTOR])
            elif row[POSITION] not in refused:
                out.append(envelope_with(row, event))
    await connection.execute(_MOVE, subscriber, target)
    return out
