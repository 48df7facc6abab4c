-- The log part of an append (migration 0003; rewritten by 0011): take the head lock,
-- check the streams' versions, insert the events, notify. Called by
-- dracap_append_guarded only (no role but the owner may execute it).
--
-- The head lock is the single row of event_log_head, taken by the UPDATE and held until
-- the transaction ends: appends are serial, positions gap-free and in commit order. The
-- version read follows the lock (each statement a fresh snapshot), so the check against
-- the expected versions is exact: a mismatch is SQLSTATE DR001, the stream in DETAIL.
--
-- Since 0011 the database, not the caller, says
-- * when: recorded_at is clock_timestamp() read under the lock, so the log's times never
--   go back and every timeout that reads them counts on the database's clock;
-- * which version each event gets: the current version of its stream (after the
--   expected one was checked) plus its rank among this append's events of that stream,
--   every stream named once in p_streams;
-- and it refuses arrays that do not all hold p_count events (SQLSTATE 22023). Streams are
-- matched by joins, not by searching the array per event: an append of n events on m
-- streams costs O(n + m), not O(n m).
-- (No percent signs in this file: the migration driver reads them as placeholders.)
CREATE OR REPLACE FUNCTION dracap_append(
    p_count int,
    p_streams text[],
    p_expected int[],
    p_event_ids uuid[],
    p_event_streams text[],
    p_types text[],
    p_schema_versions int[],
    p_namespaces text[],
    p_actor text,
    p_correlation_ids text[],
    p_causation_ids text[],
    p_payloads jsonb[]
) RETURNS TABLE (head bigint, currents int[], recorded_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_head bigint;
    v_current int[];
    v_at timestamptz;
    v_inserted bigint;
BEGIN
    IF p_count IS NULL OR p_count < 1
       OR cardinality(p_streams) IS DISTINCT FROM cardinality(p_expected)
       OR array_position(p_streams, NULL) IS NOT NULL OR '' = ANY (p_streams)
       OR cardinality(p_event_ids) IS DISTINCT FROM p_count
       OR cardinality(p_event_streams) IS DISTINCT FROM p_count
       OR cardinality(p_types) IS DISTINCT FROM p_count
       OR cardinality(p_schema_versions) IS DISTINCT FROM p_count
       OR cardinality(p_namespaces) IS DISTINCT FROM p_count
       OR cardinality(p_correlation_ids) IS DISTINCT FROM p_count
       OR cardinality(p_causation_ids) IS DISTINCT FROM p_count
       OR cardinality(p_payloads) IS DISTINCT FROM p_count THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'an append names each of its streams once and gives every one of its '
                      || coalesce(p_count, 0) || ' events an id, a stream of those, a type, '
                      || 'a schema version, a namespace, a correlation, a causation and a payload';
    END IF;
    UPDATE event_log_head SET position = position + p_count RETURNING position INTO v_head;
    v_at := clock_timestamp();
    SELECT array_agg(
               coalesce((SELECT max(e.stream_version) FROM events e WHERE e.stream = s.stream), 0)
               ORDER BY s.ord)
      INTO v_current
      FROM unnest(p_streams) WITH ORDINALITY AS s(stream, ord);
    FOR i IN 1 .. cardinality(p_streams) LOOP
        IF p_expected[i] IS NOT NULL AND p_expected[i] <> v_current[i] THEN
            RAISE EXCEPTION USING ERRCODE = 'DR001', DETAIL = p_streams[i],
                MESSAGE = 'stream ' || quote_literal(p_streams[i]) || ' is at version '
                          || v_current[i] || ', expected ' || p_expected[i];
        END IF;
    END LOOP;
    IF cardinality(p_streams) = 1 THEN  -- the usual append: one stream, no join needed
        IF NOT p_event_streams <@ p_streams THEN
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                MESSAGE = 'an append names the stream of every one of its events';
        END IF;
        INSERT INTO events (position, event_id, stream, stream_version, type, schema_version,
                            namespace, actor, correlation_id, causation_id, recorded_at,
                            payload)
        SELECT v_head - p_count + u.ord, u.event_id, p_streams[1], v_current[1] + u.ord,
               u.type, u.schema_version, u.namespace, p_actor, u.correlation_id,
               u.causation_id, v_at, u.payload
          FROM unnest(p_event_ids, p_types, p_schema_versions, p_namespaces,
                      p_correlation_ids, p_causation_ids, p_payloads)
               WITH ORDINALITY AS u(event_id, type, schema_version, namespace,
                                    correlation_id, causation_id, payload, ord);
    ELSE
        INSERT INTO events (position, event_id, stream, stream_version, type, schema_version,
                            namespace, actor, correlation_id, causation_id, recorded_at,
                            payload)
        SELECT v_head - p_count + u.ord, u.event_id, u.stream,
               c.version + row_number() OVER (PARTITION BY u.stream ORDER BY u.ord),
               u.type, u.schema_version, u.namespace, p_actor, u.correlation_id,
               u.causation_id, v_at, u.payload
          FROM unnest(p_event_ids, p_event_streams, p_types, p_schema_versions, p_namespaces,
                      p_correlation_ids, p_causation_ids, p_payloads)
               WITH ORDINALITY AS u(event_id, stream, type, schema_version, namespace,
                                    correlation_id, causation_id, payload, ord)
          JOIN unnest(p_streams, v_current) AS c(stream, version) ON c.stream = u.stream;
        GET DIAGNOSTICS v_inserted = ROW_COUNT;
        IF v_inserted <> p_count THEN  -- an event of a stream not named, a stream named twice
            RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
                MESSAGE = 'an append names each of its streams once, and every event''s stream';
        END IF;
    END IF;
    PERFORM pg_notify('dracap_events', v_head::text);
    RETURN QUERY SELECT v_head, v_current, v_at;
END
$$
