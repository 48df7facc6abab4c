"""How much of a device capacity one request consumes (request policy math).

This is the upstream consumable-capacity rule set (KEP-5075, Kubernetes 1.34/1.35,
``consumable_capacity.go``), written from ``docs/../dra-semantics.md`` §3.3 and §3.4:

* no request for a capacity -> the policy default, else the whole capacity;
* a request without policy -> exactly the request;
* ``validRange``: below ``min`` -> ``min``; with ``step`` -> rounded up to
  ``min + k*step`` in *integer* base units (``Quantity.Value()``, rounded up), which
  is the upstream quirk that collapses fractional steps; the result prints BinarySI;
* ``validValues``: the smallest value not below the request, else the request itself.

After rounding, :func:`violates_policy` decides whether the amount is admissible
(above ``max``, off the step grid, or not one of ``validValues``). A violation makes
the device ineligible for the request; it is never an error.

Everything here is integer arithmetic on :class:`events.quantities.Quantity`.
"""

from __future__ import annotations

from events.model import CapacityRequestPolicy, describe_policy
from events.quantities import Format, Quantity

__all__ = ["consumed_amount", "describe_policy", "violates_policy"]

NANOS_PER_UNIT = 10**9


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def consumed_amount(
    total: Quantity, policy: CapacityRequestPolicy | None, requested: Quantity | None
) -> Quantity:
    """The amount of one capacity a request consumes on a device (before the fit check)."""
    if requested is None:
        if policy is not None and policy.default is not None:
            return policy.default
        return total
    if policy is None:
        return requested
    valid_range = policy.valid_range
    if valid_range is not None:
        if requested < valid_range.min:
            return valid_range.min
        if valid_range.step is None:
            return requested
        r = requested.value()
        m = valid_range.min.value()
        s = valid_range.step.value()
        if s <= 0:  # validation forbids it; keep the request unchanged rather than divide by 0
            return requested
        rounded = m + s * _ceil_div(r - m, s)
        return Quantity(rounded * NANOS_PER_UNIT, Format.BINARY_SI)
    if policy.valid_values:
        for value in policy.valid_values:
            if requested <= value:
                return value
        return requested
    return requested


def violates_policy(amount: Quantity, policy: CapacityRequestPolicy | None) -> bool:
    """True when ``amount`` is not an admissible consumption under ``policy``."""
    if policy is None:
        return False
    if policy.default is not None and amount == policy.default:
        return False
    valid_range = policy.valid_range
    if valid_range is not None:
        if valid_range.max is not None and amount > valid_range.max:
            return True
        if valid_range.step is not None:
            step = valid_range.step.value()
            if step > 0 and (amount.value() - valid_range.min.value()) % step != 0:
                return True
        return False
    if policy.valid_values:
        return amount not in policy.valid_values
    return False
