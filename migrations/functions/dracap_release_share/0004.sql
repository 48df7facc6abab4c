CREATE OR REPLACE FUNCTION dracap_release_share(p_share uuid, p_position bigint)
RETURNS TABLE (namespace text, claim text, allocation_version int)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
BEGIN
    UPDATE shares s SET state = 'released', prior_state = NULL, position = p_position
     WHERE s.share_id = p_share AND s.state <> 'released'
    RETURNING s.driver, s.pool, s.device, s.amounts, s.namespace, s.claim,
              s.allocation_version INTO r;
    IF NOT FOUND THEN
        RETURN;  -- already released (or never reserved): subtract nothing
    END IF;
    UPDATE capacity_ledger c SET allocated = c.allocated - a.value::numeric
      FROM jsonb_each_text(r.amounts) AS a
     WHERE c.driver = r.driver AND c.pool = r.pool AND c.device = r.device
       AND c.capacity = a.key;
    DELETE FROM device_holds h WHERE h.share_id = p_share;
    RETURN QUERY SELECT r.namespace, r.claim, r.allocation_version;
END
$$
