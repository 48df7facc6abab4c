"""Tenants' heavy selectors: the decision defers them instead of evaluating them inline.

An inventory with an inline budget (the reservation service's) evaluates a tenant's
selector only while it stays within the budget; beyond it the claim is
:class:`Deferred` and the inventory lists what is missing, until results computed
elsewhere are recorded. Class selectors (the operator's) are always evaluated inline,
and without a budget (``dracap allocate``) so is everything.
"""

from __future__ import annotations

from events.errors import SelectorDeadlineExceeded
from events.inventory import Inventory
from services.reservation.allocating import Allocator
from services.reservation.outcomes import Deferred, Invalid
from tests.unit.allocator_fixtures import (
    DRIVER,
    claim,
    device,
    device_class,
    picked,
    request,
    slice_,
)

POLICY = {"default": "5Gi", "validRange": {"min": "5Gi", "step": "5Gi", "max": "40Gi"}}
MODEL = f'device.attributes["{DRIVER}"].model'


def gpu(name: str, model: str) -> dict[str, object]:
    return device(name, {"memory": ("40Gi", POLICY)}, attributes={"model": model})


def heavy(model: str) -> str:
    """A selector whose estimate is far above a small budget, matching one model."""
    items = "[" + ",".join(str(i) for i in range(1, 21)) + "]"
    return f'{items}.all(x, x > 0) && {MODEL} == "{model}"'


def inventory(budget: int | None, *models: str, classes: list[str] | None = None) -> Inventory:
    devices = [gpu(f"gpu-{i}", m) for i, m in enumerate(models)]
    return Inventory(
        [device_class(selectors=classes or [])], [slice_(devices)], inline_budget=budget
    )


def test_a_heavy_selector_defers_the_claim_until_its_results_are_recorded() -> None:
    inv = inventory(50, "a", "b")
    alloc = Allocator(inv)
    expression = heavy("b")
    tenant = claim(request("r", {"memory": "5Gi"}, selectors=[expression]))

    out = alloc.allocate(tenant, any_node=True)
    assert isinstance(out, Deferred) and out.expression == expression
    assert inv.wanted == {expression: {0, 1}}
    assert isinstance(alloc.allocate(tenant, any_node=True), Deferred)  # still missing

    inv.record_results(expression, {0: False, 1: True})
    assert inv.wanted == {}
    assert picked(alloc.allocate(tenant, any_node=True)) == [("r", "gpu-1", {"memory": "5Gi"})]


def test_light_tenant_selectors_and_class_selectors_are_evaluated_in_the_decision() -> None:
    inv = inventory(50, "a", "b", classes=[heavy("b")])  # a heavy *class* selector
    alloc = Allocator(inv)
    tenant = claim(request("r", {"memory": "5Gi"}, selectors=[f'{MODEL} == "b"']))
    assert picked(alloc.allocate(tenant, any_node=True)) == [("r", "gpu-1", {"memory": "5Gi"})]
    assert inv.wanted == {}


def test_spending_past_the_budget_leaves_the_rest_to_be_evaluated_elsewhere() -> None:
    inv = inventory(20, *"abcdefgh")  # a 5-unit selector over 8 devices: 40 units
    alloc = Allocator(inv)
    expression = f'{MODEL} == "h"'
    out = alloc.allocate(claim(request("r", selectors=[expression])), any_node=True)
    assert isinstance(out, Deferred)
    evaluated_here = {i for i in range(8) if (i, expression) in inv._selector_cache}
    assert evaluated_here and inv.wanted[expression] == set(range(8)) - evaluated_here


def test_deferred_results_decide_as_inline_evaluation_would() -> None:
    expression = heavy("b")
    tenant = claim(request("r", {"memory": "5Gi"}, selectors=[expression]))
    inline = Allocator(inventory(None, "a", "b", "b")).allocate(tenant, any_node=True)

    inv = inventory(50, "a", "b", "b")
    alloc = Allocator(inv)
    assert isinstance(alloc.allocate(tenant, any_node=True), Deferred)
    elsewhere = inventory(None, "a", "b", "b")  # the pool evaluates on the same devices
    inv.record_results(
        expression, {i: elsewhere.selector_result(i, expression) for i in inv.wanted[expression]}
    )
    assert picked(alloc.allocate(tenant, any_node=True)) == picked(inline)


def test_a_failing_heavy_selector_makes_the_claim_invalid_once_evaluated() -> None:
    inv = inventory(50, "a")
    alloc = Allocator(inv)
    expression = heavy("a")
    tenant = claim(request("r", selectors=[expression]))
    assert isinstance(alloc.allocate(tenant, any_node=True), Deferred)
    stopped = SelectorDeadlineExceeded(expression, "evaluation stopped after 2s (the deadline)")
    inv.record_results(expression, {0: stopped})
    out = alloc.allocate(tenant, any_node=True)
    assert isinstance(out, Invalid) and "evaluation stopped after 2s" in out.reason
