CREATE OR REPLACE FUNCTION dracap_stale_epoch(p_node text, p_epoch bigint, p_guards jsonb)
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
