CREATE OR REPLACE FUNCTION dracap_claim_released(
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
