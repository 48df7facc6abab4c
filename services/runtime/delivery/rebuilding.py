"""The bus is rebuilt from the log: the events stream and the durable consumers, kept in
place by their owner, and what the stream lacks published again.

PostgreSQL holds every event; the JetStream stream only carries them to the consumers.
When nats-server comes back without its store (a wiped volume, a new broker, a crash
before its last writes reached the disk), the stream, the durable consumers and every
consumer's place are gone, or the stream lacks its newest messages. Nothing restarts:

* the **stream's owner**, the relay, checks the stream with :meth:`BusKeeper.ensure` at
  its start, right after a publish found no stream, and every ``interval`` seconds (a
  ``STREAM.INFO`` and a ``CONSUMER.INFO`` per durable it owns: cheap, and each given
  :data:`ANSWER_WAIT_S` for its answer; no answer in time raises
  :class:`~services.runtime.ground.errors.Unanswered`, which the relay takes as "look
  again later", not as a failure of its round). ``dracap up`` makes the first check
  before any service pulls, with :meth:`BusKeeper.first_check`: asked again while
  nobody answers or the answer is "not now" (a cluster just started may not have
  elected its JetStream leader yet), for up to the failover timeout. It creates what is
  missing (the stream as :func:`~services.runtime.bus.jetstream.stream_config` says,
  each durable as :func:`~services.runtime.bus.jetstream.durable_config` says) and
  leaves what exists alone;
* the **relay** then publishes again, in order, from the position
  :meth:`BusKeeper.ensure` returns, and goes on with what is new;
* every **consumer** keeps pulling; while its durable is missing it logs that once and
  waits, and takes the messages as soon as its owner has put the durable back
  (:mod:`services.runtime.delivery.consuming`).

Who owns what
-------------
* the events stream: the relay. Its user may create the stream and update it, never
  purge or delete it nor any of its messages: the stream is configured ``deny_purge``
  and ``deny_delete``, which nats-server enforces for every caller and which no update
  can lift.
* the services' durables (the reservation feeds, ``audit``, ``billing``,
  :mod:`services.durables`): the relay too, not the services that read them.
  nats-server accepts a *push* consumer whose deliver subject is a JetStream API
  subject, so a user who may create consumers could aim JetStream at its own API; the
  relay, which may already change the stream, is the one service whose job includes
  that power. The services only pull and acknowledge.
* a node agent's durable: the enforcement service (:mod:`services.durables`), at the
  agent's lease and when the agent finds it missing. :func:`ensure_durables` is what
  any owner of durables calls.

What the stream lacks
---------------------
The relay remembers the stream sequence of the last message it published. When the
stream's last sequence is lower than that (or the relay has just started and does not
know it), the keeper looks at the stream's last message: its ``Nats-Msg-Id`` is an event
id, and the log says at which position that event is. What the bus carries after it
is missing (an empty or new stream holds nothing; the events no durable reads were
never published, so a stream whose last message is older than the relay's position may
lack nothing: the keeper reads the log from there to the first event the relay would
publish, :meth:`BusKeeper._first_carried`; the keeper remembers how far it found nothing
carried after that message, so while the stream's last message stays the same, each
check reads only what the log gained since). The relay republishes from there — but not
from further back than the consumers need:

* the **floor** is the lowest position any consumer recorded as reached
  (``consumer_checkpoints``, each consumer's high-water mark), plus one; a durable the
  keeper owns that has no row yet counts as position 0;
* and never further back than the stream's ``max_age``: the lost stream did not hold
  older events either (``events.recorded_at``, indexed).

A stream created here starts at that position (``first_seq``, nats-server 2.10 and
later). Stream sequences do not follow log positions (the relay passes over the events
no durable reads), but no sequence is above its event's position. An acknowledgement of
a message received before the loss and sent after it may therefore name a message of
the new stream that the same durable holds unacknowledged; that message then is not
delivered again should its consumer fail it — the same loss as a nak'd message below a
consumer's mark (below), absorbed the same way. Every consumer receives again what it
handled since the floor; its ``processed_messages`` rows make that a no-op. What a
consumer had not acknowledged when the store was lost — above its own mark — comes
again; a message it had nak'd for a later retry below its mark does not, unless another
consumer's mark is lower.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Sequence
from typing import Final

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import Header, StreamInfo
from nats.js.errors import NotFoundError

from events.subjects import EVERY_EVENT, BusNames, Carried
from services.runtime.bus.jetstream import (
    DUPLICATE_WINDOW_S,
    MAX_AGE_S,
    Durable,
    durable_config,
    ensure_stream,
    with_timeout,
)
from services.runtime.ground.errors import RetryableError, Unanswered, map_bus_error
from services.runtime.store import rows
from services.runtime.store.eventstore import EventStore
from services.runtime.store.failover import Deadline

__all__ = ["ANSWER_WAIT_S", "CHECK_INTERVAL_S", "BusKeeper", "ensure_durables"]

log = logging.getLogger("dracap.rebuilding")

#: Seconds between two checks of the stream and the durables by their owner.
CHECK_INTERVAL_S: Final = 5.0
#: The longest the keeper waits for an answer to one of its JetStream API requests.
ANSWER_WAIT_S: Final = 1.0

_CHECKPOINTS: Final = "SELECT consumer, position FROM consumer_checkpoints WHERE consumer <> $1"
_OLDEST_KEPT: Final = (
    "SELECT min(position) FROM events WHERE recorded_at >= now() - make_interval(secs => $1)"
)
_POSITION_OF: Final = "SELECT position FROM events WHERE event_id = $1::uuid"


class BusKeeper:
    """The events stream and the durables one owner keeps in place (module docstring)."""

    def __init__(
        self,
        store: EventStore,
        js: JetStreamContext,
        names: BusNames,
        durables: Sequence[Durable] = (),
        *,
        checkpoint: str = "relay",
        max_age: float = MAX_AGE_S,
        duplicate_window: float = DUPLICATE_WINDOW_S,
        interval: float = CHECK_INTERVAL_S,
        replicas: int | None = None,
        carried: Carried = EVERY_EVENT,
    ) -> None:
        self._store = store
        self._carried = carried  #: the events the relay publishes (the same as its)
        #: the stream's replicas (its durables take the same: :mod:`services.runtime.bus.jetstream`)
        self.replicas = replicas
        self._js = js  # what changes the stream or a durable: its creation may take a while
        self._look = with_timeout(js, ANSWER_WAIT_S)  # what only looks: answered at once
        self._names = names
        self.durables = list(durables)
        self._checkpoint = checkpoint
        self._max_age = max_age
        self._duplicate_window = duplicate_window
        self.interval = interval
        self.streams_created = 0  #: streams this keeper created
        self.durables_created = 0  #: durables this keeper created
        self._checked = False  # a first check creates what a new installation lacks
        self.unanswered = 0  #: checks the bus did not answer in time
        #: (the stream's creation, its last sequence, a position): the log up to the
        #: position held nothing the bus carries after that last message
        self._complete: tuple[object, int, int] | None = None

    async def ensure(self, relayed: int, last_seq: int | None) -> int | None:
        """Put back what is missing; the position to publish again from, or None.

        ``relayed``: every event up to here was in the stream; ``last_seq``: the stream
        sequence of the last message published (None: not known).
        """
        try:
            start = await self._ensure_stream(relayed, last_seq)
            await self._ensure_durables()
        except nats.errors.TimeoutError as exc:
            self.unanswered += 1
            where = self._names.events_subjects
            raise Unanswered(f"the bus did not answer the keeper's check ({where})") from exc
        except (nats.errors.Error, OSError) as exc:
            raise map_bus_error(exc, subject=self._names.events_subjects) from exc
        self._checked = True
        return start

    async def first_check(self, relayed: int, *, within: float) -> int | None:
        """:meth:`ensure` before the services start, asked again while the bus does not
        answer or answers "not now" (a retryable error), for up to ``within`` seconds
        after the first failure, with the store's back-off (:class:`Deadline`)."""
        deadline = Deadline(within)
        while True:
            try:
                return await self.ensure(relayed, None)
            except RetryableError as exc:
                log.warning("%s: asking again", exc)
                if not await deadline.wait():
                    raise

    async def _ensure_stream(self, relayed: int, last_seq: int | None) -> int | None:
        info = await self._stream_info()
        if info is None:
            start = await self.floor(relayed)
            await self._create_stream(start)
            if relayed:
                log.warning(
                    "the events stream was missing: created it; publishing the log "
                    "again from position %d to %d (what the bus carries of it)",
                    start,
                    relayed,
                )
            return start if start <= relayed else None
        await ensure_stream(  # its settings, should they differ
            self._js,
            self._names,
            duplicate_window=self._duplicate_window,
            max_age=self._max_age,
            current=info,
            replicas=self.replicas,
        )
        if last_seq is not None and info.state.last_seq >= last_seq:
            return None  # holds at least what was published
        last = (info.created, info.state.last_seq)
        complete = self._complete
        if complete is not None and complete[:2] == last:  # the same last message
            if complete[2] >= relayed:
                return None
            held = complete[2]  # what follows the message up to here was looked at
        else:
            held = await self._held(info)
            if held >= relayed:
                return None
        lacking = await self._first_carried(max(await self.floor(relayed), held + 1), relayed)
        if lacking is None:  # nothing after the last message that the bus carries
            self._complete = (*last, relayed)
            return None
        log.warning(
            "the events stream lacks events %d..%d (it holds up to position %d): "
            "publishing them again",
            lacking,
            relayed,
            held,
        )
        return lacking

    async def _stream_info(self) -> StreamInfo | None:
        try:
            return await self._look.stream_info(self._names.stream)
        except NotFoundError:
            return None

    async def _create_stream(self, first_seq: int) -> None:
        await ensure_stream(
            self._js,
            self._names,
            duplicate_window=self._duplicate_window,
            max_age=self._max_age,
            first_seq=first_seq,
            replicas=self.replicas,
        )
        self.streams_created += 1

    async def _held(self, info: StreamInfo) -> int:
        """The log position of the stream's last message (0: none, or not an event)."""
        if not info.state.messages or not info.state.last_seq:
            return 0
        message = await self._look.get_msg(self._names.stream, seq=info.state.last_seq)
        event_id = (message.headers or {}).get(Header.MSG_ID.value, "")
        try:
            position = await self._store.pool.fetchval(_POSITION_OF, event_id)
        except Exception as exc:  # not a UUID: a message the relay did not publish
            log.debug("last message of the stream names no event (%r)", exc)
            return 0
        return int(position or 0)

    async def _first_carried(self, first: int, last: int) -> int | None:
        """The position of the first event of ``first``..``last`` that the bus carries."""
        if first > last:
            return None
        pages = self._store.read_rows(first - 1, to_position=last)
        async with contextlib.aclosing(pages):
            async for page in pages:
                for row in page:
                    try:
                        node = rows.addressed_node(row)
                    except msgspec.MsgspecError:  # the relay decides what to do with it
                        return int(row[rows.POSITION])
                    if self._carried(row[rows.TYPE], node):
                        return int(row[rows.POSITION])
        return None

    async def floor(self, relayed: int) -> int:
        """The first position a consumer may still need (see the module docstring)."""
        async with self._store.pool.acquire() as connection:
            rows = await connection.fetch(_CHECKPOINTS, self._checkpoint)
            oldest_kept = await connection.fetchval(_OLDEST_KEPT, self._max_age)
        reached = {row["consumer"]: int(row["position"]) for row in rows}
        for durable in self.durables:
            reached.setdefault(durable.name, 0)
        needed = min(reached.values(), default=relayed) + 1
        if oldest_kept is None:  # nothing recorded within max_age: nothing to publish
            return relayed + 1
        return min(max(needed, int(oldest_kept)), relayed + 1)

    async def _ensure_durables(self) -> None:
        created = await ensure_durables(
            self._js, self._names, self.durables, new=not self._checked, look=self._look
        )
        self.durables_created += created


async def ensure_durables(
    js: JetStreamContext,
    names: BusNames,
    durables: Iterable[Durable],
    *,
    new: bool = False,
    look: JetStreamContext | None = None,
) -> int:
    """Create each of ``durables`` that the stream lacks; how many were created.

    For any owner of durables (the relay's keeper; the enforcement service for the node
    agents'): a ``CONSUMER.INFO`` each, a ``CONSUMER.CREATE`` for each missing one, one
    log line each (a warning, unless ``new``: a first start creates them all).
    ``look``: the context for the ``CONSUMER.INFO`` requests (default ``js``).
    """
    created = 0
    for durable in durables:
        try:
            await (look or js).consumer_info(names.stream, durable.name)
            continue
        except NotFoundError:
            pass
        await js.add_consumer(names.stream, durable_config(durable))
        created += 1
        if new:
            log.info("created durable consumer %s", durable.name)
        else:
            log.warning("durable consumer %s was missing: created it", durable.name)
    return created
