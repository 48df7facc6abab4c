CREATE OR REPLACE FUNCTION dracap_append(
    p_count int,
    p_streams text[],
    p_expected int[],
    p_event_ids uuid[],
    p_event_streams text[],
    p_versions int[],
    p_types text[],
    p_schema_versions int[],
    p_namespaces text[],
    p_actor text,
    p_correlation_ids text[],
    p_causation_ids text[],
    p_recorded_at timestamptz,
    p_payloads jsonb[],
    p_channel text
) RETURNS TABLE (head bigint, currents int[])
LANGUAGE plpgsql VOLATILE AS $$
-- (no percent signs in this body: the migration driver treats them as placeholders)
DECLARE
    v_head bigint;
    v_current int[];
    v_offset int[];
BEGIN
    UPDATE event_log_head SET position = position + p_count RETURNING position INTO v_head;
    SELECT array_agg(
               coalesce((SELECT max(e.stream_version) FROM events e WHERE e.stream = s.stream), 0)
               ORDER BY s.ord)
      INTO v_current
      FROM unnest(p_streams) WITH ORDINALITY AS s(stream, ord);
    FOR i IN 1 .. coalesce(array_length(p_streams, 1), 0) LOOP
        IF p_expected[i] IS NOT NULL AND p_expected[i] <> v_current[i] THEN
            RAISE EXCEPTION USING ERRCODE = 'DR001', DETAIL = p_streams[i],
                MESSAGE = 'stream ' || quote_literal(p_streams[i]) || ' is at version '
                          || v_current[i] || ', expected ' || p_expected[i];
        END IF;
    END LOOP;
    SELECT array_agg(CASE WHEN p_expected[s.ord] IS NULL THEN v_current[s.ord] ELSE 0 END
                     ORDER BY s.ord)
      INTO v_offset
      FROM unnest(p_streams) WITH ORDINALITY AS s(stream, ord);
    INSERT INTO events (position, event_id, stream, stream_version, type, schema_version,
                        namespace, actor, correlation_id, causation_id, recorded_at, payload)
    SELECT v_head - p_count + u.ord, u.event_id, u.stream,
           u.version + v_offset[array_position(p_streams, u.stream)],
           u.type, u.schema_version, u.namespace, p_actor, u.correlation_id,
           u.causation_id, p_recorded_at, u.payload
      FROM unnest(p_event_ids, p_event_streams, p_versions, p_types, p_schema_versions,
                  p_namespaces, p_correlation_ids, p_causation_ids, p_payloads)
           WITH ORDINALITY AS u(event_id, stream, version, type, schema_version, namespace,
                                correlation_id, causation_id, payload, ord);
    PERFORM pg_notify(p_channel, v_head::text);
    RETURN QUERY SELECT v_head, v_current;
END
$$
