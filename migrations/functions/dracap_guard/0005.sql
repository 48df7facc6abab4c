CREATE OR REPLACE FUNCTION dracap_guard(p_base bigint, p_guards jsonb)
RETURNS void LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    g jsonb;
    pos bigint;
    moved int;
    missing text;
    v_share record;
BEGIN
    IF p_guards IS NULL THEN
        RETURN;
    END IF;
    FOR g IN SELECT value FROM jsonb_array_elements(p_guards) LOOP
        pos := p_base + (g->>'at')::bigint;
        CASE g->>'kind'
        WHEN 'set_total' THEN
            INSERT INTO capacity_ledger (driver, pool, device, capacity, total, position)
            VALUES (g->>'driver', g->>'pool', g->>'device', g->>'capacity',
                    (g->>'total')::numeric, pos)
            ON CONFLICT (driver, pool, device, capacity)
            DO UPDATE SET total = EXCLUDED.total, position = EXCLUDED.position;
        WHEN 'reserve' THEN
            UPDATE capacity_ledger c SET allocated = c.allocated + a.value::numeric,
                   position = pos
              FROM jsonb_each_text(g->'amounts') AS a
             WHERE c.driver = g->>'driver' AND c.pool = g->>'pool'
               AND c.device = g->>'device' AND c.capacity = a.key;
            GET DIAGNOSTICS moved = ROW_COUNT;
            IF moved <> (SELECT count(*) FROM jsonb_object_keys(g->'amounts')) THEN
                SELECT k INTO missing FROM jsonb_object_keys(g->'amounts') AS k
                 WHERE NOT EXISTS (
                       SELECT FROM capacity_ledger c
                        WHERE c.driver = g->>'driver' AND c.pool = g->>'pool'
                          AND c.device = g->>'device' AND c.capacity = k)
                 ORDER BY k LIMIT 1;
                RAISE EXCEPTION USING ERRCODE = 'DR002',
                    MESSAGE = 'no capacity ' || quote_literal(missing)
                              || ' published for device ' || (g->>'driver') || '/'
                              || (g->>'pool') || '/' || (g->>'device');
            END IF;
            IF (g->>'exclusive')::boolean THEN
                INSERT INTO device_holds (driver, pool, device, share_id, namespace, claim)
                VALUES (g->>'driver', g->>'pool', g->>'device', (g->>'share_id')::uuid,
                        g->>'namespace', g->>'claim');
            END IF;
            INSERT INTO held_shares (share_id, driver, pool, device, node, amounts, position)
            VALUES ((g->>'share_id')::uuid, g->>'driver', g->>'pool', g->>'device',
                    g->>'node', g->'amounts', pos);
        WHEN 'release' THEN
            PERFORM dracap_release_held((g->>'share_id')::uuid, pos);
        WHEN 'note_epoch', 'fence' THEN
            INSERT INTO node_epochs (node, epoch) VALUES (g->>'node', (g->>'epoch')::bigint)
            ON CONFLICT (node) DO UPDATE SET epoch = EXCLUDED.epoch
             WHERE node_epochs.epoch <= EXCLUDED.epoch;
            IF FOUND AND g->>'kind' = 'fence' THEN
                FOR v_share IN SELECT share_id FROM held_shares WHERE node = g->>'node'
                                ORDER BY share_id LOOP
                    PERFORM dracap_release_held(v_share.share_id, pos);
                END LOOP;
            END IF;
        ELSE
            RAISE EXCEPTION USING MESSAGE = 'dracap_guard: unknown kind '
                                            || quote_literal(g->>'kind');
        END CASE;
    END LOOP;
END
$$
