CREATE OR REPLACE FUNCTION dracap_renew_lease(p_node text, p_epoch bigint)
RETURNS timestamptz LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = public, pg_temp AS $$
DECLARE
    v_bound text;
    v_expires timestamptz;
BEGIN
    SELECT node INTO v_bound FROM dracap_node_roles WHERE role = session_user::text;
    IF FOUND AND v_bound <> p_node THEN
        RAISE EXCEPTION USING ERRCODE = 'DR004', DETAIL = 'lease',
            MESSAGE = 'database user ' || session_user || ' acts for node '
                      || quote_literal(v_bound) || ' only: lease of '
                      || quote_literal(p_node) || ' refused';
    END IF;
    UPDATE node_leases l
       SET expires_at = clock_timestamp() + make_interval(secs => l.ttl_ms / 1000.0),
           renewed_at = clock_timestamp()
     WHERE l.node = p_node AND l.epoch = p_epoch AND l.expires_at > clock_timestamp()
       AND p_epoch > coalesce((SELECT n.epoch FROM node_epochs n WHERE n.node = p_node), 0)
    RETURNING l.expires_at INTO v_expires;
    RETURN v_expires;
END
$$
