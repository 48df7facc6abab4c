-- The node an agent's event speaks for, read by field name and from the log; NULL when
-- it names none (migration 0011; first written by 0006, taught leases by 0007 and
-- device health and share use by 0008).
--
-- p_node is the node the appending agent acts for: a share on no node, or a dead letter
-- of a message the log does not hold, is any agent's.
--
-- * a report about a share (LimitApplied, LimitFailed, LimitRemoved, ShareConfirmed,
--   ShareUsed) speaks for the node the log gives the share, never for the node its
--   payload names: the node that holds it in held_shares, else the node of its
--   reservation (an admin-access share holds nothing, nor does a released one). A share
--   the log does not know speaks for no node;
-- * EnforcementReconciled, EnforcementCheckpointSetAside, NodeLeaseAcquired and
--   DeviceHealthChanged: their node;
-- * ResourceSlicePublished: slice.spec.nodeName, when no earlier publication of that
--   slice name, nor of any slice in its (driver, pool), names another node;
-- * ResourceSliceWithdrawn: the nodeName of the slice's last publication;
-- * CapacityReleased: the share's node, as for the share reports;
-- * MessageDeadLettered: a consumer of an agent (agent-...), and the node of the event
--   it names.
-- (No percent signs in this file: the migration driver reads them as placeholders.)
CREATE OR REPLACE FUNCTION dracap_share_node(p_share text, p_node text)
RETURNS text LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_node text;
BEGIN
    IF p_share ~ '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$' THEN
        SELECT h.node INTO v_node FROM held_shares h WHERE h.share_id = p_share::uuid;
        IF FOUND THEN
            RETURN coalesce(v_node, p_node);
        END IF;
    END IF;
    -- held nothing (admin access) or nothing any more (released): its reservation says
    SELECT e.payload->>'node' INTO v_node FROM events e
     WHERE e.type = 'reservation.capacity_reserved' AND e.payload->>'share_id' = p_share
     ORDER BY e.position DESC LIMIT 1;
    IF FOUND THEN
        RETURN coalesce(v_node, p_node);  -- a share on no node: any agent's
    END IF;
    RETURN NULL;  -- a share the log does not know
END
$$;

CREATE OR REPLACE FUNCTION dracap_node_of(p_type text, p jsonb, p_node text)
RETURNS text LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_node text;
    v_other text;
    v_found boolean;
BEGIN
    CASE p_type
    WHEN 'enforcement.limit_applied', 'enforcement.limit_failed', 'enforcement.limit_removed',
         'reclamation.share_confirmed', 'enforcement.share_used',
         'reclamation.capacity_released' THEN
        RETURN dracap_share_node(p->>'share_id', p_node);
    WHEN 'enforcement.reconciled', 'enforcement.checkpoint_set_aside',
         'reclamation.node_lease_acquired', 'reclamation.device_health_changed' THEN
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
    WHEN 'runtime.message_dead_lettered' THEN
        IF left(p->>'consumer', 6) <> 'agent-' THEN
            RETURN NULL;
        END IF;
        SELECT e.payload->>'node', true INTO v_node, v_found FROM events e
         WHERE e.position = (p->>'position')::bigint;
        IF v_found THEN
            RETURN v_node;
        END IF;
        RETURN p_node;  -- a message the log does not hold (it only counts)
    ELSE
        RETURN NULL;
    END CASE;
END
$$;

-- Every event of an agent's append must speak for the agent's node (SQLSTATE DR004).
CREATE OR REPLACE FUNCTION dracap_check_node_scope(p_node text, p_types text[], p_payloads jsonb[])
RETURNS void LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_owner text;
    v_type text;
    p jsonb;
BEGIN
    FOR v_type, p IN SELECT * FROM unnest(p_types, p_payloads) LOOP
        v_owner := dracap_node_of(v_type, p, p_node);
        IF v_owner IS DISTINCT FROM p_node THEN
            RAISE EXCEPTION USING ERRCODE = 'DR004', DETAIL = v_type,
                MESSAGE = 'database user ' || session_user || ' acts for node '
                          || quote_literal(p_node) || ' only: ' || v_type || ' for '
                          || coalesce('node ' || quote_literal(v_owner), 'no node of its own')
                          || ' refused';
        END IF;
    END LOOP;
END
$$
