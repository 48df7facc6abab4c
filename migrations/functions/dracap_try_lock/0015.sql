-- A lock without a wait (migration 0015). A free lock is taken as a session-level
-- advisory lock and the log's head as of the grant returned, as dracap_lock returns it;
-- a taken one is not waited for: this session announces on the channel
-- dracap_lock_wanted (payload: the key) that it wants it, and NULL is returned. The
-- announcement is delivered when this statement's transaction commits, before the
-- caller goes on to wait in dracap_lock; a consumer that keeps the lock while idle gives
-- it back when it hears it (services/runtime/delivery/consuming.py).
-- (No percent signs in this file: the migration driver reads them as placeholders.)
CREATE OR REPLACE FUNCTION dracap_try_lock(p_key bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF pg_try_advisory_lock(p_key) THEN
        -- a fresh snapshot (READ COMMITTED, a volatile function): every commit made
        -- before the lock was granted is counted
        RETURN (SELECT position FROM event_log_head);
    END IF;
    PERFORM pg_notify('dracap_lock_wanted', p_key::text);
    RETURN NULL;
END
$$
