-- The premise of a quota decision, checked where every claims API replica meets
-- (migration 0013). The claims API decides admission on its own fold, as of a log
-- position: "the namespace holds n live claims, plus the ones I am admitting (counted)".
-- Its append carries that premise, and this function, called in the same statement after
-- dracap_append_guarded (so under the log's head lock, every earlier append visible),
-- refuses the append when some claim of the namespace was admitted after that position
-- that the decision did not count: another replica's, or the Kubernetes bridge's. The
-- refusal is SQLSTATE DR001 (a conflict, DETAIL admissions:<namespace>): the replica
-- decides again on the whole log. The quota rule itself stays the claims API's
-- (services/claims/admission.py); this only says whether its premise still holds.
--
-- p_base: the position before this append's events (they are the decision's own);
-- p_premises: [{"namespace", "seen" (the fold's position), "counted" (claim names)}].
-- The scan reads only the events after "seen" (the primary key's range), a fold's lag.
-- (No percent signs in this file: the migration driver reads them as placeholders.)
CREATE OR REPLACE FUNCTION dracap_expect_admissions(p_base bigint, p_premises jsonb)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    p jsonb;
    v_name text;
    v_at bigint;
BEGIN
    FOR p IN SELECT value FROM jsonb_array_elements(coalesce(p_premises, '[]')) LOOP
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
    END LOOP;
    RETURN true;
END
$$
