"""A log, its export and its snapshot written before claims were kept compact still read.

The files of ``tests/fixtures/oldlog/`` were made by dracap at ``bb28756`` (snapshot
format 2: each claim's whole manifest and allocation in the fold) from the events of
:mod:`tests.unit.oldlog`. Today's code must read them as it reads its own: the old
snapshot decodes (upcast) to exactly today's fold of the same events; ``replay verify
--log`` of the old export compares each old checkpoint with today's fold and finds them
equal; ``replay state --at`` from an old checkpoint is the fold at every position; and
``replay state``'s view is the old one, except for the one thing the fold no longer
keeps: the allocation's opaque configuration (the timeline's ``AllocationBound`` has
it, and ``claim get`` reads it from the log).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from events.state import ClusterState
from events.statecodec import snapshot_decode, state_digest
from services.replay.history import state_at, view
from services.replay.sources import FileSource
from services.replay.transfer import check_file
from services.replay.verify import fold_rows
from tests.unit import oldlog

FIXTURES = Path(__file__).parent.parent / "fixtures" / "oldlog"


def folded(to: int | None = None) -> ClusterState:
    state = ClusterState()
    fold_rows(state, oldlog.rows()[:to])
    return state


def test_the_fixture_is_the_log_it_says() -> None:
    snapshot = json.loads((FIXTURES / "snapshot.json").read_bytes())
    assert snapshot["format"] == 2 and snapshot["position"] == len(oldlog.rows())
    [tuned] = [c for key, c in snapshot["claims"] if key == ["team-a", "tuned"]]
    assert tuned["claim"]["spec"]["devices"]["config"]  # the manifest, whole
    assert len(tuned["allocation"]["devices"]["config"]) == 2


def test_a_format_2_snapshot_decodes_to_todays_fold_of_the_same_log() -> None:
    old = snapshot_decode((FIXTURES / "snapshot.json").read_bytes())
    today = folded()
    assert old == today
    assert state_digest(old) == state_digest(today)
    tuned = today.claims[("team-a", "tuned")]
    assert tuned.spec is not None and tuned.spec.configs == 2
    assert tuned.allocation_configs == 2 and tuned.allocation is not None
    assert tuned.allocation.devices is not None and tuned.allocation.devices.config is None


def test_replay_verify_finds_every_old_checkpoint_equal_to_todays_fold() -> None:
    state = check_file(FIXTURES / "format2.dracap-log", checkpoints=True)
    assert state_digest(state) == state_digest(folded())


@pytest.mark.parametrize("position", range(1, len(oldlog.rows()) + 1))
def test_state_at_from_an_old_checkpoint_is_the_fold_there(position: int) -> None:
    source = FileSource(FIXTURES / "format2.dracap-log")
    state = asyncio.run(state_at(source, position))
    assert state_digest(state) == state_digest(folded(position))


def test_the_replay_view_is_the_old_one_but_for_the_allocations_configuration() -> None:
    old: dict[str, Any] = json.loads((FIXTURES / "view.json").read_text())
    today = json.loads(json.dumps(view(folded())))
    tuned = old["claims"]["team-a/tuned"]["allocation"]["devices"]
    assert len(tuned.pop("config")) == 2
    assert today == old


def test_the_timelines_of_an_old_log_are_the_old_ones() -> None:
    """A claim's timeline shows its manifest and its allocation whole, as before: the
    timeline takes them from the events, since the fold no longer keeps them."""
    old = json.loads((FIXTURES / "timelines.json").read_text())
    assert oldlog.timelines(FIXTURES / "format2.dracap-log") == old
    [bound] = [s for s in old["tuned"] if s["type"] == "reservation.allocation_bound"]
    assert "allocation.devices.config" in bound["changes"]  # the configuration, whole
