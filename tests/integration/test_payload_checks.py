"""The database refuses exactly the payloads the fold cannot decode (migration 0011).

Differential tests against a real PostgreSQL: for every event type of the catalog, a
payload with every optional field set (so every struct, list and dict is visited) is
mutated at every path — each value replaced by each of a set of wrong ones, or removed —
and the database's verdict (``dracap_payload_error``) is compared with msgspec's
(:func:`events.eventcodec.decode_stored`) on the JSON exactly as the server stores it. The
database may be stricter in two ways only, on purpose: the ``type`` tag is required
(dracap always writes it) and quantities must be strings (dracap writes them so). Never
the other way: that is the finding (an undecodable event stops every reader).

Quantities and datetimes are compared on random texts with :mod:`events.quantities` and
msgspec; nesting deeper than the bound is refused; the database's checks are the ones
generated from today's catalog.
"""

from __future__ import annotations

import datetime
import json
import random
from collections.abc import Iterator
from decimal import Decimal, localcontext
from typing import Any

import asyncpg
import msgspec
import msgspec.inspect as mi

from events import catalog
from events.errors import CatalogError, QuantityError
from events.eventcodec import decode_stored
from events.quantities import Quantity
from services.runtime.store import payloadchecks


def example(t: mi.Type) -> Any:
    """A JSON value of type ``t`` with every optional part present."""
    if isinstance(t, mi.UnionType):
        return example(next(x for x in t.types if not isinstance(x, mi.NoneType)))
    if isinstance(t, mi.StrType):
        return "s"
    if isinstance(t, mi.IntType):
        return 3
    if isinstance(t, mi.BoolType):
        return True
    if isinstance(t, mi.LiteralType):
        return t.values[-1]
    if isinstance(t, mi.DateTimeType):
        return "2024-05-06T07:08:09.123Z"
    if isinstance(t, mi.CustomType):
        return "1536Mi"
    if isinstance(t, mi.AnyType):
        return {"a": [1, {"b": None}]}
    if isinstance(t, mi.ListType):
        return [example(t.item_type), example(t.item_type)]
    if isinstance(t, mi.DictType):
        return {"k1": example(t.value_type)}
    assert isinstance(t, mi.StructType), t
    out = {f.encode_name: example(f.type) for f in t.fields}
    if t.tag_field:
        out[t.tag_field] = t.tag
    return out


WRONG: tuple[Any, ...] = (
    None, 1, 1.5, -7, 10**30, "x", True, [], {}, [1], {"a": 1}, "10Gi", "1e", "1" * 1200,
    "2024-01-01T00:00:00Z", "2024-02-30T00:00:00Z",
)  # fmt: skip
REMOVED = object()


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths(item, (*prefix, index))


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy = json.loads(json.dumps(value))
    parent = copy
    for part in path[:-1]:
        parent = parent[part]
    if new is REMOVED:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return copy


def cases() -> Iterator[tuple[str, Any]]:
    for tag, cls in sorted(catalog.EVENT_TYPES.items()):
        if cls.SCHEMA_VERSION != 1:
            continue  # the same checks; its example is built the same way below
        base = example(mi.type_info(cls))
        yield tag, base
        for path in paths(base):
            for new in (*WRONG, REMOVED):
                if path or new is not REMOVED:
                    yield tag, replaced(base, path, new)


def _decodes(text: str, tag: str) -> bool:
    try:
        decode_stored(text.encode(), tag, catalog.SCHEMA_VERSIONS[tag])
    except CatalogError:
        return False
    return True


async def test_the_database_refuses_every_payload_msgspec_refuses(
    db: asyncpg.Connection,
) -> None:
    rows = list(cases())
    for tag, cls in catalog.EVENT_TYPES.items():  # the one of schema version 2 too
        if cls.SCHEMA_VERSION != 1:
            base = example(mi.type_info(cls))
            rows += [(tag, replaced(base, p, w)) for p in paths(base) for w in WRONG]
    verdicts = await db.fetch(
        "SELECT u.t, u.p::text, dracap_payload_error(u.t, u.v, u.p) "
        "FROM unnest($1::text[], $2::int[], $3::jsonb[]) AS u(t, v, p)",
        [t for t, _ in rows],
        [catalog.SCHEMA_VERSIONS[t] for t, _ in rows],
        [json.dumps(p).encode() for _, p in rows],
    )
    looser, stricter = [], []
    for tag, stored, error in verdicts:
        decodes = _decodes(stored, tag)
        if error is None and not decodes:
            looser.append((tag, stored))
        if error is not None and decodes and "$.type" not in error and "quantity" not in error:
            stricter.append((tag, stored, error))
    assert not looser, f"{len(looser)} undecodable payloads accepted, e.g. {looser[:3]}"
    assert not stricter, f"{len(stricter)} decodable payloads refused, e.g. {stricter[:3]}"
    assert len(verdicts) > 10_000


async def test_the_findings_examples_name_the_field(db: asyncpg.Connection) -> None:
    level = {"type": "enforcement.limit_applied", "share_id": "x", "node": "n", "level": 5,
             "actual": {}}  # fmt: skip
    error = await db.fetchval(
        "SELECT dracap_payload_error('enforcement.limit_applied', 1, $1::jsonb)",
        json.dumps(level).encode(),
    )
    assert error == "$.level: expected one of hard, none, soft"
    claim = example(mi.type_info(catalog.ClaimSubmitted))
    claim["claim"]["spec"]["devices"]["requests"][1]["firstAvailable"][0]["capacity"]["requests"][
        "k1"
    ] = ["10Gi"]
    error = await db.fetchval(
        "SELECT dracap_payload_error('claims.submitted', 1, $1::jsonb)", json.dumps(claim).encode()
    )
    assert error == (
        "$.claim.spec.devices.requests[1].firstAvailable[0].capacity.requests['k1']: "
        "expected a quantity (such as 10Gi or 500m)"
    )
    unknown = await db.fetchval("SELECT dracap_payload_error('claims.nope', 1, '{}'::jsonb)")
    old = await db.fetchval(
        "SELECT dracap_payload_error('reservation.capacity_reserved', 1, '{}'::jsonb)"
    )
    assert unknown == "not an event type of the catalog"
    assert old == "schema version 1 is not the current one (2)"


def _nested(levels: int) -> str:
    """JSON text of ``levels`` objects and arrays around a 1 (deeper than json recurses)."""
    opening = "".join("[" if i % 2 else '{"x":' for i in range(levels))
    closing = "".join("]" if i % 2 else "}" for i in reversed(range(levels)))
    return opening + "1" + closing


async def test_free_json_nested_deeper_than_the_bound_is_refused(db: asyncpg.Connection) -> None:
    """Opaque driver parameters are free JSON: a claim nested 2,450 levels deep (finding 7)
    would make every recursive reader fail; the database keeps it out."""
    claim = example(mi.type_info(catalog.ClaimSubmitted))
    limit = payloadchecks.DEPTH_LIMIT
    claim["claim"]["spec"]["devices"]["config"][0]["opaque"]["parameters"] = "DEEP"
    text = json.dumps(claim)
    outer = 7  # containers around the parameters: event, claim, spec, devices, config[], ...
    check = "SELECT dracap_payload_error('claims.submitted', 1, $1::jsonb)"
    fits = await db.fetchval(check, text.replace('"DEEP"', _nested(limit - outer)).encode())
    deep = await db.fetchval(check, text.replace('"DEEP"', _nested(2450)).encode())
    one_more = await db.fetchval(check, text.replace('"DEEP"', _nested(limit - outer + 1)).encode())
    assert fits is None
    assert one_more == deep == f"$: nested deeper than {limit} levels"


def _quantity_texts(rng: random.Random) -> Iterator[str]:
    digits = "0123456789"
    for _ in range(5000):
        text = rng.choice(["", "+", "-"])
        text += "".join(rng.choice(digits) for _ in range(rng.choice([0, 1, 2, 5, 20])))
        if rng.random() < 0.4:
            text += "." + "".join(rng.choice(digits) for _ in range(rng.choice([0, 1, 9, 30])))
        roll = rng.random()
        if roll < 0.3:
            text += rng.choice(["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"])
        elif roll < 0.6:
            text += rng.choice(["n", "u", "m", "", "k", "M", "G", "T", "P", "E", "e", "i", " "])
        elif roll < 0.8:
            text += rng.choice("eE") + rng.choice(["", "+", "-"])
            text += "".join(rng.choice(digits) for _ in range(rng.choice([0, 1, 3, 9, 10])))
        yield text
    yield from ("1" + "0" * 990, "1" + "0" * 991, "0." + "0" * 900 + "1", "1e-999999999")
    yield from ("1e+999999999", "9999999999999999999999Ei", "1e-30Ei", ".5", "5.", ".", "Ki")


async def test_quantities_are_read_as_events_quantities_reads_them(
    db: asyncpg.Connection,
) -> None:
    texts = list(_quantity_texts(random.Random(24)))
    rows = await db.fetch(
        "SELECT t, dracap_is_quantity(t), CASE WHEN dracap_is_quantity(t) THEN dracap_quantity(t) "
        "END FROM unnest($1::text[]) t",
        texts,
    )
    with localcontext() as exact:
        exact.prec = 5000
        for text, valid, value in rows:
            try:
                nanos: int | None = Quantity.parse(text).nanos
            except QuantityError:
                nanos = None
            assert valid == (nanos is not None), text
            if nanos is not None:
                assert value == Decimal(nanos) * Decimal("1e-9"), text


class _When(msgspec.Struct):
    at: datetime.datetime


async def test_datetimes_are_read_as_msgspec_reads_them(db: asyncpg.Connection) -> None:
    rng = random.Random(6)
    texts = [
        f"{rng.choice(['0000', '0001', '2024', '2023', '9999'])}-"
        f"{rng.choice(['01', '02', '12', '13', '00'])}-"
        f"{rng.choice(['01', '28', '29', '30', '31', '32'])}"
        f"{rng.choice('Tt _')}{rng.choice(['00', '23', '24'])}:{rng.choice(['00', '59', '60'])}:"
        f"{rng.choice(['00', '59', '60'])}{rng.choice(['', '.1', '.123456', '.1234567', '.'])}"
        f"{rng.choice(['', 'Z', 'z', '+05:30', '-00:00', '+24:00', '+5:30'])}"
        for _ in range(5000)
    ]
    rows = await db.fetch("SELECT t, dracap_is_datetime(t) FROM unnest($1::text[]) t", texts)
    for text, valid in rows:
        try:
            msgspec.json.decode(msgspec.json.encode({"at": text}), type=_When)
            decodes = True
        except msgspec.ValidationError:
            decodes = False
        assert valid == decodes, text


async def test_the_database_holds_the_checks_of_todays_catalog(db: asyncpg.Connection) -> None:
    assert await db.fetchval("SELECT dracap_catalog_digest()") == payloadchecks.digest()
