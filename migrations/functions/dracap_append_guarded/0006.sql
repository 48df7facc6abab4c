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
) RETURNS TABLE (head bigint, currents int[])
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    v_head bigint;
    v_current int[];
    v_marked int;
    v_node text;
    v_agent boolean;
BEGIN
    SELECT r.node, true INTO v_node, v_agent FROM dracap_node_roles r
     WHERE r.role = session_user::text;
    IF NOT FOUND THEN  -- an agent's user bound to no node: agent events only
        SELECT pg_has_role(session_user, 'dracap_agent', 'MEMBER') AND NOT r.rolsuper
          INTO v_agent FROM pg_roles r WHERE r.rolname = session_user;
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
    RETURN QUERY SELECT v_head, v_current;
END
$$
