"""No event can halt a reader; snapshots are checked; deep events are read; output is safe.

Against real PostgreSQL (issue 24, build items 4, 5, 7 and 8). Refused events and deep
events are copied into the log as its owner (:mod:`tests.integration.injecting`): the
application logins cannot append them. A forged snapshot is written as the snapshot
writer's login, the only one that may.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Sequence
from pathlib import Path

import asyncpg
import msgspec
import pytest

from events import catalog as c
from events.envelopes import Envelope
from events.eventcodec import encode_payload
from events.features import DEFAULT_GATES
from events.model import DeviceClass, DeviceClassSpec, ObjectMeta, ResourceClaim, ResourceClaimSpec
from events.state import ClusterState
from events.statecodec import snapshot_decode, snapshot_encode
from events.subjects import BusNames
from services.claims.admission import decide_apply
from services.enforcement.protocol import Reply, ViewAsk, Viewed, decode, encode
from services.enforcement.service import EnforcementService
from services.exitcodes import ExitCode
from services.runtime.bus.jetstream import connect_bus
from services.runtime.delivery.projecting import Projector
from services.runtime.ground.metrics import REGISTRY
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import EventStore
from services.runtime.store.livestate import HEAD, LiveState
from services.runtime.store.snapshots import FRAME_VERSION, SnapshotWriter, frame, write_snapshot
from tests.fixtures.contexts import folded
from tests.fixtures.services import fresh_database
from tests.integration import test_forensics as forensics
from tests.integration.injecting import inject, row
from tests.integration.scenario import put
from tests.integration.test_forensics import NODE, Scenario, dracap

pytestmark = pytest.mark.integration

# the recorded scenario of the forensic tests, and their store and snapshot writer's login
scenario = forensics.scenario
store = forensics.store
snapshots_user = forensics.snapshots_user

AGENT = f"agent:{NODE}#1"
HOSTILE = "x\x1b[31m\x1b]0;pwned\x07\rOK\x9b2J\u202eevil"


def _refused_total(reason: str) -> float:
    return REGISTRY.get_sample_value("dracap_events_refused_total", {"reason": reason}) or 0.0


async def _with_refused_events(scenario: Scenario, database_url: str) -> tuple[int, int, int]:
    """Append, as the log's owner: a LimitApplied that does not decode, one the fold
    refuses (its share was released by the fence), then an admission that folds."""
    head = scenario.head
    bad = msgspec.json.decode(
        encode_payload(
            c.LimitApplied(share_id=scenario.r3.share_id, node=NODE, level="hard", actual={})
        )
    )
    bad["level"] = 5
    late = c.LimitApplied(share_id=scenario.r2.share_id, node=NODE, level="hard", actual={})
    await inject(
        database_url,
        [
            row(head + 1, payload=json.dumps(bad).encode(), type_tag=c.tag_of(late), actor=AGENT),
            row(head + 2, late, actor=AGENT, stream=f"node:{NODE}:late"),
            row(head + 3, c.ClaimAdmitted(namespace="team-b", name="later"), actor="x"),
        ],
    )
    return head + 1, head + 2, head + 3


async def test_refused_events_are_skipped_by_every_reader(
    scenario: Scenario,
    store: EventStore,
    settings: Settings,
    database_url: str,
    postgres_admin_url: str,
    migrated_template: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = {r: _refused_total(r) for r in ("undecodable", "invariant")}
    undecodable, invariant, later = await _with_refused_events(scenario, database_url)

    # the live state of every service folds past them, twice, counting and logging once
    caplog.set_level(logging.ERROR, logger="dracap.refusals")
    for _ in range(2):
        live = LiveState(store)
        state = await live.fresh(HEAD)
        assert state.position == later and state.claim("team-b", "later") is not None
        assert state.refused == {undecodable: "undecodable", invariant: "invariant"}
    assert _refused_total("undecodable") == before["undecodable"] + 1
    assert _refused_total("invariant") == before["invariant"] + 1
    logged = [r for r in caplog.records if r.name == "dracap.refusals"]
    assert [r.position for r in logged] == [undecodable, invariant]  # type: ignore[attr-defined]
    assert all(r.exc_info is None for r in logged)

    # a snapshot carries them; a start from it knows them
    await write_snapshot(store.pool, state)
    started = LiveState(store)
    assert await started.load_snapshot()
    assert started.state.refused == state.refused

    # the audit and billing projectors leave them out
    caught: list[int] = []

    async def apply(_connection: object, envs: Sequence[Envelope]) -> None:
        caught.extend(e.position for e in envs)

    await Projector(store, "probe", apply, live=live).catch_up(later)
    assert caught == [p for p in range(1, later + 1) if p not in (undecodable, invariant)]

    # replay verify names each one (its own outcome and exit code), the rest agrees
    db = ("--database-url", database_url)
    code, out, err = await dracap(capsys, "replay", "verify", *db)
    assert code == ExitCode.EVENTS_REFUSED, (out, err)
    assert (
        f"REFUSED EVENT at position {undecodable}: enforcement.limit_applied by {AGENT}: "
        "undecodable" in out
    )
    assert f"REFUSED EVENT at position {invariant}: enforcement.limit_applied by {AGENT}: " in out
    assert "invariant 'readiness'" in out and "Traceback" not in out + err

    # the questions fold past them
    code, out, _ = await dracap(capsys, "replay", "state", "--at", str(later), "-o", "json", *db)
    assert code == 0 and "team-b/later" in json.loads(out)["claims"]
    code, out, _ = await dracap(capsys, "replay", "timeline", scenario.r2.share_id, *db)
    assert code == 0 and "REFUSED (invariant" in out, out
    code, out, _ = await dracap(capsys, "replay", "diff", "1", str(later), *db)
    assert code == 0
    code, _, err = await dracap(
        capsys, "replay", "plot", "gpu-0", "--out", str(tmp_path / "p.png"), *db
    )
    assert code == 0, err

    # export then import round-trips the log: refused events kept, and skipped again
    exported = tmp_path / "log.ndjson"
    code, out, err = await dracap(
        capsys, "replay", "export", "--out", str(exported), "--checkpoint-every", "5", *db
    )
    assert code == 0 and f"{later} events" in out, err
    code, out, _ = await dracap(capsys, "replay", "verify", "--log", str(exported))
    assert code == ExitCode.EVENTS_REFUSED and f"position {undecodable}" in out, out
    async with fresh_database(postgres_admin_url, migrated_template) as other:
        code, out = await forensics.round_trip(capsys, exported, other, tmp_path)
    assert code == ExitCode.EVENTS_REFUSED, out
    assert f"position {undecodable}" in out and f"position {invariant}" in out


# --- snapshots are checked, not trusted -----------------------------------------------------


async def _forge(store: EventStore, snapshots_user: str, state: ClusterState) -> None:
    """Store ``state`` as the snapshot at its position, as the snapshot writer's login."""
    event_id = await store.pool.fetchval(
        "SELECT event_id::text FROM events WHERE position = $1", state.position
    )
    writer = await asyncpg.connect(snapshots_user)
    try:
        await writer.execute(
            "INSERT INTO snapshots (position, schema_version, payload) VALUES ($1, $2, $3)",
            state.position,
            FRAME_VERSION,
            frame(snapshot_encode(state), event_id),
        )
    finally:
        await writer.close()


def _claim(namespace: str) -> bytes:
    return json.dumps(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "sneaky", "namespace": namespace},
            "spec": {
                "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "any"}}]}
            },
        }
    ).encode()


async def test_a_forged_snapshot_is_caught_by_verify_and_by_the_background_check(
    scenario: Scenario,
    store: EventStore,
    snapshots_user: str,
    database_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    gpu = DeviceClass(metadata=ObjectMeta(name="any"), spec=DeviceClassSpec())
    await put(
        store, c.DeviceClassApplied(device_class=gpu, rollout="immediate"), actor="operator:ops"
    )
    await put(store, c.NamespaceAccessSet(namespace="mallory", classes=[]), actor="operator:ops")
    honest = LiveState(store)
    await honest.fresh(HEAD)
    forged = msgspec.json.decode(snapshot_encode(honest.state))  # a copy to change
    forged["namespaces"]["mallory"]["classes"] = ["*"]  # the forged grant
    forged_state = snapshot_decode(msgspec.json.encode(forged))
    await _forge(store, snapshots_user, forged_state)

    code, out, _ = await dracap(capsys, "replay", "verify", "--database-url", database_url)
    assert code == ExitCode.SNAPSHOT_MISMATCH, out
    assert f"SNAPSHOT MISMATCH at position {forged_state.position}" in out

    checks = {o: _checks(o) for o in ("verified", "mismatch")}
    live = LiveState(store)  # a restart: the forged snapshot verifies, so it is served...
    assert await live.load_snapshot()
    assert live.state.namespaces["mallory"].classes == ["*"]
    assert decide_apply(live.state, "mallory", _claim("mallory"), DEFAULT_GATES).refusal is None
    writer = SnapshotWriter(
        store.pool, lambda: live.state, checked=lambda: live.unchecked_start is None
    )
    assert not await writer.maybe_write(stopping=True)  # never copied into a new snapshot
    replaced: list[ClusterState] = []
    live.on_replaced(replaced.append)
    stop = asyncio.Event()
    tail = asyncio.create_task(live.run(stop))
    try:
        async with asyncio.timeout(60):  # ... until the background check has caught it
            while live.unchecked_start is not None:  # noqa: ASYNC110 (the check's own flag)
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await tail
    assert _checks("mismatch") == checks["mismatch"] + 1
    assert replaced == [live.state]
    assert live.state.namespaces["mallory"].classes == []  # the forged grant no longer counts
    assert await writer.maybe_write(stopping=True)  # the checked fold is stored
    refusal = decide_apply(live.state, "mallory", _claim("mallory"), DEFAULT_GATES).refusal
    assert refusal is not None and refusal.kind == "class-access", refusal

    # an honest snapshot is verified and kept
    await store.pool.execute("DELETE FROM snapshots")
    await write_snapshot(store.pool, honest.state)
    again = LiveState(store)
    assert await again.load_snapshot()
    stop = asyncio.Event()
    tail = asyncio.create_task(again.run(stop))
    try:
        async with asyncio.timeout(60):
            while again.unchecked_start is not None:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await tail
    assert _checks("verified") == checks["verified"] + 1
    assert again.state == honest.state


def _checks(outcome: str) -> float:
    return REGISTRY.get_sample_value("dracap_snapshot_checks_total", {"outcome": outcome}) or 0.0


# --- deep events ----------------------------------------------------------------------------


async def test_a_deep_event_already_in_the_log_is_read_verified_and_exported(
    scenario: Scenario,
    store: EventStore,
    database_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    claim = msgspec.json.decode(encode_payload(c.ClaimSubmitted(claim=_resource_claim())))
    deep = '{"a":[' * 1225 + "]}" * 1225  # 2,450 levels: admitted before the limit
    config = {"opaque": {"driver": "gpu.example.com", "parameters": "HOLE"}}
    claim["claim"]["spec"] = {"devices": {"config": [config]}}
    payload = json.dumps(claim).replace('"HOLE"', deep).encode()
    position = scenario.head + 1
    await inject(
        database_url,
        [row(position, payload=payload, type_tag="claims.submitted", stream="claim:team-a/deep")],
    )
    live = LiveState(store)
    state = await live.fresh(HEAD)
    assert state.claim("team-a", "deep") is not None and not state.refused
    await write_snapshot(store.pool, state)  # encodes, and a start decodes it
    started = LiveState(store)
    assert await started.load_snapshot() and started.state == state

    db = ("--database-url", database_url)
    code, out, err = await dracap(capsys, "replay", "verify", *db)
    assert code == 0, (out, err)
    exported = tmp_path / "deep.ndjson"
    code, out, err = await dracap(capsys, "replay", "export", "--out", str(exported), *db)
    assert code == 0, err
    code, out, err = await dracap(capsys, "replay", "verify", "--log", str(exported))
    assert code == 0, (out, err)
    for output in ("json", "yaml", "table"):
        code, out, err = await dracap(
            capsys, "replay", "timeline", "team-a/deep", "-o", output, "--log", str(exported)
        )
        assert code == 0 and "Traceback" not in err, (output, err)
    code, out, err = await dracap(
        capsys, "replay", "state", "--at", str(position), "-o", "yaml", *db
    )
    assert code == 0, err


def _resource_claim() -> ResourceClaim:
    return ResourceClaim(
        metadata=ObjectMeta(name="deep", namespace="team-a"), spec=ResourceClaimSpec()
    )


# --- safe output ----------------------------------------------------------------------------


async def test_replay_prints_what_a_tenant_wrote_escaped(
    scenario: Scenario,
    store: EventStore,
    database_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await put(
        store,
        c.ClaimRejected(namespace="team-a", name="c1", field="spec", rule=HOSTILE, reason=HOSTILE),
        actor="system:claims",
    )
    db = ("--database-url", database_url)
    for output in ("table", "json", "yaml"):
        code, out, _ = await dracap(capsys, "replay", "timeline", "team-a/c1", "-o", output, *db)
        assert code == 0
        for char in ("\x1b", "\x07", "\r", "\x9b", "\u202e"):
            assert char not in out, (output, char)
        if output == "json":  # the data, intact
            steps = json.loads(out)["steps"]
            values = [v for s in steps for pair in s["changes"].values() for v in pair]
            assert any(isinstance(v, str) and HOSTILE in v for v in values)


async def test_the_enforcement_service_answers_an_agents_refused_messages_as_refused(
    scenario: Scenario, store: EventStore, database_url: str, nats_url: str
) -> None:
    """A node agent confirms its messages through the enforcement service: a message of
    an event the fold refused, and one that does not decode whose id the log holds as a
    refused event, come back ``refused`` (acknowledged unhandled, never acted on); an id
    the log does not hold comes back unconfirmed."""
    undecodable, _, later = await _with_refused_events(scenario, database_url)
    # addressed to the node (on its subjects), refused by the fold: its share was released
    confirmed = c.ShareConfirmed(share_id=scenario.r2.share_id, node=NODE)
    stream = f"node:{NODE}:confirmed"
    refused_at = await inject(database_url, [row(later + 1, confirmed, actor=AGENT, stream=stream)])
    live = LiveState(store)
    await live.fresh(HEAD)
    names = BusNames(prefix="treaders")
    nc, js = await connect_bus(nats_url)
    service = EnforcementService(folded(store, names, nc, js, live=live))
    try:
        await service.start()
        (refused,) = await store.read_positions([refused_at])  # it decodes; the fold refuses it
        undecodable_id = await store.pool.fetchval(
            "SELECT event_id::text FROM events WHERE position = $1", undecodable
        )
        stranger = str(uuid.uuid4())
        ask = ViewAsk(messages=[refused], undecodable=[undecodable_id, stranger])
        verb, outcome, data = await service.answer(
            names.node_request(NODE, "view"), None, encode(ask)
        )
        assert (verb, outcome) == ("view", "ok"), data
        viewed = decode(data, Reply[Viewed]).answer
        assert viewed is not None
        assert viewed.refused == [refused.event_id, undecodable_id]
        assert viewed.unconfirmed == [stranger] and viewed.handled == []
    finally:
        await service.close()
        await nc.close()


# --- the stack goes on ----------------------------------------------------------------------


async def test_the_stack_serves_claims_past_a_refused_event(
    settings: Settings, nats_url: str, database_url: str, tmp_path: Path
) -> None:
    """What the hostile report did: every request answered ``internal`` from then on."""
    from tests.integration.cluster import running_cluster
    from tests.integration.test_class_modes import INVENTORY
    from tests.integration.test_policy import NAMESPACE, _ready, claim_doc, view_when

    async with running_cluster(settings, nats_url, tmp_path, INVENTORY) as cluster:
        api = cluster.api
        await api.claims(NAMESPACE, "apply", claim_doc("before", "10Gi"))
        await view_when(api, "before", _ready)
        head = await cluster.stack.store.head()
        bad = {"type": "enforcement.limit_applied", "share_id": "x", "node": "n", "level": 5}
        await inject(
            database_url,
            [row(head + 1, payload=json.dumps(bad).encode(), type_tag=bad["type"], actor=AGENT)],
        )
        await api.claims(NAMESPACE, "apply", claim_doc("after", "10Gi"))
        view = await view_when(api, "after", _ready)
        assert view["ready"]
        assert cluster.stack.gauges.live.state.refused[head + 1] == "undecodable"


async def test_a_following_projector_stops_at_the_head_it_was_given(
    scenario: Scenario, store: EventStore
) -> None:
    """``run`` reads up to the head it knew after its linger and no further (issue 25):
    ``catch_up(head, chase=False)`` stops there though the store knows a newer one,
    in one batch; the default catch-up goes on to the newest head it knows."""
    head = await store.head()
    assert store.known_head == head > 3
    caught: list[int] = []

    async def apply(_connection: object, envs: Sequence[Envelope]) -> None:
        caught.extend(e.position for e in envs)

    following = Projector(store, "following", apply)
    assert await following.catch_up(head - 2, chase=False) == head - 2
    assert following.batches == 1 and caught == list(range(1, head - 1))
    assert await following.catch_up(head - 2) == head
    assert caught == list(range(1, head + 1))
