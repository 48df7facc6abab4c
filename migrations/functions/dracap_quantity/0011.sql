-- Kubernetes quantities in the database: the grammar and value of events.quantities.
--
-- dracap_is_quantity(text): whether Quantity.parse accepts the text (the payload check
-- of every quantity field; migration 0011). It mirrors events/quantities.py: an optional
-- sign, digits with an optional decimal point (at least one digit), then one binary
-- suffix (Ki..Ei), one decimal suffix (n u m k M G T P E) or none, or an exponent
-- (e/E, optionally signed digits, at most 9 significant); a decimal value may have at
-- most 1000 digits counted in nanos (binary values are capped instead). It is stricter
-- than the parser in one way only: a text longer than 1100 characters is refused (the
-- canonical text of any value dracap writes is shorter).
--
-- dracap_quantity(text): the exact value of a valid quantity text, in base units, as the
-- parser computes it: rounded up, away from zero, to a whole number of nanos; a binary
-- value capped at 2^63 - 1. The guards of migration 0011 take totals and amounts from it.
-- (No percent signs in this file: the migration driver reads them as placeholders.)

CREATE OR REPLACE FUNCTION dracap_quantity_parts(p text) RETURNS text[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT regexp_match(p, '^([+-]?)([0-9]*)(?:\.([0-9]*))?(?:([KMGTPE]i|[numkMGTPE]?)|[eE]([+-]?[0-9]+))$')
$$;

-- The power of ten that multiplies the digits (whole and fraction run together) to give
-- nanos, and the binary shift: {power10, shift}; NULL for a text that is no quantity.
CREATE OR REPLACE FUNCTION dracap_quantity_scale(m text[]) RETURNS int[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT ARRAY[
        CASE WHEN m[5] IS NOT NULL THEN m[5]::int
             ELSE CASE coalesce(m[4], '') WHEN 'n' THEN -9 WHEN 'u' THEN -6 WHEN 'm' THEN -3
                  WHEN 'k' THEN 3 WHEN 'M' THEN 6 WHEN 'G' THEN 9 WHEN 'T' THEN 12
                  WHEN 'P' THEN 15 WHEN 'E' THEN 18 ELSE 0 END
        END + 9 - length(coalesce(m[3], '')),
        CASE coalesce(m[4], '') WHEN 'Ki' THEN 10 WHEN 'Mi' THEN 20 WHEN 'Gi' THEN 30
             WHEN 'Ti' THEN 40 WHEN 'Pi' THEN 50 WHEN 'Ei' THEN 60 ELSE 0 END]
$$;

CREATE OR REPLACE FUNCTION dracap_is_quantity(p text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    m text[];
    d text;
    s int[];
BEGIN
    IF length(p) > 1100 THEN
        RETURN false;
    END IF;
    m := dracap_quantity_parts(p);
    IF m IS NULL OR coalesce(m[2], '') || coalesce(m[3], '') = '' THEN
        RETURN false;  -- not the grammar, or no digit at all
    END IF;
    IF m[5] IS NOT NULL AND length(ltrim(ltrim(m[5], '+-'), '0')) > 9 THEN
        RETURN false;  -- exponent out of range
    END IF;
    d := ltrim(coalesce(m[2], '') || coalesce(m[3], ''), '0');
    s := dracap_quantity_scale(m);
    -- a decimal value of more than 1000 digits of nanos is too large; binary ones are capped
    RETURN d = '' OR s[2] > 0 OR length(d) + s[1] <= 1000;
END
$$;

CREATE OR REPLACE FUNCTION dracap_quantity(p text) RETURNS numeric
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    m text[];
    d text;
    s int[];
    nanos numeric;
    cap constant numeric := 9223372036854775807;
BEGIN
    -- the canonical shape dracap writes: an integer and a suffix, exact without rounding
    -- ([0-9]+ and a length: a bounded repetition costs the regex engine far more)
    m := regexp_match(p, '^([+-]?[0-9]+)([KMGTPE]i|[numkMGTPE])?$');
    IF m IS NOT NULL AND length(p) <= 100 THEN
        CASE coalesce(m[2], '')
        WHEN '' THEN RETURN trim_scale(m[1]::numeric);
        WHEN 'n' THEN RETURN trim_scale(m[1]::numeric * 0.000000001);
        WHEN 'u' THEN RETURN trim_scale(m[1]::numeric * 0.000001);
        WHEN 'm' THEN RETURN trim_scale(m[1]::numeric * 0.001);
        WHEN 'k' THEN RETURN m[1]::numeric * 1000;
        WHEN 'M' THEN RETURN m[1]::numeric * 1000000;
        WHEN 'G' THEN RETURN m[1]::numeric * 1000000000;
        WHEN 'T' THEN RETURN m[1]::numeric * 1000000000000;
        WHEN 'P' THEN RETURN m[1]::numeric * 1000000000000000;
        WHEN 'E' THEN RETURN m[1]::numeric * 1000000000000000000;
        ELSE  -- binary: capped at 2^63 - 1
            nanos := abs(m[1]::numeric) * CASE m[2] WHEN 'Ki' THEN 1024 WHEN 'Mi' THEN 1048576
                     WHEN 'Gi' THEN 1073741824 WHEN 'Ti' THEN 1099511627776
                     WHEN 'Pi' THEN 1125899906842624 ELSE 1152921504606846976 END;
            RETURN sign(m[1]::numeric) * least(nanos, cap);
        END CASE;
    END IF;
    m := dracap_quantity_parts(p);
    d := ltrim(coalesce(m[2], '') || coalesce(m[3], ''), '0');
    s := dracap_quantity_scale(m);
    IF d = '' THEN
        RETURN 0;
    ELSIF s[1] >= 0 THEN
        IF length(d) + s[1] > 1000 THEN
            nanos := cap * 1000000000;  -- binary (a decimal one is no quantity): capped below
        ELSE
            nanos := (d || repeat('0', s[1]))::numeric * (1::bigint << s[2]);
        END IF;
    ELSIF -s[1] >= length(d) + 19 THEN
        nanos := 1;  -- below one nano (2^60 < 10^19): rounded up
    ELSE  -- exact: numeric division would round to its own scale first
        nanos := d::numeric * (1::bigint << s[2]);
        m[4] := ('1' || repeat('0', -s[1]));
        nanos := div(nanos, m[4]::numeric) + CASE WHEN mod(nanos, m[4]::numeric) = 0 THEN 0 ELSE 1 END;
    END IF;
    IF s[2] > 0 THEN
        nanos := least(nanos, cap * 1000000000);
    END IF;
    RETURN trim_scale(CASE WHEN m[1] = '-' THEN -nanos ELSE nanos END * 0.000000001);
END
$$
