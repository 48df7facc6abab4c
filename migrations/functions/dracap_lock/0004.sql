CREATE OR REPLACE FUNCTION dracap_lock(p_key bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_lock(p_key);
    -- a fresh snapshot (READ COMMITTED, a volatile function): every commit made
    -- before the lock was granted is counted
    RETURN (SELECT position FROM event_log_head);
END
$$
