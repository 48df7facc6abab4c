"""Projections in the server: an append and its projections in one call.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29

Design: an append holds the log's head lock from ``dracap_append`` to ``COMMIT``
(0003). Run from the client, each projection statement after the function is one
more round trip made under that lock, and the ``COMMIT`` another; on a busy event
loop each costs a millisecond or more while every other writer waits, so the lock,
not the database, bounded how fast the whole control plane could go.

``dracap_project(base, ops)`` applies the row changes of :mod:`events.ledger` in log
order, one by one, with the same statements as the client-side path
(:mod:`services.runtime.projecting`). ``ops`` is one JSON array; each op is
``[kind, offset, arg, ...]``, the event's position being ``base + offset`` and the
arguments those of the client-side statement, in its order. A capacity that no slice
published raises SQLSTATE ``DR002`` (``CapacityNotPublished``); the ledger's checks and
the holds' keys raise as they do for the client.

``dracap_append_projected(..., ops, consumer, processed)`` is ``dracap_append``
followed by ``dracap_project`` with the new positions. Sent as a statement of its own,
outside an explicit transaction, an append is then one round trip and its commit
happens in the server right after: the head lock is held for the server's own work
only. With a ``consumer`` it first records the ``processed`` message ids in
``processed_messages`` (before taking the head lock); if any was recorded before it
raises SQLSTATE ``DR003`` and nothing is written — a bus consumer's whole group then
commits in this one statement (:mod:`services.runtime.consuming`).

``dracap_lock(key)`` takes a session-level advisory lock and returns the log's head
read after the lock was granted: a consumer that serialises its handlers on a lock
learns in the same round trip how far its view must be folded to include every
commit of the lock's previous holder.

The statements are copied, not imported, so this revision stays as it is when the
client-side SQL changes; ``dracap replay verify`` and the tests compare both paths
with the fold.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (no percent signs in these bodies: the migration driver treats them as placeholders)

CLAIM_READY = """
CREATE FUNCTION dracap_claim_ready(p_namespace text, p_name text, p_position bigint, p_version int)
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    UPDATE claims c SET phase = 'ready', position = p_position
     WHERE c.namespace = p_namespace AND c.name = p_name AND c.phase = 'allocated'
       AND (p_version IS NULL OR c.allocation_version = p_version)
       AND EXISTS (SELECT FROM shares s WHERE s.namespace = c.namespace AND s.claim = c.name
                      AND s.allocation_version = c.allocation_version)
       AND NOT EXISTS (SELECT FROM shares s WHERE s.namespace = c.namespace AND s.claim = c.name
                          AND s.allocation_version = c.allocation_version AND s.state <> 'ready'
                          AND (NOT s.admin_access OR NOT EXISTS (
                               SELECT FROM shares t WHERE t.namespace = c.namespace
                                  AND t.claim = c.name
                                  AND t.allocation_version = c.allocation_version
                                  AND NOT t.admin_access)));
END
$$
"""

CLAIM_RELEASED = """
CREATE FUNCTION dracap_claim_released(
    p_namespace text, p_name text, p_position bigint, p_version int, p_keep text[])
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    UPDATE claims c SET phase = 'released', position = p_position
     WHERE c.namespace = p_namespace AND c.name = p_name AND c.allocation_version = p_version
       AND c.phase <> ALL(p_keep)
       AND NOT EXISTS (SELECT FROM shares s WHERE s.namespace = c.namespace AND s.claim = c.name
                          AND s.allocation_version = c.allocation_version
                          AND s.state <> 'released');
END
$$
"""

RELEASE_SHARE = """
CREATE FUNCTION dracap_release_share(p_share uuid, p_position bigint)
RETURNS TABLE (namespace text, claim text, allocation_version int)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
BEGIN
    UPDATE shares s SET state = 'released', prior_state = NULL, position = p_position
     WHERE s.share_id = p_share AND s.state <> 'released'
    RETURNING s.driver, s.pool, s.device, s.amounts, s.namespace, s.claim,
              s.allocation_version INTO r;
    IF NOT FOUND THEN
        RETURN;  -- already released (or never reserved): subtract nothing
    END IF;
    UPDATE capacity_ledger c SET allocated = c.allocated - a.value::numeric
      FROM jsonb_each_text(r.amounts) AS a
     WHERE c.driver = r.driver AND c.pool = r.pool AND c.device = r.device
       AND c.capacity = a.key;
    DELETE FROM device_holds h WHERE h.share_id = p_share;
    RETURN QUERY SELECT r.namespace, r.claim, r.allocation_version;
END
$$
"""

PROJECT = """
CREATE FUNCTION dracap_project(p_base bigint, p_ops jsonb)
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    o jsonb;
    k text;
    pos bigint;
    r record;
    v_share record;
    v_namespaces text[];
    v_names text[];
BEGIN
    FOR o IN SELECT value FROM jsonb_array_elements(p_ops) LOOP
        k := o->>0;
        pos := p_base + (o->>1)::bigint;
        IF k = 'set_total' THEN
            INSERT INTO capacity_ledger (driver, pool, device, capacity, total)
            VALUES (o->>2, o->>3, o->>4, o->>5, (o->>6)::numeric)
            ON CONFLICT (driver, pool, device, capacity) DO UPDATE SET total = EXCLUDED.total;
        ELSIF k = 'reserve' THEN
            UPDATE capacity_ledger SET allocated = allocated + (o->>6)::numeric
             WHERE driver = o->>2 AND pool = o->>3 AND device = o->>4 AND capacity = o->>5;
            IF NOT FOUND THEN
                RAISE EXCEPTION USING ERRCODE = 'DR002',
                    MESSAGE = 'no capacity ' || quote_literal(o->>5)
                              || ' published for device ' || (o->>2) || '/' || (o->>3)
                              || '/' || (o->>4);
            END IF;
        ELSIF k = 'hold' THEN
            INSERT INTO device_holds (driver, pool, device, share_id, namespace, claim)
            VALUES (o->>2, o->>3, o->>4, (o->>5)::uuid, o->>6, o->>7);
        ELSIF k = 'insert_share' THEN
            INSERT INTO shares (share_id, namespace, claim, allocation_version, request,
                                driver, pool, device, node, shared, admin_access, consumed,
                                amounts, policy_version, state, position)
            VALUES ((o->>2)::uuid, o->>3, o->>4, (o->>5)::int, o->>6, o->>7, o->>8, o->>9,
                    o->>10, (o->>11)::bool, (o->>12)::bool, o->13, o->14, (o->>15)::int,
                    'reserved', pos);
            UPDATE claims SET allocation_version = (o->>5)::int
             WHERE namespace = o->>3 AND name = o->>4 AND allocation_version <> (o->>5)::int;
        ELSIF k = 'release_share' THEN
            SELECT * INTO r FROM dracap_release_share((o->>2)::uuid, pos);
            IF r.namespace IS NOT NULL THEN
                PERFORM dracap_claim_released(r.namespace, r.claim, pos, r.allocation_version,
                                              ARRAY['failed']);
            END IF;
        ELSIF k = 'bind' THEN
            UPDATE shares SET state = 'bound', position = pos
             WHERE share_id = ANY (ARRAY(SELECT jsonb_array_elements_text(o->6))::uuid[])
               AND state = 'reserved';
            INSERT INTO claims (namespace, name, phase, allocation_version, node, reason,
                                position)
            VALUES (o->>2, o->>3, 'allocated', (o->>4)::int, o->>5, NULL, pos)
            ON CONFLICT (namespace, name) DO UPDATE
               SET phase = 'allocated', allocation_version = (o->>4)::int, node = o->>5,
                   reason = NULL, position = pos;
            PERFORM dracap_claim_ready(o->>2, o->>3, pos, NULL);
        ELSIF k = 'apply_limit' THEN
            UPDATE shares SET state = 'ready', level = o->>3, position = pos
             WHERE share_id = (o->>2)::uuid AND state IN ('reserved', 'bound')
            RETURNING namespace, claim, allocation_version INTO r;
            IF FOUND THEN
                PERFORM dracap_claim_ready(r.namespace, r.claim, pos, r.allocation_version);
            END IF;
        ELSIF k = 'fail_limit' THEN
            UPDATE claims c SET phase = 'failed', reason = o->>3, position = pos FROM shares s
             WHERE s.share_id = (o->>2)::uuid AND s.state <> 'released'
               AND c.namespace = s.namespace AND c.name = s.claim
               AND c.allocation_version = s.allocation_version;
        ELSIF k = 'request_release' THEN
            UPDATE claims SET phase = 'releasing', position = pos
             WHERE namespace = o->>2 AND name = o->>3 AND allocation_version = (o->>4)::int
               AND phase NOT IN ('releasing', 'released');
            IF FOUND THEN
                UPDATE shares SET state = 'releasing', position = pos
                 WHERE namespace = o->>2 AND claim = o->>3
                   AND allocation_version = (o->>4)::int
                   AND state IN ('reserved', 'bound', 'ready');
            END IF;
            PERFORM dracap_claim_released(
                o->>2, o->>3, pos, (o->>4)::int,
                ARRAY['failed', 'released', 'ready', 'allocated', 'submitted', 'admitted',
                      'rejected', 'unschedulable']);
        ELSIF k = 'mark_unknown' THEN
            IF o->>2 IS NOT NULL THEN
                UPDATE shares SET prior_state = state, state = 'unknown', position = pos
                 WHERE share_id = (o->>2)::uuid AND state NOT IN ('released', 'unknown');
            ELSIF o->>3 IS NOT NULL THEN
                INSERT INTO node_epochs (node, lease, lease_epoch)
                VALUES (o->>3, 'expired', (o->>4)::bigint)
                ON CONFLICT (node) DO UPDATE
                   SET lease = 'expired', lease_epoch = EXCLUDED.lease_epoch
                 WHERE node_epochs.lease_epoch <= EXCLUDED.lease_epoch
                   AND node_epochs.fenced_epoch <= EXCLUDED.lease_epoch;
                IF FOUND THEN
                    UPDATE shares SET prior_state = state, state = 'unknown', position = pos
                     WHERE node = o->>3 AND state NOT IN ('released', 'unknown');
                END IF;
            END IF;
        ELSIF k = 'confirm_share' THEN
            UPDATE shares SET state = coalesce(prior_state, 'ready'), prior_state = NULL,
                   position = pos
             WHERE share_id = (o->>2)::uuid AND state = 'unknown';
            UPDATE node_epochs SET lease = 'live' WHERE node = o->>3 AND lease = 'expired';
        ELSIF k = 'fence' THEN
            INSERT INTO node_epochs (node, lease, fenced_epoch)
            VALUES (o->>2, 'fenced', (o->>3)::bigint)
            ON CONFLICT (node) DO UPDATE
               SET lease = 'fenced', fenced_epoch = EXCLUDED.fenced_epoch
             WHERE node_epochs.lease_epoch <= EXCLUDED.fenced_epoch
               AND node_epochs.fenced_epoch <= EXCLUDED.fenced_epoch;
            IF FOUND THEN
                v_namespaces := '{}';
                v_names := '{}';
                FOR v_share IN SELECT share_id FROM shares
                                WHERE node = o->>2 AND state <> 'released'
                                ORDER BY share_id::text LOOP
                    SELECT * INTO r FROM dracap_release_share(v_share.share_id, pos);
                    IF r.namespace IS NOT NULL THEN
                        v_namespaces := v_namespaces || r.namespace;
                        v_names := v_names || r.claim;
                    END IF;
                END LOOP;
                FOR r IN SELECT DISTINCT t.ns, t.nm FROM unnest(v_namespaces, v_names) AS t(ns, nm)
                LOOP
                    UPDATE claims c SET position = pos,
                           phase = CASE WHEN c.phase = 'releasing' THEN 'released'
                                        ELSE 'failed' END,
                           reason = CASE WHEN c.phase = 'releasing' THEN c.reason
                                         ELSE 'node ' || (o->>2) || ' fenced at epoch '
                                              || (o->>3) END
                     WHERE c.namespace = r.ns AND c.name = r.nm
                       AND c.phase NOT IN ('released', 'failed')
                       AND (c.phase <> 'releasing' OR NOT EXISTS (
                            SELECT FROM shares s WHERE s.namespace = c.namespace
                               AND s.claim = c.name
                               AND s.allocation_version = c.allocation_version
                               AND s.state <> 'released'));
                END LOOP;
            END IF;
        ELSIF k = 'upsert_claim' THEN
            INSERT INTO claims (namespace, name, phase, reason, position)
            VALUES (o->>2, o->>3, o->>4, o->>5, pos)
            ON CONFLICT (namespace, name) DO UPDATE SET position = pos,
                   phase = CASE WHEN o->>4 = 'submitted'
                                     AND claims.phase IN ('allocated', 'ready', 'releasing')
                                THEN claims.phase ELSE o->>4 END,
                   reason = CASE WHEN NOT (o->>6)::bool
                                      OR (o->>4 = 'submitted'
                                          AND claims.phase IN ('allocated', 'ready', 'releasing'))
                                 THEN claims.reason ELSE o->>5 END;
        ELSE
            RAISE EXCEPTION USING MESSAGE = 'dracap_project: unknown change kind ' || k;
        END IF;
    END LOOP;
END
$$
"""

APPEND_PROJECTED = """
CREATE FUNCTION dracap_append_projected(
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
    p_ops jsonb,
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
    PERFORM dracap_project(v_head - p_count, p_ops);
    RETURN QUERY SELECT v_head, v_current;
END
$$
"""

LOCK = """
CREATE FUNCTION dracap_lock(p_key bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_lock(p_key);
    -- a fresh snapshot (READ COMMITTED, a volatile function): every commit made
    -- before the lock was granted is counted
    RETURN (SELECT position FROM event_log_head);
END
$$
"""

SIGNATURES = (
    "dracap_lock(bigint)",
    "dracap_append_projected(int, text[], int[], uuid[], text[], int[], text[], int[], text[], "
    "text, text[], text[], timestamptz, jsonb[], text, jsonb, text, uuid[])",
    "dracap_project(bigint, jsonb)",
    "dracap_release_share(uuid, bigint)",
    "dracap_claim_released(text, text, bigint, int, text[])",
    "dracap_claim_ready(text, text, bigint, int)",
)


def upgrade() -> None:
    for statement in (CLAIM_READY, CLAIM_RELEASED, RELEASE_SHARE, PROJECT, APPEND_PROJECTED, LOCK):
        op.execute(statement)


def downgrade() -> None:
    for signature in SIGNATURES:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
