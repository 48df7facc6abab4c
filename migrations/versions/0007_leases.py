"""Node leases with fencing epochs: acquisition, renewal, stale appends refused and logged.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06

Design (docs/reclamation.md has the long form):

* ``node_leases`` gains ``boot_id``, ``ttl_ms`` and ``renewed_at``. The guards of an
  expiry and a fence (``note_epoch``, ``fence``) also treat an epoch older than the
  node's lease as stale, as the fold does. A lease is taken by
  appending ``NodeLeaseAcquired``: its guard ``acquire`` (in ``dracap_guard``) insists
  on an epoch exactly one more than the newest of the node's lease and its expired or
  fenced epoch (``node_epochs``), or raises ``DR001`` (a conflict: somebody else took
  it first), and writes the lease row. Renewing is no event:
  ``dracap_renew_lease(node, epoch)`` moves ``expires_at`` only while the lease is
  current, unexpired and not fenced, and returns the new expiry (NULL: the lease is
  lost). It is ``SECURITY DEFINER`` and checks the session user's node binding.
* ``dracap_append_guarded`` (same arguments, one more result column ``refused``) reads
  the actor: an agent's (``agent:<node>#<epoch>``) is checked after it took the log's
  head lock, so no acquisition, expiry or fence can slip between check and commit. An
  epoch that is not the node's current lease, or that the node expired or was fenced
  at, is *refused*: instead of the batch the function appends one
  ``reclamation.append_refused`` event (to ``node:<name>``, with the agent as actor),
  marks no message as handled, and returns the node's current epoch in ``refused``;
  the store raises ``StaleEpoch``. The refusal commits with the statement, so it is in
  the log exactly once. A session of a node agent's database role must name an epoch
  (SQLSTATE ``DR004`` otherwise): every append by an agent carries it.
* The node scope of 0006 learns ``reclamation.node_lease_acquired`` (its ``node``) and
  the guard ``acquire`` (it must follow from that event, for the same node and epoch).
* A role for the reclamation service, ``dracap_reclamation``: read the log, the leases
  and the epochs, append through the function. The claims API may read the leases and
  the epochs (``dracap node list``), and so may the agents (to find their next epoch).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from alembic import op

from migrations.roles import app_role, quote

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (no percent signs in the SQL below: the migration driver treats them as placeholders)

OWNER = "dracap_owner"
RECLAMATION = "dracap_reclamation"
APPENDERS = ("dracap_claims", "dracap_reservation", "dracap_agent", RECLAMATION)
APPEND_GUARDED = (
    "dracap_append_guarded(int, text[], int[], uuid[], text[], int[], text[], int[], text[], "
    "text, text[], text[], timestamptz, jsonb[], text, jsonb, text, uuid[])"
)
RENEW = "dracap_renew_lease(text, bigint)"
STALE = "dracap_stale_epoch(text, bigint, jsonb)"

COLUMNS = """
ALTER TABLE node_leases
    ADD COLUMN boot_id    text        NOT NULL DEFAULT '',
    ADD COLUMN ttl_ms     integer     NOT NULL DEFAULT 10000 CHECK (ttl_ms > 0),
    ADD COLUMN renewed_at timestamptz NOT NULL DEFAULT now()
"""

_GUARDS_0005 = importlib.import_module("migrations.versions.0005_guards")

# 0005's guard function, taught the lease: the staleness of an expiry or fence also
# counts the node's lease (as the fold does), and ``acquire`` numbers and writes leases.
GUARD = (
    _GUARDS_0005.GUARD.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION")
    .replace(
        "    v_share record;\n",
        "    v_share record;\n    v_newest bigint;\n",
    )
    .replace(
        """        WHEN 'note_epoch', 'fence' THEN
""",
        """        WHEN 'note_epoch', 'fence' THEN
            -- stale (as in the fold) when older than the node's lease or a noted epoch
            IF (g->>'epoch')::bigint
               < coalesce((SELECT epoch FROM node_leases WHERE node = g->>'node'), 0) THEN
                CONTINUE;
            END IF;
""",
    )
    .replace(
        """        ELSE
            RAISE EXCEPTION USING MESSAGE = 'dracap_guard: unknown kind '""",
        """        WHEN 'acquire' THEN
            v_newest := greatest(
                coalesce((SELECT epoch FROM node_leases WHERE node = g->>'node'), 0),
                coalesce((SELECT epoch FROM node_epochs WHERE node = g->>'node'), 0));
            IF (g->>'epoch')::bigint <> v_newest + 1 THEN
                RAISE EXCEPTION USING ERRCODE = 'DR001', DETAIL = 'lease:' || (g->>'node'),
                    MESSAGE = 'node ' || quote_literal(g->>'node') || ' is at epoch '
                              || v_newest || ': its next lease is epoch ' || (v_newest + 1)
                              || ', not ' || (g->>'epoch');
            END IF;
            INSERT INTO node_leases (node, epoch, expires_at, boot_id, ttl_ms, renewed_at)
            VALUES (g->>'node', (g->>'epoch')::bigint,
                    clock_timestamp() + make_interval(secs => (g->>'ttl_ms')::int / 1000.0),
                    g->>'boot_id', (g->>'ttl_ms')::int, clock_timestamp())
            ON CONFLICT (node) DO UPDATE
               SET epoch = EXCLUDED.epoch, expires_at = EXCLUDED.expires_at,
                   boot_id = EXCLUDED.boot_id, ttl_ms = EXCLUDED.ttl_ms,
                   renewed_at = EXCLUDED.renewed_at;
        ELSE
            RAISE EXCEPTION USING MESSAGE = 'dracap_guard: unknown kind '""",
    )
)
assert GUARD.count("WHEN 'acquire'") == 1 and GUARD.count("CONTINUE;") == 1

# The epoch the node is at when ``p_epoch`` is stale for it, else NULL. An append that
# acquires that very epoch is judged by its guard instead.
STALE_FUNCTION = """
CREATE FUNCTION dracap_stale_epoch(p_node text, p_epoch bigint, p_guards jsonb)
RETURNS bigint LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_lease bigint;
    v_noted bigint;
BEGIN
    IF EXISTS (SELECT FROM jsonb_array_elements(coalesce(p_guards, '[]'::jsonb)) g
                WHERE g.value->>'kind' = 'acquire' AND g.value->>'node' = p_node
                  AND (g.value->>'epoch')::bigint = p_epoch) THEN
        RETURN NULL;
    END IF;
    SELECT epoch INTO v_lease FROM node_leases WHERE node = p_node;
    SELECT epoch INTO v_noted FROM node_epochs WHERE node = p_node;
    IF v_lease IS NULL OR p_epoch <> v_lease OR p_epoch <= coalesce(v_noted, 0) THEN
        RETURN greatest(coalesce(v_lease, 0), coalesce(v_noted, 0));
    END IF;
    RETURN NULL;
END
$$
"""

RENEW_FUNCTION = """
CREATE FUNCTION dracap_renew_lease(p_node text, p_epoch bigint)
RETURNS timestamptz LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = public, pg_temp AS $$
DECLARE
    v_bound text;
    v_expires timestamptz;
BEGIN
    SELECT node INTO v_bound FROM dracap_node_roles WHERE role = session_user::text;
    IF FOUND AND v_bound <> p_node THEN
        RAISE EXCEPTION USING ERRCODE = 'DR004', DETAIL = 'lease',
            MESSAGE = 'database user ' || session_user || ' acts for node '
                      || quote_literal(v_bound) || ' only: lease of '
                      || quote_literal(p_node) || ' refused';
    END IF;
    UPDATE node_leases l
       SET expires_at = clock_timestamp() + make_interval(secs => l.ttl_ms / 1000.0),
           renewed_at = clock_timestamp()
     WHERE l.node = p_node AND l.epoch = p_epoch AND l.expires_at > clock_timestamp()
       AND p_epoch > coalesce((SELECT n.epoch FROM node_epochs n WHERE n.node = p_node), 0)
    RETURNING l.expires_at INTO v_expires;
    RETURN v_expires;
END
$$
"""

NODE_OF_FUNCTION = importlib.import_module("migrations.versions.0006_roles").NODE_OF_FUNCTION
NODE_SCOPE_FUNCTION = importlib.import_module("migrations.versions.0006_roles").NODE_SCOPE_FUNCTION

# 0006's node scope, taught the lease: the event names its node; the guard follows from it.
NODE_OF_0007 = NODE_OF_FUNCTION.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION").replace(
    "'reclamation.share_confirmed' THEN",
    "'reclamation.share_confirmed', 'reclamation.node_lease_acquired' THEN",
)
NODE_SCOPE_0007 = (
    NODE_SCOPE_FUNCTION.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION")
    .replace(
        "'reclamation.share_confirmed', 'reclamation.capacity_released',",
        "'reclamation.share_confirmed', 'reclamation.capacity_released',\n"
        "        'reclamation.node_lease_acquired',",
    )
    .replace(
        "            ELSE false",
        "            WHEN 'acquire' THEN\n"
        "                v_type = 'reclamation.node_lease_acquired'\n"
        "                AND p->>'node' = g->>'node' AND p->>'epoch' = g->>'epoch'\n"
        "            ELSE false",
    )
)

APPEND_GUARDED_FUNCTION = """
CREATE FUNCTION dracap_append_guarded(
    p_count int,
    p_streams text[],
    p_expected int[],
    p_event_ids uuid[],
    p_event_streams text[],
    p_versions int[],
    p_types text[],
    p_schema_versions int[],
    p_namespaces text[],
    p_actor text,
    p_correlation_ids text[],
    p_causation_ids text[],
    p_recorded_at timestamptz,
    p_payloads jsonb[],
    p_channel text,
    p_guards jsonb,
    p_consumer text,
    p_processed uuid[]
) RETURNS TABLE (head bigint, currents int[], refused bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v_head bigint;
    v_current int[];
    v_marked int;
    v_node text;
    v_agent boolean;
    v_epoch text[];
    v_refused bigint;
BEGIN
    SELECT r.node, true INTO v_node, v_agent FROM dracap_node_roles r
     WHERE r.role = session_user::text;
    IF NOT FOUND THEN  -- an agent's user bound to no node: agent events only
        SELECT pg_has_role(session_user, 'dracap_agent', 'MEMBER') AND NOT r.rolsuper
          INTO v_agent FROM pg_roles r WHERE r.rolname = session_user;
    END IF;
    v_epoch := regexp_match(p_actor, '^agent:([^#:@[:space:]]+)#([0-9]{1,18})$');
    IF v_agent AND (v_epoch IS NULL OR v_epoch[1] IS DISTINCT FROM coalesce(v_node, v_epoch[1]))
    THEN
        RAISE EXCEPTION USING ERRCODE = 'DR004', DETAIL = 'actor',
            MESSAGE = 'database user ' || session_user || ' is a node agent''s: its appends '
                      || 'name the agent and its lease epoch (agent:'
                      || coalesce(v_node, '<node>') || '#<epoch>), not '
                      || quote_literal(p_actor);
    END IF;
    IF v_epoch IS NOT NULL THEN
        -- the log's head lock first, so that no lease, expiry or fence slips in between
        PERFORM 1 FROM event_log_head FOR UPDATE;
        v_refused := dracap_stale_epoch(v_epoch[1], v_epoch[2]::bigint, p_guards);
        IF v_refused IS NOT NULL THEN
            SELECT a.head INTO v_head
              FROM dracap_append(
                       1, ARRAY['node:' || v_epoch[1]], ARRAY[NULL]::int[],
                       ARRAY[gen_random_uuid()], ARRAY['node:' || v_epoch[1]], ARRAY[1],
                       ARRAY['reclamation.append_refused'], ARRAY[1], ARRAY[NULL]::text[],
                       p_actor, ARRAY[coalesce(p_correlation_ids[1], gen_random_uuid()::text)],
                       ARRAY[p_causation_ids[1]], p_recorded_at,
                       ARRAY[jsonb_build_object(
                           'type', 'reclamation.append_refused', 'node', v_epoch[1],
                           'epoch', v_epoch[2]::bigint, 'current_epoch', v_refused,
                           'types', to_jsonb(p_types))],
                       p_channel) AS a;
            RETURN QUERY SELECT v_head, NULL::int[], v_refused;
            RETURN;
        END IF;
    END IF;
    IF p_consumer IS NOT NULL THEN
        WITH m AS (INSERT INTO processed_messages (consumer, event_id)
                   SELECT p_consumer, unnest(p_processed) ON CONFLICT DO NOTHING RETURNING 1)
        SELECT count(*) INTO v_marked FROM m;
        IF v_marked <> cardinality(p_processed) THEN
            RAISE EXCEPTION USING ERRCODE = 'DR003',
                MESSAGE = 'consumer ' || quote_literal(p_consumer)
                          || ' had handled some of these messages before';
        END IF;
    END IF;
    SELECT a.head, a.currents INTO v_head, v_current
      FROM dracap_append(p_count, p_streams, p_expected, p_event_ids, p_event_streams,
                         p_versions, p_types, p_schema_versions, p_namespaces, p_actor,
                         p_correlation_ids, p_causation_ids, p_recorded_at, p_payloads,
                         p_channel) AS a;
    IF v_agent THEN  -- under the head lock: every earlier append is visible
        PERFORM dracap_check_node_scope(v_node, p_types, p_payloads, p_guards);
    END IF;
    PERFORM dracap_guard(v_head - p_count, p_guards);
    RETURN QUERY SELECT v_head, v_current, NULL::bigint;
END
$$
"""

_LEASE_TABLES = ("node_leases", "node_epochs")


def _ensure_reclamation_role() -> None:
    op.execute(
        f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{RECLAMATION}') THEN
        BEGIN
            CREATE ROLE {quote(RECLAMATION)} NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END IF;
END
$$
        """
    )


def _grant_append(roles: Sequence[str]) -> None:
    op.execute(f"ALTER FUNCTION {APPEND_GUARDED} OWNER TO {OWNER}")
    op.execute(f"REVOKE EXECUTE ON FUNCTION {APPEND_GUARDED} FROM PUBLIC")
    for role in roles:
        op.execute(f"GRANT EXECUTE ON FUNCTION {APPEND_GUARDED} TO {quote(role)}")


def upgrade() -> None:
    op.execute(COLUMNS)
    op.execute(GUARD)
    op.execute(STALE_FUNCTION)
    op.execute(RENEW_FUNCTION)
    op.execute(NODE_OF_0007)
    op.execute(NODE_SCOPE_0007)
    op.execute(f"DROP FUNCTION {APPEND_GUARDED}")
    op.execute(APPEND_GUARDED_FUNCTION)
    _ensure_reclamation_role()
    for function in (STALE, RENEW):
        op.execute(f"ALTER FUNCTION {function} OWNER TO {OWNER}")
        op.execute(f"REVOKE EXECUTE ON FUNCTION {function} FROM PUBLIC")
    app = app_role()
    _grant_append([*APPENDERS, *([app] if app else [])])
    op.execute(f"GRANT EXECUTE ON FUNCTION {RENEW} TO dracap_agent")
    if app:
        op.execute(f"GRANT EXECUTE ON FUNCTION {RENEW} TO {quote(app)}")
    q = quote(RECLAMATION)
    op.execute(f"GRANT USAGE ON SCHEMA public TO {q}")
    for table in ("events", "event_log_head", "snapshots", *_LEASE_TABLES):
        op.execute(f"GRANT SELECT ON {table} TO {q}")
    for table in _LEASE_TABLES:  # the claims API lists nodes; an agent finds its next epoch
        op.execute(f"GRANT SELECT ON {table} TO dracap_claims, dracap_agent")


def downgrade() -> None:
    roles = importlib.import_module("migrations.versions.0006_roles")
    op.execute(
        f"""
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = '{RECLAMATION}') THEN
        REVOKE ALL ON events, event_log_head, snapshots, node_leases, node_epochs
          FROM {quote(RECLAMATION)};
        REVOKE USAGE ON SCHEMA public FROM {quote(RECLAMATION)};
    END IF;
END
$$
        """
    )
    for table in _LEASE_TABLES:
        op.execute(f"REVOKE SELECT ON {table} FROM dracap_claims, dracap_agent")
    op.execute(f"DROP FUNCTION {APPEND_GUARDED}")
    op.execute(roles.APPEND_GUARDED_FUNCTION)
    app = app_role()
    _grant_append([*(r for r in APPENDERS if r != RECLAMATION), *([app] if app else [])])
    op.execute(NODE_SCOPE_FUNCTION.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION"))
    op.execute(NODE_OF_FUNCTION.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION"))
    op.execute(f"DROP FUNCTION {RENEW}")
    op.execute(f"DROP FUNCTION {STALE}")
    op.execute(_GUARDS_0005.GUARD.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION"))
    op.execute(
        "ALTER TABLE node_leases DROP COLUMN boot_id, DROP COLUMN ttl_ms, DROP COLUMN renewed_at"
    )
