"""Durable, idempotent consumers of the events stream, with group commit.

A service that reacts to events gives a handler: per message
(:data:`~services.runtime.delivery.handlers.Handler`) or per *group* of messages
(:data:`~services.runtime.delivery.handlers.GroupHandler`); it returns what it wants written,
:class:`~services.runtime.delivery.handlers.Handled` (the contract:
:mod:`services.runtime.delivery.handlers`). :class:`Consumer` does the rest, for one JetStream
durable pull consumer (explicit ack) per service.

Receiving
---------
The consumer keeps pull requests outstanding on a private inbox
(:class:`~services.runtime.delivery.pulling.Puller`: ``batch`` messages, expiring after
``poll_interval``), so messages flow in as the stream gets them and a lone message is
handled at once. Whatever has arrived when the previous group is done forms the
next group (at most ``max_group`` messages): under load, groups grow by themselves
and one commit carries many messages; when idle, each message goes alone.

Its durable
-----------
The durable's configuration is :func:`~services.runtime.bus.jetstream.durable_config`'s. A
consumer that *owns* its durable (``owner=True``: every consumer of a test or of a
stack that has no relay keeping them) creates it at start — waiting, one log line,
while the stream is not there yet — and creates it again whenever its pull requests
find nobody to answer them (nats-server answers ``503`` when the durable is gone: a
broker that lost its store). A consumer that does not own its durable (the
reservation workers in a deployment: the relay owns theirs,
:mod:`services.runtime.delivery.rebuilding`) only pulls: while its durable is missing it logs
that once, asks again every ``poll_interval``, and logs once more when messages come
again. A node agent's consumer (:mod:`services.enforcement.consumer`) is no
:class:`Consumer`: the enforcement service owns its durable.

Confirming
----------
A bus message is a notification, never a fact: before anything else, every message
received is checked against the log (:mod:`services.runtime.delivery.confirming`). One the log
does not hold as sent — at its position, with its id and payload — is terminated
unhandled and counted (``dracap_unconfirmed_messages_total``); it never reaches the
handler, ``processed_messages`` or the dead letters. Pass ``confirmation`` built on
the service's live view to answer most messages without a query.

Handling a group, committed in **one** statement
------------------------------------------------
A handler writes nothing itself: everything it wants written is in
``Handled.batches``, and running it twice for a message is harmless (it decides from
a live view, and a stale decision is refused by the expected versions). So a group
commits without an explicit transaction:

1. the handler runs on the group, with a plain pooled connection to read through;
2. **one** autocommitted statement (``dracap_append_guarded``, migration 0005) records
   the messages in ``processed_messages``, appends the handler's events and applies
   their guards. It holds the log's head lock only for the server's own work (a
   transaction would hold it across the ``COMMIT`` round trip, with every other writer
   waiting), and the group costs one round trip. A group whose handler wants nothing
   written only records its messages (one ``INSERT``);
3. if a message of the group had been recorded before (a redelivery after a lost ack,
   a replay), the statement raises :class:`~services.runtime.ground.errors.AlreadyHandled`
   and writes nothing; the consumer asks which were recorded, acknowledges those, and
   handles the rest again from step 1. In a group of several messages every batch
   must say, per event, which message caused it
   (:class:`~services.runtime.store.appends.Cause`); for a single message the append's
   metadata says it.

A service that keeps tables of its own from the log (the audit and billing
subscribers) is no consumer: it reads the log itself, in batches
(:mod:`services.runtime.delivery.projecting`).

After the commit, ``consumer_checkpoints`` follows to the highest log position among
the new messages — stored off the hot path by
:class:`~services.runtime.delivery.highwater.HighWaterMark`, since it is a high-water mark for
lag, not a resume point (naks let later messages overtake earlier ones; JetStream's
durable consumer is the resume point, ``processed_messages`` the exactly-once).

Then every message is acknowledged. A crash before the commit leaves nothing behind
and JetStream redelivers; a crash between commit and ack makes the redelivery a no-op
by step 3. So delivery is at least once, and the effects are exactly once.

A consumer with a per-message handler uses groups of one. ``wants`` (optional) names
the envelopes a handler acts on; the others are acknowledged without a commit.

``lock_key`` (optional) serialises the handlers of every consumer that names it,
anywhere (the reservation planner): the lock is a session lock on a connection the
consumer keeps between groups. It keeps it while messages keep arriving — for at most
:data:`LOCK_HOLD_S` at a time, so other workers get their turn — and while it is idle,
until someone asks for it: whoever finds the lock taken (:func:`take_lock`: another
worker, the planner's own round without a message) announces on
:data:`LOCK_WANTED_CHANNEL` that it waits, then waits; a consumer that hears it
(:meth:`~services.runtime.store.eventstore.EventStore.on_notice`; not its own
announcement, told by the session's pid) gives the lock back as soon as its group in
hand is done (a request heard while it does not hold the lock makes it give the lock
back after its next group). For ``lock_shared`` seconds (:data:`LOCK_SHARED_S`) after
it last met another taker (asked, or had to ask) it lets go whenever it is idle, as
before: where several workers take turns, each turn stays a grant and a release, not a
request and a wait. Idle and unasked it lets go after ``lock_idle``
(:data:`LOCK_IDLE_S`: a bound for a waiter whose announcement was lost with a broken
LISTEN connection). A lone worker thus takes the lock once, not once per message group:
at low rates, where each claim is a group of its own, that was two statements a claim
(the grant and the release) and a round trip on the claim's path. It lets go on a
failure and on stop as well.
The grant returns the log's head at the moment the lock was granted;
``HandlerContext.locked_head`` is the
position a handler's view must be folded to: that head, then the head after each of
the consumer's own commits while it keeps the lock — and never less than the highest
position among the messages handled, so the handler can wait for its live view to
reach it instead of reading the log.

That last part is what keeps every message's effect: while the lock is kept, other
writers go on committing (the claims API admits the next claim, an agent releases
capacity), and a message about such a commit can arrive during a group. Were the mark
only the head of the grant and of the consumer's own commits, a group that wrote
nothing would leave it behind the next message, the handler would decide on a view
that has not folded that message's event, decide nothing for it, and the message
would be acknowledged without its effect — an admitted claim nobody plans, freed
capacity nobody re-plans, until some later message happens to trigger a round. (It
was seen: a third claim applied right after two others stayed ``admitted`` for good.)
The messages were confirmed against the log before the handler runs, so their
positions are committed and one read reaches them.

Failures
--------
If a group's commit fails for any reason, nothing of it was written, and each of
its messages is handled again *alone*, so one bad message cannot hold back the others
and every failure is attributed to its own message. For a single message, any
exception of the handler or the append (a
:class:`~services.runtime.ground.errors.ConflictError` included: the handler decided on a
stale view and re-reads on the next try) leaves nothing written and naks the
message with a delay from ``backoff`` (by delivery count). On delivery number
``max_deliver`` the consumer gives up: it appends ``MessageDeadLettered`` (stream
``system:<name>``, causation = the message's event id) together with the
``processed_messages`` row and the checkpoint, terminates the message and counts
``dracap_dead_letters_total``. A message that cannot even be decoded is the message of
an event the fold refuses (acknowledged unhandled, counted once as refused, never
dead-lettered) or one the log does not hold (unconfirmed); a message of an event the
fold refused is acknowledged unhandled as well (:mod:`services.runtime.delivery.confirming`).

A failure that says a server cannot be reached
(:func:`~services.runtime.ground.outages.is_unreachable`: PostgreSQL restarting, say) is not
the message's fault: it is nak'd with the longest back-off and that delivery does not
count towards ``max_deliver`` (nor towards the delivery a handler sees), so an outage
of any length dead-letters nothing.

The JetStream consumer itself is created with *unlimited* deliveries: the limit is
enforced here, where the dead letter is written. Were the server to stop
redelivering at the same count, a dead letter that failed to be written (the
database briefly away) would lose the message silently; this way it comes back and
the dead-lettering is tried again. A message delivered more than ``max_deliver``
times without an outcome (it crashed its consumer each time) is dead-lettered
without running the handler again.

Stopping
--------
:meth:`Consumer.run` checks ``stop`` between groups (waiting for a message takes at
most ``poll_interval``), finishes the group in hand, stops asking for more, and naks
(without delay) what had arrived but was not started, so another worker of the same
durable gets it at once; no message is left half done.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import msgspec
import nats.errors
from asyncpg import InterfaceError, Record
from asyncpg.pool import PoolConnectionProxy
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import Header
from nats.js.errors import NotFoundError

from events.actors import Actor
from events.catalog import MessageDeadLettered
from events.envelopes import Envelope
from events.errors import CatalogError
from events.eventcodec import decode_envelope
from events.subjects import BusNames
from services.runtime.bus.jetstream import Durable, durable_config, prefix_of
from services.runtime.delivery.confirming import WARN_EVERY_S, LogConfirmation
from services.runtime.delivery.handlers import (
    GroupHandler,
    Handled,
    Handler,
    HandlerContext,
    one_at_a_time,
)
from services.runtime.delivery.highwater import SAVE_CHECKPOINT, HighWaterMark
from services.runtime.delivery.pulling import Puller
from services.runtime.ground.errors import AlreadyHandled
from services.runtime.ground.metrics import (
    CONSUMER_REDELIVERIES,
    DEAD_LETTERS,
    UNCONFIRMED_MESSAGES,
)
from services.runtime.ground.outages import StateLog, is_unreachable, one_line
from services.runtime.ground.waiting import first_of, wait_for
from services.runtime.store.appends import Batch, Metadata, Processed
from services.runtime.store.eventstore import (
    MARK_PROCESSED,
    Connection,
    EventStore,
    session_gone,
)
from services.runtime.store.refusals import note

__all__ = ["HANDLED_BEFORE", "Consumer"]

_log = logging.getLogger(__name__)

_MARK_PROCESSED: Final = (
    "INSERT INTO processed_messages (consumer, event_id) VALUES ($1, $2) "
    "ON CONFLICT DO NOTHING RETURNING true"
)
#: Which of a group's messages a consumer recorded as handled before.
HANDLED_BEFORE: Final = (
    "SELECT event_id::text FROM processed_messages WHERE consumer = $1 "
    "AND event_id = ANY($2::uuid[])"
)


class _DeadLetter(msgspec.Struct, frozen=True):
    event_id: str
    position: int
    correlation_id: str | None
    reason: str


#: Event ids whose outage-failed deliveries a consumer remembers (the oldest go first).
_EXCUSED_KEPT: Final = 10_000
#: How long a consumer keeps its ``lock_key`` across groups while messages keep coming.
LOCK_HOLD_S: Final = 0.05
#: How long a consumer keeps its ``lock_key`` while no message comes and nobody asked.
LOCK_IDLE_S: Final = 1.0
#: Where a session that finds a ``lock_key`` taken says it waits for it (payload: the key).
LOCK_WANTED_CHANNEL: Final = "dracap_lock_wanted"


#: For this long after it last met another taker of its ``lock_key`` (asked for it, or
#: had to ask), a consumer lets the lock go whenever it is idle, as workers that take
#: turns always did: keeping it would make every turn a request and a wait.
LOCK_SHARED_S: Final = 10.0


async def take_lock(connection: Connection, key: int) -> tuple[int, bool]:
    """``key`` as a session lock on ``connection``: the log's head as of the grant, and
    whether it was taken by someone else first.

    A free lock is taken at once (``dracap_try_lock``, migration 0015); a taken one is
    announced as wanted on :data:`LOCK_WANTED_CHANNEL` by the same statement (a consumer
    keeping it while idle gives it back), then waited for (``dracap_lock``). Either way
    the head is read after the grant, so it counts every commit of the holder before.
    """
    head: int | None = await connection.fetchval("SELECT dracap_try_lock($1)", key)
    if head is not None:
        return head, False
    granted: int = await connection.fetchval("SELECT dracap_lock($1)", key)
    return granted, True


def close_session(connection: Connection) -> None:
    """Close ``connection``'s session now: the server drops its session locks with it,
    which a release to the pool would not (the pool resets nothing). One already closed
    is left as it is."""
    with contextlib.suppress(InterfaceError):
        connection.terminate()


@dataclasses.dataclass(slots=True)
class _HeldLock:
    """``lock_key`` held as a session lock between groups (see ``_hold_lock``)."""

    connection: PoolConnectionProxy[Record]
    head: int | None  #: what a handler must see: the grant's head, then own commits, messages
    since: float  #: monotonic time of the grant
    used: float  #: monotonic time the last group under it ended


class _Incoming(msgspec.Struct):
    """One received message, decoded."""

    msg: Msg
    env: Envelope
    delivery: int


class Consumer:
    """One durable pull consumer and its handler (see the module docstring)."""

    def __init__(
        self,
        store: EventStore,
        js: JetStreamContext,
        names: BusNames,
        *,
        name: str,
        filter_subject: str,
        handler: Handler | None = None,
        group_handler: GroupHandler | None = None,
        wants: Callable[[Envelope], bool] | None = None,
        lock_key: int | None = None,
        lock_idle: float = LOCK_IDLE_S,
        lock_shared: float = LOCK_SHARED_S,
        confirmation: LogConfirmation | None = None,
        max_deliver: int = 5,
        backoff: Sequence[float] = (0.1, 0.5, 2, 5),
        batch: int = 256,
        max_group: int = 128,
        ack_wait: float = 30.0,
        poll_interval: float = 1.0,
        actor: Callable[[], str] | None = None,
        on_dead_letter: Callable[[str], None] | None = None,
        owner: bool = True,
    ) -> None:
        if max_deliver < 1 or not backoff:
            raise ValueError("max_deliver must be at least 1 and backoff not empty")
        if (handler is None) == (group_handler is None):
            raise ValueError("give exactly one of handler and group_handler")
        if batch < 1 or max_group < 1:
            raise ValueError("batch and max_group must be at least 1")
        self._store = store
        self._js = js
        self._names = names
        self.name = name
        self._filter = filter_subject
        self._group: GroupHandler = group_handler or one_at_a_time(handler)  # type: ignore[arg-type]
        self._max_group = max_group if group_handler is not None else 1
        self._wants = wants
        self._lock_key = lock_key
        self._confirmation = confirmation or LogConfirmation(store)
        self._held: _HeldLock | None = None
        self._lock_idle = lock_idle
        self._lock_shared = lock_shared
        self._lock_pid: int | None = None  # the server pid of the session that takes it
        self._lock_wanted = False  # someone asked for the lock since it was last let go
        self._lock_shared_at = -math.inf  # when it last met another taker (monotonic)
        self._lock_asked = asyncio.Event()  # wakes the task that lets an idle lock go
        self._lock_use = asyncio.Lock()  # a group under the lock, or its release
        self._max_deliver = max_deliver
        self._backoff = tuple(backoff)
        self._batch = batch
        self._ack_wait = ack_wait
        self._poll = poll_interval
        #: whether this consumer creates its durable (see "Its durable" above)
        self.owner = owner
        self._durable_missing = False  # logged that the durable is missing, not yet back
        self._pulling = False  # run() has its pull requests out
        self._trouble = StateLog(_log, f"consumer {name}")  # one line per change of state
        for series in (CONSUMER_REDELIVERIES, DEAD_LETTERS, UNCONFIRMED_MESSAGES):
            series.labels(consumer=name)  # at 0 from the start
        #: who records this consumer's dead letters (a node agent: itself, with its epoch)
        self._actor = actor or (lambda: str(Actor.system(name)))
        #: told the event id of each message this consumer dead-letters
        self._on_dead_letter = on_dead_letter
        self.handled = 0  #: messages handled (committed and acked)
        self.skipped = 0  #: redeliveries found already handled
        self.ignored = 0  #: messages ``wants`` declined (acked without a commit)
        self.dead_lettered = 0
        self.unconfirmed = 0  #: messages the log does not hold as sent (terminated)
        self.refused = 0  #: messages of events the fold refuses (acknowledged unhandled)
        #: event id -> deliveries lost to an outage (oldest first)
        self._excused: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._unconfirmed_unlogged = 0  # dropped since the last warning
        self._unconfirmed_logged_at = -WARN_EVERY_S
        self.groups = 0  #: commits that handled more than one message
        self._mark = HighWaterMark(store, name)

    def detached(self) -> str | None:
        """``None`` while the consumer pulls from its durable, else why not (``/readyz``)."""
        if not self._pulling:
            return "not pulling"
        if self._durable_missing:
            return "its durable consumer is missing (its owner, the relay, makes it)"
        return None

    @property
    def durable(self) -> Durable:
        """This consumer's durable: its name, filter and ack wait."""
        return Durable(self.name, self._filter, self._ack_wait)

    async def run(self, stop: asyncio.Event) -> None:
        """Receive, handle and acknowledge until ``stop`` is set; then drain and return."""
        if self.owner and not await self._create_durable(stop):
            return
        nc = self._js._nc  # nats-py has no public accessor for the context's connection
        puller = Puller(
            nc,
            self._names.stream,
            self.name,
            batch=self._batch,
            expires=self._poll,
            prefix=prefix_of(self._js),
        )
        await puller.start()
        done = asyncio.Event()
        keeper = asyncio.create_task(self._mark.run(done))
        giver = None if self._lock_key is None else asyncio.create_task(self._give_back(done))
        self._pulling = True
        try:
            while not stop.is_set():
                try:
                    msgs = await puller.next(self._poll, self._max_group)
                except (
                    nats.errors.ConnectionClosedError,
                    nats.errors.ConnectionReconnectingError,
                ) as exc:
                    self._trouble.failed(exc)
                    await asyncio.sleep(self._poll)
                    continue
                self._trouble.recovered()
                if puller.missing:
                    puller.missing = False
                    await self._missing()
                elif msgs and self._durable_missing:
                    self._durable_missing = False
                    _log.info("consumer %s: its durable consumer is back", self.name)
                async with self._lock_use:
                    if msgs:
                        await self.process_group(msgs)
                    held, now = self._held, time.monotonic()
                    if held is not None and (
                        self._lock_wanted
                        or (puller.waiting and now - held.since > LOCK_HOLD_S)
                        or (not puller.waiting and now - held.used > self._lock_idle)
                        or (not puller.waiting and now - self._lock_shared_at < self._lock_shared)
                    ):
                        await self.let_go()  # asked for, others' turn, idle: too long or shared
        finally:
            self._pulling = False
            await self.let_go()
            for msg in await puller.stop():
                await _quietly(msg.nak())  # another worker takes it at once
            done.set()
            await keeper
            if giver is not None:  # it may still wait for the database to listen
                giver.cancel()
                await asyncio.wait([giver])  # (a cancellation of run itself still comes through)

    async def _give_back(self, done: asyncio.Event) -> None:
        """Hear who asks for ``lock_key`` and let it go while no group holds it."""
        forget: Callable[[], None] | None = None
        try:
            forget = await self._store.on_notice(LOCK_WANTED_CHANNEL, self._lock_request)
        except Exception as exc:  # the database away: the idle bound lets the lock go
            _log.debug("consumer %s: cannot hear lock requests (%r)", self.name, exc)
        try:
            while not done.is_set():
                await first_of(self._lock_asked.wait(), done.wait())
                self._lock_asked.clear()
                async with self._lock_use:
                    if self._lock_wanted and self._held is not None:
                        try:
                            await self.let_go()
                        except Exception as exc:  # its session is closed: the lock went with it
                            _log.warning("consumer %s: %s", self.name, one_line(exc))
        finally:
            if forget is not None:
                forget()

    def _lock_request(self, pid: int, payload: str) -> None:
        """A NOTIFY on :data:`LOCK_WANTED_CHANNEL`: someone else waits for this key."""
        if payload == str(self._lock_key) and pid != self._lock_pid:
            self._lock_wanted = True
            self._lock_shared_at = time.monotonic()
            self._lock_asked.set()

    async def _ensure_consumer(self) -> None:
        await self._js.add_consumer(self._names.stream, durable_config(self.durable))

    async def _create_durable(self, stop: asyncio.Event) -> bool:
        """Create the durable, waiting (one log line) while the stream is not there;
        False when ``stop`` came first."""
        waiting = False
        while not stop.is_set():
            try:
                await self._ensure_consumer()
            except NotFoundError:  # the stream: its owner (the relay) has not made it yet
                if not waiting:
                    _log.warning("consumer %s: waiting for the events stream", self.name)
                    waiting = True
                with contextlib.suppress(TimeoutError):
                    await wait_for(stop.wait(), self._poll)
                continue
            if waiting:
                _log.info("consumer %s: the events stream is there; consuming", self.name)
            return True
        return False

    async def _missing(self) -> None:
        """A pull request found no durable: create it again (its owner) or say so once."""
        if self.owner:
            try:
                await self._js.consumer_info(self._names.stream, self.name)
                return  # there again (a request of before it was created found nobody)
            except NotFoundError:
                pass
            except Exception as exc:  # the broker went away again
                _log.debug("consumer %s: cannot look at its durable (%r)", self.name, exc)
                return
            try:
                await self._ensure_consumer()
            except Exception as exc:  # the stream is missing too, or the broker went away
                _log.debug("consumer %s: cannot create its durable yet (%r)", self.name, exc)
                return
            _log.warning("consumer %s: its durable consumer was missing; created it", self.name)
        elif not self._durable_missing:
            self._durable_missing = True
            _log.warning(
                "consumer %s: its durable consumer is missing; waiting for its owner", self.name
            )

    async def subscribe(self) -> JetStreamContext.PullSubscription:
        """Create (or update) the durable consumer and bind a nats-py pull subscription."""
        await self._ensure_consumer()
        return await self._js.pull_subscribe_bind(durable=self.name, stream=self._names.stream)

    # -- a group ------------------------------------------------------------------------

    async def process_group(self, msgs: Sequence[Msg]) -> None:
        """Handle received messages: together in one commit where possible."""
        group: list[_Incoming] = []
        for incoming in await self._confirmed(msgs):
            msg = incoming.msg
            if incoming.delivery > self._max_deliver:
                reason = f"delivered {incoming.delivery} times without an outcome"
                await self._give_up(msg, self._dead_letter(incoming.env, reason))
                continue
            if self._wants is not None and not self._wants(incoming.env):
                await msg.ack()
                self.ignored += 1
                continue
            group.append(incoming)
        if len(group) == 1:
            await self._process_one(group[0])
            return
        if not group:
            return
        try:
            fresh = await self._handle_group([(i.env, i.delivery) for i in group])
        except Exception as exc:
            _log.debug(
                "consumer %s: group of %d failed (%r); one by one", self.name, len(group), exc
            )
            for incoming in group:
                await self._process_one(incoming)
            return
        self.groups += 1
        for incoming in group:
            await incoming.msg.ack()
            if incoming.env.event_id in fresh:
                self.handled += 1
            else:
                self.skipped += 1

    async def _confirmed(self, msgs: Sequence[Msg]) -> list[_Incoming]:
        """Decode ``msgs`` and keep those the log confirms (see :mod:`.confirming`).

        An undecodable message that is an event the fold refuses, and a message of an
        event the fold refused, are acknowledged unhandled; an undecodable one the log
        does not hold, and every decoded message it does not hold as sent, is dropped and
        counted.
        """
        decoded: list[_Incoming] = []
        for msg in msgs:
            if msg.metadata.num_delivered > 1:
                CONSUMER_REDELIVERIES.labels(consumer=self.name).inc()
            try:
                env = decode_envelope(msg.data)
            except CatalogError as exc:
                await self._undecodable(msg, exc)
                continue
            decoded.append(_Incoming(msg, env, self._delivery(msg, env.event_id)))
        if not decoded:
            return []
        try:
            verdicts = await self._confirmation.confirm([i.env for i in decoded])
        except Exception as exc:
            if not is_unreachable(exc):
                raise
            for incoming in decoded:  # the log cannot be asked now: later, uncounted
                await self._excuse(incoming.msg, incoming.env.event_id, exc)
            return []
        confirmed: list[_Incoming] = []
        for incoming, held in zip(decoded, verdicts, strict=True):
            if held:
                confirmed.append(incoming)
            else:
                await self._drop_unconfirmed(incoming.msg, incoming.env.event_id)
        return await self._folded(confirmed)

    async def _folded(self, confirmed: list[_Incoming]) -> list[_Incoming]:
        """``confirmed`` less the events the fold refused (acknowledged unhandled)."""
        try:
            reasons = await self._confirmation.refused([i.env for i in confirmed])
        except Exception as exc:
            if not is_unreachable(exc):
                raise
            for incoming in confirmed:
                await self._excuse(incoming.msg, incoming.env.event_id, exc)
            return []
        kept: list[_Incoming] = []
        for incoming, reason in zip(confirmed, reasons, strict=True):
            if reason is None:
                kept.append(incoming)
                continue
            self.refused += 1
            await incoming.msg.ack()  # the log holds it; nobody acts on it (events.folding)
        return kept

    async def _undecodable(self, msg: Msg, exc: CatalogError) -> None:
        """Skip an undecodable message that is a refused event of the log; drop any other."""
        event_id = (msg.headers or {}).get(Header.MSG_ID.value, "")
        try:
            found = await self._confirmation.undecodable(event_id)
        except Exception as failure:
            if not is_unreachable(failure):
                raise
            await self._excuse(msg, event_id, failure)
            return
        if found is None:
            await self._drop_unconfirmed(msg, event_id or "(no id)")
            return
        refusal, actor = found
        note(refusal, event_id, actor)
        self.refused += 1
        await _quietly(msg.ack())

    def _delivery(self, msg: Msg, event_id: str) -> int:
        """The delivery count, less the deliveries a server outage made fail."""
        return msg.metadata.num_delivered - self._excused.get(event_id, 0)

    async def _excuse(self, msg: Msg, event_id: str, exc: BaseException) -> None:
        """A server is unreachable: try the message again later; the try does not count.

        Otherwise an outage longer than the back-offs would dead-letter every message
        that was in flight when it began.
        """
        self._excused[event_id] = self._excused.pop(event_id, 0) + 1
        while len(self._excused) > _EXCUSED_KEPT:
            self._excused.popitem(last=False)
        _log.warning(
            "consumer %s: event %s waits for a server (%s)", self.name, event_id, one_line(exc)
        )
        await _quietly(msg.nak(delay=self._backoff[-1]))

    async def _drop_unconfirmed(self, msg: Msg, event_id: str) -> None:
        """Terminate a message the log does not confirm; count it, log now and then."""
        await _quietly(msg.term())
        self.unconfirmed += 1
        self._unconfirmed_unlogged += 1
        UNCONFIRMED_MESSAGES.labels(consumer=self.name).inc()
        now = time.monotonic()
        if now - self._unconfirmed_logged_at >= WARN_EVERY_S:
            _log.warning(
                "consumer %s: dropped %d message(s) the log does not hold as sent (latest: %s)",
                self.name,
                self._unconfirmed_unlogged,
                event_id[:64],
            )
            self._unconfirmed_logged_at = now
            self._unconfirmed_unlogged = 0

    async def process(self, msg: Msg) -> None:
        """Handle one message to its outcome: ack, nak with delay, dead letter or drop."""
        await self.process_group([msg])

    async def _process_one(self, incoming: _Incoming) -> None:
        msg, env, delivery = incoming.msg, incoming.env, incoming.delivery
        try:
            fresh = await self._handle(env, delivery)
        except Exception as exc:
            if is_unreachable(exc):
                await self._excuse(msg, env.event_id, exc)
            else:
                await self._failed(msg, env, delivery, exc)
            return
        await msg.ack()
        self._excused.pop(env.event_id, None)
        if fresh:
            self.handled += 1
        else:
            self.skipped += 1

    async def _handle(self, env: Envelope, delivery: int) -> bool:
        """One message's commit; False when it had been handled before."""
        return bool(await self._handle_group([(env, delivery)]))

    async def _handle_group(self, group: Sequence[tuple[Envelope, int]]) -> set[str]:
        """Handle (envelope, delivery) pairs and commit; returns the event ids that were new.

        A message recorded before (a redelivery) makes the commit write nothing; those
        are then left out and the rest is handled again (the records only grow, so
        this ends).
        """
        deliveries = {env.event_id: delivery for env, delivery in group}
        envs = list({env.event_id: env for env, _ in group}.values())  # no event twice
        while envs:
            try:
                return await self._commit(envs, deliveries)
            except AlreadyHandled:
                before = await self._store.pool.fetch(
                    HANDLED_BEFORE, self.name, [e.event_id for e in envs]
                )
                seen = {row[0] for row in before}
                envs = [e for e in envs if e.event_id not in seen]
        return set()

    async def _commit(self, envs: list[Envelope], deliveries: dict[str, int]) -> set[str]:
        """Handle ``envs`` and commit in one statement, under ``lock_key`` if there is one."""
        if self._lock_key is None:
            async with self._store.pool.acquire() as connection:
                fresh, _ = await self._commit_group(connection, None, envs, deliveries)
            return fresh
        held = await self._hold_lock()
        try:
            fresh, held.head = await self._commit_group(
                held.connection, held.head, envs, deliveries
            )
            held.used = time.monotonic()
        except AlreadyHandled:
            raise  # nothing was written; the lock stays for the next try
        except Exception:
            await self.let_go()
            raise
        except BaseException:  # cancelled: the session may be mid-statement
            self._held = None
            close_session(held.connection)  # the server drops the lock with the session
            await self._store.pool.release(held.connection)
            raise
        return fresh

    async def _commit_group(
        self,
        connection: Connection,
        head: int | None,
        envs: list[Envelope],
        deliveries: dict[str, int],
    ) -> tuple[set[str], int | None]:
        """Handle ``envs``, commit them; the ids recorded now and the head after the commit."""
        ids = [e.event_id for e in envs]
        if head is not None:  # the messages' events are committed: the view must hold them
            head = max(head, max(e.position for e in envs))
        context = HandlerContext(
            connection, self._store, self.name, min(deliveries.values()), deliveries, head
        )
        handled = await self._group(context, envs)
        if any(b.events for b in handled.batches):
            stored = await self._store.append_many(
                handled.batches,
                self._metadata(handled, envs),
                connection=connection,
                processed=Processed(self.name, ids),
            )
            fresh = set(ids)
            head = max(head or 0, stored[-1].position)
        else:  # nothing to append: record the messages; those recorded before were done
            fresh = {row[0] for row in await connection.fetch(MARK_PROCESSED, self.name, ids)}
        self._committed(handled, [e for e in envs if e.event_id in fresh])
        return fresh, head

    async def _hold_lock(self) -> _HeldLock:
        """``lock_key`` as a session lock on a connection kept between groups."""
        if self._held is not None:
            return self._held
        key = self._lock_key
        assert key is not None  # only consumers with a lock_key hold one
        connection = await self._store.pool.acquire()
        try:
            self._lock_pid = connection.get_server_pid()
            head, waited = await take_lock(connection, key)
        except BaseException:
            close_session(connection)  # the lock may have been granted as the call failed
            await self._store.pool.release(connection)
            raise
        now = time.monotonic()
        if waited:
            self._lock_shared_at = now
        self._held = _HeldLock(connection, head, now, now)
        return self._held

    async def let_go(self) -> None:
        """Release ``lock_key`` (if held) and its connection; a session that cannot is closed."""
        held, self._held = self._held, None
        if held is None:
            return
        self._lock_wanted = False  # a request heard from here on is for the next grant
        self._lock_pid = None  # its session goes back to the pool: another taker's now
        try:
            await held.connection.execute("SELECT pg_advisory_unlock($1)", self._lock_key)
        except BaseException as exc:
            # asked before closing it here: a session closed by us is gone too
            gone = is_unreachable(exc) or session_gone(held.connection)
            # the pool resets nothing: the lock must not stay (a session given back
            # already — its server died under a commit — holds none)
            close_session(held.connection)
            if not (gone and isinstance(exc, Exception)):
                raise
            # the session died with its server (a failover): its lock went with it; a
            # session that died while idle was taken back by the pool already
        finally:
            await self._store.pool.release(held.connection)

    def _committed(self, handled: Handled, envs: Sequence[Envelope]) -> None:
        if envs:
            self._mark.advance(max(e.position for e in envs))
        for committed in handled.on_commit:
            committed()

    def _metadata(self, handled: Handled, todo: Sequence[Envelope]) -> Metadata:
        actor = handled.actor or str(Actor.system(self.name))
        if len(todo) == 1:
            env = todo[0]
            return Metadata(
                actor=actor, correlation_id=env.correlation_id, causation_id=env.event_id
            )
        if any(b.causes is None and b.events for b in handled.batches):
            raise TypeError(f"consumer {self.name}: a group's batches must give their causes")
        return Metadata(actor=actor)

    async def _failed(self, msg: Msg, env: Envelope, delivery: int, exc: Exception) -> None:
        if delivery >= self._max_deliver:
            await self._give_up(msg, self._dead_letter(env, f"{type(exc).__name__}: {exc}"))
            return
        delay = self._backoff[min(delivery, len(self._backoff)) - 1]
        _log.warning(
            "consumer %s: event %s failed on delivery %d (%s: %s); retrying in %ss",
            self.name,
            env.event_id,
            delivery,
            type(exc).__name__,
            exc,
            delay,
        )
        await msg.nak(delay=delay)

    @staticmethod
    def _dead_letter(env: Envelope, reason: str) -> _DeadLetter:
        return _DeadLetter(env.event_id, env.position, env.correlation_id, reason)

    async def _give_up(self, msg: Msg, letter: _DeadLetter) -> None:
        """Record the dead letter, then terminate the message (nak if recording fails)."""
        delivery = msg.metadata.num_delivered
        try:
            recorded = await self._record_dead_letter(letter, delivery)
        except Exception:
            _log.exception("consumer %s: could not dead-letter %s", self.name, letter.event_id)
            await msg.nak(delay=self._backoff[-1])
            return
        await msg.term()
        if recorded:
            self.dead_lettered += 1
            DEAD_LETTERS.labels(consumer=self.name).inc()
            _log.error(
                "consumer %s: dead-lettered event %s after %d deliveries: %s",
                self.name,
                letter.event_id,
                delivery,
                letter.reason,
            )
            if self._on_dead_letter is not None:
                self._on_dead_letter(letter.event_id)

    async def _record_dead_letter(self, letter: _DeadLetter, delivery: int) -> bool:
        event = MessageDeadLettered(
            consumer=self.name,
            event_id=letter.event_id,
            position=letter.position,
            deliveries=delivery,
            reason=letter.reason[:2000],
        )
        meta = Metadata(
            actor=self._actor(),
            correlation_id=letter.correlation_id,
            causation_id=letter.event_id or None,
        )
        async with self._store.pool.acquire() as connection, connection.transaction():
            if _is_uuid(letter.event_id) and not await connection.fetchval(
                _MARK_PROCESSED, self.name, letter.event_id
            ):
                return False  # handled (or dead-lettered) by an earlier delivery
            batch = Batch(f"consumer:{self.name}", None, [event])
            await self._store.append_many([batch], meta, connection=connection)
            await connection.execute(SAVE_CHECKPOINT, self.name, letter.position)
        return True


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


async def _quietly(work: Awaitable[object]) -> None:
    try:
        await work
    except Exception as exc:  # the connection is going away: the ack wait redelivers
        _log.debug("nak on stop failed: %r", exc)
