CREATE OR REPLACE FUNCTION dracap_append_projected(
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
    p_channel text,
    p_ops jsonb,
    p_consumer text,
    p_processed uuid[]
) RETURNS TABLE (head bigint, currents int[])
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_head bigint;
    v_current int[];
    v_marked int;
BEGIN
    IF p_consumer IS NOT NULL THEN
        WITH m AS (INSERT INTO processed_messages (consumer, event_id)
                   SELECT p_consumer, unnest(p_processed) ON CONFLICT DO NOTHING RETURNING 1)
        SELECT count(*) INTO v_marked FROM m;
        IF v_marked <> cardinality(p_processed) THEN
            RAISE EXCEPTION USING ERRCODE = 'DR003',
                MESSAGE = 'consumer ' || quote_literal(p_consumer)
                          || ' had handled some of these messages before';
        END IF;
    END IF;
    SELECT a.head, a.currents INTO v_head, v_current
      FROM dracap_append(p_count, p_streams, p_expected, p_event_ids, p_event_streams,
                         p_versions, p_types, p_schema_versions, p_namespaces, p_actor,
                         p_correlation_ids, p_causation_ids, p_recorded_at, p_payloads,
                         p_channel) AS a;
    PERFORM dracap_project(v_head - p_count, p_ops);
    RETURN QUERY SELECT v_head, v_current;
END
$$
