"""The fold's driver: refused events are skipped with the state exactly as before them."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events import catalog as c
from events.envelopes import new_envelope
from events.errors import InvariantViolation
from events.eventcodec import decode_envelope, encode_event, encode_payload
from events.folding import Refusal, decode, fold_event, fold_stored, refuse
from events.nesting import MAX_STORED_DEPTH
from events.state import ClusterState
from events.statecodec import same_state, snapshot_decode, snapshot_encode, to_builtins
from tests.unit.test_fold import (
    NODE,
    acquired,
    applied,
    bound,
    device,
    policy,
    release,
    reserve,
    rslice,
    submitted,
)


def _apart(state: ClusterState) -> dict[str, Any]:
    """The state less what a refusal moves (its position and its record of refusals)."""
    plain = to_builtins(state)
    del plain["position"], plain["refused"]
    return plain


def _stored(state: ClusterState, event: c.Event) -> c.Event | Refusal:
    return fold_stored(state, encode_payload(event), c.tag_of(event), 1, state.position + 1)


def _ready_log() -> ClusterState:
    state = ClusterState()
    for event in (
        c.ResourceSlicePublished(slice=rslice(device("gpu-0", pol=policy()))),
        submitted(),
        c.ClaimAdmitted(namespace="team-a", name="train"),
        reserve("s-1"),
        bound("train", "s-1"),
        applied("s-1"),
    ):
        assert not isinstance(_stored(state, event), Refusal)
    return state


def test_a_payload_that_does_not_decode_is_refused_and_skipped() -> None:
    state = _ready_log()
    before = _apart(state)
    payload = msgspec.json.decode(encode_payload(applied("s-1")))
    payload["level"] = 5  # what a hostile login appended: not hard/soft/none
    refusal = fold_stored(
        state, json.dumps(payload).encode(), "enforcement.limit_applied", 1, state.position + 1
    )
    assert isinstance(refusal, Refusal)
    assert (refusal.reason, refusal.type, refusal.position) == (
        "undecodable",
        "enforcement.limit_applied",
        7,
    )
    assert "level" in refusal.detail
    assert _apart(state) == before
    assert state.position == 7 and state.refused == {7: "undecodable"}
    # the log goes on: the next event folds
    assert not isinstance(_stored(state, c.ClaimAdmitted(namespace="b", name="x")), Refusal)
    assert state.position == 8 and ("b", "x") in state.claims


def test_a_valid_event_the_fold_refuses_is_skipped() -> None:
    state = _ready_log()
    before = _apart(state)
    refusal = _stored(state, applied("s-1"))  # the share is ready already
    assert isinstance(refusal, Refusal)
    assert refusal.reason == "invariant" and "readiness" in refusal.detail
    assert _apart(state) == before and state.refused == {7: "invariant"}


def test_an_unknown_type_and_a_newer_schema_are_undecodable() -> None:
    state = ClusterState()
    payload = encode_payload(c.ClaimAdmitted(namespace="a", name="b"))
    assert isinstance(fold_stored(state, payload, "claims.exploded", 1, 1), Refusal)
    assert isinstance(fold_stored(state, payload, "claims.admitted", 99, 2), Refusal)
    assert isinstance(fold_stored(state, b"not json", "claims.admitted", 1, 3), Refusal)
    assert state.refused == {1: "undecodable", 2: "undecodable", 3: "undecodable"}
    assert state.claims == {}


def test_a_step_that_fails_otherwise_changes_nothing_either() -> None:
    state = _ready_log()
    state.nodes[NODE].live_shares.add("ghost")  # a state no fold gives (a forged snapshot)
    before = _apart(state)
    refusal = _stored(state, c.NodeLeaseExpired(node=NODE, epoch=1))
    assert isinstance(refusal, Refusal) and refusal.reason == "error"
    assert "KeyError" in refusal.detail
    assert _apart(state) == before


def test_a_position_out_of_order_is_the_reader_s_error_not_a_refusal() -> None:
    state = _ready_log()
    with pytest.raises(InvariantViolation) as err:
        fold_event(state, c.ClaimAdmitted(namespace="a", name="b"), state.position)
    assert err.value.invariant == "order"
    with pytest.raises(InvariantViolation):
        refuse(state, Refusal(position=1, type="x", reason="undecodable", detail=""))


def test_refusals_survive_a_snapshot() -> None:
    state = _ready_log()
    _stored(state, applied("s-1"))
    restored = snapshot_decode(snapshot_encode(state))
    assert restored.refused == {7: "invariant"} and same_state(restored, state)
    older = msgspec.json.decode(snapshot_encode(state))
    del older["refused"]  # a snapshot written before refusals were recorded
    assert snapshot_decode(msgspec.json.encode(older)).refused == {}


# --- every step, any event: a refusal leaves the state as it was --------------------------


def _pool() -> list[c.Event]:
    """Events that fold and events that do not, depending on what came before."""
    return [
        c.ResourceSlicePublished(slice=rslice(device("gpu-0", pol=policy()), device("gpu-1"))),
        c.ResourceSlicePublished(slice=rslice(device("gpu-0", memory="8Gi"), name="other")),
        submitted(),
        submitted("infer"),
        c.ClaimAdmitted(namespace="team-a", name="train"),
        reserve("s-1"),
        reserve("s-1", "50Gi"),
        reserve("s-2", "41Gi"),
        reserve("s-3", claim="infer", dev="gpu-1"),
        reserve("s-4", dev="gpu-1", shared=False),
        bound("train", "s-1"),
        bound("infer", "s-3"),
        bound("train", "s-3"),
        applied("s-1"),
        applied("s-3", node="elsewhere"),
        release("s-1"),
        release("s-3", dev="gpu-1"),
        release("s-9"),
        c.ReleaseRequested(namespace="team-a", name="train", allocation_version=1),
        c.LimitRemoved(share_id="s-1", node=NODE),
        c.LimitFailed(share_id="s-3", node=NODE, reason="tc failed", retryable=False),
        acquired(1),
        acquired(1),
        c.NodeLeaseExpired(node=NODE, epoch=1),
        c.ShareConfirmed(share_id="s-1", node=NODE),
        c.NodeFenced(node=NODE, epoch=1),
        c.ClaimWithdrawn(namespace="team-a", name="train"),
        c.RequestPolicyChanged(
            driver="gpu.example.com",
            pool="node-a",
            device="gpu-0",
            capacity="cores",
            policy=policy(),
            policy_version=3,
        ),
    ]


POOL = _pool()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(POOL) - 1), max_size=40))
def test_a_refused_event_leaves_the_state_exactly_as_before(picks: list[int]) -> None:
    state = ClusterState()
    refused = 0
    for pick in picks:
        event = POOL[pick]
        before = _apart(state)
        result = _stored(state, event)
        if isinstance(result, Refusal):
            refused += 1
            assert _apart(state) == before, (event, result)
            assert state.refused[state.position] == result.reason
    assert len(state.refused) == refused


# --- depth --------------------------------------------------------------------------------


def _deep_claim(levels: int) -> bytes:
    payload = msgspec.json.decode(encode_payload(submitted()))
    config = {"opaque": {"driver": "gpu.example.com", "parameters": "HOLE"}}
    payload["claim"]["spec"] = {"devices": {"config": [config]}}
    text = json.dumps(payload)
    return text.replace('"HOLE"', '{"a":[' * levels + "]}" * levels).encode()


def test_a_deep_event_is_read_with_its_deep_part_kept_as_text() -> None:
    payload = _deep_claim(1225)  # 2,450 levels, as the tester's claim
    event = decode(payload, "claims.submitted", 1, 1)
    assert isinstance(event, c.ClaimSubmitted)
    config = event.claim.spec.devices.config[0]  # type: ignore[union-attr,index]
    value: Any = config.opaque.parameters  # type: ignore[union-attr]
    depth = 7  # the payload's levels above the parameters
    while isinstance(value, dict | list):
        value = value["a"] if isinstance(value, dict) else value[0]
        depth += 1
    assert depth == MAX_STORED_DEPTH and isinstance(value, str)
    assert value.encode() in payload  # the deeper levels, as their exact text
    state = ClusterState()
    assert not isinstance(fold_stored(state, payload, "claims.submitted", 1, 1), Refusal)
    assert same_state(snapshot_decode(snapshot_encode(state)), state)  # encodes, decodes
    assert to_builtins(state)["claims"]
    # the bus form of the same event decodes alike (one level more: the envelope)
    env = new_envelope(event, stream_version=1, actor="t", position=1, event_id="e")
    wire = encode_event(env).replace(encode_payload(event), payload)
    assert decode_envelope(wire).event == event


def test_an_event_within_the_bound_decodes_as_it_is() -> None:
    payload = _deep_claim(50)  # 107 levels: under the reading bound
    event = decode(payload, "claims.submitted", 1, 1)
    assert isinstance(event, c.ClaimSubmitted)
    assert msgspec.json.decode(encode_payload(event)) == msgspec.json.decode(payload)
