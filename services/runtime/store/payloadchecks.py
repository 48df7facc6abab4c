"""The database's checks of every payload and writer, generated from the catalog.

No application login may commit a payload the fold cannot decode (issue 24): a stored
event that does not decode would stop every reader of the log. The fold decodes a
stored payload with msgspec into its catalog type (:func:`events.eventcodec.decode_stored`),
so the database checks each payload against that same type, described by
``msgspec.inspect`` — the catalog is the one home, this module only translates it:

* a PL/pgSQL function per event type, ``dracap_check_<tag>(p jsonb) RETURNS text``:
  NULL when msgspec would decode ``p`` into the type, else where and why not
  (``$.claim.spec.devices.requests[0].exactly.count: expected an integer``). Every field
  of every struct, list and dict is checked the way msgspec reads it (strings, integers
  as the server prints them, booleans, literals, RFC 3339 datetimes —
  ``dracap_is_datetime`` —, quantities — ``dracap_is_quantity`` —, tags, required
  fields, ``null`` only where the type allows it); unknown fields are ignored, as the
  tolerant decoder does. A type whose tree holds free JSON (``Any``: opaque driver
  parameters, tolerations) is also refused nested deeper than :data:`DEPTH_LIMIT` levels;
* ``dracap_payload_error(type, schema_version, payload)``: the dispatcher the append
  function calls; an unknown type, or a schema version other than the current one, is
  refused too;
* the writers of :mod:`events.writers`: ``dracap_writers_of(type)``, the writer an actor
  speaks as (``dracap_writer_of(actor)``) and the writers each service kind's login may
  act as (``dracap_jobs_of(kind)``);
* ``dracap_catalog_digest()``: the SHA-256 of what all of it was generated from.

``python -m services.runtime.store.payloadchecks`` writes the result to
``migrations/functions/dracap_payload_checks.sql``, which migration 0012 installs (a
later change of the catalog regenerates the file and adds a migration that installs it
again, naming the new digest: ``tests/unit/test_payload_checks.py`` fails until both
are done, and ``tests/integration/test_payload_checks.py`` compares the database's
verdicts with msgspec's). A construct this translation does not know (a new kind of
type, a constraint) raises :class:`UnsupportedTypeError` instead of being skipped.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

import msgspec
import msgspec.inspect as mi

from events import catalog, writers
from events.quantities import Quantity

__all__ = [
    "DEPTH_LIMIT",
    "FILE",
    "UnsupportedTypeError",
    "check_function",
    "digest",
    "generate",
]

#: Payloads holding free JSON are refused nested deeper than this many levels (objects
#: and arrays): admission refuses manifests deeper than 64, and no reader recurses past
#: the bound without limit.
DEPTH_LIMIT: Final = 100
#: The generated file, relative to the repository (and to the installed packages).
FILE: Final = Path("migrations") / "functions" / "dracap_payload_checks.sql"

#: Quantities dracap writes in canonical form: this shape, at most 100 characters long, is
#: valid without a look at the size limits (100 digits and the largest suffix stay far
#: below them). (Not ``{1,100}``: a bounded repetition costs PostgreSQL's regex engine
#: far more than a length.)
_SHORT_QUANTITY: Final = r"^-?[0-9]+([KMGTPE]i|[numkMGTPE])?$"
_SHORT_LENGTH: Final = 100
#: The same within a JSON path, which cannot count characters: at most 20 digits.
_SHORT_QUANTITY_PATH: Final = r"^-?[0-9]{1,20}([KMGTPE]i|[numkMGTPE])?$"


class UnsupportedTypeError(TypeError):
    """The catalog uses a type (or a constraint) the translation does not know."""


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _json_literal(value: str) -> str:
    return _literal(msgspec.json.encode(value).decode()) + "::jsonb"


class _Emitter:
    """Statements of one function, with its variables."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.jsonb: list[str] = []
        self.ints: list[str] = []
        self.records: list[str] = []
        self.free_json = False

    def var(self, kind: list[str], prefix: str) -> str:
        name = f"{prefix}{len(kind) + 1}"
        kind.append(name)
        return name

    def emit(self, depth: int, line: str) -> None:
        self.lines.append("    " * depth + line)

    def fail(self, depth: int, condition: str, path: Sequence[str], message: str) -> None:
        self.emit(depth, f"IF {condition} THEN")
        self.emit(depth + 1, f"RETURN {' || '.join([*path, _literal(': ' + message)])};")
        self.emit(depth, "END IF;")


def _unwrap(t: mi.Type) -> tuple[mi.Type, bool]:
    """The type inside ``T | None``, and whether ``None`` is allowed."""
    if not isinstance(t, mi.UnionType):
        return t, False
    others = [x for x in t.types if not isinstance(x, mi.NoneType)]
    if len(others) != 1 or len(others) == len(t.types):
        raise UnsupportedTypeError(f"union {t!r}: only `T | None` is translated")
    return others[0], True


def _scalar(t: mi.Type, x: str) -> tuple[str, str] | None:
    """(condition true when ``x`` is a present, non-null value of the wrong shape,
    message) for a scalar type; None for a container."""
    if isinstance(t, mi.StrType):
        if (t.min_length, t.max_length, t.pattern) != (None, None, None):
            raise UnsupportedTypeError(f"string constraints {t!r}")
        return f"jsonb_typeof({x}) <> 'string'", "expected a string"
    if isinstance(t, mi.IntType):
        if (t.gt, t.ge, t.lt, t.le, t.multiple_of) != (None,) * 5:
            raise UnsupportedTypeError(f"integer constraints {t!r}")
        # an integer as the server prints it: a number of scale 0 (no fraction, no "5.0")
        return (
            f"(CASE WHEN jsonb_typeof({x}) = 'number' THEN scale({x}::numeric) <> 0 "
            f"WHEN {x} IS NULL THEN NULL ELSE true END)",
            "expected an integer",
        )
    if isinstance(t, mi.BoolType):
        return f"jsonb_typeof({x}) <> 'boolean'", "expected true or false"
    if isinstance(t, mi.LiteralType):
        if not all(isinstance(v, str) for v in t.values):
            raise UnsupportedTypeError(f"literal {t!r}: only strings are translated")
        values = [str(v) for v in t.values]
        choices = ", ".join(_json_literal(v) for v in values)
        return f"{x} NOT IN ({choices})", "expected one of " + ", ".join(values)
    if isinstance(t, mi.DateTimeType):
        if t.tz is not None:
            raise UnsupportedTypeError(f"datetime constraint {t!r}")
        return (
            f"(jsonb_typeof({x}) <> 'string' OR NOT dracap_is_datetime({x} #>> '{{}}'))",
            "expected an RFC 3339 date-time",
        )
    if isinstance(t, mi.CustomType):
        if t.cls is not Quantity:
            raise UnsupportedTypeError(f"custom type {t.cls!r}")
        text = f"({x} #>> '{{}}')"
        short = f"({text} ~ {_literal(_SHORT_QUANTITY)} AND length({text}) <= {_SHORT_LENGTH})"
        return (
            f"(jsonb_typeof({x}) <> 'string' OR NOT ({short} OR dracap_is_quantity({text})))",
            "expected a quantity (such as 10Gi or 500m)",
        )
    return None


def _container(t: mi.Type) -> str:
    if isinstance(t, mi.StructType):
        if t.array_like:
            raise UnsupportedTypeError(f"array-like struct {t.cls!r}")
        return "object"
    if isinstance(t, mi.DictType):
        if not isinstance(t.key_type, mi.StrType):
            raise UnsupportedTypeError(f"dict keys {t.key_type!r}")
        return "object"
    if isinstance(t, mi.ListType):
        return "array"
    raise UnsupportedTypeError(f"type {t!r}")


Check = tuple[str, list[str], str]  # (condition of a wrong value, path, message)


def _scalar_check(t: mi.Type, x: str, path: list[str], *, required: bool) -> Check | None:
    """The check of a value of scalar type ``t`` (or free JSON) as one condition; None
    for a container. ``x`` is a jsonb expression, SQL NULL when the field is absent."""
    t, nullable = _unwrap(t)
    x = f"({x})" if not x.isidentifier() else x
    if isinstance(t, mi.AnyType):
        return (f"{x} IS NULL" if required else "false"), path, "required"
    scalar = _scalar(t, x)
    if scalar is None:
        return None
    bad, message = scalar
    if nullable:
        bad = f"(jsonb_typeof({x}) <> 'null' AND {bad})"
    return (f"coalesce({bad}, true)" if required else bad), path, message


def _checks(out: _Emitter, depth: int, checks: list[Check]) -> None:
    """The checks, as one condition first: the fields are told apart only on failure."""
    checks = [c for c in checks if c[0] != "false"]
    grouped = len(checks) > 1
    if grouped:
        out.emit(depth, f"IF {checks[0][0]}")
        for condition, _, _ in checks[1:]:
            out.emit(depth, f"   OR {condition}")
        out.emit(depth, "THEN")
    for condition, path, message in checks:
        out.fail(depth + grouped, condition, path, message)
    if grouped:
        out.emit(depth, "END IF;")


def _value(
    out: _Emitter, depth: int, t: mi.Type, x: str, path: list[str], *, required: bool
) -> None:
    """Statements that return an error when the value ``x`` (a jsonb expression, SQL NULL
    when the field is absent) is not what msgspec decodes as ``t``."""
    scalar = _scalar_check(t, x, path, required=required)
    if isinstance(_unwrap(t)[0], mi.AnyType):
        out.free_json = True
    if scalar is not None:
        _checks(out, depth, [scalar])
        return
    t, nullable = _unwrap(t)
    x = f"({x})" if not x.isidentifier() else x
    kind = _container(t)
    message = f"expected an {kind}" if kind == "object" else "expected an array"
    var = out.var(out.jsonb, "v")
    out.emit(depth, f"{var} := {x};")
    if required and not nullable:
        out.fail(depth, f"{var} IS NULL OR jsonb_typeof({var}) <> '{kind}'", path, message)
        _contents(out, depth, t, var, path)
        return
    out.emit(depth, f"IF jsonb_typeof({var}) = '{kind}' THEN")
    _contents(out, depth + 1, t, var, path)
    if nullable:
        other = f"jsonb_typeof({var}) <> 'null'"
        if required:
            other = f"coalesce({other}, true)"
    else:
        other = f"{var} IS NOT NULL"
    out.emit(depth, f"ELSIF {other} THEN")
    out.emit(depth + 1, f"RETURN {' || '.join([*path, _literal(': ' + message)])};")
    out.emit(depth, "END IF;")


def _fields(out: _Emitter, depth: int, t: mi.StructType, var: str, path: list[str]) -> None:
    """The fields of struct ``t`` in ``var``: its scalars in one condition, then the rest."""
    scalars: list[Check] = []
    containers: list[tuple[mi.Field, str, list[str]]] = []
    for field in t.fields:
        child = f"{var}->{_literal(field.encode_name)}"
        sub = _extend(path, "." + field.encode_name)
        check = _scalar_check(field.type, child, sub, required=field.required)
        if isinstance(_unwrap(field.type)[0], mi.AnyType):
            out.free_json = True
        if check is None:
            containers.append((field, child, sub))
        else:
            scalars.append(check)
    _checks(out, depth, scalars)
    for field, child, sub in containers:
        _value(out, depth, field.type, child, sub, required=field.required)


def _contents(out: _Emitter, depth: int, t: mi.Type, var: str, path: list[str]) -> None:
    """Statements checking the contents of the container ``var`` (its shape checked)."""
    if isinstance(t, mi.StructType):
        if t.tag_field is not None:
            tag = str(t.tag)
            out.fail(
                depth,
                f"{var} ? {_literal(t.tag_field)} AND {var}->{_literal(t.tag_field)} "
                f"<> {_json_literal(tag)}",
                [*path, _literal("." + t.tag_field)],
                f"expected {tag!r}",
            )
        _fields(out, depth, t, var, path)
        return
    if isinstance(t, mi.ListType):
        if isinstance(_unwrap(t.item_type)[0], mi.AnyType):
            out.free_json = True
            return
        index = out.var(out.ints, "i")
        out.emit(depth, f"FOR {index} IN 0 .. jsonb_array_length({var}) - 1 LOOP")
        sub = [*path, f"'[' || {index} || ']'"]
        _value(out, depth + 1, t.item_type, f"{var}->{index}", sub, required=True)
        out.emit(depth, "END LOOP;")
        return
    assert isinstance(t, mi.DictType)
    if isinstance(_unwrap(t.value_type)[0], mi.AnyType):
        out.free_json = True
        return
    entry = out.var(out.records, "r")
    quick = _all_values_fine(t.value_type)
    if quick is not None:  # no loop (a query per dict) unless a value needs a closer look
        out.emit(depth, f"IF jsonb_path_exists({var}, {_literal(quick)}) THEN")
        depth += 1
    out.emit(depth, f"FOR {entry} IN SELECT key, value FROM jsonb_each({var}) LOOP")
    sub = [*path, f"'[' || quote_literal({entry}.key) || ']'"]
    _value(out, depth + 1, t.value_type, f"{entry}.value", sub, required=True)
    out.emit(depth, "END LOOP;")
    if quick is not None:
        out.emit(depth - 1, "END IF;")


def _all_values_fine(t: mi.Type) -> str | None:
    """A JSON path that finds the values of a dict that are *not* plainly of scalar type
    ``t`` (strings, booleans, short canonical quantities); None for other types."""
    if isinstance(t, mi.StrType):
        test = '@.type() != "string"'
    elif isinstance(t, mi.BoolType):
        test = '@.type() != "boolean"'
    elif isinstance(t, mi.CustomType) and t.cls is Quantity:
        test = f'@.type() != "string" || !(@ like_regex "{_SHORT_QUANTITY_PATH}")'
    else:
        return None
    return f"strict $.* ? ({test})"


def _extend(path: list[str], text: str) -> list[str]:
    """``path`` followed by the literal ``text`` (merged into a literal last part)."""
    last = path[-1]
    if last.startswith("'") and last.endswith("'") and "||" not in last:
        return [*path[:-1], _literal(last[1:-1].replace("''", "'") + text)]
    return [*path, _literal(text)]


def function_name(tag: str) -> str:
    """The check function of an event type: ``dracap_check_<tag with _ for .>``."""
    return "dracap_check_" + tag.replace(".", "_")


def check_function(tag: str, cls: type[catalog.Event]) -> str:
    """``CREATE OR REPLACE FUNCTION`` of the check of one event type."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    out = _Emitter()
    out.fail(1, "jsonb_typeof(p) IS DISTINCT FROM 'object'", ["'$'"], "expected an object")
    out.fail(
        1, f"p->'type' IS DISTINCT FROM {_json_literal(tag)}", ["'$.type'"], f"expected {tag!r}"
    )
    body = out.lines
    out.lines = []
    _fields(out, 1, info, "p", ["'$'"])
    fields, out.lines = out.lines, body
    if out.free_json:
        out.fail(
            1,
            f"jsonb_path_exists(p, 'strict $.**{{{DEPTH_LIMIT + 1}}}')",
            ["'$'"],
            f"nested deeper than {DEPTH_LIMIT} levels",
        )
    declarations = [
        *(f"    {v} jsonb;" for v in out.jsonb),
        *(f"    {v} int;" for v in out.ints),
        *(f"    {v} record;" for v in out.records),
    ]
    return "\n".join(
        [
            f"CREATE OR REPLACE FUNCTION {function_name(tag)}(p jsonb) RETURNS text",
            "LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$",
            *(["DECLARE", *declarations] if declarations else []),
            "BEGIN",
            *out.lines,
            *fields,
            "    RETURN NULL;",
            "END",
            "$$;",
        ]
    )


def _dispatcher() -> str:
    """``dracap_payload_error``: a PL/pgSQL ``CASE`` over the types, hot ones first (each
    branch's expression is prepared only once a call reaches it, so a transaction that
    appends one claim event pays for one or two comparisons, not for all the types)."""
    hot = {tag: rank for rank, tag in enumerate(_HOT)}
    tags = sorted(catalog.EVENT_TYPES, key=lambda tag: (hot.get(tag, len(hot)), tag))
    cases = [
        f"    WHEN {_literal(tag)} THEN\n"
        f"        IF p_version IS DISTINCT FROM {catalog.EVENT_TYPES[tag].SCHEMA_VERSION} THEN\n"
        f"            RETURN 'schema version ' || coalesce(p_version::text, 'null') "
        f"|| ' is not the current one ({catalog.EVENT_TYPES[tag].SCHEMA_VERSION})';\n"
        f"        END IF;\n"
        f"        RETURN {function_name(tag)}(p);"
        for tag in tags
    ]
    return "\n".join(
        [
            "CREATE OR REPLACE FUNCTION dracap_payload_error(p_type text, p_version int, "
            "p jsonb) RETURNS text",
            "LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$",
            "BEGIN",
            "    CASE p_type",
            *cases,
            "    ELSE",
            "        RETURN 'not an event type of the catalog';",
            "    END CASE;",
            "END",
            "$$;",
        ]
    )


#: The event types most appends carry, tried first.
_HOT: Final = (
    "claims.admitted",
    "claims.submitted",
    "reservation.capacity_reserved",
    "reservation.allocation_bound",
    "enforcement.limit_applied",
    "reclamation.capacity_released",
    "enforcement.limit_removed",
    "reclamation.release_requested",
)


def _array(values: Sequence[str]) -> str:
    return "ARRAY[" + ", ".join(_literal(v) for v in sorted(values)) + "]::text[]"


#: Which writers each service kind's login may act as (:data:`events.writers.JOBS`).
Jobs = Mapping[str, frozenset[writers.Writer]]


def _writers(jobs: Jobs) -> str:
    cases = "\n".join(
        f"        WHEN {_literal(tag)} THEN {_array(sorted(who))}"
        for tag, who in sorted(writers.WRITERS.items())
    )
    actors = "\n".join(
        f"        WHEN p_actor ~ {_literal(pattern)} THEN {_literal(writer)}"
        for writer, pattern in writers.ACTOR_PATTERNS.items()
    )
    kinds = "\n".join(
        f"        WHEN {_literal(kind)} THEN {_array(sorted(who))}"
        for kind, who in sorted(jobs.items())
    )
    return f"""CREATE OR REPLACE FUNCTION dracap_writers_of(p_type text) RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE p_type
{cases}
        ELSE ARRAY[]::text[] END
$$;

CREATE OR REPLACE FUNCTION dracap_writer_of(p_actor text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
{actors}
        END
$$;

CREATE OR REPLACE FUNCTION dracap_jobs_of(p_kind text) RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE p_kind
{kinds}
        END
$$;

CREATE OR REPLACE FUNCTION dracap_job_kinds() RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT {_array(sorted(jobs))}
$$;"""


def _body(jobs: Jobs | None) -> str:
    checks = [check_function(tag, cls) for tag, cls in sorted(catalog.EVENT_TYPES.items())]
    return "\n\n".join([*checks, _dispatcher(), _writers(writers.JOBS if jobs is None else jobs)])


def digest(jobs: Jobs | None = None) -> str:
    """SHA-256 (hex) of the generated checks and writers (all but the digest itself):
    it changes whenever the catalog, the writers or the translation do."""
    return hashlib.sha256(_body(jobs).encode()).hexdigest()


def generate(jobs: Jobs | None = None) -> str:
    """The whole file: every check, the dispatcher, the writers and the digest.

    ``jobs``: other logins' jobs than today's :data:`events.writers.JOBS` (a migration
    that installs, or restores, the jobs of its own revision)."""
    body = _body(jobs)
    sha = hashlib.sha256(body.encode()).hexdigest()
    head = (
        "-- GENERATED by `python -m services.runtime.store.payloadchecks` from events/catalog.py\n"
        "-- and events/writers.py: do not edit (see that module's docstring).\n"
        f"-- catalog digest: {sha}\n"
        "-- (No percent signs in this file: the migration driver reads them as placeholders.)"
    )
    tail = (
        "CREATE OR REPLACE FUNCTION dracap_catalog_digest() RETURNS text\n"
        "LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$\n"
        f"    SELECT {_literal(sha)}::text\n"
        "$$;"
    )
    text = "\n\n".join([head, body, tail]) + "\n"
    assert "%" not in text, "the migration driver reads percent signs as placeholders"
    return text


def function_names() -> list[str]:
    """Every function the generated file creates, with its argument types (to drop them)."""
    return [
        *(f"{function_name(tag)}(jsonb)" for tag in sorted(catalog.EVENT_TYPES)),
        "dracap_payload_error(text, int, jsonb)",
        "dracap_writers_of(text)",
        "dracap_writer_of(text)",
        "dracap_jobs_of(text)",
        "dracap_job_kinds()",
        "dracap_catalog_digest()",
    ]


def main(argv: Sequence[str] = ()) -> int:
    """Write the generated file under the directory ``argv[0]`` (default: here)."""
    root = Path(argv[0]) if argv else Path()
    (root / FILE).write_text(generate())
    print(f"wrote {root / FILE} (catalog digest {digest()})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
