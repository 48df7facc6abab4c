"""The background check of the snapshot a live state started from: checked, not trusted.

A snapshot verifies when its frame, checksum, event id and format are right
(:func:`services.runtime.store.snapshots.verify_snapshot`); that proves it is a snapshot of
*this* log that nobody tore, not that its state is the fold of the log. The snapshot
writer's login can store any state it likes under a correct frame — a forged grant, a
share that was never reserved — and a start that trusted it would serve it.

So a :class:`~services.runtime.store.livestate.LiveState` that started from a snapshot
(:meth:`~services.runtime.store.livestate.LiveState.load_snapshot`) runs :func:`check_start`
beside its tailer (:meth:`~services.runtime.store.livestate.LiveState.run`):

1. it folds the log from position 0 into a state of its own, through the fold's driver
   like every reader (:mod:`events.folding`), :data:`CHUNK` events at a time with a
   yield to the event loop after each chunk — the check runs on the loop of the service
   it checks, so it must never keep a decision waiting more than one chunk's fold (well
   under a millisecond); reading pages of :data:`PAGE` rows costs the loop nothing;
2. once it is within a chunk of the live state, it holds the live state still
   (:meth:`~services.runtime.store.livestate.LiveState.frozen`), folds the last few events,
   and compares the two states at the same position (:func:`events.statecodec.same_state`).
   The comparison of two large states takes a while, so where ``os.fork`` exists it
   runs in a forked child (:func:`services.runtime.store.snapshots.detach`) on the image of
   that instant and the live state is released as soon as the child exists;
3. equal: the snapshot was the fold (``dracap_snapshot_checks_total{outcome="verified"}``)
   and the live state is trustworthy from now on;
4. different: the snapshot was forged or stale (``outcome="mismatch"``, logged, alert
   ``DracapSnapshotMismatch``); the check's own state is brought up to the live state's
   position and **replaces** it (:meth:`~services.runtime.store.livestate.LiveState.replace`):
   from then on nothing of the snapshot counts, and whoever derived indexes from the old
   state rebuilds them.

A check that fails (the database away) counts ``outcome="failed"`` and starts again
after :data:`RETRY_S`, from what it has folded so far.

How long a forged snapshot can be served: from the start until the check's fold
reaches the live state — about as long as a start without a snapshot would have folded,
stretched by the service's own load (the check yields to every decision): ~15-30 s at
a million events on the 2-core development machine, a fraction of a second at the
thousands of events of a small installation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Final, Protocol

from events.folding import Refusal, fold_stored
from events.state import ClusterState
from events.statecodec import same_state
from services.runtime.ground.metrics import SNAPSHOT_CHECKS
from services.runtime.ground.waiting import wait_for
from services.runtime.store.eventstore import Connection, EventStore, iter_rows
from services.runtime.store.refusals import note
from services.runtime.store.rows import ACTOR, EVENT_ID, PAYLOAD, POSITION, SCHEMA_VERSION, TYPE
from services.runtime.store.snapshots import detach

__all__ = ["CHUNK", "PAGE", "RETRY_S", "check_start"]

log = logging.getLogger("dracap.snapshotcheck")

#: Events folded between two yields to the event loop.
CHUNK: Final = 200
#: Rows read per query.
PAGE: Final = 2000
#: Seconds before a failed check goes on.
RETRY_S: Final = 5.0
_SAME: Final = b"="
for _outcome in ("verified", "mismatch", "failed"):  # every series from 0
    SNAPSHOT_CHECKS.labels(outcome=_outcome)


class Checked(Protocol):
    """What the check uses of the live state it checks (a
    :class:`~services.runtime.store.livestate.LiveState`, which imports this module):
    its store, its state frozen and replaced, and the start still unchecked."""

    unchecked_start: int | None

    @property
    def store(self) -> EventStore: ...

    @property
    def state(self) -> ClusterState: ...

    def frozen(self) -> contextlib.AbstractAsyncContextManager[ClusterState]: ...

    def replace(self, state: ClusterState) -> None: ...


async def check_start(live: Checked, stop: asyncio.Event) -> bool | None:
    """Check the snapshot ``live`` started from (module docstring) until it is done or
    ``stop`` is set: True verified, False replaced, None stopped (or nothing to check)."""
    start = live.unchecked_start
    if start is None:
        return None
    scratch = ClusterState()
    while not stop.is_set():
        try:
            return await _check(live, scratch, start, stop)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            SNAPSHOT_CHECKS.labels(outcome="failed").inc()
            log.warning("snapshot check at %d interrupted, retried: %s", start, exc)
            with contextlib.suppress(TimeoutError):
                await wait_for(stop.wait(), RETRY_S)
    return None


async def _check(
    live: Checked, scratch: ClusterState, start: int, stop: asyncio.Event
) -> bool | None:
    if not await _near(live, scratch, stop):
        return None
    async with live.store.pool.acquire() as connection, live.frozen() as state:
        await _fold_to(connection, scratch, state.position, None)
        if hasattr(os, "fork"):
            comparing = detach(lambda: _SAME if same_state(state, scratch) else b"!")
        else:
            same = same_state(state, scratch)
    if hasattr(os, "fork"):
        verdict, code = await comparing.result()
        if code != 0:
            raise RuntimeError(f"the comparing process exited with {code}")
        same = verdict == _SAME
    if same:
        live.unchecked_start = None
        SNAPSHOT_CHECKS.labels(outcome="verified").inc()
        log.info("the snapshot at %d this state started from is the fold of the log", start)
        return True
    SNAPSHOT_CHECKS.labels(outcome="mismatch").inc()
    log.error(
        "the snapshot at %d this state started from is not the fold of the log "
        "(forged or stale): serving the fold from position 0 instead",
        start,
    )
    if not await _near(live, scratch, stop):
        return None
    async with live.store.pool.acquire() as connection, live.frozen() as state:
        await _fold_to(connection, scratch, state.position, None)
        live.replace(scratch)
    return False


async def _near(live: Checked, scratch: ClusterState, stop: asyncio.Event) -> bool:
    """Fold ``scratch`` until it is within a chunk of ``live`` (False: stopped)."""
    while live.state.position - scratch.position > CHUNK:
        async with live.store.pool.acquire() as connection:
            if not await _fold_to(connection, scratch, live.state.position, stop):
                return False
    return True


async def _fold_to(
    connection: Connection, state: ClusterState, target: int, stop: asyncio.Event | None
) -> bool:
    """Fold the log into ``state`` up to ``target``; with ``stop``, a chunk at a time with
    a yield after each (False: stopped)."""
    async for rows in iter_rows(connection, state.position, PAGE, target):
        for first in range(0, len(rows), CHUNK):
            for row in rows[first : first + CHUNK]:
                folded = fold_stored(
                    state, row[PAYLOAD], row[TYPE], row[SCHEMA_VERSION], row[POSITION]
                )
                if type(folded) is Refusal:
                    note(folded, str(row[EVENT_ID]), row[ACTOR])
            if stop is not None:
                if stop.is_set():
                    return False
                await asyncio.sleep(0)
    return True
