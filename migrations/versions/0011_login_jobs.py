"""Each login appends only its job: checked payloads, derived guards, the database's clock.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-10

Design (docs/database-roles.md and docs/event-log.md have the long form). Until now the
append function trusted what its caller sent beyond the node scope of agents: any
appending login could append any event type under any actor, pass guards that follow
from no event, commit a payload the fold cannot decode, date its events with its own
clock, and the reservation login could write the log's tables directly. From here:

* **payloads are checked against the catalog** (``dracap_payload_error``, generated from
  ``events/catalog.py`` by :mod:`services.runtime.store.payloadchecks` into
  ``migrations/functions/dracap_payload_checks.sql``; its digest is :data:`CATALOG`):
  an event msgspec would not decode, nested free JSON deeper than 100 levels, an unknown
  type or an old schema version is refused (SQLSTATE ``DR006``) for every caller;
* **each login appends as its job's writers only** (``events/writers.py``): the claims
  login as tenants (in their own namespace), operators and the Kubernetes bridge; the
  reservation and reclamation logins as themselves; the new enforcement login (and node
  agents' own logins until 0012 removes them) as ``agent:<node>#<epoch>``; each only the
  event types those writers write (SQLSTATE ``DR005``);
* **guards are derived by the database** from the events (``dracap_guards_of``); the
  function takes none from its caller, so none can follow from nothing;
* **the database says when and which version**: ``recorded_at`` is ``clock_timestamp()``
  under the head lock; stream versions follow from the current ones; arrays that do not
  all hold the append's events are refused;
* **the node of a share report is the log's**: held share, else its reservation
  (``dracap_share_node``, index ``events_reserved_share_idx``), never the payload's;
* **no direct writes**: the reservation login loses ``INSERT`` on ``events`` and the
  guard tables (the bulk path appends through the function as well);
* **the enforcement service's role** ``dracap_enforcement``: reads the log and the
  leases, appends node reports as ``agent:<node>#<epoch>`` of a live lease, renews
  leases in one statement (``dracap_renew_leases``), and writes ``processed_messages``
  and ``consumer_checkpoints`` rows of consumers ``agent-...`` only (row-level security);
* **the ledger login loses what its projectors no longer use** (they read the log from
  their own position and only insert audit records): ``processed_messages``,
  ``consumer_checkpoints`` and ``UPDATE`` on ``audit_records``.

Every function this revision writes is in ``migrations/functions/<name>/0011.sql``, in
full (:mod:`migrations.sqlfiles`): among them the append function with the node-bound
users of 0006 (a bound user appends as its own node's agent only; 0012 installs the
version without). The payload checks are generated with the jobs of 0011
(:func:`payload_checks_sql`: node agents' own logins, ``dracap_agent``, append as node
agents). The downgrade installs 0010's versions (of 0003, 0007 and 0008) and restores
its grants (the role stays: roles are the cluster's).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from alembic import op

from migrations.roles import app_role, ensure_group_role_sql, quote
from migrations.sqlfiles import function_sql, install

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: The digest of the catalog checks this revision installs (``dracap_catalog_digest()``).
CATALOG = "b3026b9b2882ac64d68bb0b23f0ae3a66af0c4725e490d4171face90777dcfd4"

OWNER = "dracap_owner"
ENFORCEMENT = "dracap_enforcement"
RESERVATION = "dracap_reservation"
APPENDERS = (
    "dracap_claims",
    RESERVATION,
    "dracap_reclamation",
    "dracap_agent",
    ENFORCEMENT,
)
#: The function files this revision installs (``migrations/functions/<name>/0011.sql``),
#: in order; the payload checks are generated with this revision's :data:`JOBS`.
FILES = (
    "dracap_quantity",
    "dracap_is_datetime",
    "dracap_payload_checks",
    "dracap_guards_of",
    "dracap_node_of",
    "dracap_session_writers",
    "dracap_append",
    "dracap_append_guarded",
    "dracap_renew_leases",
)

OLD_APPEND = (
    "dracap_append(int, text[], int[], uuid[], text[], int[], text[], int[], text[], text, "
    "text[], text[], timestamptz, jsonb[], text)"
)
OLD_APPEND_GUARDED = (
    "dracap_append_guarded(int, text[], int[], uuid[], text[], int[], text[], int[], text[], "
    "text, text[], text[], timestamptz, jsonb[], text, jsonb, text, uuid[])"
)
OLD_NODE_SCOPE = "dracap_check_node_scope(text, text[], jsonb[], jsonb)"
APPEND = (
    "dracap_append(int, text[], int[], uuid[], text[], text[], int[], text[], text, text[], "
    "text[], jsonb[])"
)
APPEND_GUARDED = (
    "dracap_append_guarded(int, text[], int[], uuid[], text[], text[], int[], text[], text, "
    "text[], text[], jsonb[], text, uuid[])"
)
RENEW = "dracap_renew_leases(text[], bigint[])"
NODE_OF = "dracap_node_of(text, jsonb, text)"
GUARD = "dracap_guard(bigint, jsonb)"
RELEASE_HELD = "dracap_release_held(uuid, bigint)"


def _payload_check_functions() -> list[str]:
    checks = importlib.import_module("services.runtime.store.payloadchecks")
    names: list[str] = checks.function_names()
    return names


#: Every function this revision creates (with its argument types).
NEW_FUNCTIONS = (
    "dracap_quantity_parts(text)",
    "dracap_quantity_scale(text[])",
    "dracap_is_quantity(text)",
    "dracap_quantity(text)",
    "dracap_is_datetime(text)",
    "dracap_guards_of(text[], jsonb[])",
    "dracap_share_node(text, text)",
    NODE_OF,
    "dracap_check_node_scope(text, text[], jsonb[])",
    "dracap_session_writers()",
    APPEND,
    APPEND_GUARDED,
    RENEW,
)

#: What the enforcement role may read and write (its consumers' rows only: see RLS).
ENFORCEMENT_GRANTS = (
    ("SELECT", "events"),
    ("SELECT", "event_log_head"),
    ("SELECT", "snapshots"),
    ("SELECT", "node_leases"),
    ("SELECT", "node_epochs"),
    ("SELECT, INSERT", "processed_messages"),
    ("SELECT, INSERT, UPDATE", "consumer_checkpoints"),
)
#: What the reservation login could write for its bulk path (0006), taken back.
LEDGER = "dracap_ledger"
#: what 0009 granted the ledger login and its projectors no longer use
LEDGER_UNUSED = (
    ("SELECT, INSERT", "processed_messages"),
    ("SELECT, INSERT, UPDATE", "consumer_checkpoints"),
    ("UPDATE", "audit_records"),
)
RESERVATION_BULK = (
    ("INSERT", "events"),
    ("UPDATE", "event_log_head"),
    ("SELECT, INSERT, UPDATE", "capacity_ledger"),
    ("SELECT, INSERT, DELETE", "held_shares"),
    ("SELECT, INSERT, DELETE", "device_holds"),
    ("SELECT, INSERT, UPDATE", "node_epochs"),
)
CONSUMER_TABLES = ("processed_messages", "consumer_checkpoints")
#: A member of the enforcement role sees and writes its consumers' rows (agent-...) only.
CONSUMER_POLICY = (
    "NOT pg_has_role(current_user, 'dracap_enforcement', 'MEMBER') OR left(consumer, 6) = 'agent-'"
)

SHARE_INDEX = """
CREATE INDEX events_reserved_share_idx ON events ((payload->>'share_id'))
 WHERE type = 'reservation.capacity_reserved'
"""


#: The jobs of this revision (``events.writers.JOBS`` then): node agents' own logins
#: append as node agents, until 0012.
JOBS = {
    "claims": frozenset({"tenant", "operator", "bridge"}),
    "reservation": frozenset({"reservation"}),
    "reclamation": frozenset({"reclamation"}),
    "enforcement": frozenset({"agent"}),
    "agent": frozenset({"agent"}),
}


def payload_checks_sql() -> str:
    """The payload checks and writers with this revision's :data:`JOBS`."""
    checks = importlib.import_module("services.runtime.store.payloadchecks")
    text: str = checks.generate(JOBS)
    return text.rstrip().rstrip(";")


def _installed(name: str) -> str:
    if name == "dracap_payload_checks":
        return payload_checks_sql()
    return function_sql(name, revision)


def upgrade() -> None:
    op.execute(f"DROP FUNCTION {OLD_APPEND_GUARDED}")
    op.execute(f"DROP FUNCTION {OLD_APPEND}")
    op.execute(f"DROP FUNCTION {OLD_NODE_SCOPE}")
    op.execute(f"DROP FUNCTION {NODE_OF}")  # its parameters are named anew
    for name in FILES:
        op.execute(_installed(name))
    op.execute(SHARE_INDEX)
    op.execute(ensure_group_role_sql(ENFORCEMENT))
    for function in (*NEW_FUNCTIONS, *_payload_check_functions()):
        op.execute(f"ALTER FUNCTION {function} OWNER TO {OWNER}")
        op.execute(f"REVOKE EXECUTE ON FUNCTION {function} FROM PUBLIC")
    app = app_role()
    appenders = [*APPENDERS, *([app] if app else [])]
    for role in appenders:
        op.execute(f"GRANT EXECUTE ON FUNCTION {APPEND_GUARDED} TO {quote(role)}")
    for role in (ENFORCEMENT, *([app] if app else [])):
        op.execute(f"GRANT EXECUTE ON FUNCTION {RENEW} TO {quote(role)}")
    q = quote(ENFORCEMENT)
    op.execute(f"GRANT USAGE ON SCHEMA public TO {q}")
    for privileges, table in ENFORCEMENT_GRANTS:
        op.execute(f"GRANT {privileges} ON {table} TO {q}")
    r = quote(RESERVATION)
    for privileges, table in RESERVATION_BULK:
        op.execute(f"REVOKE {privileges} ON {table} FROM {r}")
    op.execute(f"REVOKE EXECUTE ON FUNCTION {GUARD}, {RELEASE_HELD} FROM {r}")
    for privileges, table in LEDGER_UNUSED:
        op.execute(f"REVOKE {privileges} ON {table} FROM {quote(LEDGER)}")
    for table in CONSUMER_TABLES:
        op.execute(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY")
        op.execute(
            f"CREATE POLICY {table}_own_consumers ON {table} "
            f"USING ({CONSUMER_POLICY}) WITH CHECK ({CONSUMER_POLICY})"
        )


def downgrade() -> None:
    for table in CONSUMER_TABLES:
        op.execute(f"DROP POLICY {table}_own_consumers ON {table}")
        op.execute(f"ALTER TABLE {table} DISABLE ROW LEVEL SECURITY")
    for privileges, table in LEDGER_UNUSED:
        op.execute(f"GRANT {privileges} ON {table} TO {quote(LEDGER)}")
    r = quote(RESERVATION)
    for privileges, table in RESERVATION_BULK:
        op.execute(f"GRANT {privileges} ON {table} TO {r}")
    op.execute(f"GRANT EXECUTE ON FUNCTION {GUARD}, {RELEASE_HELD} TO {r}")
    q = quote(ENFORCEMENT)
    op.execute(f"REVOKE ALL ON {', '.join(table for _, table in ENFORCEMENT_GRANTS)} FROM {q}")
    op.execute(f"REVOKE USAGE ON SCHEMA public FROM {q}")
    op.execute("DROP INDEX events_reserved_share_idx")
    for function in (*reversed(NEW_FUNCTIONS), *_payload_check_functions()):
        op.execute(f"DROP FUNCTION {function}")
    # 0010's functions: the versions of 0003, 0007 and 0008
    install("dracap_append", "0003")
    install("dracap_append_guarded", "0007")
    install("dracap_node_of", "0008")
    install("dracap_check_node_scope", "0008")
    app = app_role()
    for function in (OLD_APPEND, OLD_APPEND_GUARDED, OLD_NODE_SCOPE, NODE_OF):
        op.execute(f"ALTER FUNCTION {function} OWNER TO {OWNER}")
        op.execute(f"REVOKE EXECUTE ON FUNCTION {function} FROM PUBLIC")
    for role in [*APPENDERS[:-1], *([app] if app else [])]:
        op.execute(f"GRANT EXECUTE ON FUNCTION {OLD_APPEND_GUARDED} TO {quote(role)}")
    if app:
        op.execute(f"GRANT EXECUTE ON FUNCTION {OLD_APPEND} TO {quote(app)}")
