"""The depth-first search for one claim on one node. Pure.

:class:`Search` tries the requests in order and, for each, the required number of
device slots; every slot tries the candidate devices in order (pools sorted, slices in
input order, devices in spec order, or the class's placement order:
:func:`~services.reservation.placement.placement_order`) and the first complete
solution wins. ``firstAvailable`` tries subrequests in order. Backtracking undoes
constraint values, dedicated picks and in-call consumption. The checks per candidate
(:meth:`Search.in_use`, :meth:`Search.foreign`, then pools, binding conditions, lost
nodes, enforcement minimums, health, capacity and policy, taints, constraints) are
upstream's, in its order; the module docstring of
:mod:`services.reservation.allocating` lists them.

The search reads the allocated state and the candidate lists through the allocator
that runs it (:class:`SearchSpace`), and never changes either: it keeps what it takes
in the call (``in_call``, ``dedicated``) to itself. Every device check costs one unit
of :data:`SEARCH_BUDGET`; a search that spends it gives up (upstream bounds the search
by a timeout). Why a failed search failed is :mod:`services.reservation.diagnosis`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from events.inventory import DeviceEntry, Inventory
from events.model import ALLOCATION_MODE_ALL, ResourceClaim
from events.quantities import Quantity
from events.selectors import AttributeValue
from services.reservation.allocated import AllocatedState
from services.reservation.candidates import CandidateList, FreeIndex, MaxTree, first_fit
from services.reservation.placement import FIRST_FIT, placement_order
from services.reservation.policy import consumed_amount, violates_policy
from services.reservation.requestspecs import (
    MAX_DEVICES_PER_CLAIM,
    Constraint,
    InvalidClaimError,
    Pick,
    RequestSpec,
)

__all__ = ["SEARCH_BUDGET", "Search", "SearchSpace"]

SEARCH_BUDGET = 200_000  # device checks per decision; upstream bounds the search by a timeout


class _BudgetExhaustedError(Exception):
    pass


class SearchSpace(Protocol):
    """What a search reads of its allocator: the state and the candidate lists."""

    @property
    def inventory(self) -> Inventory: ...
    @property
    def allocated(self) -> AllocatedState: ...
    def candidates(self, node: str | None, spec: RequestSpec) -> CandidateList: ...
    def free_tree(self, clist: CandidateList, name: str) -> MaxTree: ...
    def free_index(self, clist: CandidateList, name: str) -> FreeIndex: ...
    def whole_names(self, clist: CandidateList) -> tuple[str, ...]: ...
    def still_shared(self, entry: DeviceEntry) -> bool: ...


class Search:
    """One depth-first search for one claim on one node."""

    __slots__ = (
        "a",
        "budget",
        "claim",
        "constraints",
        "dedicated",
        "depth_failed",
        "failed_spec",
        "in_call",
        "inv",
        "invalid_pool_seen",
        "namespace",
        "node",
        "picks",
        "specs",
    )

    def __init__(
        self,
        allocator: SearchSpace,
        claim: ResourceClaim,
        specs: list[list[RequestSpec]],
        constraints: list[Constraint],
        node: str | None,
    ) -> None:
        self.a = allocator
        self.inv = allocator.inventory
        self.claim = claim
        self.namespace = claim.metadata.namespace or ""
        self.specs = specs
        self.constraints = constraints
        self.node = node
        self.picks: list[Pick] = []
        self.in_call: dict[int, dict[str, int]] = {}
        self.dedicated: set[int] = set()
        self.budget = SEARCH_BUDGET
        self.failed_spec: RequestSpec | None = None
        self.depth_failed = -1
        self.invalid_pool_seen: str | None = None

    def run(self) -> list[Pick] | None:
        try:
            ok = self._solve(0)
        except _BudgetExhaustedError:
            self.failed_spec = None
            self.depth_failed = -2
            return None
        if ok:
            return list(self.picks)
        if self.invalid_pool_seen is not None:
            raise InvalidClaimError(self.invalid_pool_seen)
        return None

    # request level
    def _solve(self, ri: int) -> bool:
        if ri == len(self.specs):
            return True
        for spec in self.specs[ri]:
            if spec.mode == ALLOCATION_MODE_ALL:
                devices = self._all_devices(spec)
                if devices and self._solve_all(ri, spec, devices, 0):
                    return True
                if not devices:
                    self._note_failure(ri, spec)
            elif self._solve_slot(ri, spec, 0):
                return True
        return False

    def _note_failure(self, ri: int, spec: RequestSpec) -> None:
        if ri >= self.depth_failed:
            self.depth_failed = ri
            self.failed_spec = spec

    # ExactCount
    def _solve_slot(self, ri: int, spec: RequestSpec, slot: int) -> bool:
        if slot == spec.count:
            return self._solve(ri + 1)
        clist = self.a.candidates(self.node, spec)
        if spec.placement != FIRST_FIT and spec.capacity and not spec.admin:
            return self._solve_ranked(ri, spec, slot, clist)
        trees: list[tuple[MaxTree, int]] = []
        if not spec.admin:
            # a capacity tree holds UNUSABLE (-1) wherever the usable tree holds 0, so a
            # threshold >= 0 on it already prunes what the usable tree would
            pruned = False
            for name, amount in spec.capacity.items():
                trees.append((self.a.free_tree(clist, name), amount.nanos))
                pruned = pruned or amount.nanos >= 0
            if spec.whole:  # a whole take needs every capacity untouched: free >= 1 prunes
                for name in self.a.whole_names(clist):
                    trees.append((self.a.free_tree(clist, name), 1))
                    pruned = True
            if not pruned:
                assert clist.usable is not None
                trees.insert(0, (clist.usable, 1))
        # the claim is complete once this slot is filled (what the recursion would find)
        last = slot + 1 == spec.count and ri + 1 == len(self.specs)
        devices = clist.devices
        errors = clist.errors
        pos = 0
        count = len(devices)
        while pos < count:
            if trees:
                pos = first_fit(trees, pos, count)
                if pos < 0:
                    break
            index = devices[pos]
            if errors:
                self._check_errors(clist, spec, index)
            pick = self._try(spec, index)
            if pick is not None and self._push(pick):
                if last or self._solve_slot(ri, spec, slot + 1):
                    return True
                self._pop()
            pos += 1
        if errors:
            self._check_errors(clist, spec, None)
        self._note_failure(ri, spec)
        return False

    def _solve_ranked(self, ri: int, spec: RequestSpec, slot: int, clist: CandidateList) -> bool:
        """One ExactCount slot with the candidates in the order of the class's placement."""
        self._check_errors(clist, spec, None)  # every candidate is looked at: any error counts
        name = min(spec.capacity)
        amount = spec.capacity[name].nanos
        sizes = self.a.allocated.sizes.get(name)
        devices = clist.devices
        for pos in placement_order(spec.placement, self.a.free_index(clist, name), amount, sizes):
            pick = self._try(spec, devices[pos])
            if pick is not None and self._push(pick):
                if self._solve_slot(ri, spec, slot + 1):
                    return True
                self._pop()
        self._note_failure(ri, spec)
        return False

    def _check_errors(self, clist: CandidateList, spec: RequestSpec, before: int | None) -> None:
        """Raise the first CEL error the upstream search would have met before ``before``."""
        for index, error in clist.errors:
            if before is not None and index > before:
                return
            if not self.in_use(spec, index):
                raise InvalidClaimError(f"request {spec.result_name}: {error}")

    # All
    def _all_devices(self, spec: RequestSpec) -> list[int]:
        for pool in self.inv.visible_pools(self.node):
            if not pool.complete:
                raise InvalidClaimError(
                    f"request {spec.result_name}: asks for all devices, but pool "
                    f"{pool.driver}/{pool.name} is incomplete (being updated)"
                )
            if pool.invalid_reason:
                raise InvalidClaimError(
                    f"request {spec.result_name}: asks for all devices, but {pool.invalid_reason}"
                )
        clist = self.a.candidates(self.node, spec)
        if clist.errors:
            raise InvalidClaimError(f"request {spec.result_name}: {clist.errors[0][1]}")
        return [
            d for d in clist.devices if self._capacity_fits(spec, self.inv.devices[d], False)[0]
        ]

    def _solve_all(self, ri: int, spec: RequestSpec, devices: list[int], slot: int) -> bool:
        if slot == len(devices):
            return self._solve(ri + 1)
        if slot + len(self.picks) >= MAX_DEVICES_PER_CLAIM + 1:
            raise InvalidClaimError(
                f"request {spec.result_name}: needs more than {MAX_DEVICES_PER_CLAIM} devices"
            )
        pick = self._try(spec, devices[slot], all_mode=True)
        if pick is None or not self._push(pick, all_mode=True):
            self._note_failure(ri, spec)
            return False
        if self._solve_all(ri, spec, devices, slot + 1):
            return True
        self._pop()
        return False

    # one candidate
    def in_use(self, spec: RequestSpec, index: int) -> bool:
        """Whether device ``index`` is taken: picked whole in this call, held exclusively,
        or dedicated and still held by shares (admin access ignores the holds)."""
        if index in self.dedicated:
            return True
        if spec.admin:
            return False
        entry = self.inv.devices[index]
        return entry.key in self.a.allocated.exclusive or self.a.still_shared(entry)

    def foreign(self, spec: RequestSpec, index: int) -> bool:
        """Whether an isolated device is held by another namespace (admin access: never)."""
        if spec.admin or not self.inv.isolated(index):
            return False
        return self.a.allocated.held_by_others(self.inv.devices[index].key, self.namespace)

    def _try(self, spec: RequestSpec, index: int, *, all_mode: bool = False) -> Pick | None:
        self.budget -= 1
        if self.budget < 0:
            raise _BudgetExhaustedError
        inv = self.inv
        entry = inv.devices[index]
        if self.in_use(spec, index) or self.foreign(spec, index):
            return None
        pool = inv.pools[entry.pool_index]
        if not all_mode:
            if pool.invalid_reason:
                self.invalid_pool_seen = self.invalid_pool_seen or pool.invalid_reason
                return None
            if not pool.complete:
                return None
        if entry.device.binding_conditions and not (
            inv.gates.device_binding_conditions and inv.gates.device_status
        ):
            return None
        if inv.lost_nodes and inv.lost(entry) is not None:
            return None
        if inv.min_enforcement and inv.below_minimum(entry, spec.class_name):
            return None
        if self.inv.unhealthy and entry.key in self.inv.unhealthy:
            return None
        ok, consumed = self._capacity_fits(spec, entry, True)
        if not ok:
            return None
        if inv.gates.device_taints and not _tolerates(entry, spec.tolerations):
            return None
        return Pick(spec, index, consumed, entry.multi)

    def _capacity_fits(
        self, spec: RequestSpec, entry: DeviceEntry, in_call: bool
    ) -> tuple[bool, dict[str, Quantity]]:
        consumed: dict[str, Quantity] = {}
        if not self.inv.gates.consumable_capacity:
            return True, consumed
        for name in spec.capacity:
            if name not in entry.capacities:
                return False, consumed
        allocated = self.a.allocated.consumed.get(entry.key)
        pending = self.in_call.get(entry.index) if in_call else None
        for name, info in entry.capacities.items():
            policy = info.policy
            if policy is None:  # consumed_amount and violates_policy without a policy
                amount = info.total if spec.whole else spec.capacity.get(name, info.total)
            else:
                amount = consumed_amount(info.total, policy, spec.wanted(name, info.total))
                if violates_policy(amount, policy):
                    return False, consumed
            used = (allocated.get(name, 0) if allocated else 0) + (
                pending.get(name, 0) if pending else 0
            )
            if used + amount.nanos > info.total.nanos:
                return False, consumed
            consumed[name] = amount
        return True, consumed

    # constraints and bookkeeping
    def _push(self, pick: Pick, *, all_mode: bool = False) -> bool:
        entry = self.inv.devices[pick.device]
        applied: list[Constraint] = []
        for constraint in self.constraints:
            if not constraint.applies(pick.spec):
                continue
            value = entry.attribute(constraint.attribute)
            ok = value is not None and _constraint_accepts(constraint, value)
            if not ok:
                for c in applied:
                    c.values.pop()
                if all_mode:
                    raise InvalidClaimError(
                        f"request {pick.spec.result_name}: device {'/'.join(entry.key)} "
                        f"violates the {'distinct' if constraint.distinct else 'match'}Attribute "
                        f"constraint on {constraint.attribute}"
                    )
                return False
            assert value is not None
            constraint.values.append(value)
            applied.append(constraint)
        if pick.share:
            pending = self.in_call.setdefault(pick.device, {})
            for name, amount in pick.consumed.items():
                pending[name] = pending.get(name, 0) + amount.nanos
        else:
            self.dedicated.add(pick.device)
        pick.applied = applied
        self.picks.append(pick)
        return True

    def _pop(self) -> None:
        pick = self.picks.pop()
        for constraint in pick.applied:
            constraint.values.pop()
        if pick.share:
            pending = self.in_call[pick.device]
            for name, amount in pick.consumed.items():
                pending[name] -= amount.nanos
        else:
            self.dedicated.discard(pick.device)


def _constraint_accepts(constraint: Constraint, value: AttributeValue) -> bool:
    if constraint.distinct:
        return all(type(v) is not type(value) or v != value for v in constraint.values)
    if not constraint.values:
        return True
    first = constraint.values[0]
    return type(first) is type(value) and first == value


def _tolerates(entry: DeviceEntry, tolerations: list[dict[str, object]]) -> bool:
    for taint in entry.device.taints or []:
        effect = taint.get("effect")
        if effect not in ("NoSchedule", "NoExecute"):
            continue
        if not any(_toleration_matches(t, taint) for t in tolerations):
            return False
    return True


def _toleration_matches(toleration: Mapping[str, object], taint: Mapping[str, object]) -> bool:
    effect = toleration.get("effect")
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key")
    operator = toleration.get("operator") or "Equal"
    if not key:
        return operator == "Exists"
    if key != taint.get("key"):
        return False
    return operator == "Exists" or toleration.get("value", "") == taint.get("value", "")
