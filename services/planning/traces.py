"""Traces of claim arrivals for ``dracap simulate``: the file format and a synthetic generator.

A trace is a list of claims, each with an arrival time, a size and a duration. Two
file formats, told apart by the extension (``.csv``; ``.ndjson`` / ``.jsonl``) or else
by the first non-blank character (``{``: NDJSON):

CSV, with a header naming the columns (any order; ``id`` is optional)::

    arrival,size,duration,id
    0.0,10Gi,300,train-1
    0.5,4Gi,,infer-1

NDJSON, one object per line::

    {"arrival": 0.0, "size": "10Gi", "duration": 300, "id": "train-1"}
    {"arrival": 0.5, "size": 4294967296, "duration": null}

* ``arrival``: seconds from the start of the trace, a finite number >= 0. Lines need
  not be sorted: claims are simulated in arrival order (file order among equals).
* ``size``: what the claim asks of one device: a Kubernetes quantity (``10Gi``) or a
  whole number of bytes, > 0.
* ``duration``: seconds the claim holds its capacity once served, > 0; empty, ``null``
  or ``inf``: it never leaves (a cluster filling up).
* ``id``: a name for the claim (default: its line number).

A line that breaks a rule is refused with one line naming the file, the line, the
field and the rule (:class:`TraceError`, exit code 2).

:func:`synthetic` generates a trace: sizes drawn from a weighted list, Poisson
arrivals at a rate, exponential (or endless) durations, all from a seed.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec

from events.errors import QuantityError
from events.quantities import Format, Quantity
from services.exitcodes import CommandError, ExitCode

__all__ = [
    "SizeChoice",
    "SyntheticSpec",
    "TraceClaim",
    "TraceError",
    "format_bytes",
    "load_trace",
    "parse_bytes",
    "parse_sizes",
    "parse_trace",
    "rate_for_load",
    "synthetic",
    "write_trace",
]

_FIELDS: Final = ("arrival", "size", "duration", "id")
_NANO: Final = 10**9


class TraceError(CommandError):
    """A trace or generator setting that breaks a rule; names where and which rule."""

    def __init__(self, where: str, field: str, rule: str) -> None:
        super().__init__(f"{where}: {field}: {rule}", ExitCode.BAD_INPUT)
        self.where = where
        self.field = field
        self.rule = rule


class TraceClaim(msgspec.Struct, frozen=True, gc=False):
    """One claim of a trace: arrival (s), size (bytes), duration (s, ``None``: forever)."""

    arrival: float
    size: int
    duration: float | None
    id: str


def parse_bytes(text: str) -> int:
    """Bytes of a quantity (``40Gi``, ``1.5G``, ``1024``), rounded up; raises QuantityError."""
    return Quantity.parse(text.strip()).value()


def format_bytes(size: int) -> str:
    """``size`` bytes as a quantity (``10Gi``), canonical."""
    return Quantity(size * _NANO, Format.BINARY_SI).canonical()


# --- reading ----------------------------------------------------------------------------


def load_trace(path: str | Path) -> list[TraceClaim]:
    """The claims of a trace file, sorted by arrival; :class:`TraceError` on bad input."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(name, "file", f"cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise TraceError(name, "file", "must be UTF-8 text") from None
    return parse_trace(text, name)


def parse_trace(text: str, source: str = "trace") -> list[TraceClaim]:
    """The claims of a trace's text (format as in the module doc), sorted by arrival."""
    lowered = source.lower()
    if lowered.endswith((".ndjson", ".jsonl")):
        ndjson = True
    elif lowered.endswith(".csv"):
        ndjson = False
    else:
        ndjson = text.lstrip().startswith("{")
    claims = _ndjson(text, source) if ndjson else _csv(text, source)
    if not claims:
        raise TraceError(source, "file", "holds no claim")
    claims.sort(key=lambda c: c.arrival)  # stable: file order among equal arrivals
    return claims


def _ndjson(text: str, source: str) -> list[TraceClaim]:
    claims = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(where, "line", f"must be one JSON object ({exc.msg})") from None
        if not isinstance(doc, dict):
            raise TraceError(where, "line", "must be one JSON object")
        unknown = sorted(set(doc) - set(_FIELDS))
        if unknown:
            raise TraceError(where, unknown[0], f"unknown field; known: {', '.join(_FIELDS)}")
        claims.append(_claim(doc, where, str(number)))
    return claims


def _csv(text: str, source: str) -> list[TraceClaim]:
    rows = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    claims = []
    for row in rows:
        number = rows.line_num
        if not any(cell.strip() for cell in row):
            continue
        where = f"{source}:{number}"
        if header is None:
            header = [cell.strip() for cell in row]
            for name in header:
                if name not in _FIELDS:
                    raise TraceError(
                        where, name or "header", f"unknown column; known: {', '.join(_FIELDS)}"
                    )
            for name in ("arrival", "size"):
                if name not in header:
                    raise TraceError(where, "header", f"needs a column {name!r}")
            continue
        if len(row) != len(header):
            raise TraceError(where, "line", f"has {len(row)} cells, the header {len(header)}")
        doc = {name: cell.strip() for name, cell in zip(header, row, strict=True)}
        claims.append(_claim(doc, where, str(number)))
    return claims


def _claim(doc: dict[str, Any], where: str, default_id: str) -> TraceClaim:
    return TraceClaim(
        arrival=_arrival(doc.get("arrival"), where),
        size=_size(doc.get("size"), where),
        duration=_duration(doc.get("duration"), where),
        id=str(doc.get("id") or default_id),
    )


def _number(value: Any, where: str, field: str) -> float:
    if isinstance(value, bool):
        raise TraceError(where, field, f"must be a number of seconds (got {value!r})")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TraceError(where, field, f"must be a number of seconds (got {value!r})") from None


def _arrival(value: Any, where: str) -> float:
    if value is None or value == "":
        raise TraceError(where, "arrival", "is required")
    arrival = _number(value, where, "arrival")
    if not math.isfinite(arrival) or arrival < 0:
        raise TraceError(where, "arrival", f"must be a finite number >= 0 (got {value!r})")
    return arrival


def _size(value: Any, where: str) -> int:
    rule = "must be a quantity like 10Gi or a whole number of bytes, > 0"
    if value is None or value == "":
        raise TraceError(where, "size", "is required")
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise TraceError(where, "size", f"{rule} (got {value!r})")
    if isinstance(value, int | float):
        size = int(value)
    elif isinstance(value, str):
        try:
            size = parse_bytes(value)
        except QuantityError as exc:
            raise TraceError(where, "size", f"{rule} ({exc})") from None
    else:
        raise TraceError(where, "size", f"{rule} (got {value!r})")
    if size <= 0:
        raise TraceError(where, "size", f"{rule} (got {value!r})")
    return size


def _duration(value: Any, where: str) -> float | None:
    if value is None or value == "" or value == "inf":
        return None
    duration = _number(value, where, "duration")
    if math.isinf(duration) and duration > 0:
        return None
    if not math.isfinite(duration) or duration <= 0:
        raise TraceError(
            where, "duration", f"must be a number of seconds > 0, or empty (got {value!r})"
        )
    return duration


def write_trace(claims: Iterable[TraceClaim], path: str | Path) -> None:
    """Write ``claims`` as CSV or NDJSON (by the extension, as :func:`load_trace` reads)."""
    lowered = str(path).lower()
    lines: list[str] = []
    if lowered.endswith((".ndjson", ".jsonl")):
        for c in claims:
            doc = {"arrival": c.arrival, "size": format_bytes(c.size), "duration": c.duration}
            lines.append(json.dumps({**doc, "id": c.id}))
    else:
        lines.append("arrival,size,duration,id")
        for c in claims:
            duration = "" if c.duration is None else repr(c.duration)
            lines.append(f"{c.arrival!r},{format_bytes(c.size)},{duration},{c.id}")
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


# --- the synthetic generator ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SizeChoice:
    """One size of the synthetic distribution and its weight."""

    size: int
    weight: float


def parse_sizes(text: str, where: str = "--sizes") -> tuple[SizeChoice, ...]:
    """``4Gi:30,8Gi:25,40Gi:5`` (size:weight, weight 1 when left out) as choices."""
    choices = []
    for i, part in enumerate(p.strip() for p in text.split(",")):
        if not part:
            continue
        size_text, _, weight_text = part.partition(":")
        try:
            size = parse_bytes(size_text)
        except QuantityError as exc:
            raise TraceError(where, f"entry {i}", f"size must be a quantity ({exc})") from None
        try:
            weight = float(weight_text) if weight_text else 1.0
        except ValueError:
            weight = -1.0
        if size <= 0 or not math.isfinite(weight) or weight <= 0:
            raise TraceError(
                where, f"entry {i}", f"must be SIZE[:WEIGHT], size > 0 and weight > 0 ({part!r})"
            )
        choices.append(SizeChoice(size, weight))
    if not choices:
        raise TraceError(where, "sizes", "needs at least one SIZE[:WEIGHT]")
    return tuple(choices)


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """A synthetic trace: ``claims`` arrivals, Poisson at ``rate`` per second.

    ``mean_duration``: seconds, exponentially distributed (``None``: claims never leave).
    """

    claims: int
    sizes: tuple[SizeChoice, ...]
    rate: float
    mean_duration: float | None
    seed: int = 1

    def mean_size(self) -> float:
        total = sum(c.weight for c in self.sizes)
        return sum(c.size * c.weight for c in self.sizes) / total

    def median_size(self) -> int:
        total = sum(c.weight for c in self.sizes)
        seen = 0.0
        for choice in sorted(self.sizes, key=lambda c: c.size):
            seen += choice.weight
            if seen >= total / 2:
                return choice.size
        return self.sizes[-1].size


def rate_for_load(
    load: float, capacity: int, sizes: Sequence[SizeChoice], duration: float
) -> float:
    """The arrival rate at which claims ask on average for ``load`` x ``capacity``."""
    total = sum(c.weight for c in sizes)
    mean = sum(c.size * c.weight for c in sizes) / total
    return load * capacity / (mean * duration)


def synthetic(spec: SyntheticSpec) -> list[TraceClaim]:
    """The claims of ``spec``, reproducible from its seed."""
    if spec.claims <= 0:
        raise TraceError("synthetic trace", "claims", "must be > 0")
    if not math.isfinite(spec.rate) or spec.rate <= 0:
        raise TraceError("synthetic trace", "rate", "must be a number of claims per second > 0")
    mean = spec.mean_duration
    if mean is not None and (not math.isfinite(mean) or mean <= 0):
        raise TraceError("synthetic trace", "duration", "must be a number of seconds > 0")
    rng = random.Random(spec.seed)
    sizes = [c.size for c in spec.sizes]
    weights = [c.weight for c in spec.sizes]
    drawn = rng.choices(sizes, weights, k=spec.claims)
    claims = []
    now = 0.0
    for i in range(spec.claims):
        now += rng.expovariate(spec.rate)
        duration = rng.expovariate(1.0 / mean) if mean is not None else None
        claims.append(TraceClaim(now, drawn[i], duration, f"c{i}"))
    return claims
