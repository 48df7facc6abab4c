"""Exact Kubernetes ``resource.Quantity`` values.

A :class:`Quantity` is the pure-Python twin of ``k8s.io/apimachinery/pkg/api/resource``
``Quantity``: it parses the same strings, compares and adds the same way, and prints the
same canonical text (``"1.5Gi"`` becomes ``"1536Mi"``, ``"0.5"`` becomes ``"500m"``).

Design
------
* **Integer nanos.** The value is stored as one Python ``int`` counting units of
  ``1e-9`` (``Quantity.nanos``). Kubernetes never keeps precision below nano: parsing
  rounds a finer non-zero value *up, away from zero*, so ``"0.9n"`` is ``1n`` and
  ``"-3.001n"`` is ``-4n``. An integer count of nanos therefore represents every parsed
  quantity exactly, and sums, differences, comparisons and integer products stay exact.
* **No floats.** Binary floats cannot hold ``0.1`` or ``2**63 - 1`` exactly, so two
  quantities that Kubernetes treats as equal could compare unequal, or a capacity could
  be over-allocated by a rounding error. Floats appear only in
  :meth:`Quantity.as_approximate_float`, for display and metrics.
* **Format is presentation only.** Like upstream, a quantity remembers whether it was
  written with a binary suffix (``Ki``), a decimal suffix (``k``) or an exponent
  (``e3``) and uses that family when printed. Equality, ordering and hashing look at the
  value alone: ``Quantity.parse("1Ki") == Quantity.from_int(1024)``.
* **Immutable and cached.** Instances cannot be changed after construction, so
  :func:`parse_quantity` keeps a small LRU cache of parsed strings; hot loops that parse
  the same capacities over and over pay for the scan once.

Upstream rules reproduced here (``quantity.go`` / ``suffix.go``):

* grammar: optional ``+``/``-``, digits with an optional decimal point (``"5."`` and
  ``".5"`` are fine), then one suffix: ``Ki Mi Gi Ti Pi Ei``, ``n u m k M G T P E`` or
  nothing, or ``e``/``E`` followed by an optionally signed integer. ``"1E"`` is exa,
  ``"1e"`` is an error, ``"1e3.5"`` is an error;
* a binary suffix gives ``BinarySI``, an exponent gives ``DecimalExponent``, anything
  else ``DecimalSI``; a non-zero ``BinarySI`` value smaller than one becomes
  ``DecimalSI``;
* a ``BinarySI`` value is capped, silently, at ``2**63 - 1`` in magnitude (upstream's
  ``maxAllowed``); decimal values are not capped;
* printing: ``BinarySI`` uses the largest binary suffix that divides the value, but
  falls back to decimal printing when the value is fractional or below 1024 in
  magnitude; decimal printing picks the largest power-of-1000 exponent that leaves no
  fractional digits; ``DecimalSI`` beyond ``E`` (``10**18``) switches to exponent
  notation (``"1e21"``), as current upstream does.

Deliberate differences from the Go code, all on inputs no real manifest uses:

* a number needs at least one digit: upstream's scanner reads ``"."``, ``"+"``,
  ``"Ki"`` or ``"e3"`` as zero, this module rejects them;
* decimal values must stay below about ``1e990`` (1000 digits of nanos) and exponents
  below ``1e9``, so that a short hostile string such as ``"1e999999999"`` cannot make
  the process build a gigantic integer (upstream keeps it as a scaled decimal); such
  strings raise :class:`QuantityError`, oversized ``BinarySI`` values are capped as
  usual;
* ``BinarySI`` values of ``1024**7`` and more (reachable only through arithmetic) print
  with ``Ei`` and a larger number, where upstream drops the suffix.
"""

from __future__ import annotations

import enum
import functools
import re
import typing

from events.errors import QuantityError

__all__ = ["Format", "Quantity", "parse_quantity"]


class Format(enum.StrEnum):
    """The suffix family a quantity was written in, and is printed in."""

    BINARY_SI = "BinarySI"
    DECIMAL_SI = "DecimalSI"
    DECIMAL_EXPONENT = "DecimalExponent"


_NANO: typing.Final = 10**9
_MILLI_IN_NANOS: typing.Final = 10**6
_MAX_INT64: typing.Final = 2**63 - 1
# Upstream's maxAllowed: the largest BinarySI magnitude, in nanos.
_MAX_BINARY_NANOS: typing.Final = _MAX_INT64 * _NANO
# Largest number of decimal digits a parsed value may have, counted in nanos.
_MAX_NANO_DIGITS: typing.Final = 1000
# Largest number of significant digits in an exponent ("1e123456789" is the limit).
_MAX_EXPONENT_DIGITS: typing.Final = 9

_DECIMAL_EXPONENTS: typing.Final[dict[str, int]] = {
    "n": -9,
    "u": -6,
    "m": -3,
    "": 0,
    "k": 3,
    "M": 6,
    "G": 9,
    "T": 12,
    "P": 15,
    "E": 18,
}
_BINARY_SHIFTS: typing.Final[dict[str, int]] = {
    "Ki": 10,
    "Mi": 20,
    "Gi": 30,
    "Ti": 40,
    "Pi": 50,
    "Ei": 60,
}
_DECIMAL_SUFFIXES: typing.Final[dict[int, str]] = {e: s for s, e in _DECIMAL_EXPONENTS.items()}
_BINARY_SUFFIXES: typing.Final[tuple[str, ...]] = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")

# sign, integer digits, fraction digits, named suffix, exponent. The character classes
# of neighbouring groups are disjoint, so matching never backtracks more than one step.
_QUANTITY_RE: typing.Final = re.compile(
    r"([+-]?)([0-9]*)(?:\.([0-9]*))?(?:([KMGTPE]i|[numkMGTPE]?)|[eE]([+-]?[0-9]+))"
)


@typing.final
class Quantity:
    """An exact Kubernetes quantity: an integer count of nanos plus a print format."""

    __slots__ = ("format", "nanos")

    nanos: int
    format: Format

    def __init__(self, nanos: int, format: Format = Format.DECIMAL_SI) -> None:
        """Build a quantity worth ``nanos * 1e-9`` that prints in ``format``."""
        if not isinstance(nanos, int) or isinstance(nanos, bool):
            raise TypeError(f"nanos must be an int, not {type(nanos).__name__}")
        object.__setattr__(self, "nanos", nanos)
        object.__setattr__(self, "format", Format(format))

    # -- construction -------------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> Quantity:
        """Parse a Kubernetes quantity string; raise :class:`QuantityError` if invalid."""
        return parse_quantity(text)

    @classmethod
    def from_int(cls, value: int, format: Format = Format.DECIMAL_SI) -> Quantity:
        """A quantity of ``value`` whole base units (like Go ``NewQuantity``)."""
        return cls(value * _NANO, format)

    # -- immutability ------------------------------------------------------------

    if not typing.TYPE_CHECKING:  # hidden from mypy so it still flags unknown attributes

        def __setattr__(self, name: str, value: object) -> None:
            raise AttributeError(f"Quantity is immutable: cannot set {name!r}")

        def __delattr__(self, name: str) -> None:
            raise AttributeError(f"Quantity is immutable: cannot delete {name!r}")

    def __reduce__(self) -> tuple[type[Quantity], tuple[int, Format]]:
        return (Quantity, (self.nanos, self.format))

    def __copy__(self) -> Quantity:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> Quantity:
        return self

    # -- accessors ---------------------------------------------------------------

    def value(self) -> int:
        """Whole base units, rounded up away from zero (Go ``Value()``)."""
        return _ceil_away(self.nanos, _NANO)

    def milli_value(self) -> int:
        """Thousandths of a base unit, rounded up away from zero (Go ``MilliValue()``)."""
        return _ceil_away(self.nanos, _MILLI_IN_NANOS)

    def as_approximate_float(self) -> float:
        """The value as the nearest float; for display and metrics only."""
        try:
            return self.nanos / _NANO  # int / int is correctly rounded
        except OverflowError:
            return float("inf") if self.nanos > 0 else float("-inf")

    def is_integer(self) -> bool:
        """Whether the value is a whole number of base units."""
        return self.nanos % _NANO == 0

    def sign(self) -> int:
        """-1, 0 or 1."""
        return (self.nanos > 0) - (self.nanos < 0)

    def compare_to(self, other: Quantity) -> int:
        """-1, 0 or 1 comparing values; the formats are ignored (Go ``Cmp``)."""
        return (self.nanos > other.nanos) - (self.nanos < other.nanos)

    # -- printing ----------------------------------------------------------------

    def canonical(self) -> str:
        """The canonical text, exactly as Kubernetes prints it (Go ``String()``)."""
        return _canonical(self.nanos, self.format)

    __str__ = canonical

    def __repr__(self) -> str:
        return f"Quantity({self.canonical()!r})"

    # -- comparison --------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Quantity):
            return self.nanos == other.nanos
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.nanos)

    def __lt__(self, other: Quantity) -> bool:
        if isinstance(other, Quantity):
            return self.nanos < other.nanos
        return NotImplemented

    def __le__(self, other: Quantity) -> bool:
        if isinstance(other, Quantity):
            return self.nanos <= other.nanos
        return NotImplemented

    def __gt__(self, other: Quantity) -> bool:
        if isinstance(other, Quantity):
            return self.nanos > other.nanos
        return NotImplemented

    def __ge__(self, other: Quantity) -> bool:
        if isinstance(other, Quantity):
            return self.nanos >= other.nanos
        return NotImplemented

    def __bool__(self) -> bool:
        return self.nanos != 0

    # -- arithmetic --------------------------------------------------------------

    def __add__(self, other: Quantity) -> Quantity:
        """Exact sum in ``self``'s format (a zero ``self`` takes ``other``'s, as Go)."""
        if not isinstance(other, Quantity):
            return NotImplemented
        fmt = self.format if self.nanos else other.format
        return Quantity(self.nanos + other.nanos, fmt)

    def __sub__(self, other: Quantity) -> Quantity:
        """Exact difference in ``self``'s format (a zero ``self`` takes ``other``'s)."""
        if not isinstance(other, Quantity):
            return NotImplemented
        fmt = self.format if self.nanos else other.format
        return Quantity(self.nanos - other.nanos, fmt)

    def __neg__(self) -> Quantity:
        return Quantity(-self.nanos, self.format)

    def __mul__(self, other: int) -> Quantity:
        """Exact product with an integer, keeping the format."""
        if not isinstance(other, int) or isinstance(other, bool):
            return NotImplemented
        return Quantity(self.nanos * other, self.format)

    __rmul__ = __mul__


def _ceil_away(nanos: int, unit: int) -> int:
    """``nanos / unit`` rounded away from zero."""
    if nanos >= 0:
        return -(-nanos // unit)
    return nanos // unit


@functools.lru_cache(maxsize=1024)
def _canonical(nanos: int, fmt: Format) -> str:
    """Upstream ``CanonicalizeBytes`` on a nanos count."""
    if nanos == 0:
        return "0"
    sign = "-" if nanos < 0 else ""
    magnitude = -nanos if nanos < 0 else nanos
    if fmt is Format.BINARY_SI and magnitude >= 1024 * _NANO and magnitude % _NANO == 0:
        units = magnitude // _NANO
        power = 0
        while power < 6 and units & 1023 == 0:
            units >>= 10
            power += 1
        return f"{sign}{units}{_BINARY_SUFFIXES[power]}"
    # Decimal printing; BinarySI lands here when fractional or below 1024.
    exponent = -9
    while magnitude % 1000 == 0:
        magnitude //= 1000
        exponent += 3
    if fmt is not Format.DECIMAL_EXPONENT and exponent <= 18:
        return f"{sign}{magnitude}{_DECIMAL_SUFFIXES[exponent]}"
    if exponent == 0:
        return f"{sign}{magnitude}"
    return f"{sign}{magnitude}e{exponent}"


@functools.lru_cache(maxsize=4096)
def parse_quantity(text: str) -> Quantity:
    """Parse a Kubernetes quantity string; raise :class:`QuantityError` if invalid."""
    if not isinstance(text, str):
        raise TypeError(f"quantity must be a str, not {type(text).__name__}")
    if text.isascii() and text.isdigit():
        # Fast path for plain integers such as "8" or "1024".
        digits = text.lstrip("0")
        if len(digits) + 9 > _MAX_NANO_DIGITS:
            raise QuantityError(text, "value is too large")
        return Quantity(int(digits or "0") * _NANO, Format.DECIMAL_SI)

    match = _QUANTITY_RE.fullmatch(text)
    if match is None:
        raise QuantityError(text, _explain(text))
    sign, whole, fraction, named, exponent_text = match.groups()
    fraction = fraction or ""
    if not whole and not fraction:
        raise QuantityError(text, "a quantity needs at least one digit")

    shift = 0  # binary exponent
    if exponent_text is not None:
        fmt = Format.DECIMAL_EXPONENT
        exp_digits = exponent_text.lstrip("+-").lstrip("0")
        if len(exp_digits) > _MAX_EXPONENT_DIGITS:
            raise QuantityError(text, "exponent is out of range")
        exponent = int(exponent_text)
    elif named in _BINARY_SHIFTS:
        fmt = Format.BINARY_SI
        shift = _BINARY_SHIFTS[named]
        exponent = 0
    else:
        fmt = Format.DECIMAL_SI
        exponent = _DECIMAL_EXPONENTS[named]

    magnitude = _scaled_nanos(whole + fraction, exponent + 9 - len(fraction), shift)
    if magnitude is None:
        if fmt is not Format.BINARY_SI:
            raise QuantityError(text, "value is too large")
        magnitude = _MAX_BINARY_NANOS
    if fmt is Format.BINARY_SI:
        if magnitude > _MAX_BINARY_NANOS:
            magnitude = _MAX_BINARY_NANOS
        elif 0 < magnitude < _NANO:
            fmt = Format.DECIMAL_SI  # upstream: below one, binary would only confuse
    return Quantity(-magnitude if sign == "-" else magnitude, fmt)


def _scaled_nanos(digits: str, power10: int, shift: int) -> int | None:
    """``ceil(int(digits) * 2**shift * 10**power10)``; ``None`` if too large.

    Works on arbitrarily long digit strings without building huge integers: when
    ``power10`` is negative, the digits below ``10**-(power10 + shift)`` only decide
    whether to round up, because together they are worth less than the spacing between
    the values the kept digits can produce.
    """
    digits = digits.lstrip("0")
    if not digits:
        return 0
    if power10 >= 0:
        if len(digits) + power10 > _MAX_NANO_DIGITS:
            return None
        scale: int = 10**power10
        return (int(digits) << shift) * scale
    dropped = max(0, -power10 - shift)
    kept = len(digits) - dropped
    if kept > _MAX_NANO_DIGITS + shift:
        return None
    head = int(digits[:kept]) if kept > 0 else 0
    has_tail = dropped > 0 and digits[max(kept, 0) :].strip("0") != ""
    divisor: int = 10 ** (-power10 - dropped)
    whole, rest = divmod(head << shift, divisor)
    return whole + 1 if rest or has_tail else whole


def _explain(text: str) -> str:
    """A short reason why ``text`` does not match the quantity grammar."""
    if not text:
        return "empty string is not a quantity"
    if text != text.strip():
        return "leading or trailing whitespace is not allowed"
    return (
        "must be a signed decimal number followed by one of Ki Mi Gi Ti Pi Ei, "
        "n u m k M G T P E, or an exponent such as e3"
    )
