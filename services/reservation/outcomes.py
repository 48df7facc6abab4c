"""What one allocation decision returns.

One of three outcomes, mirroring the upstream allocator's three results:

* :class:`Allocated` — a complete allocation (upstream: a result), with the
  Kubernetes ``AllocationResult`` and one :class:`Grant` per device result that says
  what to add to the allocated state;
* :class:`Unschedulable` — no solution right now (upstream: ``nil, nil``); the claim
  may fit later, when capacity is released;
* :class:`Invalid` — the claim cannot be allocated as written (upstream: an error),
  e.g. a disabled feature, a missing class, a failing CEL selector.

and a fourth that upstream does not need, because cel-go is fast: :class:`Deferred` —
no decision yet, a tenant's selector is too expensive to evaluate in the decision and
its results are being computed elsewhere (only when the inventory has an inline
budget; see :mod:`events.inventory`).
"""

from __future__ import annotations

import msgspec

from events.model import AllocationResult
from events.quantities import Quantity

DeviceKey = tuple[str, str, str]


class Grant(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One device result of an allocation, as the allocated state records it."""

    request: str
    device: DeviceKey
    share_id: str | None  # set for multi-allocatable devices (the Kubernetes shareID)
    admin_access: bool
    consumed: dict[str, Quantity]  # every capacity of a multi-allocatable device; else {}
    namespace: str = ""  # the claim's: a device isolated by its class holds one at a time


class Allocated(msgspec.Struct, frozen=True, kw_only=True):
    claim: str  # namespace/name
    node: str | None
    allocation: AllocationResult
    grants: list[Grant]


class Unschedulable(msgspec.Struct, frozen=True, kw_only=True):
    claim: str
    reason: str


class Invalid(msgspec.Struct, frozen=True, kw_only=True):
    claim: str
    reason: str


class Deferred(msgspec.Struct, frozen=True, kw_only=True):
    claim: str
    expression: str  # the selector whose results are missing
    reason: str = "a selector of the claim is being evaluated"


Outcome = Allocated | Unschedulable | Invalid | Deferred
