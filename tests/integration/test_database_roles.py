"""The tenant boundary in the database (migration 0006), against a real PostgreSQL.

* every application role (one per service kind, the read-only role, and the app role of
  0001) is refused ``UPDATE``, ``DELETE`` and ``TRUNCATE`` on ``events`` by its
  *privileges* — before the append-only trigger that stops everybody would;
* the read-only role cannot insert, nor append through the append function;
* no application role may change the schema;
* the enforcement service's login (node agents have none since 0012) appends a node's
  reports as that node's agent (``agent:<node>#<epoch>``) and nothing else: another
  node's report, a slice or pool of another node, or another node's share are refused
  with :class:`~services.runtime.ground.errors.NodeScopeViolation`; an event that is not an
  agent's with :class:`~services.runtime.ground.errors.AppendForbidden` (migration 0011:
  ``tests/integration/test_login_jobs.py`` tries every login), and no guard can be
  passed at all (the database derives them).

Group roles are taken with the ``role`` startup parameter by the suite's administrator
(what a login user that belongs to the group has); the enforcement login is a real login
user (the session user is what the database checks), created for the test and dropped.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import asyncpg
import msgspec
import pytest

from events import catalog
from events.catalog import Event
from events.envelopes import stream_of
from events.eventcodec import encode_payload
from events.guards import SetTotal, encode_guards
from services.runtime.ground.errors import AppendForbidden, NodeScopeViolation, PermanentError
from services.runtime.ground.settings import ServiceKind, Settings
from services.runtime.store.appends import Batch, Metadata
from services.runtime.store.eventstore import EventStore
from services.runtime.store.servicestores import ServiceStores
from tests.fixtures.logins import login_users
from tests.integration import sample as s
from tests.integration.scenario import lease, put

SERVICE_ROLES = (
    "dracap_claims",
    "dracap_reservation",
    "dracap_relay",
    "dracap_readonly",
    "dracap_enforcement",
)
APP_ROLES = (*SERVICE_ROLES, "dracap_app")


async def _as_role(database_url: str, role: str) -> asyncpg.Connection:
    connection = await asyncpg.connect(database_url, server_settings={"role": role})
    assert await connection.fetchval("SELECT current_user") == role
    return connection


@pytest.fixture
async def one_event(store: EventStore) -> None:
    await put(store, s.claim_submitted())


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[EventStore]:
    async with await EventStore.open(settings) as store:
        yield store


async def _refused_by_privileges(database_url: str, role: str, sql: str, privilege: str) -> None:
    connection = await _as_role(database_url, role)
    try:
        assert not await connection.fetchval("SELECT has_table_privilege('events', $1)", privilege)
        with pytest.raises(asyncpg.InsufficientPrivilegeError) as refused:
            await connection.execute(sql)
        assert "append-only" not in str(refused.value)  # not the trigger: the grants
    finally:
        await connection.close()
    admin = await asyncpg.connect(database_url)
    try:
        assert await admin.fetchval("SELECT count(*) FROM events") == 1
    finally:
        await admin.close()


# --- append-only by privileges ----------------------------------------------------------


@pytest.mark.usefixtures("one_event")
@pytest.mark.parametrize("role", APP_ROLES)
async def test_an_application_role_cannot_update_events(database_url: str, role: str) -> None:
    sql = "UPDATE events SET actor = 'evil'"
    await _refused_by_privileges(database_url, role, sql, "UPDATE")


@pytest.mark.usefixtures("one_event")
@pytest.mark.parametrize("role", APP_ROLES)
async def test_an_application_role_cannot_delete_events(database_url: str, role: str) -> None:
    await _refused_by_privileges(database_url, role, "DELETE FROM events", "DELETE")


@pytest.mark.usefixtures("one_event")
@pytest.mark.parametrize("role", APP_ROLES)
async def test_an_application_role_cannot_truncate_events(database_url: str, role: str) -> None:
    await _refused_by_privileges(database_url, role, "TRUNCATE events", "TRUNCATE")


# --- the read-only role -----------------------------------------------------------------


@pytest.mark.usefixtures("one_event")
async def test_the_readonly_role_cannot_insert(database_url: str) -> None:
    connection = await _as_role(database_url, "dracap_readonly")
    try:
        assert await connection.fetchval("SELECT count(*) FROM events") == 1  # it reads
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await connection.execute(
                "INSERT INTO events SELECT position + 1, gen_random_uuid(), stream, "
                "stream_version + 1, type, schema_version, namespace, actor, correlation_id, "
                "causation_id, recorded_at, payload FROM events"
            )
        for table in ("capacity_ledger", "processed_messages", "consumer_checkpoints"):
            assert not await connection.fetchval("SELECT has_table_privilege($1, 'INSERT')", table)
    finally:
        await connection.close()


@pytest.mark.usefixtures("one_event")
async def test_the_readonly_role_cannot_append_through_the_function(settings: Settings) -> None:
    readonly = msgspec.structs.replace(settings, app_role="dracap_readonly")
    async with await EventStore.open(readonly) as store:
        with pytest.raises(PermanentError, match="permission denied"):
            await put(store, s.claim_submitted("team-b", "c2"))
        assert await store.head() == 1


# --- no DDL -----------------------------------------------------------------------------


DDL = (
    "CREATE TABLE sneaky (id int)",
    "ALTER TABLE events ADD COLUMN sneaky int",
    "ALTER TABLE events DISABLE TRIGGER events_append_only_rows",
    "DROP TABLE capacity_ledger",
    "CREATE INDEX sneaky ON events (actor)",
    "CREATE FUNCTION sneaky() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    "CREATE SCHEMA sneaky",
    "COMMENT ON TABLE events IS 'sneaky'",
)


@pytest.mark.parametrize("role", APP_ROLES)
async def test_application_roles_cannot_change_the_schema(database_url: str, role: str) -> None:
    connection = await _as_role(database_url, role)
    try:
        assert not await connection.fetchval("SELECT has_schema_privilege('public', 'CREATE')")
        for sql in DDL:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await connection.execute(sql)
        # GRANT on a table it does not own only warns, and grants nothing
        await connection.execute("GRANT UPDATE ON events TO PUBLIC")
        assert not await connection.fetchval("SELECT has_table_privilege('events', 'UPDATE')")
    finally:
        await connection.close()


async def test_the_owner_role_owns_the_schema(database_url: str) -> None:
    connection = await asyncpg.connect(database_url)
    try:
        owners = await connection.fetch(
            "SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = 'public' "
            "AND tablename <> 'alembic_version'"
        )
        assert [row[0] for row in owners] == ["dracap_owner"]
        definer = await connection.fetchrow(
            "SELECT prosecdef, pg_get_userbyid(proowner) FROM pg_proc "
            "WHERE proname = 'dracap_append_guarded'"
        )
        assert definer is not None and tuple(definer) == (True, "dracap_owner")
    finally:
        await connection.close()


# --- node agents' reports, as the enforcement service's login appends them ------------------


@pytest.fixture
async def reporter(settings: Settings, postgres_admin_url: str) -> AsyncIterator[Settings]:
    """Settings that log in as a new member of ``dracap_enforcement`` (dropped after the
    test): the one login that appends node agents' reports (node agents have none, 0012),
    each append as the agent of the node its actor names."""
    kinds = [ServiceKind.ENFORCEMENT]
    async with login_users(settings.database_url, postgres_admin_url, kinds) as urls:
        yield msgspec.structs.replace(settings, database_urls=urls).for_service(kinds[0])


def _node() -> str:
    return f"node-{uuid.uuid4().hex[:8]}"


def _applied(share_id: str, node: str) -> catalog.LimitApplied:
    return catalog.LimitApplied(
        share_id=share_id, node=node, level="hard", actual={"memory": s.q("10Gi")}
    )


_NS = uuid.UUID("6ba7b810-9dad-11d1-80b4-00c04fd430c8")


def _share(node: str) -> str:
    """The share the ``nodes`` fixture reserves on ``node``."""
    return str(uuid.uuid5(_NS, node))


@pytest.fixture
async def nodes(store: EventStore) -> tuple[str, str]:
    """Two nodes with a slice each (``<node>-gpus``, pool ``<node>``), a share on each and
    an admin-access share on each (``_share(node + "-admin")``: it holds nothing)."""
    a, b = _node(), _node()
    for node in (a, b):
        await put(store, s.slice_published(name=f"{node}-gpus", pool=node))
        await put(store, s.reserved(name=node, pool=node, share_id=_share(node)))
        admin = _share(f"{node}-admin")
        await put(store, s.reserved(name=f"{node}-a", pool=node, share_id=admin, admin=True))
    return a, b


async def test_an_agent_appends_its_own_nodes_reports(
    nodes: tuple[str, str], reporter: Settings
) -> None:
    a, _ = nodes
    async with await EventStore.open(reporter) as agent:
        stored = await put(agent, _applied(_share(a), a), actor=await lease(agent, a))
        assert stored[0].event == _applied(_share(a), a)
        assert (
            await agent.pool.fetchval("SELECT session_user")
            == urlsplit(reporter.database_url).username
        )


async def test_an_agent_of_node_a_cannot_report_for_node_b(
    nodes: tuple[str, str], reporter: Settings, store: EventStore
) -> None:
    a, b = nodes
    head = await store.head()
    async with await EventStore.open(reporter) as agent:
        actor = await lease(agent, a)
        head = await store.head()
        with pytest.raises(NodeScopeViolation) as refused:
            await put(agent, _applied(_share(b), b), actor=actor)
    assert refused.value.event_type == "enforcement.limit_applied"
    message = str(refused.value)
    assert f"'{a}'" in message and f"'{b}'" in message and "enforcement.limit_applied" in message
    assert await store.head() == head  # nothing written


def _slice(name: str, pool: str, node: str) -> catalog.ResourceSlicePublished:
    """A slice ``name`` of ``node`` with its devices in ``pool``."""
    published = s.slice_published(name=name, pool=pool)
    spec = msgspec.structs.replace(published.slice.spec, node_name=node)
    return catalog.ResourceSlicePublished(slice=msgspec.structs.replace(published.slice, spec=spec))


def _refusals(a: str, b: str) -> dict[str, list[Event]]:
    """Appends an agent of node ``a`` may not make, by what is wrong with them."""
    return {
        "another node's removal": [catalog.LimitRemoved(share_id=_share(b), node=b)],
        "another node's share, named as its own": [_applied(_share(b), a)],
        "confirming another node's share": [catalog.ShareConfirmed(share_id=_share(b), node=a)],
        "using another node's share": [
            catalog.ShareUsed(share_id=_share(b), node=a, evidence="forged")
        ],
        "another node's reconcile": [catalog.EnforcementReconciled(node=b)],
        "another node's slice": [_slice(f"{b}-extra", b, b)],
        "a slice name of another node": [_slice(f"{b}-gpus", a, a)],
        "another node's pool": [_slice(f"{a}-extra", b, a)],
        "withdrawing another node's slice": [catalog.ResourceSliceWithdrawn(name=f"{b}-gpus")],
        "failing another node's admin-access share (finding 5)": [
            catalog.LimitFailed(share_id=_share(f"{b}-admin"), node=a, retryable=False, reason="x")
        ],
        "releasing another node's share": [
            s.released(s.reserved(name=b, pool=b, share_id=_share(b)))
        ],
        "one good event and one bad": [
            _applied(_share(a), a),
            catalog.LimitFailed(share_id=_share(b), node=b, retryable=False, reason="x"),
        ],
    }


async def test_an_agent_appends_no_event_an_agent_does_not_write(
    nodes: tuple[str, str], reporter: Settings, store: EventStore
) -> None:
    a, _ = nodes
    async with await EventStore.open(reporter) as agent:
        actor = await lease(agent, a)
        head = await store.head()
        with pytest.raises(AppendForbidden, match=re.escape("claims.admitted is not written by")):
            await put(agent, catalog.ClaimAdmitted(namespace="team-a", name="c1"), actor=actor)
    assert await store.head() == head


@pytest.mark.parametrize("case", list(_refusals("a", "b")))
async def test_an_agent_cannot_append_what_is_not_its_nodes(
    case: str, nodes: tuple[str, str], reporter: Settings, store: EventStore
) -> None:
    a, b = nodes
    batches = [Batch(stream_of(e), None, [e]) for e in _refusals(a, b)[case]]
    head = await store.head()
    async with await EventStore.open(reporter) as agent:
        actor = await lease(agent, a)
        head = await store.head()
        with pytest.raises(NodeScopeViolation, match=re.escape(f"acts for node '{a}' only")):
            await agent.append_many(batches, Metadata(actor=actor))
    assert await store.head() == head


async def test_an_agent_releases_and_publishes_for_its_own_node(
    nodes: tuple[str, str], reporter: Settings, store: EventStore
) -> None:
    a, _ = nodes
    own = s.reserved(name=a, pool=a, share_id=_share(a))
    async with await EventStore.open(reporter) as agent:
        actor = await lease(agent, a)
        removed = catalog.LimitRemoved(share_id=own.share_id, node=a)
        await put(agent, removed, s.released(own), actor=actor)
        await put(
            agent,
            s.slice_published(name=f"{a}-gpus", pool=a, devices={"gpu-0": {"memory": "40Gi"}}),
            actor=actor,
        )
        await put(agent, catalog.ResourceSliceWithdrawn(name=f"{a}-gpus"), actor=actor)
    held = await store.pool.fetchval("SELECT count(*) FROM held_shares WHERE node = $1", a)
    assert held == 0


async def test_the_enforcement_login_appends_for_the_node_its_actor_names_only(
    nodes: tuple[str, str], reporter: Settings
) -> None:
    a, b = nodes
    async with await EventStore.open(reporter) as agent:
        actor_a, actor_b = await lease(agent, a), await lease(agent, b)
        await put(agent, _applied(_share(a), a), actor=actor_a)
        await put(agent, _applied(_share(b), b), actor=actor_b)
        with pytest.raises(AppendForbidden, match=re.escape("claims.admitted is not written by")):
            await put(agent, catalog.ClaimAdmitted(namespace="team-a", name="c1"), actor=actor_a)
        with pytest.raises(NodeScopeViolation):  # its actor names node a: a report on b is not a's
            await put(agent, _applied(_share(b), b), actor=actor_a)


async def test_an_agent_cannot_smuggle_a_guard(
    nodes: tuple[str, str], reporter: Settings, store: EventStore
) -> None:
    """No guard is taken from the caller (0011): the function of 0006 that took them is
    gone, and the guard function itself is the owner's."""
    a, b = nodes
    forged = encode_guards(
        [SetTotal(at=1, driver=s.DRIVER, pool=b, device="gpu-0", capacity="memory", total="1")]
    )
    report = encode_payload(_applied(_share(a), a))
    async with await EventStore.open(reporter) as agent:
        actor = await lease(agent, a)
        with pytest.raises(asyncpg.UndefinedFunctionError):
            await agent.pool.fetchrow(
                "SELECT * FROM dracap_append_guarded(1, $1, $2, $3, $1, $4, $5, $6, $7, $12, "
                "$8, $9, now(), $10, 'dracap_events', $11, NULL, NULL)",
                [f"node:{a}"],
                [None],
                [uuid.uuid4()],
                [1],
                ["enforcement.limit_applied"],
                [1],
                [None],
                ["c"],
                [None],
                [report],
                forged,
                actor,
            )
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await agent.pool.execute("SELECT dracap_guard(0, $1)", forged)
    total = await store.pool.fetchval(
        "SELECT total FROM capacity_ledger WHERE pool = $1 AND device = 'gpu-0'", b
    )
    assert total > 1


async def test_an_agent_has_no_privilege_on_the_tables_it_appends_to(
    nodes: tuple[str, str], reporter: Settings
) -> None:
    a, _ = nodes
    async with await EventStore.open(reporter) as agent:
        for sql in (
            "INSERT INTO events SELECT * FROM events LIMIT 1",
            "UPDATE capacity_ledger SET total = total + 1",
            "DELETE FROM held_shares",
            "UPDATE event_log_head SET position = position",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await agent.pool.execute(sql)
        await put(agent, _applied(_share(a), a), actor=await lease(agent, a))


@pytest.mark.parametrize("role", ["dracap_reservation", "dracap_claims"])
async def test_no_login_writes_the_log_or_the_guard_tables_itself(
    database_url: str, role: str
) -> None:
    """0011 took back the reservation login's bulk path (INSERT on events and the guard
    tables): every append, large ones included, goes through the checked function."""
    connection = await _as_role(database_url, role)
    try:
        for table in ("events", "capacity_ledger", "held_shares", "device_holds", "node_epochs"):
            assert not await connection.fetchval("SELECT has_table_privilege($1, 'INSERT')", table)
        assert not await connection.fetchval(
            "SELECT has_table_privilege('event_log_head', 'UPDATE')"
        )
        assert not await connection.fetchval(
            "SELECT has_function_privilege('dracap_guard(bigint, jsonb)', 'EXECUTE')"
        )
    finally:
        await connection.close()


async def test_a_large_append_is_checked_and_guarded_like_a_small_one(
    nodes: tuple[str, str], settings: Settings, store: EventStore
) -> None:
    a, _ = nodes
    shares = [s.reserved(name=f"bulk-{i}", pool=a, consumed="1Mi") for i in range(300)]
    await store.append_many([Batch(stream_of(shares[0]), None, shares)], Metadata(actor="test"))
    held = await store.pool.fetchval(
        "SELECT count(*) FROM held_shares WHERE share_id = ANY($1::uuid[])",
        [uuid.UUID(r.share_id) for r in shares],
    )
    assert held == 300  # every guard ran


# --- one process, a store per role ----------------------------------------------------------


@pytest.fixture
async def service_users(
    settings: Settings, postgres_admin_url: str
) -> AsyncIterator[dict[str, str]]:
    """A login user per service kind (URLs by :attr:`Settings.database_urls` key)."""
    async with login_users(settings.database_url, postgres_admin_url) as urls:
        yield urls


async def test_each_service_gets_a_store_of_its_own_user_and_they_share_commits(
    settings: Settings, service_users: dict[str, str]
) -> None:
    stores = await ServiceStores.open(
        msgspec.structs.replace(settings, database_urls=service_users)
    )
    try:
        users = {}
        for kind in ServiceKind:
            store = stores.of(kind)
            users[kind] = await store.pool.fetchval("SELECT current_user")
        assert users == {kind: urlsplit(service_users[kind.value]).username for kind in ServiceKind}
        assert stores.of(ServiceKind.READONLY) is stores.reader
        assert len(stores.opened) == len(ServiceKind)
        heard: list[int] = []
        stores.reader.on_commit(lambda envs: heard.extend(e.position for e in envs))
        await stores.reader.wait_for_new(0, 0.01)  # the reader listens
        claims = stores.of(ServiceKind.CLAIMS)
        await put(claims, catalog.ClaimAdmitted(namespace="team-a", name="c1"), actor="operator:t")
        assert heard == [1]
        assert stores.reader.committed_head() == 1  # SEEN includes it, NOTIFY or not
    finally:
        await stores.close()


async def test_without_role_urls_every_service_shares_one_store(settings: Settings) -> None:
    stores = await ServiceStores.open(settings)
    try:
        assert len(stores.opened) == 1
        assert all(stores.of(kind) is stores.reader for kind in ServiceKind)
        assert await stores.reader.pool.fetchval("SELECT current_user") == "dracap_app"
    finally:
        await stores.close()
