"""The commit hand-over: this process's own appends, passed from the store to a reader.

The event store reports each append it commits itself (``EventStore.on_commit``) with
the envelopes a reader of the log would get. A reader that follows the log in position
order — the relay publishing it, the live state folding it — takes those from memory
instead of waiting for the NOTIFY and reading them back. :class:`Handover` is the
buffer between the two, keyed by position:

* :meth:`Handover.offer` (the commit listener) keeps the envelopes past the reader's
  position and sets :attr:`Handover.offered` (a :class:`~services.runtime.ground.waiting.Signal`:
  the reader's one wait includes it without a task of its own). When
  more than ``kept`` envelopes are waiting the reader is far behind and will read the
  log anyway, so the offer is dropped — nothing is lost, the log has it.
* :meth:`Handover.take` returns the envelopes that come *next* (position + 1, + 2, …,
  up to a limit), in order, and drops those the reader has passed by reading the log
  (:meth:`Handover.discard_passed` does only the latter); :meth:`Handover.covers` says
  whether all of them up to a head are there (what a reader waiting for its own
  appends in flight waits for: ``EventStore.appends_answered``).

The reader owns its position; the hand-over asks for it (the ``position`` callable)
and never keeps a copy, so the two cannot disagree. A hand-over receives offers while
it is :meth:`Handover.attached` to a store — for the reader's run — and is emptied when
it is detached. Everything here runs on the event loop's thread: no locks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from events.envelopes import Envelope
from services.runtime.ground.waiting import Signal
from services.runtime.store.eventstore import EventStore

__all__ = ["Handover"]


class Handover:
    """Committed envelopes waiting for a reader at ``position()`` (see the module docstring)."""

    def __init__(self, position: Callable[[], int], *, kept: int) -> None:
        self._position = position
        self._kept = kept
        self._waiting: dict[int, Envelope] = {}
        #: set by every offer; the reader clears it before it takes
        self.offered = Signal()

    def __len__(self) -> int:
        return len(self._waiting)

    @contextlib.contextmanager
    def attached(self, store: EventStore) -> Iterator[Handover]:
        """Receive ``store``'s commits until the block ends; then forget what is waiting."""
        detach = store.on_commit(self.offer)
        try:
            yield self
        finally:
            detach()
            self._waiting.clear()

    def offer(self, envelopes: Sequence[Envelope]) -> None:
        """Commit listener: keep ``envelopes`` the reader has not reached, and wake it."""
        if len(self._waiting) > self._kept:
            return  # far behind: the reader reads the log instead
        position = self._position()
        for env in envelopes:
            if env.position > position:
                self._waiting[env.position] = env
        self.offered.set()

    def covers(self, head: int) -> bool:
        """Whether every envelope after the reader's position up to ``head`` is waiting
        to be taken (the gap to a head the reader heard of is filled from memory)."""
        waiting = self._waiting
        return all(p in waiting for p in range(self._position() + 1, head + 1))

    def take(self, limit: int | None = None) -> list[Envelope]:
        """The waiting envelopes that come next, in order (at most ``limit``)."""
        self.discard_passed()
        following = self._position() + 1
        out: list[Envelope] = []
        while limit is None or len(out) < limit:
            env = self._waiting.pop(following, None)
            if env is None:
                break
            out.append(env)
            following += 1
        return out

    def discard_passed(self) -> None:
        """Drop the envelopes at or before the reader's position (it read them)."""
        position = self._position()
        for passed in [p for p in self._waiting if p <= position]:
            del self._waiting[passed]
