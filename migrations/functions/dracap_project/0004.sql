CREATE OR REPLACE FUNCTION dracap_project(p_base bigint, p_ops jsonb)
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    o jsonb;
    k text;
    pos bigint;
    r record;
    v_share record;
    v_namespaces text[];
    v_names text[];
BEGIN
    FOR o IN SELECT value FROM jsonb_array_elements(p_ops) LOOP
        k := o->>0;
        pos := p_base + (o->>1)::bigint;
        IF k = 'set_total' THEN
            INSERT INTO capacity_ledger (driver, pool, device, capacity, total)
            VALUES (o->>2, o->>3, o->>4, o->>5, (o->>6)::numeric)
            ON CONFLICT (driver, pool, device, capacity) DO UPDATE SET total = EXCLUDED.total;
        ELSIF k = 'reserve' THEN
            UPDATE capacity_ledger SET allocated = allocated + (o->>6)::numeric
             WHERE driver = o->>2 AND pool = o->>3 AND device = o->>4 AND capacity = o->>5;
            IF NOT FOUND THEN
                RAISE EXCEPTION USING ERRCODE = 'DR002',
                    MESSAGE = 'no capacity ' || quote_literal(o->>5)
                              || ' published for device ' || (o->>2) || '/' || (o->>3)
                              || '/' || (o->>4);
            END IF;
        ELSIF k = 'hold' THEN
            INSERT INTO device_holds (driver, pool, device, share_id, namespace, claim)
            VALUES (o->>2, o->>3, o->>4, (o->>5)::uuid, o->>6, o->>7);
        ELSIF k = 'insert_share' THEN
            INSERT INTO shares (share_id, namespace, claim, allocation_version, request,
                                driver, pool, device, node, shared, admin_access, consumed,
                                amounts, policy_version, state, position)
            VALUES ((o->>2)::uuid, o->>3, o->>4, (o->>5)::int, o->>6, o->>7, o->>8, o->>9,
                    o->>10, (o->>11)::bool, (o->>12)::bool, o->13, o->14, (o->>15)::int,
                    'reserved', pos);
            UPDATE claims SET allocation_version = (o->>5)::int
             WHERE namespace = o->>3 AND name = o->>4 AND allocation_version <> (o->>5)::int;
        ELSIF k = 'release_share' THEN
            SELECT * INTO r FROM dracap_release_share((o->>2)::uuid, pos);
            IF r.namespace IS NOT NULL THEN
                PERFORM dracap_claim_released(r.namespace, r.claim, pos, r.allocation_version,
                                              ARRAY['failed']);
            END IF;
        ELSIF k = 'bind' THEN
            UPDATE shares SET state = 'bound', position = pos
             WHERE share_id = ANY (ARRAY(SELECT jsonb_array_elements_text(o->6))::uuid[])
               AND state = 'reserved';
            INSERT INTO claims (namespace, name, phase, allocation_version, node, reason,
                                position)
            VALUES (o->>2, o->>3, 'allocated', (o->>4)::int, o->>5, NULL, pos)
            ON CONFLICT (namespace, name) DO UPDATE
               SET phase = 'allocated', allocation_version = (o->>4)::int, node = o->>5,
                   reason = NULL, position = pos;
            PERFORM dracap_claim_ready(o->>2, o->>3, pos, NULL);
        ELSIF k = 'apply_limit' THEN
            UPDATE shares SET state = 'ready', level = o->>3, position = pos
             WHERE share_id = (o->>2)::uuid AND state IN ('reserved', 'bound')
            RETURNING namespace, claim, allocation_version INTO r;
            IF FOUND THEN
                PERFORM dracap_claim_ready(r.namespace, r.claim, pos, r.allocation_version);
            END IF;
        ELSIF k = 'fail_limit' THEN
            UPDATE claims c SET phase = 'failed', reason = o->>3, position = pos FROM shares s
             WHERE s.share_id = (o->>2)::uuid AND s.state <> 'released'
               AND c.namespace = s.namespace AND c.name = s.claim
               AND c.allocation_version = s.allocation_version;
        ELSIF k = 'request_release' THEN
            UPDATE claims SET phase = 'releasing', position = pos
             WHERE namespace = o->>2 AND name = o->>3 AND allocation_version = (o->>4)::int
               AND phase NOT IN ('releasing', 'released');
            IF FOUND THEN
                UPDATE shares SET state = 'releasing', position = pos
                 WHERE namespace = o->>2 AND claim = o->>3
                   AND allocation_version = (o->>4)::int
                   AND state IN ('reserved', 'bound', 'ready');
            END IF;
            PERFORM dracap_claim_released(
                o->>2, o->>3, pos, (o->>4)::int,
                ARRAY['failed', 'released', 'ready', 'allocated', 'submitted', 'admitted',
                      'rejected', 'unschedulable']);
        ELSIF k = 'mark_unknown' THEN
            IF o->>2 IS NOT NULL THEN
                UPDATE shares SET prior_state = state, state = 'unknown', position = pos
                 WHERE share_id = (o->>2)::uuid AND state NOT IN ('released', 'unknown');
            ELSIF o->>3 IS NOT NULL THEN
                INSERT INTO node_epochs (node, lease, lease_epoch)
                VALUES (o->>3, 'expired', (o->>4)::bigint)
                ON CONFLICT (node) DO UPDATE
                   SET lease = 'expired', lease_epoch = EXCLUDED.lease_epoch
                 WHERE node_epochs.lease_epoch <= EXCLUDED.lease_epoch
                   AND node_epochs.fenced_epoch <= EXCLUDED.lease_epoch;
                IF FOUND THEN
                    UPDATE shares SET prior_state = state, state = 'unknown', position = pos
                     WHERE node = o->>3 AND state NOT IN ('released', 'unknown');
                END IF;
            END IF;
        ELSIF k = 'confirm_share' THEN
            UPDATE shares SET state = coalesce(prior_state, 'ready'), prior_state = NULL,
                   position = pos
             WHERE share_id = (o->>2)::uuid AND state = 'unknown';
            UPDATE node_epochs SET lease = 'live' WHERE node = o->>3 AND lease = 'expired';
        ELSIF k = 'fence' THEN
            INSERT INTO node_epochs (node, lease, fenced_epoch)
            VALUES (o->>2, 'fenced', (o->>3)::bigint)
            ON CONFLICT (node) DO UPDATE
               SET lease = 'fenced', fenced_epoch = EXCLUDED.fenced_epoch
             WHERE node_epochs.lease_epoch <= EXCLUDED.fenced_epoch
               AND node_epochs.fenced_epoch <= EXCLUDED.fenced_epoch;
            IF FOUND THEN
                v_namespaces := '{}';
                v_names := '{}';
                FOR v_share IN SELECT share_id FROM shares
                                WHERE node = o->>2 AND state <> 'released'
                                ORDER BY share_id::text LOOP
                    SELECT * INTO r FROM dracap_release_share(v_share.share_id, pos);
                    IF r.namespace IS NOT NULL THEN
                        v_namespaces := v_namespaces || r.namespace;
                        v_names := v_names || r.claim;
                    END IF;
                END LOOP;
                FOR r IN SELECT DISTINCT t.ns, t.nm FROM unnest(v_namespaces, v_names) AS t(ns, nm)
                LOOP
                    UPDATE claims c SET position = pos,
                           phase = CASE WHEN c.phase = 'releasing' THEN 'released'
                                        ELSE 'failed' END,
                           reason = CASE WHEN c.phase = 'releasing' THEN c.reason
                                         ELSE 'node ' || (o->>2) || ' fenced at epoch '
                                              || (o->>3) END
                     WHERE c.namespace = r.ns AND c.name = r.nm
                       AND c.phase NOT IN ('released', 'failed')
                       AND (c.phase <> 'releasing' OR NOT EXISTS (
                            SELECT FROM shares s WHERE s.namespace = c.namespace
                               AND s.claim = c.name
                               AND s.allocation_version = c.allocation_version
                               AND s.state <> 'released'));
                END LOOP;
            END IF;
        ELSIF k = 'upsert_claim' THEN
            INSERT INTO claims (namespace, name, phase, reason, position)
            VALUES (o->>2, o->>3, o->>4, o->>5, pos)
            ON CONFLICT (namespace, name) DO UPDATE SET position = pos,
                   phase = CASE WHEN o->>4 = 'submitted'
                                     AND claims.phase IN ('allocated', 'ready', 'releasing')
                                THEN claims.phase ELSE o->>4 END,
                   reason = CASE WHEN NOT (o->>6)::bool
                                      OR (o->>4 = 'submitted'
                                          AND claims.phase IN ('allocated', 'ready', 'releasing'))
                                 THEN claims.reason ELSE o->>5 END;
        ELSE
            RAISE EXCEPTION USING MESSAGE = 'dracap_project: unknown change kind ' || k;
        END IF;
    END LOOP;
END
$$
