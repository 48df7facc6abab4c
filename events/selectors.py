"""DRA CEL device selectors (Kubernetes 1.34, ``resource.k8s.io/v1``) on top of cel-python.

A DeviceClass or a ResourceClaim request filters devices with
``selectors[].cel.expression``. This module compiles such an expression once and
evaluates it against a :class:`DeviceView`, mirroring the environment of upstream
``k8s.io/dynamic-resource-allocation/cel``:

* one variable, ``device``, with the fields ``driver`` (string), ``attributes``
  (domain -> id -> value), ``capacity`` (domain -> id -> quantity) and, only when the
  consumable-capacity feature is on, ``allowMultipleAllocations`` (bool). Selecting any
  other field of ``device`` is a compile error, as it is for the upstream type checker.
* looking up an unknown *domain* in ``attributes``/``capacity`` yields an empty map, so
  ``device.attributes["other.example.com"].foo`` fails only because ``foo`` is
  missing; an unknown *id* in a known domain is a runtime error.
* the Kubernetes quantity library (``quantity``, ``isQuantity``, ``compareTo``,
  ``isGreaterThan``, ``isLessThan``, ``add``, ``sub``, ``sign``, ``isInteger``,
  ``asInteger``, ``asApproximateFloat``) and the semver library (``semver``,
  ``isSemver``, both with the optional ``normalize`` flag, ``major``, ``minor``,
  ``patch``, ``compareTo``, ``isGreaterThan``, ``isLessThan``). Quantities and versions
  travel through CEL as the small wrapper types :class:`CelQuantity` and
  :class:`CelSemver`, which support ``==``/``!=`` by value but, as upstream, no
  ``<``/``>`` operators.

Design
------
cel-python parses but does not type-check, so the compile step adds a cheap static
pass over the parse tree that rejects what the upstream checker would reject most
often: unknown ``device`` fields, undeclared identifiers and unknown functions. The
runtime is celpy's interpreter; its transpiling runner is not used because it resolves
extension functions through module globals and is not thread-safe.

Limits: an expression longer than :data:`MAX_EXPRESSION_LENGTH` characters does not
compile, nor does one whose *estimated* cost is above :data:`MAX_COST` units or cannot
be bounded; every evaluation is metered and stops with
:class:`~events.errors.SelectorCostExceeded` once its *actual* cost passes the limit
it runs under (:data:`MAX_COST` unless the caller asks for less). Both are upstream's
rules, in cel-go's cost units (:mod:`events.celcost`). cel-python needs tens of
microseconds per unit, so a selector near the limit runs for many seconds: a service
that evaluates tenants' selectors keeps the expensive ones off its event loop
(:mod:`services.runtime.ops.selectorpool`).

Performance: :func:`compile_selector` is cached on ``(expression, flag)``. Converting
a :class:`DeviceView` into celpy values is done once per view object and stored in a
private slot of the (frozen) view, so a view evaluated against many selectors pays the
conversion once; the mappings of a view must therefore not be mutated after its first
evaluation.

Unqualified attribute and capacity names (``model`` rather than
``dra.example.com/model``) belong to the driver's domain; a :class:`DeviceView` holds
names already split, and :meth:`DeviceView.from_qualified_names` does the split.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, cast

import celpy
import lark
import semver
from celpy import celtypes
from celpy.celparser import CELParseError
from celpy.evaluation import CELEvalError, base_functions, bool_eq
from lark.exceptions import UnexpectedCharacters, UnexpectedToken

from events import celcost
from events.errors import QuantityError, SelectorCostExceeded, SelectorError
from events.quantities import Quantity

__all__ = [
    "INLINE_COMPILE_CHARS",
    "MAX_COST",
    "MAX_EXPRESSION_LENGTH",
    "AttributeValue",
    "CelQuantity",
    "CelSemver",
    "DeviceView",
    "Selector",
    "activation_for",
    "compile_selector",
    "is_checked",
    "is_compiled",
    "record_verdict",
    "selector_problem",
    "split_qualified_name",
]

AttributeValue = bool | int | str | semver.Version
"""A DRA device attribute value; a version is a semver 2.0.0 version."""

MAX_EXPRESSION_LENGTH: Final = 10 * 1024
"""Upstream ``CELSelectorExpressionMaxLength``."""

INLINE_COMPILE_CHARS: Final = 256
"""Longer tenant expressions are compiled away from a service's event loop (parsing costs
cel-python some 40-80 µs per character)."""

MAX_COST: Final = 1_000_000
"""Upstream ``CELSelectorExpressionMaxCost``: the estimate's and each evaluation's limit."""

_NANOS_PER_UNIT: Final = 10**9
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
_MAX_MESSAGE: Final = 400

_DEVICE: Final = "device"
_DEVICE_FIELDS: Final = frozenset({"driver", "attributes", "capacity"})
_MULTI_ALLOC_FIELD: Final = "allowMultipleAllocations"
_MACROS: Final = frozenset({"all", "exists", "exists_one", "map", "filter"})
_TYPE_IDENTS: Final = frozenset(
    {"bool", "bytes", "double", "duration", "int", "list", "map", "null_type", "string"}
    | {"timestamp", "type", "uint"}
)


# ---------------------------------------------------------------------------
# Values as CEL sees them


class CelQuantity:
    """A Kubernetes quantity inside CEL: equality by value, no ordering operators."""

    __slots__ = ("quantity",)

    def __init__(self, quantity: Quantity) -> None:
        self.quantity = quantity

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CelQuantity) and self.quantity == other.quantity

    def __hash__(self) -> int:
        return hash(self.quantity)

    def __repr__(self) -> str:
        return f"quantity({self.quantity.canonical()!r})"


class CelSemver:
    """A semantic version inside CEL: equality by precedence, no ordering operators."""

    __slots__ = ("version",)

    def __init__(self, version: semver.Version) -> None:
        self.version = version

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CelSemver) and self.version.compare(other.version) == 0

    def __hash__(self) -> int:
        v = self.version
        return hash((v.major, v.minor, v.patch, v.prerelease))

    def __repr__(self) -> str:
        return f"semver({str(self.version)!r})"


def _cel_attribute(value: AttributeValue) -> object:
    """Convert one attribute value into its celpy representation."""
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    return CelSemver(value)


class _DomainMap(celtypes.MapType):
    """The outer ``attributes``/``capacity`` map: an unknown domain reads as ``{}``."""

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str) and not dict.__contains__(self, key):
            return celtypes.MapType()
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key]


# ---------------------------------------------------------------------------
# The device


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceView:
    """What a selector sees of one device; names already split into domain and id.

    Unqualified attribute/capacity names belong under the driver's domain; use
    :meth:`from_qualified_names` to build a view from API-style names. The mappings
    must not be mutated once the view has been evaluated (the CEL form is cached).
    """

    driver: str
    attributes: Mapping[str, Mapping[str, AttributeValue]]
    capacity: Mapping[str, Mapping[str, Quantity]]
    allow_multiple_allocations: bool = False
    _cel: dict[str, object] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    @classmethod
    def from_qualified_names(
        cls,
        driver: str,
        attributes: Mapping[str, AttributeValue],
        capacity: Mapping[str, Quantity],
        *,
        allow_multiple_allocations: bool = False,
    ) -> DeviceView:
        """Build a view from ``domain/id`` or bare ``id`` names, as a ResourceSlice has."""
        attrs: dict[str, dict[str, AttributeValue]] = {}
        for name, value in attributes.items():
            domain, ident = split_qualified_name(name, driver)
            attrs.setdefault(domain, {})[ident] = value
        caps: dict[str, dict[str, Quantity]] = {}
        for name, quantity in capacity.items():
            domain, ident = split_qualified_name(name, driver)
            caps.setdefault(domain, {})[ident] = quantity
        return cls(driver, attrs, caps, allow_multiple_allocations)


def split_qualified_name(name: str, driver: str) -> tuple[str, str]:
    """Split ``domain/id``; a bare ``id`` belongs to the driver's domain."""
    domain, sep, ident = name.partition("/")
    if not sep:
        return driver, name
    return domain, ident


def activation_for(view: DeviceView) -> dict[str, object]:
    """Return the celpy activation of ``view``, converting it on first use only."""
    cached = view._cel
    if cached is not None:
        return cached
    attributes = _DomainMap(
        {
            celtypes.StringType(domain): celtypes.MapType(
                {celtypes.StringType(k): _cel_attribute(v) for k, v in ids.items()}
            )
            for domain, ids in view.attributes.items()
        }
    )
    capacity = _DomainMap(
        {
            celtypes.StringType(domain): celtypes.MapType(
                {celtypes.StringType(k): CelQuantity(q) for k, q in ids.items()}
            )
            for domain, ids in view.capacity.items()
        }
    )
    device = celtypes.MapType(
        {
            celtypes.StringType("driver"): celtypes.StringType(view.driver),
            celtypes.StringType("attributes"): attributes,
            celtypes.StringType("capacity"): capacity,
            celtypes.StringType(_MULTI_ALLOC_FIELD): celtypes.BoolType(
                view.allow_multiple_allocations
            ),
        }
    )
    activation: dict[str, object] = {_DEVICE: device}
    object.__setattr__(view, "_cel", activation)
    return activation


# ---------------------------------------------------------------------------
# The quantity and semver libraries


def _error(message: str) -> CELEvalError:
    """A CEL runtime error value (returned, not raised, so ``||``/``&&`` can absorb it)."""
    return CELEvalError(message, ValueError, (message,))


def _no_overload(function: str, *args: object) -> CELEvalError:
    types = ", ".join(type(a).__name__ for a in args)
    return _error(f"no such overload: {function}({types})")


def _as_int_operand(value: object) -> int | None:
    """Return ``value`` as a Python int if it is a CEL int (not a bool)."""
    if isinstance(value, celtypes.IntType) or (
        isinstance(value, int) and not isinstance(value, bool | celtypes.BoolType)
    ):
        if isinstance(value, celtypes.BoolType | celtypes.UintType):
            return None
        return int(value)
    return None


@functools.lru_cache(maxsize=1024)
def _parse_quantity(text: str) -> CelQuantity | str:
    """Parse a quantity literal (cached: selectors repeat the same literals); error text."""
    try:
        return CelQuantity(Quantity.parse(text))
    except QuantityError as ex:
        return str(ex)


def _fn_quantity(text: object) -> object:
    if not isinstance(text, str):
        return _no_overload("quantity", text)
    parsed = _parse_quantity(str(text))
    return _error(parsed) if isinstance(parsed, str) else parsed


def _fn_is_quantity(text: object) -> object:
    if not isinstance(text, str):
        return _no_overload("isQuantity", text)
    return celtypes.BoolType(not isinstance(_parse_quantity(str(text)), str))


def _fn_sign(q: object) -> object:
    if not isinstance(q, CelQuantity):
        return _no_overload("sign", q)
    return celtypes.IntType(q.quantity.sign())


def _int64_of(q: Quantity) -> int | None:
    whole, rest = divmod(q.nanos, _NANOS_PER_UNIT)
    if rest or not _INT64_MIN <= whole <= _INT64_MAX:
        return None
    return whole


def _fn_is_integer(q: object) -> object:
    if not isinstance(q, CelQuantity):
        return _no_overload("isInteger", q)
    return celtypes.BoolType(_int64_of(q.quantity) is not None)


def _fn_as_integer(q: object) -> object:
    if not isinstance(q, CelQuantity):
        return _no_overload("asInteger", q)
    value = _int64_of(q.quantity)
    if value is None:
        return _error(f"cannot convert {q!r} to integer")
    return celtypes.IntType(value)


def _fn_as_approximate_float(q: object) -> object:
    if not isinstance(q, CelQuantity):
        return _no_overload("asApproximateFloat", q)
    return celtypes.DoubleType(q.quantity.as_approximate_float())


def _arith(name: str, q: object, other: object, sign: int) -> object:
    if not isinstance(q, CelQuantity):
        return _no_overload(name, q, other)
    if isinstance(other, CelQuantity):
        operand = other.quantity
    else:
        number = _as_int_operand(other)
        if number is None:
            return _no_overload(name, q, other)
        operand = Quantity.parse(str(number))
    result = q.quantity + operand if sign > 0 else q.quantity - operand
    return CelQuantity(result)


def _fn_add(q: object, other: object) -> object:
    return _arith("add", q, other, +1)


def _fn_sub(q: object, other: object) -> object:
    return _arith("sub", q, other, -1)


def _compare(name: str, a: object, b: object) -> int | CELEvalError:
    """Three-way compare two quantities or two versions."""
    if isinstance(a, CelQuantity) and isinstance(b, CelQuantity):
        return a.quantity.compare_to(b.quantity)
    if isinstance(a, CelSemver) and isinstance(b, CelSemver):
        return a.version.compare(b.version)
    return _no_overload(name, a, b)


def _fn_compare_to(a: object, b: object) -> object:
    result = _compare("compareTo", a, b)
    return result if isinstance(result, CELEvalError) else celtypes.IntType(result)


def _fn_is_greater_than(a: object, b: object) -> object:
    result = _compare("isGreaterThan", a, b)
    return result if isinstance(result, CELEvalError) else celtypes.BoolType(result > 0)


def _fn_is_less_than(a: object, b: object) -> object:
    result = _compare("isLessThan", a, b)
    return result if isinstance(result, CELEvalError) else celtypes.BoolType(result < 0)


def _normalize_semver(text: str) -> str:
    """Upstream's tolerant form: drop a ``v``, pad to x.y.z, strip leading zeros."""
    text = text.removeprefix("v")
    parts = text.split(".", 2)
    for i, part in enumerate(parts):
        if len(part) > 1:
            stripped = part.lstrip("0")
            if not stripped or not stripped[0].isdigit():
                stripped = "0" + stripped
            parts[i] = stripped
    if len(parts) < 3:
        if "+" in parts[-1] or "-" in parts[-1]:
            raise ValueError("short version cannot contain pre-release or build metadata")
        parts.extend(["0"] * (3 - len(parts)))
    return ".".join(parts)


def _parse_semver(text: object, normalize: object) -> semver.Version | CELEvalError:
    if not isinstance(text, str) or not isinstance(normalize, bool | celtypes.BoolType):
        return _no_overload("semver", text, normalize)
    try:
        source = _normalize_semver(str(text)) if normalize else str(text)
        return semver.Version.parse(source)
    except (ValueError, TypeError) as ex:
        return _error(f"invalid semantic version {str(text)!r}: {ex}")


def _fn_semver(text: object, normalize: object = False) -> object:
    parsed = _parse_semver(text, normalize)
    return parsed if isinstance(parsed, CELEvalError) else CelSemver(parsed)


def _fn_is_semver(text: object, normalize: object = False) -> object:
    if not isinstance(text, str):
        return _no_overload("isSemver", text)
    return celtypes.BoolType(not isinstance(_parse_semver(text, normalize), CELEvalError))


def _semver_part(name: str) -> Callable[[object], object]:
    def part(v: object) -> object:
        if not isinstance(v, CelSemver):
            return _no_overload(name, v)
        return celtypes.IntType(getattr(v.version, name))

    part.__name__ = f"_fn_{name}"
    return part


def _fn_dyn(value: object) -> object:
    return value


_NUMBERS: Final = (celtypes.IntType, celtypes.UintType, celtypes.DoubleType)


def _plain_number(value: object) -> int | float:
    """The Python number behind a CEL int, uint or double."""
    return float(value) if isinstance(value, float) else int(cast(int, value))


def _fn_equals(a: object, b: object) -> object:
    """``==`` with CEL's heterogeneous equality: values of different types are unequal."""
    try:
        return bool_eq(cast(Any, a), cast(Any, b))
    except TypeError:
        if isinstance(a, _NUMBERS) and isinstance(b, _NUMBERS):
            return celtypes.BoolType(_plain_number(a) == _plain_number(b))
        return celtypes.BoolType(False)


def _fn_not_equals(a: object, b: object) -> object:
    """``!=``, the negation of :func:`_fn_equals`."""
    equal = _fn_equals(a, b)
    return equal if isinstance(equal, CELEvalError) else celtypes.BoolType(not equal)


_FUNCTIONS: Final[dict[str, Callable[..., object]]] = {
    "quantity": _fn_quantity,
    "isQuantity": _fn_is_quantity,
    "sign": _fn_sign,
    "isInteger": _fn_is_integer,
    "asInteger": _fn_as_integer,
    "asApproximateFloat": _fn_as_approximate_float,
    "add": _fn_add,
    "sub": _fn_sub,
    "compareTo": _fn_compare_to,
    "isGreaterThan": _fn_is_greater_than,
    "isLessThan": _fn_is_less_than,
    "semver": _fn_semver,
    "isSemver": _fn_is_semver,
    "major": _semver_part("major"),
    "minor": _semver_part("minor"),
    "patch": _semver_part("patch"),
    "dyn": _fn_dyn,
    "_==_": _fn_equals,
    "_!=_": _fn_not_equals,
}
_KNOWN_FUNCTIONS: Final = frozenset(base_functions) | frozenset(_FUNCTIONS) | {"has"}

_ENV: Final = celpy.Environment()


# ---------------------------------------------------------------------------
# Static checks


def _children(tree: lark.Tree[Any]) -> Iterator[lark.Tree[Any]]:
    return (c for c in tree.children if isinstance(c, lark.Tree))


def _bare_ident(tree: lark.Tree[Any]) -> str | None:
    """Return the name if ``tree`` is nothing but an identifier."""
    node = tree
    while node.data != "ident":
        subtrees = list(_children(node))
        if len(subtrees) != 1 or len(node.children) != 1:
            return None
        node = subtrees[0]
    return str(node.children[0])


def _macro_parts(tree: lark.Tree[Any]) -> tuple[lark.Tree[Any], list[lark.Tree[Any]]] | None:
    """For ``range.macro(var, body)`` return ``(range, [var, body...])``."""
    if tree.data != "member_dot_arg" or len(tree.children) != 3:
        return None
    target, name, exprlist = tree.children
    if str(name) not in _MACROS or not isinstance(exprlist, lark.Tree):
        return None
    assert isinstance(target, lark.Tree)
    return target, list(_children(exprlist))


def _check_tree(tree: lark.Tree[Any], consumable_capacity: bool) -> str | None:
    """Return why the upstream checker would reject ``tree``, or None."""
    fields = _DEVICE_FIELDS | {_MULTI_ALLOC_FIELD} if consumable_capacity else _DEVICE_FIELDS
    bound: set[str] = set()
    for node in tree.iter_subtrees():
        if node.data == "ident" and str(node.children[0]) == "cel":
            return "the cel.* extensions (cel.bind) are not supported"
        parts = _macro_parts(node)
        if parts is not None and parts[1]:
            var = _bare_ident(parts[1][0])
            if var is None:
                return f"argument 1 of {node.children[1]}() must be a simple identifier"
            bound.add(var)
    for node in tree.iter_subtrees():
        if node.data in ("ident", "dot_ident"):
            name = str(node.children[0])
            if name not in bound and name != _DEVICE and name not in _TYPE_IDENTS:
                return f"undeclared reference to {name!r}"
        elif node.data == "ident_arg":
            name = str(node.children[0])
            if name not in _KNOWN_FUNCTIONS:
                return f"undeclared reference to function {name!r}"
        elif node.data == "member_dot_arg":
            name = str(node.children[1])
            if name not in _KNOWN_FUNCTIONS and name not in _MACROS:
                return f"undeclared reference to function {name!r}"
        elif node.data == "member_dot":
            target, name_token = node.children
            assert isinstance(target, lark.Tree)
            if _bare_ident(target) == _DEVICE and str(name_token) not in fields:
                return f"undefined field {str(name_token)!r} of device"
    return None


def _cost_problem(cost: int | None) -> str | None:
    """Why an estimated cost is refused, or None."""
    if cost is None:
        return (
            "the cost cannot be bounded (a comprehension over a list of unknown size, "
            "or a string operation on a string of unknown length)"
        )
    if cost > MAX_COST:
        return f"estimated cost {cost} exceeds the limit of {MAX_COST}"
    return None


# ---------------------------------------------------------------------------
# Compile and evaluate


def _describe(ex: BaseException) -> str:
    """A short message from a celpy exception (celpy may embed whole activations)."""
    text = str(ex.args[0]) if ex.args else type(ex).__name__
    if isinstance(ex, CELEvalError) and len(ex.args) > 2 and ex.args[2]:
        detail = ex.args[2]
        if isinstance(detail, tuple) and detail and str(detail[0]) not in text:
            text = f"{text}: {detail[0]}"
    text = text.split(" (in activation", 1)[0]
    if len(text) > _MAX_MESSAGE:
        text = text[:_MAX_MESSAGE] + "..."
    return text


def _syntax_error(ex: CELParseError) -> str:
    """``syntax error at line L, column C: unexpected ...`` from the parser's error."""
    where = f"syntax error at line {ex.line}, column {ex.column}"
    cause = ex.__cause__ or ex.__context__
    if isinstance(cause, UnexpectedCharacters):
        return f"{where}: unexpected character {cause.char!r}"
    if isinstance(cause, UnexpectedToken):
        token = str(cause.token)
        return f"{where}: unexpected {repr(token) if token else 'end of expression'}"
    return where


class Selector:
    """One compiled selector expression; immutable and safe to share.

    ``estimated_cost``: the worst case of one evaluation, in cost units.
    """

    __slots__ = ("_program", "consumable_capacity", "estimated_cost", "expression")

    def __init__(
        self,
        expression: str,
        consumable_capacity: bool,
        program: celpy.Runner,
        estimated_cost: int,
    ) -> None:
        self.expression = expression
        self.consumable_capacity = consumable_capacity
        self.estimated_cost = estimated_cost
        self._program = program

    def __repr__(self) -> str:
        return f"Selector({self.expression!r})"

    def matches(self, device: DeviceView, *, cost_limit: int = MAX_COST) -> bool:
        """Evaluate against ``device``; raise :class:`SelectorError` on any failure.

        The evaluation stops with :class:`SelectorCostExceeded` once it has spent more
        than ``cost_limit`` units.
        """
        return self.evaluate(device, cost_limit=cost_limit)[0]

    def evaluate(self, device: DeviceView, *, cost_limit: int = MAX_COST) -> tuple[bool, int]:
        """:meth:`matches`, and the actual cost of the evaluation."""
        budget = celcost.Budget(cost_limit)
        try:
            result = celcost.run(self._program, activation_for(device), budget)
        except celcost.OverBudget:
            raise SelectorCostExceeded(
                self.expression, f"actual cost exceeded the limit of {cost_limit}", cost_limit
            ) from None
        except Exception as ex:
            raise SelectorError(self.expression, _describe(ex)) from ex
        if type(result) is bool or isinstance(result, celtypes.BoolType):
            return bool(result), budget.spent
        raise SelectorError(
            self.expression, f"must evaluate to bool, not {type(result).__name__}: {result!r}"
        )


_CACHED: Final = 4096
_compiled: collections.OrderedDict[tuple[str, bool], Selector | SelectorError] = (
    collections.OrderedDict()
)
_verdicts: collections.OrderedDict[tuple[str, bool], str | None] = collections.OrderedDict()


def _remember(
    cache: collections.OrderedDict[tuple[str, bool], Any], key: tuple[str, bool], value: object
) -> None:
    cache[key] = value
    if len(cache) > _CACHED:
        cache.popitem(last=False)  # the oldest entry


def compile_selector(expression: str, *, consumable_capacity: bool = True) -> Selector:
    """Compile ``expression`` (cached, errors too); raise :class:`SelectorError` if invalid."""
    key = (expression, bool(consumable_capacity))
    found = _compiled.get(key)
    if found is None:
        try:
            found = _compile(*key)
        except SelectorError as exc:
            found = exc
        _remember(_compiled, key, found)
    if isinstance(found, SelectorError):
        raise SelectorError(found.expression, found.message)
    return found


def is_compiled(expression: str, *, consumable_capacity: bool = True) -> bool:
    """Whether :func:`compile_selector` answers ``expression`` from its cache."""
    return (expression, bool(consumable_capacity)) in _compiled


def is_checked(expression: str, *, consumable_capacity: bool = True) -> bool:
    """Whether :func:`selector_problem` answers ``expression`` without compiling it."""
    key = (expression, bool(consumable_capacity))
    return key in _verdicts or key in _compiled


def selector_problem(expression: str, *, consumable_capacity: bool = True) -> str | None:
    """Why ``expression`` does not compile (the compiler's message), or None.

    A verdict reached in another process (:func:`record_verdict`) is taken as it is, so
    a service can have long expressions compiled away from its event loop; without
    one, the expression is compiled here.
    """
    key = (expression, bool(consumable_capacity))
    if key in _verdicts:
        return _verdicts[key]
    try:
        compile_selector(expression, consumable_capacity=consumable_capacity)
    except SelectorError as exc:
        return exc.message
    return None


def record_verdict(expression: str, problem: str | None, *, consumable_capacity: bool) -> None:
    """Remember what compiling ``expression`` elsewhere said (see :func:`selector_problem`)."""
    _remember(_verdicts, (expression, bool(consumable_capacity)), problem)


def _compile(expression: str, consumable_capacity: bool) -> Selector:
    """The uncached body of :func:`compile_selector`."""
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise SelectorError(
            expression,
            f"expression is {len(expression)} characters, more than {MAX_EXPRESSION_LENGTH}",
        )
    try:
        tree = _ENV.compile(expression)
    except CELParseError as ex:
        raise SelectorError(expression, f"compilation failed: {_syntax_error(ex)}") from ex
    except Exception as ex:
        raise SelectorError(expression, f"compilation failed: {_describe(ex)}") from ex
    cost = celcost.estimate(tree)
    problem = _check_tree(tree, consumable_capacity) or _cost_problem(cost)
    if problem is not None:
        raise SelectorError(expression, f"compilation failed: {problem}")
    program = _ENV.program(tree, functions=cast(Any, _FUNCTIONS))
    return Selector(expression, consumable_capacity, program, cost or 0)
