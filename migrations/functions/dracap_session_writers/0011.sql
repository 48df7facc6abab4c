-- The writers (events/writers.py) the session's database user may append as: the union
-- of the jobs of the service groups it belongs to (dracap_<kind> for every kind of
-- events.writers.JOBS: dracap_job_kinds, dracap_jobs_of). NULL when it
-- belongs to none: a superuser, the owner, the app role of 0001 (DRACAP_APP_ROLE) —
-- administrators and the compatibility role, which keep the whole catalog.
--
-- session_user, not current_user: the append function runs as its owner, and SET ROLE
-- cannot change the session user. A group that does not exist (any more) is skipped.
-- PL/pgSQL: its query is planned once per session, not at every append.
-- (No percent signs in this file: the migration driver reads them as placeholders.)
CREATE OR REPLACE FUNCTION dracap_session_writers() RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT CASE WHEN (SELECT rolsuper FROM pg_roles WHERE rolname = session_user) THEN NULL
           ELSE (SELECT array_agg(DISTINCT w ORDER BY w)
                   FROM pg_roles g
                  CROSS JOIN LATERAL unnest(dracap_jobs_of(substr(g.rolname, 8))) w
                  WHERE g.rolname IN (SELECT 'dracap_' || k FROM unnest(dracap_job_kinds()) k)
                    AND pg_has_role(session_user, g.oid, 'MEMBER'))
           END);
END
$$
