-- The one way an application appends (migrations 0005-0008; rewritten by 0011; 0012 drops
-- the node-bound users of 0006: node agents have no database login).
--
-- SECURITY DEFINER: it runs as dracap_owner with search_path pinned, and EXECUTE is
-- granted to the appending roles only, which have no privilege on the tables at all.
-- What the caller sends is data to check, nothing more:
--
-- 1. every payload is one the fold decodes: dracap_payload_error, generated from the
--    catalog (SQLSTATE DR006, InvalidEvent), for every caller;
-- 2. the session's database user appends only as its job's writers
--    (dracap_session_writers: claims as tenants, operators and the Kubernetes bridge;
--    reservation and reclamation as themselves; the enforcement service as node agents),
--    only event types those writers write (dracap_writers_of), a tenant only in its own
--    namespace, a node agent only as agent:<node>#<epoch> and only for its consumers
--    agent-... (SQLSTATE DR005, AppendForbidden); a superuser, the owner and the app role
--    keep the whole catalog;
-- 3. before anything else, under the head lock: an agent's epoch must be its node's lease
--    (or the one this append acquires), else the refusal is recorded instead
--    (AppendRefused, 0007) and its current epoch returned in refused;
-- 4. the consumer's processed_messages (DR003 when one was there before);
-- 5. dracap_append (head lock, versions, insert, notify; recorded_at is the database's
--    clock);
-- 6. a node agent's events all speak for its node, judged from the log
--    (dracap_check_node_scope, DR004);
-- 7. the guards, derived by the database from the events (dracap_guards_of) and applied
--    by dracap_guard: no caller passes one.
-- (No percent signs in this file: the migration driver reads them as placeholders.)
CREATE OR REPLACE FUNCTION dracap_append_guarded(
    p_count int,
    p_streams text[],
    p_expected int[],
    p_event_ids uuid[],
    p_event_streams text[],
    p_types text[],
    p_schema_versions int[],
    p_namespaces text[],
    p_actor text,
    p_correlation_ids text[],
    p_causation_ids text[],
    p_payloads jsonb[],
    p_consumer text,
    p_processed uuid[]
) RETURNS TABLE (head bigint, currents int[], refused bigint, recorded_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v_head bigint;
    v_current int[];
    v_at timestamptz;
    v_marked int;
    v_error text;
    v_type text;
    v_at_event bigint;
    v_writers text[];
    v_writer text;
    v_who text;
    v_bound text;
    v_tenant text;
    v_namespace text;
    v_epoch text[];
    v_refused bigint;
    v_guards jsonb;
BEGIN
    -- 1. every payload decodes (before the head lock: it delays nobody). Set-based, as
    --    below: a loop that indexes the arrays would read them from the start each time.
    IF cardinality(p_payloads) = 1 THEN  -- the usual single event: no query at all
        v_at_event := 1;
        v_type := p_types[1];
        v_error := dracap_payload_error(p_types[1], p_schema_versions[1], p_payloads[1]);
    ELSE
        SELECT u.i, u.type, u.error INTO v_at_event, v_type, v_error
          FROM (SELECT e.i, e.type,
                       dracap_payload_error(e.type, e.schema_version, e.payload) AS error
                  FROM unnest(p_types, p_schema_versions, p_payloads)
                       WITH ORDINALITY AS e(type, schema_version, payload, i)) AS u
         WHERE u.error IS NOT NULL ORDER BY u.i LIMIT 1;
    END IF;
    IF v_error IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'DR006', DETAIL = coalesce(v_type, ''),
            MESSAGE = 'event ' || v_at_event || ' of the append (' || coalesce(v_type, 'no type')
                      || ') is not one the catalog decodes: ' || v_error;
    END IF;
    -- 2. the session's job
    v_writers := dracap_session_writers();
    v_epoch := regexp_match(p_actor, '^agent:([^#:@[:space:]]+)#([0-9]{1,18})$');
    IF v_writers IS NOT NULL THEN
        v_writer := dracap_writer_of(p_actor);
        v_who := 'database user ' || session_user || ' (' || array_to_string(v_writers, ', ')
                 || ')';
        IF v_writer IS NULL OR NOT v_writer = ANY (v_writers) THEN
            RAISE EXCEPTION USING ERRCODE = 'DR005', DETAIL = 'actor',
                MESSAGE = v_who || ' may not append as actor ' || quote_literal(p_actor);
        END IF;
        SELECT t INTO v_type FROM unnest(p_types) AS t
         WHERE NOT v_writer = ANY (dracap_writers_of(t)) LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'DR005', DETAIL = v_type,
                MESSAGE = v_who || ' may not append ' || v_type || ' as '
                          || quote_literal(p_actor) || ': ' || v_type || ' is not written by '
                          || v_writer || ' actors';
        END IF;
        IF v_writer = 'tenant' THEN  -- its own namespace only
            v_tenant := coalesce(substring(p_actor FROM '@(.*)$'),
                                 substring(p_actor FROM ':(.*)$'));
            SELECT e.type, coalesce(e.p->>'namespace', e.p->'claim'->'metadata'->>'namespace',
                                    e.namespace)
              INTO v_type, v_namespace
              FROM unnest(p_types, p_payloads, p_namespaces) AS e(type, p, namespace)
             WHERE coalesce(e.p->>'namespace', e.p->'claim'->'metadata'->>'namespace')
                       IS DISTINCT FROM v_tenant
                OR e.namespace IS DISTINCT FROM v_tenant
             LIMIT 1;
            IF FOUND THEN
                RAISE EXCEPTION USING ERRCODE = 'DR005', DETAIL = v_type,
                    MESSAGE = v_who || ': ' || quote_literal(p_actor) || ' acts in namespace '
                              || quote_literal(v_tenant) || ' only, not '
                              || quote_literal(coalesce(v_namespace, ''));
            END IF;
        ELSIF v_writer = 'agent' THEN
            SELECT r.node INTO v_bound FROM dracap_node_roles r WHERE r.role = session_user::text;
            IF v_bound IS NOT NULL AND v_bound IS DISTINCT FROM v_epoch[1] THEN
                RAISE EXCEPTION USING ERRCODE = 'DR004', DETAIL = 'actor',
                    MESSAGE = 'database user ' || session_user || ' acts for node '
                              || quote_literal(v_bound) || ' only: its appends name the agent '
                              || 'and its lease epoch (agent:' || v_bound || '#<epoch>), not '
                              || quote_literal(p_actor);
            END IF;
            IF p_consumer IS NOT NULL AND left(p_consumer, 6) IS DISTINCT FROM 'agent-' THEN
                RAISE EXCEPTION USING ERRCODE = 'DR005', DETAIL = 'consumer',
                    MESSAGE = v_who || ' may not record messages of consumer '
                              || quote_literal(p_consumer) || ': a node agent''s consumers '
                              || 'are agent-...';
            END IF;
        END IF;
    END IF;
    v_guards := dracap_guards_of(p_types, p_payloads);
    -- 3. an agent's epoch, under the head lock: no lease, expiry or fence slips in between
    IF v_epoch IS NOT NULL THEN
        PERFORM 1 FROM event_log_head FOR UPDATE;
        v_refused := dracap_stale_epoch(v_epoch[1], v_epoch[2]::bigint, v_guards);
        IF v_refused IS NOT NULL THEN
            SELECT a.head, a.recorded_at INTO v_head, v_at
              FROM dracap_append(
                       1, ARRAY['node:' || v_epoch[1]], ARRAY[NULL]::int[],
                       ARRAY[gen_random_uuid()], ARRAY['node:' || v_epoch[1]],
                       ARRAY['reclamation.append_refused'], ARRAY[1], ARRAY[NULL]::text[],
                       p_actor, ARRAY[coalesce(p_correlation_ids[1], gen_random_uuid()::text)],
                       ARRAY[p_causation_ids[1]],
                       ARRAY[jsonb_build_object(
                           'type', 'reclamation.append_refused', 'node', v_epoch[1],
                           'epoch', v_epoch[2]::bigint, 'current_epoch', v_refused,
                           'types', to_jsonb(p_types))]) AS a;
            RETURN QUERY SELECT v_head, NULL::int[], v_refused, v_at;
            RETURN;
        END IF;
    END IF;
    -- 4. the consumer's messages, once
    IF p_consumer IS NOT NULL THEN
        WITH m AS (INSERT INTO processed_messages (consumer, event_id)
                   SELECT p_consumer, unnest(p_processed) ON CONFLICT DO NOTHING RETURNING 1)
        SELECT count(*) INTO v_marked FROM m;
        IF v_marked <> coalesce(cardinality(p_processed), 0) THEN
            RAISE EXCEPTION USING ERRCODE = 'DR003',
                MESSAGE = 'consumer ' || quote_literal(p_consumer)
                          || ' had handled some of these messages before';
        END IF;
    END IF;
    -- 5. the log
    SELECT a.head, a.currents, a.recorded_at INTO v_head, v_current, v_at
      FROM dracap_append(p_count, p_streams, p_expected, p_event_ids, p_event_streams,
                         p_types, p_schema_versions, p_namespaces, p_actor,
                         p_correlation_ids, p_causation_ids, p_payloads) AS a;
    -- 6. a node agent reports on its own node only (under the head lock)
    IF v_writer = 'agent' THEN
        PERFORM dracap_check_node_scope(v_epoch[1], p_types, p_payloads);
    END IF;
    -- 7. the guards that follow from the events
    IF v_guards IS NOT NULL THEN
        PERFORM dracap_guard(v_head - p_count, v_guards);
    END IF;
    RETURN QUERY SELECT v_head, v_current, NULL::bigint, v_at;
END
$$
