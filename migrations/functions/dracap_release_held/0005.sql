CREATE OR REPLACE FUNCTION dracap_release_held(p_share uuid, p_position bigint)
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
BEGIN
    DELETE FROM held_shares WHERE share_id = p_share
    RETURNING driver, pool, device, amounts INTO r;
    IF NOT FOUND THEN
        RETURN;  -- released before (or never held): nothing to give back
    END IF;
    UPDATE capacity_ledger c SET allocated = c.allocated - a.value::numeric,
           position = p_position
      FROM jsonb_each_text(r.amounts) AS a
     WHERE c.driver = r.driver AND c.pool = r.pool AND c.device = r.device
       AND c.capacity = a.key;
    DELETE FROM device_holds WHERE share_id = p_share;
END
$$
