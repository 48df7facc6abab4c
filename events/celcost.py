"""The cost of a CEL selector: a static estimate, and a budget enforced while it runs.

Kubernetes caps a DRA selector at ``CELSelectorExpressionMaxCost`` = 1,000,000 cost
units, both as the checker's *estimate* (API validation refuses an expression whose
worst case is above it) and as the *actual* cost of each evaluation (the evaluation is
aborted when it goes over). A cost unit is cel-go's: roughly one basic operation.
This module applies the same two limits to expressions run by cel-python.

Units (cel-go's published cost rules, which this follows)
---------------------------------------------------------
* a literal costs 0; an identifier, a field selection and an index 1 each;
* a function or operator call 1 plus its arguments; ``&&``, ``||`` and ``?:`` only
  their arguments (``?:``: the condition and the dearer branch);
* string functions are charged per tenth of a character: ``startsWith``/``endsWith``
  by the argument's length, ``contains`` by both lengths multiplied, ``matches`` by the
  string's length times a quarter of the pattern's, ``==``/``<`` on strings by the
  shorter length, ``+`` on strings by the result's length; ``x in list`` by the list's
  length;
* creating a list costs 10, a map 30, a message 40;
* a comprehension (``all``, ``exists``, ``exists_one``, ``map``, ``filter``) costs its
  range plus, per element, its body and the loop's own bookkeeping (3 for the boolean
  macros, 12 for ``map`` and 13 for ``filter``, which build a list), plus 1 for the
  result (11 for ``map``/``filter``: the empty list it starts from).

The estimate
------------
:func:`estimate` walks the parse tree once, tracking the *shape* of every value it can
bound: the length of strings, the entries of lists and maps and, one level down, their
elements. Literals have exact shapes; ``device`` has the API's limits (at most
:data:`MAX_ENTRIES_PER_MAP` attributes and capacities, names of at most 63 characters,
string values of at most :data:`MAX_STRING_VALUE` characters); a comprehension variable
takes the shape of its range's elements (a map's keys). A comprehension over a range
of unknown size, or a string operation on strings of unknown length, cannot be
bounded: :func:`estimate` returns ``None`` and the expression is refused, as the
upstream checker refuses an estimate above the limit.

The runtime budget
------------------
:class:`CostedEvaluator` is cel-python's evaluator with a meter: every node it visits
is charged (the same units, with string operations at 1 — the estimate stays an upper
bound of what the meter counts) and every comprehension step is charged its
bookkeeping. When the budget runs out it raises :class:`OverBudget`, a
``BaseException`` so that no ``except Exception`` inside cel-python can absorb it (an
exhausted budget is not a CEL error value that ``||`` may short-circuit away).
"""

from __future__ import annotations

import math
from typing import Any, Final, NamedTuple, cast

import celpy
import lark
from celpy.evaluation import Activation, Evaluator

__all__ = [
    "MAX_ENTRIES_PER_MAP",
    "MAX_STRING_VALUE",
    "Budget",
    "CostedEvaluator",
    "Interrupted",
    "OverBudget",
    "clear_interrupt",
    "estimate",
    "interrupt",
]

MAX_ENTRIES_PER_MAP: Final = 32
"""Upstream ``ResourceSliceMaxAttributesAndCapacitiesPerDevice``."""

MAX_STRING_VALUE: Final = 64
"""Upstream ``DeviceAttributeMaxValueLength`` (string and version attributes)."""

_MAX_NAME: Final = 63  # a domain (DNS label) or an attribute id
_STRING_FACTOR: Final = 0.1
_REGEX_FACTOR: Final = 0.25
_LIST_CREATE: Final = 10
_MAP_CREATE: Final = 30
_MESSAGE_CREATE: Final = 40
#: Cost of the macro outside its loop, and of each step of its loop.
MACRO_BASE: Final = {"all": 1, "exists": 1, "exists_one": 2, "map": 11, "filter": 11}
MACRO_STEP: Final = {"all": 3, "exists": 3, "exists_one": 3, "map": 12, "filter": 13}
_STRING_METHODS: Final = frozenset({"contains", "startsWith", "endsWith", "matches"})


# ---------------------------------------------------------------------------
# Shapes and the estimate


class Shape(NamedTuple):
    """What is known of a value's size: ``None`` where nothing is."""

    size: int | None  # length of a string or bytes, entries of a list or map; 1: scalar
    items: Shape | None = None  # list elements or map values
    keys: Shape | None = None  # map keys


_UNKNOWN: Final = Shape(None)
_SCALAR: Final = Shape(1)
_NAME: Final = Shape(_MAX_NAME)
_VALUE_MAP: Final = Shape(MAX_ENTRIES_PER_MAP, Shape(MAX_STRING_VALUE), _NAME)
_QUANTITY_MAP: Final = Shape(MAX_ENTRIES_PER_MAP, _SCALAR, _NAME)
DEVICE_FIELDS: Final = {
    "driver": _NAME,
    "attributes": Shape(MAX_ENTRIES_PER_MAP, _VALUE_MAP, _NAME),
    "capacity": Shape(MAX_ENTRIES_PER_MAP, _QUANTITY_MAP, _NAME),
    "allowMultipleAllocations": _SCALAR,
}
_DEVICE: Final = Shape(len(DEVICE_FIELDS), _NAME, Shape(24))


def _plus(*costs: int | None) -> int | None:
    total = 0
    for cost in costs:
        if cost is None:
            return None
        total += cost
    return total


def _times(count: int | None, cost: int | None) -> int | None:
    return None if count is None or cost is None else count * cost


def _per(size: int | None, factor: float) -> int | None:
    return None if size is None else math.ceil(size * factor)


def _union(a: Shape | None, b: Shape | None) -> Shape:
    if a is None or b is None:
        return _UNKNOWN
    size = None if a.size is None or b.size is None else max(a.size, b.size)
    items = None if a.items is None and b.items is None else _union(a.items, b.items)
    keys = None if a.keys is None and b.keys is None else _union(a.keys, b.keys)
    return Shape(size, items, keys)


def _subtrees(tree: lark.Tree[Any]) -> list[lark.Tree[Any]]:
    return [c for c in tree.children if isinstance(c, lark.Tree)]


class _Estimator:
    """One walk over a parse tree; ``scopes`` holds the comprehension variables."""

    def __init__(self) -> None:
        self.scopes: list[tuple[str, Shape]] = []

    def walk(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        method = getattr(self, "_" + str(tree.data), None)
        if method is not None:
            return cast(tuple[int | None, Shape], method(tree))
        children = _subtrees(tree)
        if len(children) == 1:  # a pass-through level of the grammar
            return self.walk(children[0])
        return None, _UNKNOWN  # a construct this estimator does not know: unbounded

    def _operands(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape, Shape]:
        """Cost and shapes of a binary operator node ``[op(left), right]``."""
        op, right = tree.children
        assert isinstance(op, lark.Tree) and isinstance(right, lark.Tree)
        left_cost, left = self.walk(op.children[0])
        right_cost, right_shape = self.walk(right)
        return _plus(left_cost, right_cost), left, right_shape

    def _expr(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        children = _subtrees(tree)
        if len(children) == 1:
            return self.walk(children[0])
        (cond, _), (yes, yes_shape), (no, no_shape) = (self.walk(c) for c in children)
        dearer = None if yes is None or no is None else max(yes, no)
        return _plus(cond, dearer), _union(yes_shape, no_shape)

    def _logical(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        children = _subtrees(tree)
        if len(children) == 1:
            return self.walk(children[0])
        return _plus(*(self.walk(c)[0] for c in children)), _SCALAR

    _conditionalor = _logical
    _conditionaland = _logical

    def _relation(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        children = _subtrees(tree)
        if len(children) == 1:
            return self.walk(children[0])
        cost, left, right = self._operands(tree)
        if children[0].data == "relation_in":
            return _plus(cost, right.size), _SCALAR
        sizes = [s for s in (left.size, right.size) if s is not None]
        compare = max(1, math.ceil(min(sizes) * _STRING_FACTOR)) if sizes else None
        return _plus(cost, compare), _SCALAR

    def _addition(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        children = _subtrees(tree)
        if len(children) == 1:
            return self.walk(children[0])
        cost, left, right = self._operands(tree)
        if children[0].data == "addition_sub":
            return _plus(cost, 1), _SCALAR
        size = None if left.size is None or right.size is None else left.size + right.size
        joined = Shape(size, _union(left.items, right.items) if left.items or right.items else None)
        add = None if size is None else max(1, math.ceil(size * _STRING_FACTOR))
        return _plus(cost, add), joined

    def _arithmetic(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        children = _subtrees(tree)
        if len(children) == 1:
            return self.walk(children[0])
        return _plus(*(self.walk(c)[0] for c in children), 1), _SCALAR

    _multiplication = _arithmetic
    _unary = _arithmetic

    def _unary_not(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        return 0, _SCALAR

    _unary_neg = _unary_not

    def _multiplication_op(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        return self.walk(tree.children[0])

    _multiplication_mul = _multiplication_op
    _multiplication_div = _multiplication_op
    _multiplication_mod = _multiplication_op

    def _literal(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        token = tree.children[0]
        if isinstance(token, lark.Token) and token.type in ("STRING_LIT", "MLSTRING_LIT"):
            return 0, Shape(len(token))
        if isinstance(token, lark.Token) and token.type == "BYTES_LIT":
            return 0, Shape(len(token))
        return 0, _SCALAR

    def _ident(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        name = str(tree.children[0])
        for bound, shape in reversed(self.scopes):
            if bound == name:
                return 1, shape
        return 1, _DEVICE if name == "device" else _UNKNOWN

    def _dot_ident(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        return 1, _UNKNOWN

    def _paren_expr(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        return self.walk(_subtrees(tree)[0])

    def _list_lit(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        elements = [self.walk(e) for e in self._exprs(tree)]
        items: Shape | None = None
        for _, shape in elements:
            items = shape if items is None else _union(items, shape)
        return _plus(_LIST_CREATE, *(c for c, _ in elements)), Shape(len(elements), items)

    def _map_lit(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        inits = _subtrees(tree)
        parts = [self.walk(e) for e in _subtrees(inits[0])] if inits else []
        keys, values = parts[0::2], parts[1::2]
        key_shape = value_shape = None
        for (_, k), (_, v) in zip(keys, values, strict=True):
            key_shape = k if key_shape is None else _union(key_shape, k)
            value_shape = v if value_shape is None else _union(value_shape, v)
        cost = _plus(_MAP_CREATE, *(c for c, _ in parts))
        return cost, Shape(len(keys), value_shape, key_shape)

    def _member_object(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        target, *inits = _subtrees(tree)
        values = [self.walk(v)[0] for init in inits for v in _subtrees(init)]
        return _plus(self.walk(target)[0], _MESSAGE_CREATE, *values), _UNKNOWN

    def _member_dot(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        target, name = tree.children
        cost, shape = self.walk(target)
        if shape is _DEVICE:
            return _plus(cost, 1), DEVICE_FIELDS.get(str(name), _UNKNOWN)
        return _plus(cost, 1), shape.items or _UNKNOWN

    def _member_index(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        target, index = _subtrees(tree)
        cost, shape = self.walk(target)
        index_cost, _ = self.walk(index)
        return _plus(cost, index_cost, 1), shape.items or _UNKNOWN

    def _exprs(self, tree: lark.Tree[Any]) -> list[lark.Tree[Any]]:
        """The argument expressions of a call or the elements of a list literal."""
        lists = [c for c in _subtrees(tree) if c.data == "exprlist"]
        return _subtrees(lists[0]) if lists else []

    def _ident_arg(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        name = str(tree.children[0])
        args = [self.walk(a) for a in self._exprs(tree)]
        cost = _plus(1, *(c for c, _ in args))
        if name == "dyn" and args:
            return cost, args[0][1]
        if name in ("string", "bytes") and args:
            size = args[0][1].size
            return cost, Shape(None if size is None else max(4 * size, 40))
        if name in ("list", "map") and args:
            return cost, args[0][1]
        return cost, _SCALAR  # sizes, conversions, quantities, versions: fixed size

    def _member_dot_arg(self, tree: lark.Tree[Any]) -> tuple[int | None, Shape]:
        target, name_token = tree.children[:2]
        name = str(name_token)
        if name in MACRO_BASE:
            return self._comprehension(target, name, self._exprs(tree))
        target_cost, target_shape = self.walk(target)
        args = [self.walk(a) for a in self._exprs(tree)]
        cost = _plus(target_cost, *(c for c, _ in args))
        if name in _STRING_METHODS and len(args) == 1:
            return _plus(cost, _string_method(name, target_shape, args[0][1])), _SCALAR
        return _plus(cost, 1), _SCALAR

    def _comprehension(
        self, target: lark.Tree[Any], name: str, args: list[lark.Tree[Any]]
    ) -> tuple[int | None, Shape]:
        range_cost, range_shape = self.walk(target)
        var = _bound_name(args[0]) if args else None
        element = range_shape.keys if range_shape.keys is not None else range_shape.items
        self.scopes.append((var or "", element or _UNKNOWN))
        try:
            body = [self.walk(a) for a in args[1:]]
        finally:
            self.scopes.pop()
        step = _plus(MACRO_STEP[name], *(c for c, _ in body))
        if name == "map" and len(body) == 2:
            step = _plus(step, 1)  # the filtering form: map(x, p, f)
        cost = _plus(range_cost, MACRO_BASE[name], _times(range_shape.size, step))
        if name == "map":
            return cost, Shape(range_shape.size, body[-1][1] if body else _UNKNOWN)
        if name == "filter":
            return cost, Shape(range_shape.size, range_shape.items)
        return cost, _SCALAR


def _string_method(name: str, target: Shape, arg: Shape) -> int | None:
    if name in ("startsWith", "endsWith"):
        return _per(arg.size, _STRING_FACTOR)
    if name == "contains":
        return _times(_per(target.size, _STRING_FACTOR), _per(arg.size, _STRING_FACTOR))
    text = None if target.size is None else target.size + 1
    return _times(_per(text, _STRING_FACTOR), _per(arg.size, _REGEX_FACTOR))


def _bound_name(tree: lark.Tree[Any]) -> str | None:
    idents = list(tree.find_data("ident"))
    return str(idents[0].children[0]) if len(idents) == 1 else None


def estimate(tree: lark.Tree[Any]) -> int | None:
    """The worst-case cost of a parsed expression; ``None`` when it cannot be bounded."""
    cost, _ = _Estimator().walk(tree)
    return cost


# ---------------------------------------------------------------------------
# The runtime budget


class OverBudget(BaseException):
    """The evaluation used up its budget (see the module docstring)."""


class Interrupted(BaseException):
    """The evaluation was asked to stop from outside (:func:`interrupt`)."""


class Budget:
    """The cost units an evaluation may still spend.

    Every charge is also where an evaluation notices :func:`interrupt`: the evaluator
    stops between two nodes, never in the middle of one of cel-python's own steps (an
    exception raised at an arbitrary point — by a signal handler, say — can be swallowed
    by C code that ignores errors, and the evaluation goes on with a wrong value).
    """

    __slots__ = ("limit", "spent")
    #: set by :func:`interrupt`, from a signal handler of the process
    stop_requested = False

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.spent = 0

    def spend(self, units: int) -> None:
        """Charge ``units``; raise :class:`OverBudget` once the limit is passed."""
        self.spent += units
        if self.spent > self.limit:
            raise OverBudget
        if Budget.stop_requested:
            raise Interrupted


def interrupt() -> None:
    """Make the evaluation running in this process stop at its next node (see Budget)."""
    Budget.stop_requested = True


def clear_interrupt() -> None:
    """Before the next evaluation: no stop requested."""
    Budget.stop_requested = False


#: What visiting a node of the parse tree costs (nodes with operands only when they
#: hold an operator: the grammar's single-child levels are free).
_NODE_COST: Final = {
    "ident": 1,
    "dot_ident": 1,
    "member_dot": 1,
    "member_index": 1,
    "ident_arg": 1,
    "dot_ident_arg": 1,
    "list_lit": _LIST_CREATE,
    "map_lit": _MAP_CREATE,
    "member_object": _MESSAGE_CREATE,
}
_OPERATOR_NODES: Final = frozenset({"relation", "addition", "multiplication", "unary"})


class CostedEvaluator(Evaluator):
    """cel-python's evaluator, charging a :class:`Budget` as it goes."""

    def __init__(
        self, ast: lark.Tree[Any], activation: Activation, budget: Budget, step: int = 0
    ) -> None:
        super().__init__(ast, activation)
        self.budget = budget
        self._step = step  # charged per evaluation: a comprehension's bookkeeping
        self._macro_step = 0  # the step of the macro whose body is being built

    def _visit_tree(self, tree: lark.Tree[Any]) -> Any:
        data = tree.data
        cost = _NODE_COST.get(data)
        if cost is not None:
            self.budget.spend(cost)
        elif data in _OPERATOR_NODES and len(tree.children) > 1:
            self.budget.spend(1)
        return super()._visit_tree(tree)

    def member_dot_arg(self, tree: lark.Tree[Any]) -> Any:
        name = str(tree.children[1])
        if name not in MACRO_BASE:
            self.budget.spend(1)
            return super().member_dot_arg(tree)
        self.budget.spend(MACRO_BASE[name])
        outer, self._macro_step = self._macro_step, MACRO_STEP[name]
        try:
            return super().member_dot_arg(tree)
        finally:
            self._macro_step = outer

    def sub_evaluator(self, ast: lark.Tree[Any]) -> CostedEvaluator:
        return CostedEvaluator(ast, self.activation, self.budget, self._macro_step)

    def evaluate(self, context: Any = None) -> Any:
        if self._step:
            self.budget.spend(self._step)
        return super().evaluate(context)


def run(program: celpy.Runner, context: dict[str, object], budget: Budget) -> object:
    """Evaluate a compiled program under ``budget`` (raises :class:`OverBudget`)."""
    evaluator = CostedEvaluator(program.ast, program.new_activation(), budget)
    return evaluator.evaluate(cast(Any, context))
