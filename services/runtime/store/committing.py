"""Group commit for request handlers: concurrent appends share one transaction.

An API instance serves many requests at once, and each decided write is one small
append. Committed one by one, every request pays a transaction of its own and holds
the log's head lock (:mod:`services.runtime.store.eventstore`) for it, so the requests queue
behind each other's WAL flushes. :class:`GroupCommitter` collects the appends that
arrive while a transaction is in flight and writes them together, all in one
``append_many`` — one transaction, one flush — and then wakes every caller.

Semantics stay those of a single append per caller:

* each write keeps its own stream and expected version; a group never holds two
  writes for one stream (the second waits for the next group, so it is checked
  against the version the first produced), nor writes of two actors (an append
  records one actor: :mod:`events.actors`);
* if the group's append fails — one stale expected version is enough — nothing of it
  was written, and every write of the group is appended again *alone*, so each caller
  gets exactly the outcome (success, ``ConflictError``, ...) it would have got on its
  own;
* the envelope fields of every event are as for a lone append with no correlation id
  (each event is its own correlation), and the namespace column is the event's own
  (:func:`events.envelopes.namespace_of`).

A writer task runs only while writes are waiting; an idle committer costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Final

from events.catalog import Event
from events.envelopes import Envelope
from services.runtime.store.appends import AdmissionPremise, Batch, Metadata
from services.runtime.store.eventstore import EventStore

__all__ = ["GroupCommitter"]

log = logging.getLogger("dracap.committing")

MAX_GROUP: Final = 256


class _Write:
    __slots__ = ("batch", "done", "meta")

    def __init__(self, batch: Batch, meta: Metadata, done: asyncio.Future[list[Envelope]]) -> None:
        self.batch = batch
        self.meta = meta
        self.done = done


class GroupCommitter:
    """Appends of concurrent callers, written in groups (see the module docstring)."""

    def __init__(self, store: EventStore, actor: str, *, max_group: int = MAX_GROUP) -> None:
        self._store = store
        self._meta = Metadata(actor=actor)  # of writes that name no actor of their own
        self._max_group = max_group
        self._waiting: list[_Write] = []
        self._writer: asyncio.Task[None] | None = None
        self.groups = 0  #: transactions that carried more than one write
        self.alone = 0  #: writes appended on their own after their group failed

    async def append(
        self,
        stream: str,
        expected_version: int | None,
        events: Sequence[Event],
        *,
        actor: str | None = None,
        premise: AdmissionPremise | None = None,
    ) -> list[Envelope]:
        """Append ``events`` to ``stream`` at ``expected_version``; returns the envelopes.

        ``actor``: who caused them (default: the committer's); a group holds the writes
        of one actor only, since an append records one actor. ``premise``: an
        admission's quota premise, checked with the group (a broken one fails the group,
        and then only its own write appended alone).
        """
        done: asyncio.Future[list[Envelope]] = asyncio.get_running_loop().create_future()
        meta = self._meta if actor is None else Metadata(actor=actor)
        batch = Batch(stream, expected_version, events, premise=premise)
        self._waiting.append(_Write(batch, meta, done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_all())
        return await done

    async def close(self) -> None:
        """Wait for the writes in flight."""
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)

    async def _write_all(self) -> None:
        while self._waiting:
            group: list[_Write] = []
            later: list[_Write] = []
            streams: set[str] = set()
            actor = self._waiting[0].meta.actor
            for write in self._waiting:
                if (
                    write.batch.stream in streams
                    or write.meta.actor != actor
                    or len(group) >= self._max_group
                ):
                    later.append(write)
                else:
                    streams.add(write.batch.stream)
                    group.append(write)
            self._waiting = later
            try:
                await self._write(group)
            except BaseException as exc:  # cancelled: no caller may wait forever
                for write in group + self._waiting:
                    if not write.done.done():
                        write.done.set_exception(exc)
                self._waiting = []
                raise

    async def _write(self, group: list[_Write]) -> None:
        if len(group) == 1:
            await self._alone(group[0])
            return
        try:
            stored = await self._store.append_many([w.batch for w in group], group[0].meta)
        except Exception as exc:
            log.debug("group of %d appends failed (%r); appending one by one", len(group), exc)
            for write in group:
                self.alone += 1
                await self._alone(write)
            return
        self.groups += 1
        by_stream: dict[str, list[Envelope]] = {}
        for env in stored:
            by_stream.setdefault(env.stream, []).append(env)
        for write in group:
            if not write.done.done():
                write.done.set_result(by_stream.get(write.batch.stream, []))

    async def _alone(self, write: _Write) -> None:
        try:
            stored = await self._store.append_many([write.batch], write.meta)
        except Exception as exc:
            if not write.done.done():
                write.done.set_exception(exc)
            return
        if not write.done.done():
            write.done.set_result(stored)
