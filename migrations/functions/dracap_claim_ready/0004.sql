CREATE OR REPLACE FUNCTION dracap_claim_ready(p_namespace text, p_name text, p_position bigint, p_version int)
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
