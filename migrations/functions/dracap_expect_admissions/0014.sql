-- The premise of an admission, checked where every claims API replica meets
-- (migrations 0013, 0014). The claims API decides admission on its own fold, as of a log
-- position ("seen"). Its append carries what that decision took for granted, and this
-- function, called in the same statement after dracap_append_guarded (so under the log's
-- head lock, every earlier append visible), refuses the append when an event after
-- "seen" has changed it:
--
-- * the quota ("quota": true, 0013): a claim of the namespace admitted after "seen" that
--   the decision did not count ("counted": claim names) - another replica's, or the
--   Kubernetes bridge's;
-- * the namespace's policy (0014): an admin.namespace_access_set of the namespace (its
--   classes, adminAccess, opaque configuration, quota, requests per claim);
-- * a class the claim names ("classes"): an inventory.class_mode_set (disabled,
--   whole-device) or an inventory.device_class_removed of it.
--
-- The refusal is SQLSTATE DR001 (a conflict, DETAIL admissions:<namespace>): the replica
-- decides again on the whole log. The rules stay the claims API's
-- (services/claims/admission.py); this only says whether their premise still holds.
-- A premise without "quota" is a 0013 one: it counts admissions.
--
-- p_base: the position before this append's events (they are the decision's own);
-- p_premises: [{"namespace", "seen", "counted", "quota", "classes"}]. The scans read only
-- the events after "seen" (the primary key's range), a fold's lag.
-- (No percent signs in this file: the migration driver reads them as placeholders.)
CREATE OR REPLACE FUNCTION dracap_expect_admissions(p_base bigint, p_premises jsonb)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    p jsonb;
    v_name text;
    v_type text;
    v_at bigint;
BEGIN
    FOR p IN SELECT value FROM jsonb_array_elements(coalesce(p_premises, '[]')) LOOP
        IF coalesce((p->>'quota')::boolean, true) THEN
            SELECT e.payload->>'name', e.position INTO v_name, v_at
              FROM events e
             WHERE e.position > (p->>'seen')::bigint AND e.position <= p_base
               AND e.type = 'claims.admitted' AND e.namespace = p->>'namespace'
               AND NOT (e.payload->'name') <@ coalesce(p->'counted', '[]')
             ORDER BY e.position LIMIT 1;
            IF FOUND THEN
                RAISE EXCEPTION USING ERRCODE = 'DR001',
                    DETAIL = 'admissions:' || (p->>'namespace'),
                    MESSAGE = 'claim ' || quote_literal(v_name) || ' of namespace '
                              || quote_literal(p->>'namespace') || ' was admitted at position '
                              || v_at || ', after the decision''s position ' || (p->>'seen')
                              || ': decide again';
            END IF;
        END IF;
        SELECT e.type, e.position INTO v_type, v_at
          FROM events e
         WHERE e.position > (p->>'seen')::bigint AND e.position <= p_base
           AND ((e.type = 'admin.namespace_access_set'
                 AND e.payload->>'namespace' = p->>'namespace')
             OR (e.type IN ('inventory.class_mode_set', 'inventory.device_class_removed')
                 AND coalesce(p->'classes', '[]') @> to_jsonb(e.payload->>'name')))
         ORDER BY e.position LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION USING ERRCODE = 'DR001',
                DETAIL = 'admissions:' || (p->>'namespace'),
                MESSAGE = v_type || ' at position ' || v_at || ' changed what an admission '
                          || 'in namespace ' || quote_literal(p->>'namespace')
                          || ' decided on at position ' || (p->>'seen') || ': decide again';
        END IF;
    END LOOP;
    RETURN true;
END
$$
