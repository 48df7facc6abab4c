"""What a consumer's handler is given and what it returns: the handler contract. Pure types.

A service that reacts to events gives its :class:`~services.runtime.delivery.consuming.Consumer`
a handler: per message (:data:`Handler`: a :class:`HandlerContext` and the envelope) or
per *group* of messages (:data:`GroupHandler`: a list of envelopes). The context holds
a plain Postgres connection to read through, the store, the consumer's name, the
delivery counts and, for a consumer with a ``lock_key``, the head its view must be
folded to.

A handler writes nothing itself: everything it wants written is in
:attr:`Handled.batches`, which the consumer commits in one statement together with the
messages it handled; running a handler twice for a message is harmless (it decides
from a live view, and a stale decision is refused by the expected versions). Why and
how the consumer commits, retries and dead-letters is :mod:`services.runtime.delivery.consuming`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping

import msgspec

from events.envelopes import Envelope
from services.runtime.store.appends import Batch
from services.runtime.store.eventstore import Connection, EventStore

__all__ = ["GroupHandler", "Handled", "Handler", "HandlerContext", "one_at_a_time"]


class Handled(msgspec.Struct):
    """What a handler wants written, atomically with the consumer's checkpoint.

    ``actor`` defaults to ``system:<name>`` (:mod:`events.actors`). ``on_commit``:
    callables run once the group has committed (metrics of what was written: a commit
    that failed and was handled again must not count twice).
    """

    batches: list[Batch] = []
    actor: str | None = None
    on_commit: list[Callable[[], None]] = []


@dataclasses.dataclass(frozen=True, slots=True)
class HandlerContext:
    """What a handler may use while its messages are handled."""

    #: a plain connection to read through (nothing the handler writes through it
    #: commits with the group: what it wants written goes in ``Handled.batches``)
    connection: Connection
    store: EventStore
    consumer: str  #: the consumer's name
    delivery: int  #: 1 on the first delivery; in a group, the lowest of the group
    #: the delivery count of each message handled, by event id
    deliveries: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: with a ``lock_key``: the log's head when the lock was granted, then after each
    #: of the consumer's own commits, and at least the highest position among the
    #: messages handled (the view must be folded that far); else ``None``
    locked_head: int | None = None


Handler = Callable[[HandlerContext, Envelope], Awaitable[Handled]]
GroupHandler = Callable[[HandlerContext, list[Envelope]], Awaitable[Handled]]


def one_at_a_time(handler: Handler) -> GroupHandler:
    """A per-message handler as a group handler (its consumer makes groups of one)."""

    async def handle(context: HandlerContext, envs: list[Envelope]) -> Handled:
        [env] = envs
        return await handler(context, env)

    return handle
