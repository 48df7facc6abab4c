"""Each service login appends its own job and nothing else (migration 0011, issue 24).

A hostile holder of each login the deployment hands out — the claims API's, the
reservation service's, the reclamation service's and the enforcement service's — tries
what the log must refuse, through the one function the login may call:

* another login's event types (the claims login replacing node b's lease, the
  reservation and reclamation logins granting adminAccess);
* an operator actor it does not speak as (a tenant actor outside its namespace, for the
  claims login);
* guards that do not follow from its events (the function of 0010 that took them, and the
  guard function itself);
* a payload the fold cannot decode (``LimitApplied`` with ``"level": 5``, a wrong type
  deep inside a ResourceClaim);

and the enforcement login as node agents' proxy: another node's reports, a stale epoch,
another node's admin-access share (finding 5), other consumers' rows, lease renewals.
Every refusal is typed (:class:`~services.runtime.ground.errors.AppendForbidden`,
:class:`~services.runtime.ground.errors.InvalidEvent`,
:class:`~services.runtime.ground.errors.NodeScopeViolation`,
:class:`~services.runtime.ground.errors.StaleEpoch`) and leaves the log and the guard tables as
they were. Logins are real login users in their groups (the session user is what the
database judges), created for the test and dropped.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import msgspec
import pytest

from events import catalog
from events.catalog import Event
from events.envelopes import stream_of
from events.errors import CatalogError
from events.eventcodec import decode_stored, encode_payload
from events.guards import Acquire, SetTotal, encode_guards
from services.runtime.ground.errors import (
    AppendForbidden,
    InvalidEvent,
    NodeScopeViolation,
    StaleEpoch,
    map_database_error,
)
from services.runtime.ground.settings import ServiceKind, Settings
from services.runtime.store.appends import Batch, Metadata, Processed
from services.runtime.store.eventstore import EventStore
from tests.fixtures.contexts import folded
from tests.fixtures.logins import login_users
from tests.integration import sample as s
from tests.integration.scenario import lease, put

KINDS = (
    ServiceKind.CLAIMS,
    ServiceKind.RESERVATION,
    ServiceKind.RECLAMATION,
    ServiceKind.ENFORCEMENT,
)
#: The actor each login's service appends as (an agent's is its node's lease's).
ACTORS = {
    ServiceKind.CLAIMS: "operator:alice",
    ServiceKind.RESERVATION: "system:reservation-0",
    ServiceKind.RECLAMATION: "system:reclamation-0",
}
A, B = "node-a", "node-b"
_NS = uuid.UUID("0f1a2b3c-4d5e-4f60-8a7b-8c9d0e1f2a3b")


def share(node: str, admin: bool = False) -> str:
    return str(uuid.uuid5(_NS, f"{node}/{admin}"))


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[EventStore]:
    async with await EventStore.open(settings) as store:
        yield store


@pytest.fixture
async def world(store: EventStore) -> dict[str, str]:
    """Nodes a and b: a slice, a share and an admin-access share each, a live lease each.
    Returns each node's agent actor."""
    actors = {}
    for node in (A, B):
        await put(store, s.slice_published(name=f"{node}-gpus", pool=node))
        await put(store, s.reserved(name=f"{node}-c", pool=node, share_id=share(node)))
        admin = s.reserved(name=f"{node}-adm", pool=node, share_id=share(node, True), admin=True)
        await put(store, admin)
        actors[node] = await lease(store, node)
    return actors


@pytest.fixture
async def logins(settings: Settings, postgres_admin_url: str) -> AsyncIterator[dict[str, Settings]]:
    """A login user per service kind (in its group role), as settings to connect with."""
    async with login_users(settings.database_url, postgres_admin_url, KINDS) as urls:
        yield {
            kind: msgspec.structs.replace(settings, database_url=url, app_role="")
            for kind, url in urls.items()
        }


async def _append(login: Settings, actor: str, *events: Event, **kw: Any) -> None:
    async with await EventStore.open(login) as own:
        await own.append_many(
            [Batch(stream_of(e), None, [e]) for e in events], Metadata(actor=actor), **kw
        )


_RAW = (
    "SELECT * FROM dracap_append_guarded(1, $1, ARRAY[NULL]::int[], $2, $1, $3, $4, $5, $6, "
    "ARRAY['c'], ARRAY[NULL]::text[], $7, NULL, NULL)"
)


async def _raw(login: Settings, actor: str, type_: str, payload: dict[str, Any]) -> None:
    """One event appended through the function as sent: no client-side check at all."""
    connection = await asyncpg.connect(login.database_url)
    try:
        await connection.fetchrow(
            _RAW,
            ["hostile:stream"],
            [uuid.uuid4()],
            [type_],
            [catalog.SCHEMA_VERSIONS[type_]],
            [payload.get("namespace")],
            actor,
            [msgspec.json.encode(payload).decode()],
        )
    except asyncpg.PostgresError as exc:
        raise map_database_error(exc) from exc
    finally:
        await connection.close()


async def _tables(store: EventStore) -> tuple[Any, ...]:
    """What the log and every guard table hold (to show a refusal changed nothing)."""
    rows = []
    for table in ("event_log_head", "capacity_ledger", "held_shares", "device_holds",
                  "node_epochs", "node_leases"):  # fmt: skip
        rows.append(await store.pool.fetch(f"SELECT * FROM {table} ORDER BY 1"))
    return tuple(tuple(map(tuple, r)) for r in rows)


def _actor(kind: ServiceKind, world: dict[str, str]) -> str:
    return world[A] if kind == ServiceKind.ENFORCEMENT else ACTORS[kind]


# --- each login's own job -----------------------------------------------------------------


async def test_each_login_appends_what_its_service_writes(
    store: EventStore, world: dict[str, str], logins: dict[str, Settings]
) -> None:
    claims = logins["claims"]
    await _append(claims, "tenant:bob@team-a", s.claim_submitted("team-a", "c9"))
    await _append(claims, "anonymous:team-a", catalog.ClaimAdmitted(namespace="team-a", name="c9"))
    await _append(
        claims,
        "operator:alice",
        catalog.NamespaceAccessSet(namespace="team-a", classes=["*"], admin_access=True),
    )
    await _append(claims, "operator:alice", catalog.ClaimWithdrawn(namespace="team-b", name="x"))
    bridged = s.reserved("team-k", "k1", pool=A)
    await _append(claims, "system:kubernetes-bridge", bridged, s.bound(bridged))
    reserved = s.reserved("team-a", "c9", pool=A)
    await _append(logins["reservation"], "system:reservation-0", reserved, s.bound(reserved))
    await _append(
        logins["reservation"],
        "system:reservation-claims",
        catalog.ClaimUnschedulable(namespace="team-a", name="c8", reason="full"),
    )
    await _append(
        logins["reclamation"],
        "system:reclamation-0",
        catalog.ReleaseRequested(
            namespace="team-a", name="c9", allocation_version=1, reason="not started"
        ),
    )
    await _append(
        logins["reclamation"],
        "system:fence-hook",
        catalog.ShareMarkedUnknown(share_id=share(B), node=B),
    )
    applied = catalog.LimitApplied(
        share_id=reserved.share_id, node=A, level="hard", actual=dict(reserved.consumed)
    )
    await _append(logins["enforcement"], world[A], applied)
    await _append(
        logins["enforcement"],
        world[B],
        catalog.LimitRemoved(share_id=share(B), node=B),
        s.released(s.reserved(name=f"{B}-c", pool=B, share_id=share(B))),
    )
    held = await store.pool.fetchval(
        "SELECT count(*) FROM held_shares WHERE share_id = $1", uuid.UUID(share(B))
    )
    assert held == 0  # the release's guard ran, derived by the database


# --- what no login may do -----------------------------------------------------------------

#: An event of another login's job, for each login (appended with the login's own actor).
ANOTHER_JOB: dict[ServiceKind, Event] = {
    # the claims login replacing node b's lease (finding 3)
    ServiceKind.CLAIMS: catalog.NodeLeaseAcquired(node=B, epoch=2, boot_id="evil", ttl_ms=10**9),
    # the reservation and reclamation logins granting adminAccess (finding 3)
    ServiceKind.RESERVATION: catalog.NamespaceAccessSet(
        namespace="team-a", classes=["*"], admin_access=True
    ),
    ServiceKind.RECLAMATION: catalog.NamespaceAccessSet(
        namespace="team-a", classes=["*"], admin_access=True
    ),
    ServiceKind.ENFORCEMENT: catalog.ClaimAdmitted(namespace="team-a", name="c1"),
}


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
async def test_another_logins_event_types_are_refused(
    kind: ServiceKind, store: EventStore, world: dict[str, str], logins: dict[str, Settings]
) -> None:
    before = await _tables(store)
    event = ANOTHER_JOB[kind]
    with pytest.raises(AppendForbidden) as refused:
        await _append(logins[kind.value], _actor(kind, world), event)
    assert refused.value.event_type == catalog.tag_of(event)
    assert await _tables(store) == before


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
async def test_an_actor_not_of_the_logins_job_is_refused(
    kind: ServiceKind, store: EventStore, world: dict[str, str], logins: dict[str, Settings]
) -> None:
    """An operator granting adminAccess, through any login but the claims API's; through
    the claims API's, a tenant acting outside its own namespace."""
    before = await _tables(store)
    grant = catalog.NamespaceAccessSet(namespace="team-b", classes=["*"], admin_access=True)
    if kind == ServiceKind.CLAIMS:
        actor, event = "tenant:mallory@team-a", s.claim_submitted("team-b", "theirs")
    else:
        actor, event = "operator:operator", grant
    with pytest.raises(AppendForbidden):
        await _append(logins[kind.value], actor, event)
    assert await _tables(store) == before


#: Guards the caller would like the database to apply: node b's lease replaced, a device's
#: total raised (room to oversubscribe it).
FORGED = [
    Acquire(at=1, node=B, epoch=2, boot_id="evil", ttl_ms=10**9),
    SetTotal(at=1, driver=s.DRIVER, pool=B, device="gpu-0", capacity="memory", total="1e18"),
]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
async def test_guards_that_do_not_follow_from_the_events_are_refused(
    kind: ServiceKind, store: EventStore, world: dict[str, str], logins: dict[str, Settings]
) -> None:
    before = await _tables(store)
    own = {
        ServiceKind.CLAIMS: catalog.ClaimAdmitted(namespace="team-a", name="c1"),
        ServiceKind.RESERVATION: catalog.ClaimUnschedulable(
            namespace="team-a", name="c1", reason="x"
        ),
        ServiceKind.RECLAMATION: catalog.ShareMarkedUnknown(share_id=share(A), node=A),
        ServiceKind.ENFORCEMENT: catalog.EnforcementReconciled(node=A),
    }[kind]
    connection = await asyncpg.connect(logins[kind.value].database_url)
    try:
        with pytest.raises(asyncpg.PostgresError):  # 0010's function took the caller's guards
            await connection.fetchrow(
                "SELECT * FROM dracap_append_guarded(1, $1, ARRAY[NULL]::int[], $2, $1, "
                "ARRAY[1], $3, ARRAY[1], ARRAY[NULL]::text[], $4, ARRAY['c'], "
                "ARRAY[NULL]::text[], now(), $5, 'dracap_events', $6, NULL, NULL)",
                [stream_of(own)],
                [uuid.uuid4()],
                [catalog.tag_of(own)],
                _actor(kind, world),
                [encode_payload(own).decode()],
                encode_guards(FORGED).decode(),
            )
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await connection.execute("SELECT dracap_guard(0, $1)", encode_guards(FORGED).decode())
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await connection.execute("UPDATE node_leases SET epoch = 99")
    finally:
        await connection.close()
    assert await _tables(store) == before


def _undecodable(kind: ServiceKind) -> tuple[str, dict[str, Any], str]:
    """(type, payload, the field the refusal names) of the login's own kind."""
    if kind == ServiceKind.CLAIMS:  # a wrong type deep inside a ResourceClaim manifest
        payload = msgspec.to_builtins(s.claim_submitted("team-a", "deep"), enc_hook=str)
        payload["claim"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = "two"
        return "claims.submitted", payload, "$.claim.spec.devices.requests[0].exactly.count"
    if kind == ServiceKind.RESERVATION:
        payload = msgspec.to_builtins(s.reserved(pool=A), enc_hook=str)
        payload["consumed"] = {"memory": "lots"}
        return "reservation.capacity_reserved", payload, "$.consumed['memory']"
    if kind == ServiceKind.RECLAMATION:
        return (
            "reclamation.node_lease_expired",
            {"type": "reclamation.node_lease_expired", "node": A, "epoch": "1"},
            "$.epoch",
        )
    # the finding's own example: a LimitApplied whose level is 5
    payload = {
        "type": "enforcement.limit_applied",
        "share_id": share(A),
        "node": A,
        "level": 5,
        "actual": {},
    }
    return "enforcement.limit_applied", payload, "$.level"


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
async def test_a_payload_the_fold_cannot_decode_is_refused(
    kind: ServiceKind, store: EventStore, world: dict[str, str], logins: dict[str, Settings]
) -> None:
    before = await _tables(store)
    type_, payload, field = _undecodable(kind)
    with pytest.raises(CatalogError):
        decode_stored(msgspec.json.encode(payload), type_, catalog.SCHEMA_VERSIONS[type_])
    with pytest.raises(InvalidEvent) as refused:
        await _raw(logins[kind.value], _actor(kind, world), type_, payload)
    assert field in str(refused.value) and type_ in str(refused.value)
    assert await _tables(store) == before
    async for env in store.read_all():  # and every reader still folds the whole log
        assert env.event is not None


# --- the enforcement login, a proxy of node agents ----------------------------------------


async def test_enforcement_appends_for_a_node_only_what_is_that_nodes(
    store: EventStore, world: dict[str, str], logins: dict[str, Settings]
) -> None:
    enforcement = logins["enforcement"]
    before = await _tables(store)
    refusals: list[tuple[str, Event]] = [
        # node a's agent reporting on node b's share, naming b or itself
        (world[A], catalog.LimitApplied(share_id=share(B), node=B, level="hard", actual={})),
        (world[A], catalog.LimitApplied(share_id=share(B), node=A, level="hard", actual={})),
        # finding 5: failing node b's admin-access share (it holds nothing in the ledger)
        (
            world[A],
            catalog.LimitFailed(share_id=share(B, True), node=A, retryable=False, reason="x"),
        ),
        (
            world[A],
            catalog.LimitFailed(share_id=share(B, True), node=B, retryable=False, reason="x"),
        ),
        # a share the log does not know
        (world[A], catalog.ShareUsed(share_id=str(uuid.uuid4()), node=A, evidence="x")),
        (world[A], catalog.EnforcementReconciled(node=B)),
    ]
    for actor, event in refusals:
        with pytest.raises(NodeScopeViolation):
            await _append(enforcement, actor, event)
    assert await _tables(store) == before
    # its own admin-access share is its own
    await _append(
        enforcement,
        world[A],
        catalog.LimitFailed(share_id=share(A, True), node=A, retryable=False, reason="ok"),
    )


async def test_enforcement_needs_the_nodes_live_epoch(
    store: EventStore, world: dict[str, str], logins: dict[str, Settings]
) -> None:
    enforcement = logins["enforcement"]
    report = catalog.EnforcementReconciled(node=A)
    with pytest.raises(AppendForbidden):  # no epoch: not an agent's actor
        await _append(enforcement, f"agent:{A}", report)
    fresh = catalog.NodeLeaseAcquired(node=A, epoch=2, boot_id="boot-2", ttl_ms=60_000)
    await _append(enforcement, f"agent:{A}#2", fresh)  # the acquisition names its new epoch
    with pytest.raises(StaleEpoch):
        await _append(enforcement, world[A], report)  # epoch 1 is gone
    refused = [e async for e in store.read_all() if isinstance(e.event, catalog.AppendRefused)]
    assert [(r.event.node, r.event.epoch, r.event.current_epoch) for r in refused] == [(A, 1, 2)]


async def test_enforcement_records_only_its_agents_consumers(
    store: EventStore, world: dict[str, str], logins: dict[str, Settings]
) -> None:
    enforcement = logins["enforcement"]
    report = catalog.EnforcementReconciled(node=A)
    message = str(uuid.uuid4())
    with pytest.raises(AppendForbidden):
        await _append(
            enforcement, world[A], report, processed=Processed("reservation-claims", [message])
        )
    await _append(enforcement, world[A], report, processed=Processed(f"agent-{A}", [message]))
    connection = await asyncpg.connect(enforcement.database_url)
    try:
        for sql in (
            "INSERT INTO processed_messages (consumer, event_id) "
            "VALUES ('reservation-claims', gen_random_uuid())",
            "INSERT INTO consumer_checkpoints (consumer, position) VALUES ('relay', 99)",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):  # row-level security
                await connection.execute(sql)
        await connection.execute(
            "INSERT INTO consumer_checkpoints (consumer, position) VALUES ($1, 1) "
            "ON CONFLICT (consumer) DO UPDATE SET position = EXCLUDED.position",
            f"agent-{A}",
        )
        seen = await connection.fetch("SELECT DISTINCT consumer FROM processed_messages")
        assert {r[0] for r in seen} == {f"agent-{A}"}  # other consumers' rows are invisible
    finally:
        await connection.close()


async def test_enforcement_renews_live_leases_in_one_statement(
    store: EventStore, world: dict[str, str], logins: dict[str, Settings]
) -> None:
    await store.pool.execute(
        "UPDATE node_leases "
        "SET expires_at = clock_timestamp() + interval '1 second', ttl_ms = 3600000"
    )
    await store.pool.execute(  # node c's lease ran out (nobody recorded it yet)
        "INSERT INTO node_leases (node, epoch, expires_at, ttl_ms) "
        "VALUES ('node-c', 1, clock_timestamp() - interval '1 second', 3600000)"
    )
    async with await EventStore.open(logins["enforcement"]) as enforcement:
        renewed = await enforcement.renew_leases({A: 1, B: 7, "node-c": 1, "node-z": 1})
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await enforcement.pool.execute("UPDATE node_leases SET expires_at = expires_at")
    assert renewed == {A}  # b: a stale epoch; c: expired; z: no lease
    left = await store.pool.fetchval(
        "SELECT extract(epoch FROM expires_at - clock_timestamp()) FROM node_leases "
        "WHERE node = $1",
        A,
    )
    assert left > 3000  # its own ttl, from the database's clock


async def test_other_logins_may_not_renew_leases(logins: dict[str, Settings]) -> None:
    for kind in ("claims", "reservation", "reclamation"):
        connection = await asyncpg.connect(logins[kind].database_url)
        try:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await connection.fetch("SELECT * FROM dracap_renew_leases($1, $2)", [A], [1])
        finally:
            await connection.close()


# --- the database's clock -------------------------------------------------------------------


def _ten_minutes_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's wall clock, ten minutes behind (until ``monkeypatch.undo()``)."""
    real = datetime.datetime

    class Behind(real):
        @classmethod
        def now(cls, tz: datetime.tzinfo | None = None) -> datetime.datetime:  # type: ignore[override]
            return real.now(tz) - datetime.timedelta(minutes=10)

    monkeypatch.setattr(datetime, "datetime", Behind)


async def test_recorded_at_is_the_databases_clock_whatever_the_writers(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer ten minutes behind (finding 6) dates nothing: the database does."""
    _ten_minutes_behind(monkeypatch)
    [env] = await put(store, catalog.ClaimAdmitted(namespace="team-a", name="late"))
    monkeypatch.undo()
    stored, now = await store.pool.fetchrow(
        "SELECT recorded_at, clock_timestamp() FROM events WHERE position = $1", env.position
    )
    assert env.recorded_at == stored  # what the writer was told is what the log holds
    assert abs((now - stored).total_seconds()) < 60
    assert abs((store.clock.now() - now).total_seconds()) < 60  # the store learnt the clock


async def test_a_writer_ten_minutes_behind_does_not_shorten_a_not_started_timeout(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 6: the agent that made a claim Ready ran 10 minutes behind; under a 60 s
    not-started timeout the claim was released within seconds. The timeout counts from
    the recorded_at of the Ready event, on the database's clock: nothing is due."""
    from events import model
    from services.reclamation.service import ReclamationService
    from services.runtime.store.livestate import HEAD

    device_class = model.convert(
        {
            "metadata": {
                "name": "gpu.example.com",
                "annotations": {"dracap.io/not-started-timeout": "60s"},
            },
            "spec": {},
        },
        model.DeviceClass,
    )
    await put(store, catalog.DeviceClassApplied(device_class=device_class, rollout="immediate"))
    await put(store, s.slice_published(pool=A))
    reserved = s.reserved(pool=A)
    await put(store, s.claim_submitted(), catalog.ClaimAdmitted(namespace="team-a", name="c1"))
    await put(store, reserved, s.bound(reserved))
    actor = await lease(store, A)
    _ten_minutes_behind(monkeypatch)
    ready = catalog.LimitApplied(
        share_id=reserved.share_id, node=A, level="hard", actual=dict(reserved.consumed)
    )
    await put(store, ready, actor=actor)
    monkeypatch.undo()
    reclamation = ReclamationService(folded(store))
    state = await reclamation.live.fresh(HEAD)
    assert state.claims[("team-a", "c1")].phase == "ready"
    assert await reclamation.tick() == 0  # 60 s have not passed on the database's clock
    assert not [e async for e in store.read_all() if isinstance(e.event, catalog.ReleaseRequested)]


async def test_the_ledger_login_only_inserts_audit_records(
    settings: Settings, postgres_admin_url: str
) -> None:
    """The projectors read the log from their own position and only insert audit records:
    the ledger's login may not rewrite one, nor write consumers' rows it has no use for
    (0011 took them back)."""
    async with login_users(settings.database_url, postgres_admin_url, [ServiceKind.LEDGER]) as u:
        connection = await asyncpg.connect(u[ServiceKind.LEDGER.value])
        try:
            for sql in (
                "UPDATE audit_records SET namespace = 'elsewhere'",
                "INSERT INTO processed_messages (consumer, event_id) "
                "VALUES ('x', gen_random_uuid())",
                "INSERT INTO consumer_checkpoints (consumer, position) VALUES ('relay', 99)",
            ):
                with pytest.raises(asyncpg.InsufficientPrivilegeError):
                    await connection.execute(sql)
            await connection.fetch("SELECT position FROM snapshots LIMIT 1")  # its view's start
        finally:
            await connection.close()
