"""The database keeps only what it checks: guards derived from the fold, read by name.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

Design: up to 0004 every append also projected the claim and share state machines
into ``shares``, ``claims`` and ``node_epochs`` — a third copy of the fold, tied to
the client by positional JSON slots, written under the log's head lock although only
``dracap replay verify`` read it. From here the database holds only what protects an
invariant inside the append (:mod:`events.guards`):

* ``capacity_ledger`` (unchanged, plus ``position``: the last event that moved it);
* ``held_shares``: one row per live non-admin share with the amounts it holds; a
  release deletes it, so a duplicate release gives nothing back;
* ``device_holds`` (unchanged): one exclusive holder per dedicated device;
* ``node_epochs`` (now one epoch per node): fences older than it release nothing.

``dracap_guard(base, guards)`` applies a JSON array of guards in order; each is an
object with a ``kind`` and the fields of its :mod:`events.guards` class, read by name.
Both append paths call it: ``dracap_append_guarded`` (the one-statement path, which
also records a consumer's ``processed_messages`` as 0004's function did) and the bulk
path after its ``COPY``. A capacity that no slice published raises SQLSTATE ``DR002``;
the ledger's CHECK and the holds' key raise as before.

The upgrade moves the live non-admin shares into ``held_shares`` and the newest epoch
of each node into ``node_epochs``. The downgrade restores 0004's tables and functions
with ``shares``, ``claims`` and the old ``node_epochs`` *empty*: they were read models
of the log, and only a replay could fill them again.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from alembic import op

from migrations.roles import app_role, quote

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (no percent signs in these bodies: the migration driver treats them as placeholders)

TABLES = (
    """
ALTER TABLE capacity_ledger ADD COLUMN position bigint
    """,
    """
CREATE TABLE held_shares (
    share_id uuid   PRIMARY KEY,
    driver   text   NOT NULL,
    pool     text   NOT NULL,
    device   text   NOT NULL,
    node     text,
    amounts  jsonb  NOT NULL,
    position bigint NOT NULL
)
    """,
    """
CREATE INDEX held_shares_node_idx ON held_shares (node) WHERE node IS NOT NULL
    """,
    """
INSERT INTO held_shares (share_id, driver, pool, device, node, amounts, position)
SELECT share_id, driver, pool, device, node, amounts, position
  FROM shares WHERE state <> 'released' AND NOT admin_access
    """,
    """
CREATE TABLE node_fence_epochs (
    node  text   PRIMARY KEY,
    epoch bigint NOT NULL
)
    """,
    """
INSERT INTO node_fence_epochs (node, epoch)
SELECT node, greatest(lease_epoch, fenced_epoch) FROM node_epochs
    """,
)

DROPPED = (
    "DROP FUNCTION dracap_append_projected(int, text[], int[], uuid[], text[], int[], "
    "text[], int[], text[], text, text[], text[], timestamptz, jsonb[], text, jsonb, text, "
    "uuid[])",
    "DROP FUNCTION dracap_project(bigint, jsonb)",
    "DROP FUNCTION dracap_release_share(uuid, bigint)",
    "DROP FUNCTION dracap_claim_released(text, text, bigint, int, text[])",
    "DROP FUNCTION dracap_claim_ready(text, text, bigint, int)",
    "DROP TABLE shares",
    "DROP TABLE claims",
    "DROP TABLE node_epochs",
    "ALTER TABLE node_fence_epochs RENAME TO node_epochs",
    "ALTER TABLE node_epochs RENAME CONSTRAINT node_fence_epochs_pkey TO node_epochs_pkey",
)

RELEASE_HELD = """
CREATE FUNCTION dracap_release_held(p_share uuid, p_position bigint)
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
BEGIN
    DELETE FROM held_shares WHERE share_id = p_share
    RETURNING driver, pool, device, amounts INTO r;
    IF NOT FOUND THEN
        RETURN;  -- released before (or never held): nothing to give back
    END IF;
    UPDATE capacity_ledger c SET allocated = c.allocated - a.value::numeric,
           position = p_position
      FROM jsonb_each_text(r.amounts) AS a
     WHERE c.driver = r.driver AND c.pool = r.pool AND c.device = r.device
       AND c.capacity = a.key;
    DELETE FROM device_holds WHERE share_id = p_share;
END
$$
"""

GUARD = """
CREATE FUNCTION dracap_guard(p_base bigint, p_guards jsonb)
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    g jsonb;
    pos bigint;
    moved int;
    missing text;
    v_share record;
BEGIN
    IF p_guards IS NULL THEN
        RETURN;
    END IF;
    FOR g IN SELECT value FROM jsonb_array_elements(p_guards) LOOP
        pos := p_base + (g->>'at')::bigint;
        CASE g->>'kind'
        WHEN 'set_total' THEN
            INSERT INTO capacity_ledger (driver, pool, device, capacity, total, position)
            VALUES (g->>'driver', g->>'pool', g->>'device', g->>'capacity',
                    (g->>'total')::numeric, pos)
            ON CONFLICT (driver, pool, device, capacity)
            DO UPDATE SET total = EXCLUDED.total, position = EXCLUDED.position;
        WHEN 'reserve' THEN
            UPDATE capacity_ledger c SET allocated = c.allocated + a.value::numeric,
                   position = pos
              FROM jsonb_each_text(g->'amounts') AS a
             WHERE c.driver = g->>'driver' AND c.pool = g->>'pool'
               AND c.device = g->>'device' AND c.capacity = a.key;
            GET DIAGNOSTICS moved = ROW_COUNT;
            IF moved <> (SELECT count(*) FROM jsonb_object_keys(g->'amounts')) THEN
                SELECT k INTO missing FROM jsonb_object_keys(g->'amounts') AS k
                 WHERE NOT EXISTS (
                       SELECT FROM capacity_ledger c
                        WHERE c.driver = g->>'driver' AND c.pool = g->>'pool'
                          AND c.device = g->>'device' AND c.capacity = k)
                 ORDER BY k LIMIT 1;
                RAISE EXCEPTION USING ERRCODE = 'DR002',
                    MESSAGE = 'no capacity ' || quote_literal(missing)
                              || ' published for device ' || (g->>'driver') || '/'
                              || (g->>'pool') || '/' || (g->>'device');
            END IF;
            IF (g->>'exclusive')::boolean THEN
                INSERT INTO device_holds (driver, pool, device, share_id, namespace, claim)
                VALUES (g->>'driver', g->>'pool', g->>'device', (g->>'share_id')::uuid,
                        g->>'namespace', g->>'claim');
            END IF;
            INSERT INTO held_shares (share_id, driver, pool, device, node, amounts, position)
            VALUES ((g->>'share_id')::uuid, g->>'driver', g->>'pool', g->>'device',
                    g->>'node', g->'amounts', pos);
        WHEN 'release' THEN
            PERFORM dracap_release_held((g->>'share_id')::uuid, pos);
        WHEN 'note_epoch', 'fence' THEN
            INSERT INTO node_epochs (node, epoch) VALUES (g->>'node', (g->>'epoch')::bigint)
            ON CONFLICT (node) DO UPDATE SET epoch = EXCLUDED.epoch
             WHERE node_epochs.epoch <= EXCLUDED.epoch;
            IF FOUND AND g->>'kind' = 'fence' THEN
                FOR v_share IN SELECT share_id FROM held_shares WHERE node = g->>'node'
                                ORDER BY share_id LOOP
                    PERFORM dracap_release_held(v_share.share_id, pos);
                END LOOP;
            END IF;
        ELSE
            RAISE EXCEPTION USING MESSAGE = 'dracap_guard: unknown kind '
                                            || quote_literal(g->>'kind');
        END CASE;
    END LOOP;
END
$$
"""

APPEND_GUARDED = """
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
) RETURNS TABLE (head bigint, currents int[])
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_head bigint;
    v_current int[];
    v_marked int;
BEGIN
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
    PERFORM dracap_guard(v_head - p_count, p_guards);
    RETURN QUERY SELECT v_head, v_current;
END
$$
"""

SIGNATURES = (
    "dracap_append_guarded(int, text[], int[], uuid[], text[], int[], text[], int[], text[], "
    "text, text[], text[], timestamptz, jsonb[], text, jsonb, text, uuid[])",
    "dracap_guard(bigint, jsonb)",
    "dracap_release_held(uuid, bigint)",
)


def upgrade() -> None:
    for statement in (*TABLES, *DROPPED, RELEASE_HELD, GUARD, APPEND_GUARDED):
        op.execute(statement)
    role = app_role()
    if role:
        for table in ("held_shares", "node_epochs"):
            op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {quote(role)}")


def _revision(name: str) -> object:
    return importlib.import_module(f"migrations.versions.{name}")


def downgrade() -> None:
    for signature in SIGNATURES:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
    op.execute("DROP TABLE held_shares")
    op.execute("DROP TABLE node_epochs")
    op.execute("ALTER TABLE capacity_ledger DROP COLUMN position")
    first = _revision("0001_event_log")
    schema: Sequence[str] = getattr(first, "SCHEMA")  # noqa: B009
    for statement in schema:
        tables = any(f"CREATE TABLE {t} " in statement for t in ("shares", "claims", "node_epochs"))
        if tables or "CREATE INDEX shares_" in statement:
            op.execute(statement)
    role = app_role()
    if role:
        for table in ("shares", "claims", "node_epochs"):
            op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {quote(role)}")
    projections = _revision("0004_server_projections")
    for name in ("CLAIM_READY", "CLAIM_RELEASED", "RELEASE_SHARE", "PROJECT", "APPEND_PROJECTED"):
        op.execute(getattr(projections, name))  # dracap_lock stays: 0005 kept it
