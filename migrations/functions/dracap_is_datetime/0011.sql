-- Whether msgspec decodes the text as a datetime (RFC 3339, as events.catalog's fields
-- are read back): YYYY-MM-DD, 'T', 't' or a space, hh:mm:ss, optional fraction digits,
-- then 'Z', 'z', +hh:mm, -hh:mm or nothing; a real date of year 1 to 9999, hours below
-- 24, minutes and seconds below 60, offsets below 24 hours. The payload check of every
-- datetime field (migration 0011).
CREATE OR REPLACE FUNCTION dracap_is_datetime(p text) RETURNS boolean
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT CASE WHEN p ~ '^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[Tt ]([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])?$'
        THEN substr(p, 1, 4) <> '0000'
         AND substr(p, 9, 2)::int <= extract(day FROM make_date(substr(p, 1, 4)::int,
                                                              substr(p, 6, 2)::int, 1)
                                                    + interval '1 month - 1 day')
        ELSE false END
$$
