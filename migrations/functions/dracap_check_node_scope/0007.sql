CREATE OR REPLACE FUNCTION dracap_check_node_scope(
    p_node text, p_types text[], p_payloads jsonb[], p_guards jsonb)
RETURNS void LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_agent_types text[] := ARRAY[
        'enforcement.limit_applied', 'enforcement.limit_failed', 'enforcement.limit_removed',
        'enforcement.reconciled', 'enforcement.checkpoint_set_aside',
        'reclamation.share_confirmed', 'reclamation.capacity_released',
        'reclamation.node_lease_acquired',
        'inventory.resource_slice_published', 'inventory.resource_slice_withdrawn',
        'runtime.message_dead_lettered'];
    v_who text := 'database user ' || session_user || CASE WHEN p_node IS NULL
                  THEN ' is a node agent''s' ELSE ' acts for node ' || quote_literal(p_node)
                  || ' only' END || ': ';
    v_owner text;
    v_type text;
    p jsonb;
    g jsonb;
    v_at int;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_types), 0) LOOP
        v_type := p_types[i];
        IF NOT v_type = ANY (v_agent_types) THEN
            RAISE EXCEPTION USING ERRCODE = 'DR004', DETAIL = v_type,
                MESSAGE = v_who || v_type || ' is not a node agent''s event';
        END IF;
        IF p_node IS NOT NULL THEN
            v_owner := dracap_node_of(v_type, p_payloads[i], p_node);
            IF v_owner IS DISTINCT FROM p_node THEN
                RAISE EXCEPTION USING ERRCODE = 'DR004', DETAIL = v_type,
                    MESSAGE = v_who || v_type || ' for '
                              || coalesce('node ' || quote_literal(v_owner), 'no node of its own')
                              || ' refused';
            END IF;
        END IF;
    END LOOP;
    IF p_guards IS NULL THEN
        RETURN;
    END IF;
    FOR g IN SELECT value FROM jsonb_array_elements(p_guards) LOOP
        v_at := (g->>'at')::int;
        v_type := p_types[v_at];
        p := p_payloads[v_at];
        IF (CASE g->>'kind'
            WHEN 'release' THEN
                v_type = 'reclamation.capacity_released' AND p->>'share_id' = g->>'share_id'
            WHEN 'set_total' THEN
                v_type = 'inventory.resource_slice_published'
                AND p->'slice'->'spec'->>'driver' = g->>'driver'
                AND p->'slice'->'spec'->'pool'->>'name' = g->>'pool'
                AND EXISTS (SELECT FROM jsonb_array_elements(p->'slice'->'spec'->'devices') d
                             WHERE d->>'name' = g->>'device'
                               AND d->'capacity'->(g->>'capacity') IS NOT NULL)
            WHEN 'acquire' THEN
                v_type = 'reclamation.node_lease_acquired'
                AND p->>'node' = g->>'node' AND p->>'epoch' = g->>'epoch'
            ELSE false
            END) IS NOT TRUE THEN
            RAISE EXCEPTION USING ERRCODE = 'DR004', DETAIL = coalesce(v_type, 'none'),
                MESSAGE = v_who || 'guard ' || quote_literal(coalesce(g->>'kind', ''))
                          || ' does not follow from ' || coalesce(v_type, 'any event')
                          || ' of its append';
        END IF;
    END LOOP;
END
$$
