"""Encoding a snapshot in a forked child (``services.runtime.store.snapshots.encode_detached``).

The child's image of the state is the state at the instant of the fork: folding more
into the parent's state while the child encodes must not show up in the snapshot (a
torn snapshot). A child that fails gives a ``SnapshotError``, not a snapshot.
"""

from __future__ import annotations

import asyncio
import os
import zlib

import pytest

from events import catalog as c
from events.errors import SnapshotError
from events.fold import apply_event
from events.state import ClusterState
from events.statecodec import snapshot_decode, snapshot_encode
from services.runtime.store import snapshots
from tests.integration import sample as s

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _state(claims: int) -> tuple[ClusterState, list[c.CapacityReserved]]:
    state = ClusterState()
    events: list[c.Event] = [s.slice_published(devices={"gpu-0": {"memory": "80Gi"}})]
    reserved = [s.reserved("team-a", f"c{i}", "gpu-0", "1Gi") for i in range(claims)]
    for i, r in enumerate(reserved):
        events += [c.ClaimAdmitted(namespace="team-a", name=f"c{i}"), r, s.bound(r)]
    for position, event in enumerate(events, start=1):
        apply_event(state, event, position)
    return state, reserved


async def test_the_snapshot_is_the_state_as_it_was_when_the_child_forked() -> None:
    state, reserved = _state(40)
    before = snapshot_decode(snapshot_encode(state))
    task = asyncio.ensure_future(snapshots.encode_detached(state))
    await asyncio.sleep(0)  # the task's first step forks, then awaits the pipe
    # the parent folds on while the child encodes
    apply_event(state, s.released(reserved[0]), state.position + 1)
    apply_event(state, c.ClaimAdmitted(namespace="team-b", name="x"), state.position + 1)
    position, packed = await task
    stored = snapshot_decode(zlib.decompress(packed))
    assert position == before.position == stored.position
    assert stored == before
    assert stored != snapshot_decode(snapshot_encode(state))


async def test_a_child_that_fails_writes_no_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(state: ClusterState) -> bytes:
        raise RuntimeError("cannot encode")

    monkeypatch.setattr(snapshots, "snapshot_encode", broken)  # the child inherits it
    with pytest.raises(SnapshotError, match="exited with 1"):
        await snapshots.encode_detached(_state(1)[0])


def test_the_child_encodes_at_the_lowest_priority() -> None:
    """The encoding takes what the services leave of a busy CPU (issue 25): the child
    runs ``CHILD_NICENESS`` nicer than its parent (capped at 19, the lowest)."""
    parent = os.getpriority(os.PRIO_PROCESS, 0)
    detached = snapshots.detach(lambda: str(os.getpriority(os.PRIO_PROCESS, 0)).encode())
    body, code = asyncio.run(detached.result())
    assert code == 0
    assert int(body) == min(19, parent + snapshots.CHILD_NICENESS) > parent


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_the_child_encodes_under_the_idle_scheduling_policy() -> None:
    """A service task that wakes on the child's core runs at once (SCHED_IDLE)."""
    detached = snapshots.detach(lambda: str(os.sched_getscheduler(0)).encode())
    body, code = asyncio.run(detached.result())
    assert code == 0
    assert int(body) == os.SCHED_IDLE != os.sched_getscheduler(0)
