"""Unit tests for the DRA CEL selector environment (events.selectors)."""

from __future__ import annotations

import signal

import pytest
import semver

from events import celcost
from events.errors import SelectorCostExceeded, SelectorError
from events.quantities import Quantity
from events.selectors import (
    MAX_COST,
    MAX_EXPRESSION_LENGTH,
    DeviceView,
    activation_for,
    compile_selector,
    split_qualified_name,
)

DRIVER = "dra.example.com"


def _device(*, allow_multiple_allocations: bool = False) -> DeviceView:
    """A GPU as a ResourceSlice would publish it (unqualified names = driver domain)."""
    return DeviceView.from_qualified_names(
        DRIVER,
        {
            "model": "a100",
            "cores": 108,
            "mig": True,
            "driverVersion": semver.Version.parse("1.2.3"),
            "numa.example.com/node": 1,
        },
        {
            "memory": Quantity.parse("40Gi"),
            "bandwidth": Quantity.parse("1.5"),
        },
        allow_multiple_allocations=allow_multiple_allocations,
    )


D = f'device.attributes["{DRIVER}"]'
C = f'device.capacity["{DRIVER}"]'


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        # driver
        (f'device.driver == "{DRIVER}"', True),
        ('device.driver == "other.example.com"', False),
        # attributes: string, int, bool
        (f'{D}.model == "a100"', True),
        (f'{D}.model.startsWith("a1")', True),
        (f'{D}.model != "h100"', True),
        (f"{D}.cores >= 100", True),
        (f"{D}.cores < 100", False),
        (f"{D}.mig", True),
        (f"!{D}.mig", False),
        # heterogeneous equality is false, not an error (attributes are dyn upstream)
        (f"{D}.model == 1", False),
        (f"{D}.model != 1", True),
        ("1 == 1.0", True),
        # qualified names land in their own domain, unqualified ones in the driver's
        ('device.attributes["numa.example.com"].node == 1', True),
        (f'"node" in {D}', False),
        (f'"model" in {D}', True),
        # an unknown domain is an empty map
        ('device.attributes["unknown.example.com"].size() == 0', True),
        ('"unknown.example.com" in device.attributes', False),
        # versions
        (f'{D}.driverVersion == semver("1.2.3")', True),
        (f'{D}.driverVersion == semver("1.2.3+build.7")', True),
        (f'{D}.driverVersion != semver("1.2.4")', True),
        (f'{D}.driverVersion.isGreaterThan(semver("1.2.3-rc.1"))', True),
        (f'{D}.driverVersion.isLessThan(semver("1.10.0"))', True),
        (f'{D}.driverVersion.compareTo(semver("2.0.0")) == -1', True),
        (f"{D}.driverVersion.major() == 1 && {D}.driverVersion.minor() == 2", True),
        (f"{D}.driverVersion.patch() == 3", True),
        # capacity
        (f'{C}.memory.compareTo(quantity("10Gi")) >= 0', True),
        (f'{C}.memory.compareTo(quantity("40Gi")) == 0', True),
        (f'{C}.memory.compareTo(quantity("41Gi")) >= 0', False),
        (f'{C}.memory.isGreaterThan(quantity("39Gi"))', True),
        (f'{C}.memory.isLessThan(quantity("39Gi"))', False),
        (f'{C}.memory == quantity("40Gi")', True),
        (f'{C}.memory == quantity("42949672960")', True),
        (f"{C}.memory.asApproximateFloat() == 42949672960.0", True),
        (f"{C}.bandwidth.asApproximateFloat() == 1.5", True),
        (f"{C}.memory.asInteger() == 42949672960", True),
        (f"{C}.memory.isInteger()", True),
        (f"{C}.bandwidth.isInteger()", False),
        (f"{C}.memory.sign() == 1", True),
        (f"{C}.memory.sub({C}.memory).sign() == 0", True),
        ('device.capacity["unknown.example.com"].size() == 0', True),
        # macros over the maps
        ('device.attributes.exists(d, d == "numa.example.com")', True),
        (f"{D}.all(k, k.size() > 0)", True),
        (f'{D}.filter(k, k.startsWith("c")).size() == 1', True),
        # short-circuit absorbs errors as in CEL
        (f"true || {D}.missing", True),
        (f"false && {D}.missing", False),
        ("dyn(true)", True),
    ],
)
def test_matches(expression: str, expected: bool) -> None:
    assert compile_selector(expression).matches(_device()) is expected


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ('quantity("1Gi") == quantity("1024Mi")', True),
        ('quantity("200M").compareTo(quantity("0.2G")) == 0', True),
        ('quantity("50M").compareTo(quantity("50Mi")) == -1', True),
        ('quantity("50k").add(quantity("20k")) == quantity("70k")', True),
        ('quantity("50k").add(20) == quantity("50020")', True),
        ('quantity("50k").sub(20000) == quantity("30k")', True),
        ('quantity("50k").add(20).sub(quantity("100k")).sub(-50000) == quantity("20")', True),
        ('quantity("50k").sub(20000).asApproximateFloat() == 30000.0', True),
        ('quantity("50k").asInteger() == 50000', True),
        ('quantity("9999999999999999999999999999999999999G").isInteger()', False),
        ('quantity("-5").sign() == -1', True),
        ('isQuantity("1.3Gi")', True),
        ('isQuantity("200K")', False),
        ('isQuantity("Three")', False),
        ('semver("1.2.3").compareTo(semver("0.1.2")) == 1', True),
        ('isSemver("1.0.0")', True),
        ('isSemver("v1.0")', False),
        ('isSemver("1.0")', False),
        ('isSemver("01.1.1")', False),
        ('isSemver("v1.0", true)', True),
        ('semver("v1.0", true) == semver("1.0.0")', True),
        ('semver("01.01.01", true) == semver("1.1.1")', True),
        ('isSemver("1.0-rc", true)', False),
    ],
)
def test_libraries(expression: str, expected: bool) -> None:
    assert compile_selector(expression).matches(_device()) is expected


@pytest.mark.parametrize(
    ("expression", "fragment"),
    [
        (f"{D}.missing", "missing"),
        (f'{C}.missing.isGreaterThan(quantity("1"))', "missing"),
        ('device.attributes["unknown.example.com"].model == "a100"', "model"),
        ('quantity("200K") == quantity("1")', "200K"),
        ('semver("nope").major() == 1', "nope"),
        ('quantity("1.5").asInteger() == 1', "integer"),
        (f'{D}.driverVersion.isGreaterThan(quantity("1"))', "no such overload"),
        (f'{C}.memory.add(true) == quantity("1")', "no such overload"),
        (f'{C}.memory < quantity("1")', "overload"),
        ("1 / 0 == 1", "divide"),
        # non-bool results
        (f"{D}.cores", "must evaluate to bool"),
        (f"{D}.model", "must evaluate to bool"),
        ('quantity("1")', "must evaluate to bool"),
    ],
)
def test_runtime_errors(expression: str, fragment: str) -> None:
    selector = compile_selector(expression)
    with pytest.raises(SelectorError) as info:
        selector.matches(_device())
    assert info.value.expression == expression
    assert expression in str(info.value)
    assert fragment in info.value.message


@pytest.mark.parametrize(
    ("expression", "fragment"),
    [
        ("device.driver ==", "compilation failed"),
        ('device.driver == "a', "compilation failed"),
        ("device.foo == 1", "foo"),
        ("unknownVar == 1", "unknownVar"),
        ("noSuchFunction(1)", "noSuchFunction"),
        (f"{D}.model.noSuchMethod()", "noSuchMethod"),
        ("cel.bind(x, 1, x == 1)", "cel.bind"),
        (
            "["
            + ",".join(["1"] * 2000)
            + "].all(x, ["
            + ",".join(["1"] * 2000)
            + "].all(y, y == x))",
            "cost",
        ),
        ("true || " * (MAX_EXPRESSION_LENGTH // 8) + "true", "characters"),
    ],
)
def test_compile_errors(expression: str, fragment: str) -> None:
    with pytest.raises(SelectorError) as info:
        compile_selector(expression)
    assert info.value.expression == expression
    assert fragment in info.value.message


def test_expression_at_length_limit_compiles() -> None:
    expression = "true" + " " * (MAX_EXPRESSION_LENGTH - 4)
    assert compile_selector(expression).matches(_device())


@pytest.mark.parametrize("flag_value", [True, False])
def test_allow_multiple_allocations_with_feature(flag_value: bool) -> None:
    selector = compile_selector("device.allowMultipleAllocations", consumable_capacity=True)
    assert selector.matches(_device(allow_multiple_allocations=flag_value)) is flag_value


@pytest.mark.parametrize(
    "expression",
    ["device.allowMultipleAllocations", "has(device.allowMultipleAllocations) || true"],
)
def test_allow_multiple_allocations_without_feature_does_not_compile(expression: str) -> None:
    with pytest.raises(SelectorError, match="allowMultipleAllocations"):
        compile_selector(expression, consumable_capacity=False)


def test_without_feature_other_fields_still_work() -> None:
    selector = compile_selector(f'device.driver == "{DRIVER}"', consumable_capacity=False)
    assert selector.matches(_device())


def test_cache_returns_same_object() -> None:
    expression = f'{D}.model == "a100"'
    first = compile_selector(expression)
    assert compile_selector(expression) is first
    assert compile_selector(expression, consumable_capacity=True) is first
    other = compile_selector(expression, consumable_capacity=False)
    assert other is not first
    assert compile_selector(expression, consumable_capacity=False) is other


def test_activation_is_converted_once_per_view() -> None:
    view = _device()
    assert activation_for(view) is activation_for(view)
    assert view == _device()  # the private cache takes no part in equality


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model", (DRIVER, "model")),
        ("numa.example.com/node", ("numa.example.com", "node")),
    ],
)
def test_split_qualified_name(name: str, expected: tuple[str, str]) -> None:
    assert split_qualified_name(name, DRIVER) == expected


def test_view_files_unqualified_names_under_driver_domain() -> None:
    view = _device()
    assert view.attributes[DRIVER]["model"] == "a100"
    assert view.attributes["numa.example.com"]["node"] == 1
    assert "node" not in view.attributes[DRIVER]
    assert view.capacity[DRIVER]["memory"] == Quantity.parse("40Gi")


def test_view_built_directly() -> None:
    view = DeviceView(
        driver="gpu.example.com",
        attributes={"gpu.example.com": {"model": "h100"}},
        capacity={},
    )
    selector = compile_selector('device.attributes["gpu.example.com"].model == "h100"')
    assert selector.matches(view)
    assert not compile_selector("device.allowMultipleAllocations").matches(view)


# --- cost: the estimate and the runtime budget ------------------------------------------------


def _nested(n: int) -> str:
    """``[1..n].all(x, [1..n].all(y, x*y >= 0))`` with the lists written out."""
    items = "[" + ",".join(str(i) for i in range(1, n + 1)) + "]"
    return f"{items}.all(x, {items}.all(y, x*y >= 0))"


@pytest.mark.parametrize(
    ("expression", "cost"),
    [
        ("true", 0),
        ("device.driver", 2),  # an identifier and a selection
        (f'device.driver == "{DRIVER}"', 4),  # ... and the comparison of short strings
        (f'{D}.cores > 100 && {D}.model == "a100"', 10),  # && costs its operands only
        ("[1, 2, 3].all(x, x > 0)", 26),  # list 10, result 1, 3 x (step 3 + body 2)
        ("[1, 2, 3].map(x, x * 2)", 63),  # list 10, base 11, 3 x (step 12 + body 2)
        ("2 in [1, 2, 3]", 13),  # list 10, the look-up: one unit per element
    ],
)
def test_estimated_cost_follows_the_cel_go_rules(expression: str, cost: int) -> None:
    assert compile_selector(expression).estimated_cost == cost


@pytest.mark.parametrize(
    "expression",
    [
        f'device.driver == "{DRIVER}"',
        f'{D}.cores > 100 && {D}.model.startsWith("a")',
        'device.attributes.all(domain, device.attributes[domain].all(k, k != ""))',
        "[1, 2, 3].map(x, x * 2).filter(y, y > 2).exists_one(z, z == 4)",
        f"{D}.model.matches('^a[0-9]+$') || {D}.cores == 1",
        _nested(20),
        'device.capacity.exists(d, device.capacity[d].exists(c, c == "memory"))',
    ],
)
def test_an_evaluation_never_costs_more_than_its_estimate(expression: str) -> None:
    selector = compile_selector(expression)
    _, spent = selector.evaluate(_device())
    assert 0 < spent <= selector.estimated_cost


def test_just_under_the_limit_compiles_and_just_over_does_not() -> None:
    assert 900_000 < compile_selector(_nested(370)).estimated_cost <= MAX_COST
    with pytest.raises(SelectorError, match=r"estimated cost 1016131 exceeds the limit of 1000000"):
        compile_selector(_nested(380))


def test_a_comprehension_over_a_range_of_unknown_size_does_not_compile() -> None:
    with pytest.raises(SelectorError, match="cannot be bounded"):
        compile_selector(f"{D}.model.parts.all(p, p == 1)")


@pytest.mark.parametrize(
    "expression", [_nested(40), f"false || {_nested(40)}", f"{_nested(40)} || true"]
)
def test_an_evaluation_stops_when_its_budget_is_spent(expression: str) -> None:
    selector = compile_selector(expression)
    assert selector.matches(_device())  # within the default limit
    with pytest.raises(SelectorCostExceeded) as info:
        selector.matches(_device(), cost_limit=500)
    assert info.value.limit == 500
    assert "actual cost exceeded the limit of 500" in info.value.message


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("device.driver ==", "syntax error at line 1, column 15: unexpected end of expression"),
        ("device.driver == 'a", 'syntax error at line 1, column 18: unexpected character "\'"'),
        ("device driver", "syntax error at line 1, column 8: unexpected 'driver'"),
    ],
)
def test_syntax_errors_say_where_and_what(expression: str, message: str) -> None:
    with pytest.raises(SelectorError) as info:
        compile_selector(expression)
    assert info.value.message == f"compilation failed: {message}"


def test_an_interrupted_evaluation_stops_cleanly_at_any_moment() -> None:
    """A CPU-time signal asks the evaluator to stop: always a clean stop, never a wrong value.

    (Raising in the signal handler instead let C code swallow the exception now and then:
    the evaluation went on and answered a type error.)
    """
    selector = compile_selector(_nested(200))
    previous = signal.signal(signal.SIGPROF, lambda *_: celcost.interrupt())
    try:
        for i in range(40):
            celcost.clear_interrupt()
            signal.setitimer(signal.ITIMER_PROF, 0.01 + (i % 7) * 0.007)
            try:
                with pytest.raises(celcost.Interrupted):
                    selector.matches(_device())
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
    finally:
        signal.signal(signal.SIGPROF, previous)
        celcost.clear_interrupt()
    assert compile_selector(_nested(20)).matches(_device())
