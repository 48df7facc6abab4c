-- The guards of the events of one append, derived by the database from the events
-- themselves (migration 0011): the JSON array dracap_guard applies, as
-- events.guards.guards_of_many makes it in Python (the model the unit tests check
-- against the fold; tests/integration/test_guards_sql.py compares the two). No caller
-- passes guards any more, so no caller can pass one that does not follow from its events.
--
-- * reservation.capacity_reserved, unless admin access: reserve its consumed amounts
--   (dracap_quantity), holding the device when it is not shared;
-- * reclamation.capacity_released: release the share;
-- * inventory.resource_slice_published: set the total of every device capacity;
-- * reclamation.node_lease_expired: note the epoch; reclamation.node_fenced: fence it;
-- * reclamation.node_lease_acquired: acquire the lease.
--
-- The payloads were checked against the catalog first (dracap_payload_error), so every
-- field read here has its type. NULL when no event has a guard. The events are read in
-- one pass over the arrays (indexing them would read them from the start each time).
-- (No percent signs in this file: the migration driver reads them as placeholders.)
CREATE OR REPLACE FUNCTION dracap_guards_of(p_types text[], p_payloads jsonb[])
RETURNS jsonb LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    v_out jsonb[] := '{}';  -- appended in place; a jsonb array would be copied each time
    v_type text;
    p jsonb;
    v_at bigint;
    v_spec jsonb;
    v_amounts jsonb;
    c record;
    d jsonb;
BEGIN
    IF NOT p_types && ARRAY['reservation.capacity_reserved', 'reclamation.capacity_released',
                            'inventory.resource_slice_published', 'reclamation.node_lease_expired',
                            'reclamation.node_fenced', 'reclamation.node_lease_acquired'] THEN
        RETURN NULL;  -- the usual batch of claim events: nothing to read
    END IF;
    FOR v_type, p, v_at IN SELECT * FROM unnest(p_types, p_payloads) WITH ORDINALITY LOOP
        CASE v_type
        WHEN 'reservation.capacity_reserved' THEN
            IF NOT (p->'admin_access')::boolean THEN
                v_amounts := '{}'::jsonb;
                FOR c IN SELECT key, value FROM jsonb_each(p->'consumed') LOOP
                    v_amounts := v_amounts
                                 || jsonb_build_object(c.key, dracap_quantity(c.value #>> '{}')::text);
                END LOOP;
                v_out := v_out || jsonb_build_object(
                    'kind', 'reserve', 'at', v_at, 'share_id', p->'share_id',
                    'driver', p->'driver', 'pool', p->'pool', 'device', p->'device',
                    'node', p->'node', 'namespace', p->'namespace', 'claim', p->'name',
                    'amounts', v_amounts, 'exclusive', NOT (p->'shared')::boolean);
            END IF;
        WHEN 'reclamation.capacity_released' THEN
            v_out := v_out || jsonb_build_object(
                'kind', 'release', 'at', v_at, 'share_id', p->'share_id');
        WHEN 'inventory.resource_slice_published' THEN
            v_spec := p->'slice'->'spec';
            IF jsonb_typeof(v_spec->'devices') = 'array' THEN
                FOR d IN SELECT value FROM jsonb_array_elements(v_spec->'devices') LOOP
                    CONTINUE WHEN jsonb_typeof(d->'capacity') IS DISTINCT FROM 'object';
                    FOR c IN SELECT key, value FROM jsonb_each(d->'capacity') ORDER BY key LOOP
                        v_out := v_out || jsonb_build_object(
                            'kind', 'set_total', 'at', v_at, 'driver', v_spec->'driver',
                            'pool', v_spec->'pool'->'name', 'device', d->'name',
                            'capacity', c.key,
                            'total', dracap_quantity(c.value->>'value')::text);
                    END LOOP;
                END LOOP;
            END IF;
        WHEN 'reclamation.node_lease_expired' THEN
            v_out := v_out || jsonb_build_object(
                'kind', 'note_epoch', 'at', v_at, 'node', p->'node', 'epoch', p->'epoch');
        WHEN 'reclamation.node_fenced' THEN
            v_out := v_out || jsonb_build_object(
                'kind', 'fence', 'at', v_at, 'node', p->'node', 'epoch', p->'epoch');
        WHEN 'reclamation.node_lease_acquired' THEN
            v_out := v_out || jsonb_build_object(
                'kind', 'acquire', 'at', v_at, 'node', p->'node', 'epoch', p->'epoch',
                'boot_id', p->'boot_id', 'ttl_ms', p->'ttl_ms');
        ELSE
            NULL;  -- no guard
        END CASE;
    END LOOP;
    RETURN CASE WHEN cardinality(v_out) = 0 THEN NULL ELSE to_jsonb(v_out) END;
END
$$
