"""Durable, idempotent consumers of the events stream.

A service that reacts to events is a :data:`Handler`: it gets the event's envelope
and a :class:`HandlerContext` (a Postgres connection inside an open transaction, and
the store) and returns what it wants written, :class:`Handled`. :class:`Consumer`
does the rest, for one JetStream durable pull consumer (explicit ack) per service.

Per message, in **one** Postgres transaction:

1. ``INSERT INTO processed_messages (consumer, event_id) ... ON CONFLICT DO NOTHING``;
   no row inserted means the message was handled before (a redelivery after a lost
   ack, a replay): the transaction ends and the message is acknowledged, nothing
   else happens. A concurrent redelivery of a message still being handled waits on
   the key's lock and then finds the row;
2. the handler runs (it may read through ``context.connection``);
3. its batches are appended with ``EventStore.append_many(..., connection=...)``;
4. ``consumer_checkpoints`` moves to the message's log position (never back: naks
   let later messages overtake earlier ones, so the checkpoint is a high-water mark
   for lag, not a resume point — JetStream's durable consumer is the resume point).

The transaction commits, then the message is acknowledged. A crash before the commit
leaves nothing behind and JetStream redelivers; a crash between commit and ack makes
the redelivery a no-op by step 1. So delivery is at least once, and the effects are
exactly once.

Failures: any exception of the handler or the append (a
:class:`~services.runtime.errors.ConflictError` included: the handler decided on a
stale view and re-reads on the next try) rolls the transaction back and naks the
message with a delay from ``backoff`` (by delivery count). On delivery number
``max_deliver`` the consumer gives up: it appends ``MessageDeadLettered`` (stream
``consumer:<name>``, causation = the message's event id) together with the
``processed_messages`` row and the checkpoint, terminates the message and counts
``dracap_dead_letters_total``. A message that cannot even be decoded is
dead-lettered at once.

The JetStream consumer itself is created with *unlimited* deliveries: the limit is
enforced here, where the dead letter is written. Were the server to stop
redelivering at the same count, a dead letter that failed to be written (the
database briefly away) would lose the message silently; this way it comes back and
the dead-lettering is tried again. A message delivered more than ``max_deliver``
times without an outcome (it crashed its consumer each time) is dead-lettered
without running the handler again.

Stopping: :meth:`Consumer.run` checks ``stop`` between fetches (a fetch waits at
most ``poll_interval``), finishes every message already fetched, and returns; no
message is left half done, none is nak'd just because the process stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, Header

from events.catalog import Envelope, MessageDeadLettered, decode_envelope
from events.errors import CatalogError
from events.subjects import BusNames
from services.runtime.eventstore import Batch, Connection, EventStore, Metadata
from services.runtime.metrics import CONSUMER_REDELIVERIES, DEAD_LETTERS

__all__ = ["Consumer", "Handled", "Handler", "HandlerContext"]

_log = logging.getLogger(__name__)

_MARK_PROCESSED: Final = (
    "INSERT INTO processed_messages (consumer, event_id) VALUES ($1, $2) "
    "ON CONFLICT DO NOTHING RETURNING true"
)
_SAVE_CHECKPOINT: Final = (
    "INSERT INTO consumer_checkpoints (consumer, position) VALUES ($1, $2) "
    "ON CONFLICT (consumer) DO UPDATE SET position = GREATEST("
    "consumer_checkpoints.position, EXCLUDED.position), updated_at = now()"
)


class Handled(msgspec.Struct):
    """What a handler wants written, atomically with the consumer's checkpoint.

    ``actor`` defaults to ``consumer:<name>``.
    """

    batches: list[Batch] = []
    actor: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class HandlerContext:
    """What a handler may use while its message's transaction is open."""

    connection: Connection  #: inside the transaction; reads see the handler's view
    store: EventStore
    consumer: str  #: the consumer's name
    delivery: int  #: 1 on the first delivery


Handler = Callable[[HandlerContext, Envelope], Awaitable[Handled]]


class _DeadLetter(msgspec.Struct, frozen=True):
    event_id: str
    position: int
    correlation_id: str | None
    reason: str


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
        handler: Handler,
        max_deliver: int = 5,
        backoff: Sequence[float] = (0.1, 0.5, 2, 5),
        batch: int = 16,
        ack_wait: float = 30.0,
        poll_interval: float = 1.0,
    ) -> None:
        if max_deliver < 1 or not backoff:
            raise ValueError("max_deliver must be at least 1 and backoff not empty")
        self._store = store
        self._js = js
        self._names = names
        self.name = name
        self._filter = filter_subject
        self._handler = handler
        self._max_deliver = max_deliver
        self._backoff = tuple(backoff)
        self._batch = batch
        self._ack_wait = ack_wait
        self._poll = poll_interval
        self.handled = 0  #: messages handled (committed and acked)
        self.skipped = 0  #: redeliveries found already handled
        self.dead_lettered = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch, handle and acknowledge until ``stop`` is set; then drain and return."""
        subscription = await self.subscribe()
        try:
            while not stop.is_set():
                for msg in await self._fetch(subscription):
                    await self.process(msg)
        finally:
            await subscription.unsubscribe()

    async def subscribe(self) -> JetStreamContext.PullSubscription:
        """Create (or update) the durable consumer and bind a pull subscription to it."""
        config = ConsumerConfig(
            durable_name=self.name,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            filter_subject=self._filter,
            ack_wait=self._ack_wait,
            max_deliver=-1,  # the limit is ours: see the module docstring
        )
        await self._js.add_consumer(self._names.stream, config)
        return await self._js.pull_subscribe_bind(durable=self.name, stream=self._names.stream)

    async def _fetch(self, subscription: JetStreamContext.PullSubscription) -> list[Msg]:
        try:
            return await subscription.fetch(self._batch, timeout=self._poll)
        except TimeoutError:  # nats.errors.TimeoutError, or asyncio's from a pull's deadline
            return []
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
            _log.warning("consumer %s: bus connection unavailable", self.name)
            await asyncio.sleep(self._poll)
            return []

    async def process(self, msg: Msg) -> None:
        """Handle one message to its outcome: ack, nak with delay, or dead letter."""
        delivery = msg.metadata.num_delivered
        if delivery > 1:
            CONSUMER_REDELIVERIES.labels(consumer=self.name).inc()
        try:
            env = decode_envelope(msg.data)
        except CatalogError as exc:
            event_id = (msg.headers or {}).get(Header.MSG_ID.value, "")
            await self._give_up(msg, _DeadLetter(event_id, 0, None, f"undecodable: {exc}"))
            return
        if delivery > self._max_deliver:
            reason = f"delivered {delivery} times without an outcome"
            await self._give_up(msg, self._dead_letter(env, reason))
            return
        try:
            fresh = await self._handle(env, delivery)
        except Exception as exc:
            await self._failed(msg, env, delivery, exc)
            return
        await msg.ack()
        if fresh:
            self.handled += 1
        else:
            self.skipped += 1

    async def _handle(self, env: Envelope, delivery: int) -> bool:
        """The message's transaction; False when it had been handled before."""
        async with self._store.pool.acquire() as connection, connection.transaction():
            if not await connection.fetchval(_MARK_PROCESSED, self.name, env.event_id):
                return False
            context = HandlerContext(connection, self._store, self.name, delivery)
            handled = await self._handler(context, env)
            if handled.batches:
                meta = Metadata(
                    actor=handled.actor or f"consumer:{self.name}",
                    correlation_id=env.correlation_id,
                    causation_id=env.event_id,
                )
                await self._store.append_many(handled.batches, meta, connection=connection)
            await connection.execute(_SAVE_CHECKPOINT, self.name, env.position)
        return True

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

    async def _record_dead_letter(self, letter: _DeadLetter, delivery: int) -> bool:
        event = MessageDeadLettered(
            consumer=self.name,
            event_id=letter.event_id,
            position=letter.position,
            deliveries=delivery,
            reason=letter.reason[:2000],
        )
        meta = Metadata(
            actor=f"consumer:{self.name}",
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
            await connection.execute(_SAVE_CHECKPOINT, self.name, letter.position)
        return True


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True
