CREATE OR REPLACE FUNCTION dracap_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = 'insufficient_privilege',
        MESSAGE = 'the event log is append-only: ' || TG_OP || ' on events refused';
END;
$$
