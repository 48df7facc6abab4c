CREATE OR REPLACE FUNCTION dracap_append_guarded(
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
