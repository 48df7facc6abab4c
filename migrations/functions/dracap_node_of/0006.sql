-- The node an agent's event speaks for, read by field name; NULL when it names none.
-- p_bound is the session's node: a share or dead letter of no node is anybody's.
CREATE OR REPLACE FUNCTION dracap_node_of(p_type text, p jsonb, p_bound text)
RETURNS text LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_node text;
    v_other text;
    v_found boolean;
BEGIN
    CASE p_type
    WHEN 'enforcement.limit_applied', 'enforcement.limit_failed', 'enforcement.limit_removed',
         'enforcement.reconciled', 'enforcement.checkpoint_set_aside',
         'reclamation.share_confirmed' THEN
        RETURN p->>'node';
    WHEN 'inventory.resource_slice_published' THEN
        v_node := p->'slice'->'spec'->>'nodeName';
        -- the slice's name and its pool must not belong to another node
        SELECT e.payload->'slice'->'spec'->>'nodeName' INTO v_other FROM events e
         WHERE e.stream = 'slice:' || (p->'slice'->'metadata'->>'name')
           AND e.type = 'inventory.resource_slice_published'
           AND e.payload->'slice'->'spec'->>'nodeName' IS DISTINCT FROM v_node
         LIMIT 1;
        IF FOUND THEN
            RETURN coalesce(v_other, '(none)');
        END IF;
        SELECT e.payload->'slice'->'spec'->>'nodeName' INTO v_other FROM events e
         WHERE e.type = 'inventory.resource_slice_published'
           AND e.payload->'slice'->'spec'->>'driver' = p->'slice'->'spec'->>'driver'
           AND e.payload->'slice'->'spec'->'pool'->>'name' = p->'slice'->'spec'->'pool'->>'name'
           AND e.payload->'slice'->'spec'->>'nodeName' IS DISTINCT FROM v_node
         LIMIT 1;
        IF FOUND THEN
            RETURN coalesce(v_other, '(none)');
        END IF;
        RETURN v_node;
    WHEN 'inventory.resource_slice_withdrawn' THEN
        SELECT e.payload->'slice'->'spec'->>'nodeName' INTO v_node FROM events e
         WHERE e.stream = 'slice:' || (p->>'name')
           AND e.type = 'inventory.resource_slice_published'
         ORDER BY e.stream_version DESC LIMIT 1;
        RETURN v_node;
    WHEN 'reclamation.capacity_released' THEN
        SELECT h.node, true INTO v_node, v_found FROM held_shares h
         WHERE h.share_id = (p->>'share_id')::uuid;
        IF NOT FOUND THEN  -- an admin share, or one released before: its reservation
            SELECT e.payload->>'node', true INTO v_node, v_found FROM events e
             WHERE e.stream = 'device:' || (p->>'driver') || '/' || (p->>'pool') || '/'
                              || (p->>'device')
               AND e.type = 'reservation.capacity_reserved'
               AND e.payload->>'share_id' = p->>'share_id'
             ORDER BY e.stream_version DESC LIMIT 1;
        END IF;
        IF v_found AND v_node IS NULL THEN
            RETURN p_bound;  -- a share on no node: any agent may give it back
        END IF;
        RETURN v_node;
    WHEN 'runtime.message_dead_lettered' THEN
        IF left(p->>'consumer', 6) <> 'agent-' THEN
            RETURN NULL;
        END IF;
        SELECT e.payload->>'node', true INTO v_node, v_found FROM events e
         WHERE e.position = (p->>'position')::bigint;
        IF v_found THEN
            RETURN v_node;
        END IF;
        RETURN p_bound;  -- a message the log does not hold (it only counts)
    ELSE
        RETURN NULL;
    END CASE;
END
$$
