"""Database roles: an owner, a least-privilege role per service kind, node-bound agents.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05

Design (docs/database-roles.md has the long form and the grant table):

* **Group roles** (``NOLOGIN``), created if missing — roles are cluster-wide and several
  databases of one cluster may use them, so the downgrade revokes this database's
  grants and keeps the roles:

  - ``dracap_owner`` owns every table and function of the schema; migrations run as a
    superuser or a member of it (the migrating user is made a member when it is not a
    superuser, as 0001 did for the app role);
  - ``dracap_claims`` (claims and admin API), ``dracap_reservation``, ``dracap_relay``
    and ``dracap_agent`` (node agents): each gets what its code path needs and nothing
    else; none has ``UPDATE``, ``DELETE`` or ``TRUNCATE`` on ``events``, none owns
    anything, none may ``CREATE`` in the schema;
  - ``dracap_readonly``: ``SELECT`` on every table, for audit, ``dracap replay verify``
    and forensics.

  The app role of 0001 (``dracap_app``) keeps its grants: existing callers go on working.

* **Appending goes through one function.** ``dracap_append_guarded`` becomes
  ``SECURITY DEFINER`` (it runs as ``dracap_owner``, ``search_path`` pinned) and only
  the roles that append may execute it: the claims API and the node agents append
  without any privilege on the tables themselves. The reservation service keeps
  ``INSERT`` on ``events`` and the guard tables for the bulk path (``COPY``); the store
  sees whether its role may take that path and otherwise sends every append through the
  function (``services.runtime.store.eventstore``).

* **Node-bound roles.** ``dracap_node_roles`` maps a login role to the one node it acts
  for (``dracap db node-role NODE`` creates and binds one). When the *session* user
  (``session_user``: the function runs as its owner, and ``SET ROLE`` cannot change the
  session user) is bound to a node, every event of the append must be one a node agent
  writes, for that node — read by field name from the payload: ``node`` of the
  enforcement reports, ``slice.spec.nodeName`` of a published slice (whose name and pool
  must not belong to another node), the node of the share a ``CapacityReleased`` gives
  back, the node of the slice withdrawn, of the message dead-lettered — and every guard
  must follow from its own event (a ``release`` of that share, a ``set_total`` of a
  device of that slice). Otherwise SQLSTATE ``DR004`` names the node and the event type
  (``NodeScopeViolation``). The check runs after ``dracap_append`` took the head lock, so
  it sees every earlier append. A member of ``dracap_agent`` bound to no node (one user
  for the agents of several nodes) may append the same kinds of event, with guards that
  follow from them, for any node. ``dracap_bound_node()`` tells a session the node its
  user acts for, so an agent started for another node stops at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.roles import app_role, quote
from migrations.sqlfiles import install

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (no percent signs in the SQL below: the migration driver treats them as placeholders)

OWNER = "dracap_owner"
CLAIMS = "dracap_claims"
RESERVATION = "dracap_reservation"
RELAY = "dracap_relay"
AGENT = "dracap_agent"
READONLY = "dracap_readonly"
SERVICE_ROLES = (CLAIMS, RESERVATION, RELAY, AGENT, READONLY)

TABLES = (
    "event_log_head",
    "events",
    "capacity_ledger",
    "device_holds",
    "held_shares",
    "node_epochs",
    "consumer_checkpoints",
    "snapshots",
    "node_leases",
    "processed_messages",
    "dracap_node_roles",
)

APPEND = (
    "dracap_append(int, text[], int[], uuid[], text[], int[], text[], int[], text[], text, "
    "text[], text[], timestamptz, jsonb[], text)"
)
APPEND_GUARDED = (
    "dracap_append_guarded(int, text[], int[], uuid[], text[], int[], text[], int[], text[], "
    "text, text[], text[], timestamptz, jsonb[], text, jsonb, text, uuid[])"
)
GUARD = "dracap_guard(bigint, jsonb)"
RELEASE_HELD = "dracap_release_held(uuid, bigint)"
LOCK = "dracap_lock(bigint)"
NODE_OF = "dracap_node_of(text, jsonb, text)"
BOUND_NODE = "dracap_bound_node()"
NODE_SCOPE = "dracap_check_node_scope(text, text[], jsonb[], jsonb)"
OLD_FUNCTIONS = ("dracap_events_append_only()", APPEND, APPEND_GUARDED, GUARD, RELEASE_HELD, LOCK)
NEW_FUNCTIONS = (NODE_OF, NODE_SCOPE)

#: What each service role may do: (privileges, table) and the functions it may execute.
#: Reading the log is ``SELECT`` on ``events``, ``event_log_head`` and ``snapshots``; the
#: consumers (reservation workers, agents) record handled messages and their lag mark.
_READ_LOG = (("SELECT", "events"), ("SELECT", "event_log_head"), ("SELECT", "snapshots"))
_CONSUMER = (
    ("SELECT, INSERT", "processed_messages"),
    ("SELECT, INSERT, UPDATE", "consumer_checkpoints"),
)
#: The bulk path (COPY) writes the log and the guard tables itself, as the invoker.
_BULK = (
    ("INSERT", "events"),
    ("UPDATE", "event_log_head"),
    ("SELECT, INSERT, UPDATE", "capacity_ledger"),
    ("SELECT, INSERT, DELETE", "held_shares"),
    ("SELECT, INSERT, DELETE", "device_holds"),
    ("SELECT, INSERT, UPDATE", "node_epochs"),
)
TABLE_GRANTS: dict[str, tuple[tuple[str, str], ...]] = {
    CLAIMS: _READ_LOG,
    RESERVATION: (*_READ_LOG, *_CONSUMER, *_BULK),
    RELAY: (
        ("SELECT", "events"),
        ("SELECT", "event_log_head"),
        ("SELECT, INSERT, UPDATE", "consumer_checkpoints"),
    ),
    AGENT: (*_READ_LOG, *_CONSUMER),
    READONLY: tuple(("SELECT", table) for table in TABLES),
}
FUNCTION_GRANTS: dict[str, tuple[str, ...]] = {
    CLAIMS: (APPEND_GUARDED,),
    RESERVATION: (APPEND_GUARDED, GUARD, RELEASE_HELD, LOCK),
    RELAY: (),
    AGENT: (APPEND_GUARDED,),
    READONLY: (),
}

NODE_ROLES = """
CREATE TABLE dracap_node_roles (
    role       text        PRIMARY KEY,
    node       text        NOT NULL CHECK (node <> ''),
    created_at timestamptz NOT NULL DEFAULT now()
)
"""


SLICE_POOL_INDEX = """
CREATE INDEX events_slice_pool_idx
    ON events ((payload->'slice'->'spec'->>'driver'), (payload->'slice'->'spec'->'pool'->>'name'))
 WHERE type = 'inventory.resource_slice_published'
"""


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _ensure_role(role: str) -> None:
    """Create ``role`` unless it exists (a migration of another database may create it
    at the same moment); make the migrating user a member when it is no superuser."""
    member = ""
    if role == OWNER:
        member = f"""
    IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
       AND NOT pg_has_role(current_user, {_literal(role)}, 'MEMBER') THEN
        EXECUTE 'GRANT {quote(role)} TO ' || quote_ident(current_user);
    END IF;"""
    op.execute(
        f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = {_literal(role)}) THEN
        BEGIN
            CREATE ROLE {quote(role)} NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;{member}
END
$$
        """
    )


def _grant(role: str) -> None:
    q = quote(role)
    op.execute(f"GRANT USAGE ON SCHEMA public TO {q}")
    for privileges, table in TABLE_GRANTS[role]:
        op.execute(f"GRANT {privileges} ON {table} TO {q}")
    for function in FUNCTION_GRANTS[role]:
        op.execute(f"GRANT EXECUTE ON FUNCTION {function} TO {q}")


def upgrade() -> None:
    op.execute(NODE_ROLES)
    op.execute(SLICE_POOL_INDEX)
    op.execute(f"DROP FUNCTION {APPEND_GUARDED}")
    for name in ("dracap_node_of", "dracap_check_node_scope", "dracap_append_guarded"):
        install(name, revision)
    install("dracap_bound_node", revision)
    for role in (OWNER, *SERVICE_ROLES):
        _ensure_role(role)
    for table in TABLES:
        op.execute(f"ALTER TABLE {table} OWNER TO {OWNER}")
    op.execute(f"ALTER FUNCTION {BOUND_NODE} OWNER TO {OWNER}")
    for function in (*OLD_FUNCTIONS, *NEW_FUNCTIONS):
        op.execute(f"REVOKE EXECUTE ON FUNCTION {function} FROM PUBLIC")
        op.execute(f"ALTER FUNCTION {function} OWNER TO {OWNER}")
    op.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    for role in SERVICE_ROLES:
        _grant(role)
    app = app_role()
    if app:  # the app role of 0001 keeps what it had: the functions were PUBLIC's
        for function in (APPEND, APPEND_GUARDED, GUARD, RELEASE_HELD, LOCK):
            op.execute(f"GRANT EXECUTE ON FUNCTION {function} TO {quote(app)}")


def _revoke(role: str) -> None:
    tables = ", ".join(TABLES)
    functions = ", ".join((*OLD_FUNCTIONS, *NEW_FUNCTIONS))
    op.execute(
        f"""
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = {_literal(role)}) THEN
        REVOKE ALL ON {tables} FROM {quote(role)};
        REVOKE ALL ON FUNCTION {functions} FROM {quote(role)};
        REVOKE USAGE ON SCHEMA public FROM {quote(role)};
    END IF;
END
$$
        """
    )


def downgrade() -> None:
    for role in SERVICE_ROLES:
        _revoke(role)
    app = app_role()
    if app:
        for function in (APPEND, APPEND_GUARDED, GUARD, RELEASE_HELD, LOCK):
            op.execute(f"REVOKE EXECUTE ON FUNCTION {function} FROM {quote(app)}")
    for table in TABLES:
        op.execute(f"ALTER TABLE {table} OWNER TO CURRENT_USER")
    for function in OLD_FUNCTIONS:
        op.execute(f"ALTER FUNCTION {function} OWNER TO CURRENT_USER")
        op.execute(f"GRANT EXECUTE ON FUNCTION {function} TO PUBLIC")
    op.execute(f"DROP FUNCTION {APPEND_GUARDED}")
    op.execute(f"DROP FUNCTION {NODE_SCOPE}")
    op.execute(f"DROP FUNCTION {NODE_OF}")
    op.execute(f"DROP FUNCTION {BOUND_NODE}")
    install("dracap_append_guarded", "0005")
    op.execute("DROP INDEX events_slice_pool_idx")
    op.execute("DROP TABLE dracap_node_roles")
