-- The node the session's user acts for (NULL: none), for an agent to check at start; it
-- tells a user nothing but its own binding, so PUBLIC keeps EXECUTE.
CREATE OR REPLACE FUNCTION dracap_bound_node() RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT node FROM dracap_node_roles WHERE role = session_user::text
$$
