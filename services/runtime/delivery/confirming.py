"""Bus messages confirmed against the log before anyone acts on them.

A message on the events stream is a *notification*, never a fact. The relay is meant to
be the only publisher there, but a NATS account that can publish to the stream's
subjects (a misconfigured permission, a stolen credential) could inject an envelope
that was never written to PostgreSQL — a ``ReleaseRequested`` that makes an agent tear
down another tenant's limit, say. So every consumer asks the log first:

* a message is **confirmed** when the log holds, at the message's position, an event
  with the same id, stream, stream version and payload (the whole envelope is
  compared; only ``schema_version`` may differ, because the relay upcasts old rows);
* anything else is **unconfirmed**: the consumer terminates it without running its
  handler, counts ``dracap_unconfirmed_messages_total{consumer}`` and logs it (at
  most one line per :data:`WARN_EVERY_S` per consumer, with the number dropped since).

Where the log is read: the relay publishes an event only after it has committed, so a
read issued after the message arrived sees it. A consumer with a
:class:`~services.runtime.store.livestate.LiveState` keeps the envelopes its view folded
most recently (:data:`RECENT_KEPT`), which answers nearly every message without a
query — by the time an agent or a planner gets a message, its own view has usually
folded the event already; the rest (and every consumer without a view) cost one
``SELECT`` per group of messages (:meth:`EventStore.read_positions`). It keeps no event
that carries a tenant's payload of unbounded size — a manifest (``ClaimSubmitted``) or
an allocation with its opaque configuration — so that what it holds does not grow with
what tenants send (a manifest may carry 32 configurations of 10 KiB); no consumer with
a view is sent a manifest, and an agent confirms an allocation with a configuration by
the query.

Refused events (:mod:`events.folding`) are skipped here, by every consumer, as every
reader of the log skips them:

* a message that cannot even be decoded is looked up by its ``Nats-Msg-Id`` (the relay
  sets it to the event id): when the log's row of that id is one the fold's driver
  refuses to decode as well, the message is that refused event (:meth:`LogConfirmation.
  undecodable` gives its :class:`~events.folding.Refusal`) and is acknowledged unhandled,
  counted once (:mod:`services.runtime.store.refusals`), never dead-lettered; an id the log does
  not hold, or holds as an event that decodes, makes it unconfirmed;
* a confirmed message of an event the fold refused (a ``LimitApplied`` for a share that
  is ready already, say) is acknowledged unhandled too: a consumer with a live view asks
  it (:meth:`LogConfirmation.refused`: the view folded up to the message records each
  refusal). (The audit and billing subscribers consume no message: they read the log
  in order themselves and skip refused events there, :mod:`services.runtime.delivery.projecting`.)

This is the rule "act only on what the log says" at the door; the handlers add the
second half of it — they decide from the folded state, never from the message alone
(an agent removes a limit only when the claim is ``releasing`` at that allocation
version).
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Sequence
from typing import Final

import msgspec

from events.catalog import AllocationBound, ClaimSubmitted, Event
from events.envelopes import Envelope
from events.folding import Refusal
from services.runtime.store.eventstore import EventStore
from services.runtime.store.livestate import LiveState
from services.runtime.store.rows import ACTOR, SELECT, decoded

__all__ = ["RECENT_KEPT", "WARN_EVERY_S", "LogConfirmation", "same_event"]

#: Folded envelopes kept for confirmation without a query.
RECENT_KEPT: Final = 16_384
#: Unconfirmed messages are logged at most this often per consumer.
WARN_EVERY_S: Final = 10.0
_MAX_POSITION: Final = 2**63 - 1


def same_event(sent: Envelope, logged: Envelope | None) -> bool:
    """Whether ``sent`` (from the bus) is the event the log holds as ``logged``."""
    if logged is None or sent.event_id != logged.event_id:
        return False
    if sent.schema_version != logged.schema_version:
        sent = msgspec.structs.replace(sent, schema_version=logged.schema_version)
    return sent == logged


def _carries_tenant_payload(event: Event) -> bool:
    """Whether ``event`` holds a manifest or an allocation's opaque configuration."""
    if type(event) is ClaimSubmitted:
        return True
    if type(event) is AllocationBound:
        devices = event.allocation.devices
        return devices is not None and bool(devices.config)
    return False


class LogConfirmation:
    """Confirms bus messages against the log (see the module docstring)."""

    def __init__(
        self, store: EventStore, live: LiveState | None = None, *, kept: int = RECENT_KEPT
    ) -> None:
        self._store = store
        self._live = live
        self._kept = kept
        self._recent: dict[int, Envelope] = {}
        self._order: collections.deque[int] = collections.deque()  # positions, oldest first
        if live is not None:
            live.subscribe(self._folded)

    def _folded(self, env: Envelope) -> None:
        if _carries_tenant_payload(env.event):
            return
        # (a deque, not the dict's own order: taking a dict's first key after many
        # deletions scans the holes they leave, every time)
        self._recent[env.position] = env
        self._order.append(env.position)
        if len(self._order) > self._kept:
            self._recent.pop(self._order.popleft(), None)

    async def confirm(self, envs: Sequence[Envelope]) -> list[bool]:
        """For each envelope, whether the log holds it as sent."""
        logged: dict[int, Envelope] = {}
        missing: set[int] = set()
        for env in envs:
            known = self._recent.get(env.position)
            if known is not None:
                logged[env.position] = known
            elif 0 < env.position <= _MAX_POSITION:
                missing.add(env.position)
        if missing:
            for env in await self._store.read_positions(sorted(missing)):
                logged[env.position] = env
        return [same_event(e, logged.get(e.position)) for e in envs]

    async def holds(self, event_id: str) -> bool:
        """Whether the log holds an event with the id an undecodable message carried."""
        try:
            uuid.UUID(event_id)
        except ValueError:
            return False
        return await self._store.holds_event(event_id)

    async def undecodable(self, event_id: str) -> tuple[Refusal, str] | None:
        """The refusal (and actor) of the logged event an undecodable message carried the
        id of, if the fold's driver refuses to decode that event too; ``None`` when the log
        does not hold the id, or holds an event that decodes (the message is not it)."""
        try:
            uuid.UUID(event_id)
        except ValueError:
            return None
        row = await self._store.pool.fetchrow(f"{SELECT} WHERE event_id = $1::uuid", event_id)
        if row is None:
            return None
        event = decoded(row)
        return (event, row[ACTOR]) if isinstance(event, Refusal) else None

    async def refused(self, envs: Sequence[Envelope]) -> list[str | None]:
        """For each confirmed envelope, the reason the fold refused its event (``None``:
        folded, or no live view to ask)."""
        if self._live is None or not envs:
            return [None] * len(envs)
        state = await self._live.fresh(max(e.position for e in envs))
        return [state.refused.get(e.position) for e in envs]
