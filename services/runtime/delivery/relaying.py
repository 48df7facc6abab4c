"""The outbox relay: the Postgres event log, published in order to JetStream.

Services never publish to the bus; they append to the log (the single source of
truth) and the relay carries every committed event that some durable consumer reads to
the events stream, exactly once and in position order (``carried``:
:func:`services.durables.carried` in every deployment, every event when not given). The
events no durable reads — a claim's submission, its reservation, the agent's report:
three of the five a claim takes to be Ready — it passes over: its position and
checkpoint move past them, and a window of nothing else costs no round trip (each would
be stored by JetStream, acknowledged to the relay, and read by nobody; the log holds
them, and everyone who needs them reads the log). The loop:

1. read the log after the checkpoint, one *window* of rows at a time (keyset paging,
   the next page already being read while this one is published);
2. publish the whole window with ``publish_async``: every message is written to the
   connection at once and up to ``window`` acknowledgements are outstanding; the acks
   are awaited together, once per window (one round trip per window, never one per
   message);
3. when every ack of the window is in, the relay's position moves to the window's
   last event and the next window is read at once; a companion task stores the
   position as the checkpoint (``consumer_checkpoints``, consumer ``"relay"``;
   :mod:`services.runtime.delivery.highwater`) as often as it can, off the publishing path
   (a commit per window would put a WAL flush between every two windows);
4. when the log is drained, wait for the store's NOTIFY (or a poll timeout) and go on.

Hand-over: appends that this process's own store commits (one statement, or its own
transaction) are handed to the relay as they commit (``EventStore.on_commit``). When
the next position to publish is among them, the relay publishes them from memory,
without the NOTIFY wake-up and the read — in ``dracap up`` that is nearly every event
of the claim path, one round trip less per hop. Anything else (another process's
appends, appends inside a consumer's transaction, a gap) is read from the log as
above; the order, the windows and the checkpoint are the same either way. The buffer
between the store and the relay is a :class:`~services.runtime.store.handover.Handover`
(shared with the live state's tailer), holding at most four windows.

Exactly once: each message carries ``Nats-Msg-Id = event id`` (and
``Nats-Expected-Stream``). A crash after some acks but before the checkpoint caught
up makes the next relay publish those events again — the windows published since the
last stored checkpoint, normally one or two; JetStream recognises the ids within its
duplicate window (:data:`services.runtime.bus.jetstream.DUPLICATE_WINDOW_S`) and acknowledges
them as duplicates without storing them. Only a relay that stays down for longer than
the duplicate window *after such a crash* can store those events twice — the
consumers' idempotency (``processed_messages``) absorbs that. On a clean stop the
final position is stored before :meth:`Relay.run` returns.

Order: messages of one connection are stored in the order they were written, so a
window lands in position order. After a failed window (a publish error or an ack
timeout) nothing past the checkpoint is trusted; the relay backs off and publishes
again from the checkpoint.

The stream: the relay owns it, and the service durables
(:mod:`services.runtime.delivery.rebuilding`, given a
:class:`~services.runtime.delivery.rebuilding.BusKeeper`). At its start, every ``keeper.interval``
seconds and right after a publish found no stream, it has the keeper put back what is missing; when
the stream lacks events the relay had published (a broker that lost its store), it publishes them
again from the position the keeper names, then goes on. A check that JetStream does not answer
(the keeper's requests wait :data:`~services.runtime.delivery.rebuilding.ANSWER_WAIT_S`; a
clustered stream or durable between two leaders answers nothing for a few seconds) is put off
for an interval, and the relay publishes on: a stream that is missing says so by the next
publish's ``503``, which has the keeper look again. (Each check waited out the API's 5 s instead,
and failed the relay's round: a killed nats-server that led the stream or a durable stalled the
relay 10 s or more; issue 29.) While the broker is away, or the stream is,
the relay logs one line when that begins and one when it ends
(:class:`~services.runtime.ground.outages.StateLog`), not a traceback per retry.

Lag: ``dracap_relay_lag_events`` is the log's head less the relay's position, set as
the relay advances and, on its own timer (every ``lag_interval``), from the head read
from the log (the head heard of, when the database does not answer): it grows while
the broker is away, when nothing is published, and ``DracapRelayLag`` fires. It is 0
when :meth:`Relay.run` returns: a replica standing by (:mod:`services.runtime.ops.leadership`)
lags nothing; the active one reports the lag.

Lease: a deployed relay runs while it holds its lease (``dracap serve relay``,
:class:`~services.runtime.ops.leadership.Leadership`), and ``leased`` raises
:class:`~services.runtime.ground.errors.NotActive` before each window once it no longer does:
a relay that lost its lease publishes nothing more, its run stops, and it stands by.
Each window's events are counted by what became of them
(``dracap_relay_messages_total{outcome="stored"|"duplicate"|"unread"}``: stored by the
stream, recognised as stored before, or passed over).

Wire form: the envelope JSON of :func:`events.eventcodec.encode_event`. For rows written
under the current schema version the stored payload is spliced in unchanged
(``msgspec.Raw``), which spares a decode and re-encode per event; rows of an older
schema version are decoded (upcast) and published in the current form, with the
envelope's ``schema_version`` saying so. Handed-over envelopes are encoded from the
event itself (:func:`encode_event`): the same JSON, with the payload's keys in the
event's order instead of ``jsonb``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Final

import asyncpg
import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import Header, PubAck

from events.catalog import SCHEMA_VERSIONS, schema_version_of, tag_of
from events.envelopes import Envelope
from events.eventcodec import encode_event
from events.folding import Refusal
from events.subjects import EVERY_EVENT, BusNames, Carried, node_of
from services.runtime.delivery.highwater import SAVE_CHECKPOINT, HighWaterMark
from services.runtime.delivery.rebuilding import BusKeeper
from services.runtime.ground.context import ServiceContext
from services.runtime.ground.errors import LogDiverged, NotFound, Unanswered
from services.runtime.ground.metrics import RELAY_LAG, RELAY_MESSAGES
from services.runtime.ground.outages import StateLog
from services.runtime.ground.waiting import Signal, first_of, signalled, wait_for
from services.runtime.store import rows
from services.runtime.store.continuity import Continuity
from services.runtime.store.eventstore import ANSWER_WAIT_S, EventStore
from services.runtime.store.handover import Handover
from services.runtime.store.refusals import note

__all__ = ["CHECKPOINT", "Outgoing", "Relay", "outgoing"]

CHECKPOINT: Final = "relay"
#: JetStream API errors that say the stream is not there: stream not found, expected
#: stream does not match.
_NO_STREAM_CODES: Final = frozenset({10059, 10060})
#: What a publish into no stream raises (nobody answers it), and a missing stream.
_NO_STREAM: Final = (
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.NotFoundError,
    NotFound,
)
_log = logging.getLogger(__name__)


def _no_stream(exc: BaseException) -> bool:
    """Whether a failed publish says the stream is missing (the broker answers)."""
    if isinstance(exc, _NO_STREAM):
        return True
    return isinstance(exc, nats.js.errors.APIError) and exc.err_code in _NO_STREAM_CODES


_ENCODER: Final = msgspec.json.Encoder()


class Outgoing(msgspec.Struct, frozen=True):
    """One message for the bus: subject, envelope JSON, event id and log position."""

    subject: str
    data: bytes
    event_id: str
    position: int


def outgoing(
    names: BusNames, row: asyncpg.Record, carried: Carried = EVERY_EVENT
) -> Outgoing | None:
    """The bus message of one stored event row (see "Wire form" above); ``None`` for an
    event the bus does not carry (``carried``: no durable reads it), and for an event the
    fold's driver refuses to decode whose message cannot be made (an old schema version, a
    node that does not read): it is left off the bus, since every reader skips it anyway
    (:mod:`events.folding`), and counted once."""
    tag, version = row[rows.TYPE], row[rows.SCHEMA_VERSION]
    if version != SCHEMA_VERSIONS.get(tag):
        event = rows.decoded(row)
        if isinstance(event, Refusal):
            note(event, str(row[rows.EVENT_ID]), row[rows.ACTOR])
            return None
        env = rows.envelope_with(row, event)
        env = msgspec.structs.replace(env, schema_version=schema_version_of(env.event))
        return outgoing_envelope(names, env, carried)
    try:
        node = rows.addressed_node(row)
        subject = names.subject_of(tag, node)
    except Exception:  # not a node name: the event does not decode (or the subject is bad)
        event = rows.decoded(row)
        if isinstance(event, Refusal):
            note(event, str(row[rows.EVENT_ID]), row[rows.ACTOR])
        return None
    if not carried(tag, node):
        return None
    wire = rows.raw_envelope_of(row)
    return Outgoing(subject, _ENCODER.encode(wire), wire.event_id, wire.position)


def outgoing_envelope(
    names: BusNames, env: Envelope, carried: Carried = EVERY_EVENT
) -> Outgoing | None:
    """The bus message of an envelope this process appended (same form as from its row);
    ``None`` for an event the bus does not carry."""
    tag, node = tag_of(env.event), node_of(env.event)
    if not carried(tag, node):
        return None
    return Outgoing(names.subject_of(tag, node), encode_event(env), env.event_id, env.position)


class Relay:
    """Publishes the event log to JetStream in order, ``window`` messages in flight."""

    def __init__(
        self,
        context: ServiceContext[EventStore],
        *,
        window: int = 256,
        checkpoint: str = CHECKPOINT,
        ack_timeout: float = 10.0,
        idle_poll: float = 1.0,
        retry_delay: float = 0.5,
        keeper: BusKeeper | None = None,
        lag_interval: float = 1.0,
        leased: Callable[[], None] = lambda: None,
        carried: Carried = EVERY_EVENT,
    ) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        store = self._store = context.stores
        self._keeper = keeper
        self._check_at = 0.0  # monotonic time of the keeper's next check
        #: the stream sequence of the last message published (None: not known)
        self._last_seq: int | None = None
        self._trouble = StateLog(_log, "relay")
        self._js = context.js
        self._names = context.names
        self._window = window
        self._checkpoint = checkpoint
        self._ack_timeout = ack_timeout
        self._idle_poll = idle_poll
        self._retry_delay = retry_delay
        self._lag_interval = lag_interval
        #: raises NotActive when this relay may not publish (it lost its lease)
        self._leased = leased
        self._carried = carried  #: the events published; the others are passed over
        self.position = 0  #: every event up to here is in the stream
        self._mark = HighWaterMark(store, checkpoint)
        self.published = 0  #: messages the stream stored
        self.duplicates = 0  #: messages the stream recognised as already stored
        self.unread = 0  #: events passed over: no durable reads them (or they do not decode)
        self.windows = 0  #: windows published
        self.handed_over = 0  #: messages published from this process's appends, unread
        #: this process's committed appends not yet published
        self._handover = Handover(lambda: self.position, kept=4 * window)
        #: the rows read last, compared with the log after a new session (a failover)
        self._continuity = Continuity()

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until ``stop`` is set; the window in flight is finished first."""
        self.position = await self.load_checkpoint()
        # a lambda, so a subclass's or a test's _save_checkpoint is the one called
        mark = self._mark = HighWaterMark(
            self._store, self._checkpoint, save=lambda p: self._save_checkpoint(p)
        )
        mark.position = mark.saved = self.position
        done = asyncio.Event()
        keeper = asyncio.create_task(mark.run(done))
        lag = asyncio.create_task(self._measure_lag(done), name="dracap-relay-lag")
        try:
            with self._handover.attached(self._store):
                await self._relay(stop)
        except BaseException:  # cancelled: the process is going down, no final store
            keeper.cancel()
            raise
        finally:
            done.set()
            lag.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lag
            RELAY_LAG.set(0)  # a relay that stands by lags nothing: the active one says
            with contextlib.suppress(asyncio.CancelledError):
                await keeper  # on a clean stop: stores the final position

    async def _measure_lag(self, done: asyncio.Event) -> None:
        """Set the lag from the log's head every ``lag_interval``, published or not."""
        while not done.is_set():
            try:
                head = await self._store.head()
            except Exception:  # the database is away: what was heard of is all there is
                head = 0
            RELAY_LAG.set(max(0, max(head, self._store.known_head) - self.position))
            with contextlib.suppress(TimeoutError):
                await wait_for(done.wait(), self._lag_interval)

    async def _relay(self, stop: asyncio.Event) -> None:
        """Drain and wait until ``stop`` is set, retrying after a failure."""
        async with signalled(stop) as stopping:
            await self._relay_until(stop, stopping)

    async def _relay_until(self, stop: asyncio.Event, stopping: Signal) -> None:
        while not stop.is_set():
            try:
                await self._keep()
                await self._drain(stop)
                self._trouble.recovered()
                if not stop.is_set():
                    await self._wait(stopping)
            except LogDiverged as exc:  # a failover lost events this relay had published
                _log.error("relay: %s; publishing again from position %d", exc, exc.position)
                self._go_back(exc.position - 1)
            except Exception as exc:
                if _no_stream(exc):
                    self._check_at = 0.0  # have the keeper look at once
                self._trouble.failed(exc, f"after position {self.position}")
                await first_of(asyncio.sleep(self._retry_delay), stop.wait())

    async def _keep(self) -> None:
        """Have the keeper put back what is missing, when a check is due; publish again
        what the stream lacks."""
        keeper = self._keeper
        if keeper is None or time.monotonic() < self._check_at:
            return
        try:
            start = await keeper.ensure(self.position, self._last_seq)
        except Unanswered as exc:  # a stream or durable between two leaders: publish on
            _log.debug("relay: the keeper's check is put off: %s", exc)
            self._check_at = time.monotonic() + keeper.interval
            return
        self._check_at = time.monotonic() + keeper.interval
        if start is not None and start <= self.position:
            self._go_back(start - 1)

    def _go_back(self, position: int) -> None:
        """Publish again from after ``position`` (the stream lacks what came after it, or
        the log does not hold it any more); JetStream drops the ids it stored already.
        The next drain stores the go-back first where the stored row is ahead of it."""
        self.position = position
        self._mark.go_back(position)
        self._handover.discard_passed()
        self._last_seq = None

    @property
    def saved(self) -> int:
        """The stored checkpoint (at most :attr:`position`)."""
        return self._mark.saved

    async def load_checkpoint(self) -> int:
        """The stored checkpoint (0 when the relay has never run)."""
        position: int | None = await self._store.reading(
            lambda pool: pool.fetchval(
                "SELECT position FROM consumer_checkpoints WHERE consumer = $1", self._checkpoint
            )
        )
        return position or 0

    async def _drain(self, stop: asyncio.Event) -> None:
        self._handover.offered.clear()  # an offer from here on wakes the next wait at once
        await self._mark.rewound()  # a go-back behind the stored row is stored first
        await self._store.verify(self._continuity)  # (after a new session: a failover?)
        while not stop.is_set():
            offered = self._take_offered()
            if (
                not offered
                and self._store.known_head > self.position
                and await self._store.appends_answered(
                    ANSWER_WAIT_S, enough=lambda: self._handover.covers(self._store.known_head)
                )
            ):
                offered = self._take_offered()  # the gap was an append of ours, unanswered
            if offered:  # this process's own appends, next in line: no read
                made = (outgoing_envelope(self._names, e, self._carried) for e in offered)
                await self._publish_window([m for m in made if m is not None], len(offered))
                self._advance(offered[-1].position)
                self.handed_over += len(offered)
                continue
            if self._store.known_head <= self.position:
                break  # nothing committed past us that we heard of
            async for page in self._store.read_rows(
                self.position, batch_size=self._window, continuity=self._continuity
            ):
                made = (outgoing(self._names, row, self._carried) for row in page)
                await self._publish_window([m for m in made if m is not None], len(page))
                self._advance(page[-1][rows.POSITION])
                if stop.is_set():
                    return
            self._handover.discard_passed()
        RELAY_LAG.set(max(0, self._store.known_head - self.position))

    def _advance(self, position: int) -> None:
        self.position = position
        self._mark.advance(position)
        RELAY_LAG.set(max(self._store.known_head, position) - position)

    def _take_offered(self) -> list[Envelope]:
        """The offered envelopes that come next, in order, up to a window."""
        return self._handover.take(self._window)

    async def _publish_window(self, messages: Sequence[Outgoing], events: int) -> None:
        """Write every message of a window of ``events`` events, then await all
        acknowledgements together (nothing to await: no round trip)."""
        self._leased()  # a relay that lost its lease publishes nothing more
        unread = events - len(messages)
        self.unread += unread
        RELAY_MESSAGES.labels("unread").inc(unread)
        if not messages:
            return
        acks: list[asyncio.Future[PubAck]] = []
        try:
            for message in messages:
                acks.append(await self._publish_async(message))
            async with asyncio.timeout(self._ack_timeout):
                results = await asyncio.gather(*acks)
        finally:
            for ack in acks:
                ack.cancel()  # no-op once done; releases the client's pending slot if not
        duplicates = sum(1 for result in results if result.duplicate)
        self._last_seq = max(result.seq for result in results)
        self.duplicates += duplicates
        self.published += len(results) - duplicates
        RELAY_MESSAGES.labels("stored").inc(len(results) - duplicates)
        RELAY_MESSAGES.labels("duplicate").inc(duplicates)
        self.windows += 1

    async def _publish_async(self, message: Outgoing) -> asyncio.Future[PubAck]:
        """Hand one message to the connection; returns the future of its ack."""
        return await self._js.publish_async(
            message.subject,
            message.data,
            stream=self._names.stream,
            headers={Header.MSG_ID.value: message.event_id},
        )

    async def _save_checkpoint(self, position: int) -> None:
        await self._store.pool.execute(SAVE_CHECKPOINT, self._checkpoint, position)

    async def _wait(self, stopping: Signal) -> None:
        """Until the log moves past the checkpoint, an append is offered, ``stopping`` is
        set, or a poll passes (at most until the keeper's next check): one future."""
        poll = self._idle_poll
        if self._keeper is not None:
            poll = max(0.0, min(poll, self._check_at - time.monotonic()))
        await self._store.wait_for_new(
            self.position, poll, wakes=(self._handover.offered, stopping)
        )
