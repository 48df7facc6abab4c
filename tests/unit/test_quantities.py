"""Tests for events.quantities: Kubernetes resource.Quantity semantics.

Most expected values come from the tables in upstream
k8s.io/apimachinery/pkg/api/resource/quantity_test.go (TestQuantityParse,
TestQuantityString, TestQuantityParseEmit, TestNewSet, TestMilliNewSet, ...).
"""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.errors import QuantityError
from events.quantities import Format, Quantity, parse_quantity

NANO = 10**9
MAX_INT64 = 2**63 - 1

BIN = Format.BINARY_SI
DEC = Format.DECIMAL_SI
EXP = Format.DECIMAL_EXPONENT


def q(text: str) -> Quantity:
    return Quantity.parse(text)


# (input, value in nanos, format after parsing): upstream TestQuantityParse.
PARSE_CASES: list[tuple[str, int, Format]] = [
    ("0", 0, DEC),
    ("0n", 0, DEC),
    ("0u", 0, DEC),
    ("0m", 0, DEC),
    ("0Ki", 0, BIN),
    ("0k", 0, DEC),
    ("0Mi", 0, BIN),
    ("0M", 0, DEC),
    ("0Gi", 0, BIN),
    ("0G", 0, DEC),
    ("0Ti", 0, BIN),
    ("0T", 0, DEC),
    ("1", NANO, DEC),
    ("1Ki", 1024 * NANO, BIN),
    ("8Ki", 8 * 1024 * NANO, BIN),
    ("7Mi", 7 * 2**20 * NANO, BIN),
    ("6Gi", 6 * 2**30 * NANO, BIN),
    ("5Ti", 5 * 2**40 * NANO, BIN),
    ("4Pi", 4 * 2**50 * NANO, BIN),
    ("3Ei", 3 * 2**60 * NANO, BIN),
    ("10Ti", 10 * 2**40 * NANO, BIN),
    ("100Ti", 100 * 2**40 * NANO, BIN),
    ("5n", 5, DEC),
    ("4u", 4_000, DEC),
    ("3m", 3_000_000, DEC),
    ("9", 9 * NANO, DEC),
    ("8k", 8 * 10**3 * NANO, DEC),
    ("50k", 5 * 10**4 * NANO, DEC),
    ("7M", 7 * 10**6 * NANO, DEC),
    ("6G", 6 * 10**9 * NANO, DEC),
    ("5T", 5 * 10**12 * NANO, DEC),
    ("40T", 4 * 10**13 * NANO, DEC),
    ("300T", 3 * 10**14 * NANO, DEC),
    ("2P", 2 * 10**15 * NANO, DEC),
    ("1E", 10**18 * NANO, DEC),
    ("1E-3", 10**6, EXP),
    ("1e3", 10**3 * NANO, EXP),
    ("1E6", 10**6 * NANO, EXP),
    ("1e9", 10**9 * NANO, EXP),
    ("1E12", 10**12 * NANO, EXP),
    ("1e15", 10**15 * NANO, EXP),
    ("1E18", 10**18 * NANO, EXP),
    ("1e14", 10**14 * NANO, EXP),
    ("1e13", 10**13 * NANO, EXP),
    ("100.035k", 100035 * NANO, DEC),
    ("0.001", 10**6, DEC),
    ("0.0005k", 5 * 10**8, DEC),
    ("0.005", 5 * 10**6, DEC),
    ("0.05", 5 * 10**7, DEC),
    ("0.5", 5 * 10**8, DEC),
    ("0.00050k", 5 * 10**8, DEC),
    ("0.00500", 5 * 10**6, DEC),
    ("0.05000", 5 * 10**7, DEC),
    ("0.50000", 5 * 10**8, DEC),
    ("0.5e0", 5 * 10**8, EXP),
    ("0.5e-1", 5 * 10**7, EXP),
    ("0.5e-2", 5 * 10**6, EXP),
    ("10.035M", 10035 * 10**3 * NANO, DEC),
    ("1.2e3", 1200 * NANO, EXP),
    ("1.3E+6", 13 * 10**5 * NANO, EXP),
    ("1.40e9", 14 * 10**8 * NANO, EXP),
    ("1.53E12", 153 * 10**10 * NANO, EXP),
    ("1.6e15", 16 * 10**14 * NANO, EXP),
    ("1.7E18", 17 * 10**17 * NANO, EXP),
    ("9.01", 901 * 10**7, DEC),
    ("8.1k", 8100 * NANO, DEC),
    ("7.123456M", 7123456 * NANO, DEC),
    ("6.987654321G", 6987654321 * NANO, DEC),
    ("5.444T", 5444 * 10**9 * NANO, DEC),
    ("40.1T", 401 * 10**11 * NANO, DEC),
    ("300.2T", 3002 * 10**11 * NANO, DEC),
    ("2.5P", 25 * 10**14 * NANO, DEC),
    ("1.01E", 101 * 10**16 * NANO, DEC),
    # Things that saturate or round up to a whole nano.
    ("3.001n", 4, DEC),
    ("1.1E-9", 2, EXP),
    ("0.0000000001", 1, DEC),
    ("0.0000000005", 1, DEC),
    ("0.00000000050", 1, DEC),
    ("0.5e-9", 1, EXP),
    ("0.9n", 1, DEC),
    ("0.00000012345", 124, DEC),
    ("0.00000012354", 124, DEC),
    ("9Ei", MAX_INT64 * NANO, BIN),
    ("9223372036854775807Ki", MAX_INT64 * NANO, BIN),
    ("12E", 12 * 10**18 * NANO, DEC),
    # Fractional binary values.
    ("100.035Ki", 10243584 * 10**7, BIN),
    ("0.5Mi", 2**19 * NANO, BIN),
    ("0.05Gi", 53687091200000000, BIN),
    ("0.025Ti", 27487790694400000000, BIN),
    # "Things written by trolls".
    ("0.000000000001Ki", 2, DEC),  # rounds up and becomes DecimalSI
    (".001", 10**6, DEC),
    (".0001k", 10**8, DEC),
    ("1.", NANO, DEC),
    ("1.G", 10**9 * NANO, DEC),
    # Not in the upstream table, same rules.
    ("007", 7 * NANO, DEC),
    ("1e0", NANO, EXP),
    ("1e-0", NANO, EXP),
    ("1e+03", 1000 * NANO, EXP),
    ("1e-100", 1, EXP),
    ("0.5Ki", 512 * NANO, BIN),
    ("18446744073709551616", 2**64 * NANO, DEC),  # decimal values are not capped
    ("1" + "0" * 30 + "Ki", MAX_INT64 * NANO, BIN),
    ("0." + "0" * 3000 + "1", 1, DEC),
    ("1." + "0" * 3000, NANO, DEC),
    ("0" * 5000 + "1", NANO, DEC),
    ("0" * 5000 + "1.5", 15 * 10**8, DEC),
]


@pytest.mark.parametrize(("text", "nanos", "fmt"), PARSE_CASES)
def test_parse_value_and_format(text: str, nanos: int, fmt: Format) -> None:
    got = q(text)
    assert got.nanos == nanos
    assert got.format is fmt


@pytest.mark.parametrize(("text", "nanos", "fmt"), PARSE_CASES)
def test_parse_signed(text: str, nanos: int, fmt: Format) -> None:
    negative = q("-" + text)
    assert negative.nanos == -nanos
    assert negative.format is fmt
    positive = q("+" + text)
    assert positive.nanos == nanos
    assert positive.format is fmt


# (input, canonical): upstream TestQuantityString (expect and alternate) and
# TestQuantityParseEmit, plus the examples from the Quantity doc comment.
CANONICAL_CASES: list[tuple[str, str]] = [
    ("1Ki", "1Ki"),
    ("1Mi", "1Mi"),
    ("1Gi", "1Gi"),
    ("1024Mi", "1Gi"),
    ("307200Ki", "300Mi"),
    ("6Ki", "6Ki"),
    ("1025024Mi", "1001Gi"),
    ("1024Gi", "1Ti"),
    ("1.5Gi", "1536Mi"),
    ("1000M", "1G"),
    ("0.001T", "1G"),
    ("1000u", "1m"),
    ("80m", "80m"),
    ("1.08", "1080m"),
    ("1080000000n", "1080m"),
    ("300M", "300M"),
    ("1T", "1T"),
    ("1E", "1E"),
    ("1000E", "1e21"),
    ("5000E", "5e21"),
    ("1000000E", "1e24"),
    ("1234567M", "1234567M"),
    ("3k", "3k"),
    ("1025", "1025"),
    ("0", "0"),
    ("00", "0"),
    ("0Ki", "0"),
    ("-0", "0"),
    ("1e9", "1e9"),
    (".001e12", "1e9"),
    ("1e-3", "1e-3"),
    ("0.001e0", "1e-3"),
    ("1e-9", "1e-9"),
    ("1000e-12", "1e-9"),
    ("80e-3", "80e-3"),
    ("300e6", "300e6"),
    ("1e12", "1e12"),
    ("3e3", "3e3"),
    ("1e0", "1"),
    ("1.5e3", "1500"),
    ("1n", "1n"),
    ("80n", "80n"),
    ("1080n", "1080n"),
    ("1u", "1u"),
    ("80u", "80u"),
    ("1080u", "1080u"),
    (".001Ki", "1024m"),
    (".000001Ki", "1024u"),
    (".000000001Ki", "1024n"),
    (".000000000001Ki", "2n"),
    ("0.5", "500m"),
    ("1.5", "1500m"),
    ("1500000", "1500k"),
    ("1500", "1500"),
    ("1024", "1024"),  # a DecimalSI value keeps decimal suffixes
    ("1k", "1k"),
    ("0.5Ki", "512"),  # BinarySI below 1024 prints as DecimalSI
    ("1023", "1023"),
    ("1.5Ki", "1536"),
    ("100.035Ki", "102435840m"),  # fractional BinarySI prints as DecimalSI
    ("9Ei", "9223372036854775807"),
    ("8Ei", "9223372036854775807"),
    ("7Ei", "7Ei"),
    ("1048576Ki", "1Gi"),
    ("1.01E", "1010P"),
    ("12E", "12E"),
    ("100.035k", "100035"),
    ("1.3E+6", "1300e3"),
    ("18446744073709551616", "18446744073709551616"),
]


@pytest.mark.parametrize(("text", "expected"), CANONICAL_CASES)
def test_canonical(text: str, expected: str) -> None:
    parsed = q(text)
    assert parsed.canonical() == expected
    assert str(parsed) == expected
    # Canonical text is a fixed point and keeps the value.
    again = q(expected)
    assert again.canonical() == expected
    assert again == parsed


@pytest.mark.parametrize(("text", "expected"), CANONICAL_CASES)
def test_canonical_negative(text: str, expected: str) -> None:
    if text.startswith("-"):
        return
    if expected == "0":
        assert q("-" + text).canonical() == "0"  # never "-0"
    else:
        assert q("-" + text).canonical() == "-" + expected


@pytest.mark.parametrize(
    ("nanos", "fmt", "expected"),
    [
        # upstream TestQuantityString, built from values rather than text
        (2**30 * NANO, BIN, "1Gi"),
        (5 * NANO, BIN, "5"),
        (500 * 10**6, BIN, "500m"),
        (1234567 * 10**6, BIN, "1234567m"),
        (1025 * NANO, BIN, "1025"),
        (1500 * NANO, BIN, "1500"),
        (5000 * NANO, BIN, "5000"),
        (1536 * NANO, BIN, "1536"),
        (3 * 2**19 * NANO, BIN, "1536Ki"),
        (1536 * NANO + 1, BIN, "1536000000001n"),
        (1024 * NANO, BIN, "1Ki"),
        (-1024 * NANO, BIN, "-1Ki"),
        (-1023 * NANO, BIN, "-1023"),
        (2**63 * NANO, BIN, "8Ei"),
        (2**70 * NANO, BIN, "1024Ei"),
        (0, BIN, "0"),
        (0, EXP, "0"),
        (10**9 * NANO, DEC, "1G"),
        (10**21 * NANO, DEC, "1e21"),
        (1, EXP, "1e-9"),
        (80 * 10**6, EXP, "80e-3"),
        (300 * 10**6 * NANO, EXP, "300e6"),
        # upstream TestNewSet / TestMilliNewSet
        (1000 * NANO, DEC, "1k"),
        (1234000 * NANO, DEC, "1234k"),
        (2**20 * NANO, BIN, "1Mi"),
        (10**6, DEC, "1m"),
        (1024 * 10**6, BIN, "1024m"),
        (2**20 * 10**6, BIN, "1048576m"),
        (1000 * NANO, EXP, "1e3"),
    ],
)
def test_canonical_from_nanos(nanos: int, fmt: Format, expected: str) -> None:
    assert Quantity(nanos, fmt).canonical() == expected


INVALID = [
    # upstream TestQuantityParse invalid list
    "1.1.M",
    "1+1.0M",
    "0.1mi",
    "0.1am",
    "aoeu",
    ".5i",
    "1i",
    "-3.01i",
    "-3.01e-",
    " 1",
    "1 ",
    "Non-Numeric",
    # and more
    "",
    " ",
    "1.2.3",
    "1kb",
    "1K",
    "1KI",
    "1ki",
    "1e",
    "1E+",
    "1e3.5",
    "1e3k",
    "1ee3",
    "1Ke3",
    "1m-3",
    "1Mii",
    "--1",
    "+-1",
    "1-",
    "1_000",
    "0x10",
    "1,5",
    "\u0661",  # Arabic-Indic digit one: only ASCII digits are digits
    "1\n",
    "\t1",
    "inf",
    "NaN",
    # no digit at all (upstream's scanner reads these as zero)
    "Ki",
    "m",
    ".",
    "-",
    "+",
    "-.",
    "e3",
    ".Ki",
    # out of the supported range
    "1e1234567890",
    "1" * 1200,
    "1e2000",
]


@pytest.mark.parametrize("text", INVALID)
def test_invalid(text: str) -> None:
    with pytest.raises(QuantityError) as info:
        q(text)
    assert info.value.text == text
    assert repr(text) in str(info.value)
    assert info.value.reason


def test_invalid_is_value_error_and_not_cached() -> None:
    for _ in range(2):
        with pytest.raises(ValueError, match="1kb"):
            parse_quantity("1kb")


def test_parse_rejects_non_string() -> None:
    with pytest.raises(TypeError):
        parse_quantity(5)  # type: ignore[arg-type, unused-ignore]


@pytest.mark.parametrize(
    ("text", "value", "milli"),
    [
        ("0", 0, 0),
        ("1", 1, 1000),
        ("1.5", 2, 1500),
        ("-1.5", -2, -1500),
        ("1001m", 2, 1001),
        ("-1001m", -2, -1001),
        ("999m", 1, 999),
        ("-999m", -1, -999),
        ("1n", 1, 1),
        ("-1n", -1, -1),
        ("1500001n", 1, 2),
        ("-1500001n", -1, -2),
        ("9.01", 10, 9010),
        ("-9.01", -10, -9010),
        ("1Ki", 1024, 1024000),
        ("1.5Gi", 1610612736, 1610612736000),
        ("1k", 1000, 1000000),
        ("1E", 10**18, 10**21),
        ("9Ei", MAX_INT64, MAX_INT64 * 1000),
    ],
)
def test_value_and_milli_value(text: str, value: int, milli: int) -> None:
    parsed = q(text)
    assert parsed.value() == value
    assert parsed.milli_value() == milli


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", True), ("0", True), ("1.5", False), ("1Ki", True), ("-3", True), ("1n", False)],
)
def test_is_integer(text: str, expected: bool) -> None:
    assert q(text).is_integer() is expected


def test_as_approximate_float() -> None:
    assert q("1.5").as_approximate_float() == 1.5
    assert q("-500m").as_approximate_float() == -0.5
    assert q("1Gi").as_approximate_float() == float(2**30)
    assert q("1n").as_approximate_float() == 1e-9
    assert Quantity(10**400).as_approximate_float() == float("inf")
    assert Quantity(-(10**400)).as_approximate_float() == float("-inf")


def test_sign_and_bool() -> None:
    assert q("5m").sign() == 1
    assert q("-5m").sign() == -1
    assert q("0Ki").sign() == 0
    assert q("1n")
    assert not q("0")
    assert not q("-0.0")


@pytest.mark.parametrize(
    ("left", "right", "expected"),
    [
        ("0", "0", 0),
        ("100m", "50m", 1),
        ("50m", "100m", -1),
        ("10000T", "100Gi", 1),
        ("1G", "1Gi", -1),
        ("1Ki", "1024", 0),
        ("1k", "1Ki", -1),
        ("1e3", "1k", 0),
        ("-1Gi", "-1G", -1),
        ("1n", "0", 1),
        ("-1n", "0", -1),
        ("1.5Gi", "1536Mi", 0),
        ("0.5", "500m", 0),
    ],
)
def test_ordering_across_formats(left: str, right: str, expected: int) -> None:
    a, b = q(left), q(right)
    assert a.compare_to(b) == expected
    assert b.compare_to(a) == -expected
    assert (a < b) is (expected < 0)
    assert (a <= b) is (expected <= 0)
    assert (a > b) is (expected > 0)
    assert (a >= b) is (expected >= 0)
    assert (a == b) is (expected == 0)
    assert (a != b) is (expected != 0)
    if expected == 0:
        assert hash(a) == hash(b)


def test_equality_ignores_format_and_other_types() -> None:
    assert Quantity.from_int(1024) == q("1Ki")
    assert Quantity.from_int(1024, Format.BINARY_SI).canonical() == "1Ki"
    assert Quantity.from_int(1024).canonical() == "1024"
    assert len({q("1Ki"), q("1024"), q("1.024k"), q("1024e0")}) == 1
    assert q("1") != 1
    assert q("1") != "1"
    with pytest.raises(TypeError):
        _ = q("1") < 1  # type: ignore[operator]


def test_sorting() -> None:
    texts = ["1Gi", "1G", "500m", "-1", "0", "1Ki", "1k", "1e-9"]
    ordered = sorted(q(t) for t in texts)
    assert [x.canonical() for x in ordered] == ["-1", "0", "1e-9", "500m", "1k", "1Ki", "1G", "1Gi"]


def test_arithmetic_is_exact() -> None:
    tenth = q("100m")
    total = Quantity(0)
    for _ in range(10):
        total = total + tenth
    assert total == q("1")
    assert total.canonical() == "1"
    assert q("0.1") + q("0.2") == q("0.3")
    assert q("1Gi") - q("1G") == q("73741824")
    assert q("1n") * 3 == q("3n")
    assert 3 * q("1n") == q("3n")
    assert q("1.5Gi") * -2 == q("-3Gi")
    assert -q("1Ki") == q("-1024")
    assert q(str(MAX_INT64)) + q("1") == q("9223372036854775808")
    assert q("9223372036854775808").canonical() == "9223372036854775808"
    assert (Quantity(-(2**63) * NANO) - Quantity(0)).canonical() == "-9223372036854775808"


def test_arithmetic_formats_follow_go() -> None:
    # Add/Sub keep the receiver's format...
    assert (q("10Ki") + q("1k")).format is BIN
    assert (q("1k") + q("1Ki")).format is DEC
    assert (q("1Gi") - q("1Mi")).canonical() == "1023Mi"
    # ... unless the receiver is zero, which takes the other operand's format.
    assert (q("0") + q("1Gi")).canonical() == "1Gi"
    assert (q("0") - q("1Gi")).canonical() == "-1Gi"
    assert (q("1Gi") + q("0")).canonical() == "1Gi"
    assert (q("100m") - q("0")).canonical() == "100m"
    # Neg and Mul keep the format.
    assert (-q("1Gi")).canonical() == "-1Gi"
    assert (q("1Gi") * 3).canonical() == "3Gi"
    assert (q("1Gi") * 0).format is BIN


def test_arithmetic_rejects_other_types() -> None:
    with pytest.raises(TypeError):
        _ = q("1") + 1  # type: ignore[operator]
    with pytest.raises(TypeError):
        _ = q("1") - 1  # type: ignore[operator]
    with pytest.raises(TypeError):
        _ = q("1") * 1.5  # type: ignore[operator]
    with pytest.raises(TypeError):
        _ = q("1") * q("1")  # type: ignore[operator]


def test_immutable_and_copyable() -> None:
    value = q("1Gi")
    with pytest.raises(AttributeError):
        value.nanos = 5
    with pytest.raises(AttributeError):
        value.format = Format.DECIMAL_SI
    with pytest.raises(AttributeError):
        del value.nanos
    with pytest.raises(AttributeError):
        value.other = 1  # type: ignore[attr-defined]
    assert copy.copy(value) is value
    assert copy.deepcopy(value) is value
    restored = pickle.loads(pickle.dumps(value))
    assert restored == value
    assert restored.format is BIN
    assert restored.canonical() == "1Gi"


def test_constructor() -> None:
    assert Quantity(5).format is DEC
    assert Quantity(5, "BinarySI").format is BIN  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Quantity(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Quantity(True)
    with pytest.raises(ValueError, match="Binary"):
        Quantity(1, "Binary")  # type: ignore[arg-type]
    assert Quantity.from_int(3, BIN).nanos == 3 * NANO


def test_repr() -> None:
    assert repr(q("1Gi")) == "Quantity('1Gi')"
    assert repr(q("1.5")) == "Quantity('1500m')"


def test_parse_is_cached() -> None:
    assert parse_quantity("123Mi") is parse_quantity("123Mi")
    assert Quantity.parse("123Mi") is parse_quantity("123Mi")


nanos_strategy = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30),
    st.builds(
        lambda m, e: m * 10**e,
        st.integers(min_value=-1100, max_value=1100),
        st.integers(min_value=0, max_value=30),
    ),
    st.builds(
        lambda m, e: m * 1024**e * NANO,
        st.integers(min_value=-1100, max_value=1100),
        st.integers(min_value=0, max_value=6),
    ),
)


@settings(max_examples=300, deadline=None)
@given(nanos=nanos_strategy, fmt=st.sampled_from(list(Format)))
def test_canonical_round_trip(nanos: int, fmt: Format) -> None:
    if fmt is Format.BINARY_SI and abs(nanos) > MAX_INT64 * NANO:
        nanos = nanos % (MAX_INT64 * NANO)  # parsing caps BinarySI at 2**63 - 1
    original = Quantity(nanos, fmt)
    text = original.canonical()
    parsed = parse_quantity(text)
    assert parsed == original
    assert parsed.nanos == nanos
    again = parsed.canonical()
    assert parse_quantity(again).canonical() == again
    if fmt is not Format.BINARY_SI:
        assert again == text
    elif text != again:
        # A BinarySI integer with no binary suffix ("5000") parses back as DecimalSI.
        assert text.lstrip("-").isdigit()
        assert original.is_integer()


@settings(max_examples=200, deadline=None)
@given(
    whole=st.integers(min_value=0, max_value=10**12),
    fraction=st.text(alphabet="0123456789", max_size=15),
    suffix=st.sampled_from(["", "n", "u", "m", "k", "M", "G", "Ki", "Mi", "Gi", "e3", "e-7"]),
    negative=st.booleans(),
)
def test_parse_rounds_up_away_from_zero(
    whole: int, fraction: str, suffix: str, negative: bool
) -> None:
    from fractions import Fraction

    text = f"{'-' if negative else ''}{whole}.{fraction}{suffix}"
    scale: dict[str, Fraction | int] = {
        "": 1,
        "n": Fraction(1, 10**9),
        "u": Fraction(1, 10**6),
        "m": Fraction(1, 1000),
    }
    scale |= {"k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    scale |= {"e3": 10**3, "e-7": Fraction(1, 10**7)}
    exact = (whole + Fraction(int(fraction or "0"), 10 ** len(fraction))) * scale[suffix] * NANO
    ceiling = -(-exact.numerator // exact.denominator)
    if suffix.endswith("i"):
        ceiling = min(ceiling, MAX_INT64 * NANO)  # upstream's maxAllowed
    expected = -ceiling if negative else ceiling
    assert parse_quantity(text).nanos == expected
