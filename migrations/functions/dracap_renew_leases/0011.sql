-- Renew many nodes' leases in one statement (migration 0011): the enforcement service
-- calls it once per tick with every node that heartbeated. A lease (node, epoch) that is
-- still the node's, unexpired and neither expired nor fenced in the log (node_epochs)
-- is extended by its own ttl, counted on the database's clock; the nodes renewed are
-- returned, the others have lost their lease (they take a new one, with a new epoch).
-- A renewal never revives an expired lease. SECURITY DEFINER: EXECUTE is the
-- enforcement role's (and the app role's), which may not write node_leases itself.
-- (No percent signs in this file: the migration driver reads them as placeholders.)
CREATE OR REPLACE FUNCTION dracap_renew_leases(p_nodes text[], p_epochs bigint[])
RETURNS SETOF text LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = public, pg_temp AS $$
    UPDATE node_leases l
       SET expires_at = clock_timestamp() + make_interval(secs => l.ttl_ms / 1000.0),
           renewed_at = clock_timestamp()
      FROM (SELECT DISTINCT r.node, r.epoch
              FROM unnest(p_nodes, p_epochs) AS r(node, epoch)) AS r
     WHERE l.node = r.node AND l.epoch = r.epoch AND l.expires_at > clock_timestamp()
       AND r.epoch > coalesce((SELECT n.epoch FROM node_epochs n WHERE n.node = r.node), 0)
    RETURNING l.node
$$
