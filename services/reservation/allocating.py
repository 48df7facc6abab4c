"""The allocator: one ResourceClaim in, one decision out. Pure: no I/O.

It follows the upstream structured-parameters allocator of Kubernetes 1.35 for
consumable capacity (see ``dra-semantics.md`` in the design folder), without the
v1.34.x defects that page lists:

1. **Pre-checks** turn into :class:`Invalid`: disabled gates (capacity requests and
   ``distinctAttribute`` need ``DRAConsumableCapacity``, ``firstAvailable`` needs
   ``DRAPrioritizedList``, ``adminAccess`` needs ``DRAAdminAccess`` and a namespace
   labelled for it), a missing class, an empty constraint, more than 32 devices,
   ``All`` over an incomplete or invalid pool, a CEL error met during the search.
2. **Depth-first search**: requests in order, for each the required number of device
   slots; every slot tries the candidate devices in order (pools sorted, slices in
   input order, devices in spec order) and the first complete solution wins.
   ``firstAvailable`` tries subrequests in order. Backtracking undoes constraint
   values, dedicated picks and in-call consumption.
3. **Checks per candidate**, in upstream order: in use (an exclusive hold, a
   dedicated pick earlier in this call, or -- upstream 1.37's rule, not 1.34's -- a
   dedicated device that live shares still hold because its slice allowed multiple
   allocations when they were granted; admin access ignores holds of other claims),
   then dracap's tenancy rule (an *isolated* device, one a class annotated
   ``dracap.io/shared-across-namespaces: deny`` selects, is taken only while no other
   namespace holds a share or hold of it; admin access ignores it as it ignores holds),
   selectors, capacity (:mod:`services.reservation.policy`: every capacity of the
   device, requested or not, must fit next to allocated and in-call consumption and
   satisfy its policy), binding conditions and taints when their gates are on, then
   the constraints.
   The order in which a slot tries its candidates is the class's placement policy
   (``dracap.io/placement``, :mod:`services.reservation.placement`): ``first-fit`` is
   upstream's order above; ``binpack``, ``spread`` and ``fragmentation-aware`` rank the
   same candidates by their free capacity. Only the order changes, never the checks: a
   device is eligible or not whatever the policy. A ranked slot looks at every
   candidate, so a CEL error of any candidate not in use makes the claim
   :class:`Invalid` (first-fit: only one met before the device taken).
   A class in mode ``whole-device`` (``ClassModeSet``) is decided as if the
   DRAConsumableCapacity gate were off for it: a capacity request is :class:`Invalid`,
   and each claim takes a device whole -- a dedicated device as always, a
   multi-allocatable one through a share consuming every capacity's whole total (the
   ledger keeps a multi-allocatable device shared), so it fits only a device no live
   share holds and nothing fits beside it; a device whose request policy forbids a share
   of its whole total cannot be taken whole. A class in mode ``disabled`` is
   :class:`Invalid`. Allocations made earlier are never revisited.
4. **Results**: multi-allocatable devices get a fresh ShareID (UUID v4) and
   ``consumedCapacity`` listing every capacity; dedicated devices get neither.

Allocated state is kept per device, never as a list of shares, so "how much of this
device is taken" is a dict lookup whatever the number of shares. Candidate lists
with max-trees (:mod:`services.reservation.candidates`) skip full devices.

Decisions do not change the allocated state; :meth:`Allocator.commit` and
:meth:`Allocator.release` do, so a caller can decide, persist, then commit.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from msgspec.structs import replace

from events.errors import SelectorError
from events.inventory import DeviceEntry, Inventory, SelectorsPending
from events.model import (
    ALLOCATION_MODE_ALL,
    ALLOCATION_MODE_EXACT_COUNT,
    AllocationResult,
    DeviceAllocationConfiguration,
    DeviceAllocationResult,
    DeviceClaimConfiguration,
    DeviceConstraint,
    DeviceRequest,
    DeviceRequestAllocationResult,
    NodeSelector,
    NodeSelectorRequirement,
    NodeSelectorTerm,
    ResourceClaim,
)
from events.quantities import Quantity
from events.selectors import AttributeValue
from events.state import DeviceKey
from events.tenancy import placement
from services.reservation.candidates import (
    UNUSABLE,
    CandidateList,
    FreeIndex,
    MaxTree,
    first_fit,
)
from services.reservation.outcomes import (
    Allocated,
    Deferred,
    Grant,
    Invalid,
    Outcome,
    Unschedulable,
)
from services.reservation.placement import FIRST_FIT, placement_order
from services.reservation.policy import consumed_amount, describe_policy, violates_policy

MAX_DEVICES_PER_CLAIM = 32
SEARCH_BUDGET = 200_000  # device checks per decision; upstream bounds the search by a timeout


class _InvalidClaimError(Exception):
    """Raised inside the search for an upstream *error*; becomes :class:`Invalid`."""


class _BudgetExhaustedError(Exception):
    pass


# --- allocated state ---------------------------------------------------------------------


@dataclass(slots=True)
class AllocatedState:
    """What is taken: consumption per device and capacity, exclusive holds, and holders.

    Keyed by device, so lookups cost the same with ten shares or ten million.
    """

    consumed: dict[DeviceKey, dict[str, int]] = field(default_factory=dict)
    exclusive: dict[DeviceKey, int] = field(default_factory=dict)  # hold counts
    #: per device, the namespaces holding non-admin grants (grant counts)
    holders: dict[DeviceKey, dict[str, int]] = field(default_factory=dict)
    #: per device, the live non-admin shares (grants with a ShareID): they keep a device
    #: republished as dedicated in use until the last one is released
    shared: dict[DeviceKey, int] = field(default_factory=dict)
    shares: int = 0
    #: per capacity name, how many live shares consume each amount (nanos): the request
    #: sizes the fragmentation-aware placement expects next
    sizes: dict[str, dict[int, int]] = field(default_factory=dict)

    def add(self, grant: Grant, *, sign: int = 1) -> None:
        """Record (sign=1) or forget (sign=-1) one non-admin grant."""
        if grant.admin_access:
            return
        device = grant.device
        namespaces = self.holders.get(device)
        if namespaces is None:
            namespaces = self.holders[device] = {}
        namespace = grant.namespace
        count = namespaces.get(namespace, 0) + sign
        if count > 0:
            namespaces[namespace] = count
        else:
            namespaces.pop(namespace, None)
            if not namespaces:
                del self.holders[device]
        if grant.share_id is None:
            count = self.exclusive.get(device, 0) + sign
            if count > 0:
                self.exclusive[device] = count
            else:
                self.exclusive.pop(device, None)
            return
        self.shares += sign
        shared = self.shared
        count = shared.get(device, 0) + sign
        if count > 0:
            shared[device] = count
        else:
            shared.pop(device, None)
        per_device = self.consumed.get(device)
        if per_device is None:
            per_device = self.consumed[device] = {}
        sizes = self.sizes
        for name, amount in grant.consumed.items():
            nanos = amount.nanos
            per_device[name] = per_device.get(name, 0) + sign * nanos
            counts = sizes.get(name)
            if counts is None:
                counts = sizes[name] = {}
            count = counts.get(nanos, 0) + sign
            if count > 0:
                counts[nanos] = count
            else:
                counts.pop(nanos, None)

    def consumed_nanos(self, key: DeviceKey, name: str) -> int:
        per_device = self.consumed.get(key)
        return per_device.get(name, 0) if per_device else 0

    def held_by_others(self, key: DeviceKey, namespace: str) -> bool:
        """Whether a namespace other than ``namespace`` holds a grant on the device."""
        namespaces = self.holders.get(key)
        if not namespaces:
            return False
        return len(namespaces) > 1 or namespace not in namespaces


def grants_from_claim(claim: ResourceClaim, *, consumable_capacity: bool = True) -> list[Grant]:
    """The grants an already-allocated claim holds (upstream ``GatherAllocatedState``).

    Admin-access results are ignored. With the consumable-capacity gate off, every
    result counts as an exclusive hold (upstream ``ListAllAllocatedDevices``).
    """
    allocation = claim.status.allocation if claim.status else None
    results = (allocation.devices.results if allocation and allocation.devices else None) or []
    grants = []
    for r in results:
        if r.admin_access:
            continue
        share_id = r.share_id if consumable_capacity else None
        grants.append(
            Grant(
                request=r.request,
                device=(r.driver, r.pool, r.device),
                share_id=share_id,
                admin_access=False,
                consumed=dict(r.consumed_capacity or {}) if share_id else {},
                namespace=claim.metadata.namespace or "",
            )
        )
    return grants


def claim_configs(
    config: Sequence[DeviceClaimConfiguration] | None,
) -> list[DeviceAllocationConfiguration]:
    """A claim's own configuration as its allocation carries it (``FromClaim``, after the
    classes' entries)."""
    return [
        DeviceAllocationConfiguration(source="FromClaim", requests=c.requests, opaque=c.opaque)
        for c in config or ()
    ]


def with_claim_configs(
    allocation: AllocationResult, config: Sequence[DeviceClaimConfiguration] | None
) -> AllocationResult:
    """``allocation``, decided on a claim without its configuration (the fold's
    :class:`~events.claimspecs.ClaimSpec`), with that configuration added as
    :meth:`Allocator.allocate` adds it to a whole claim's."""
    added = claim_configs(config)
    devices = allocation.devices
    if not added or devices is None:
        return allocation
    whole = replace(devices, config=[*(devices.config or ()), *added])
    return replace(allocation, devices=whole)


# --- one request slot's view of the claim ---------------------------------------------------


@dataclass(slots=True)
class _RequestSpec:
    """An ``exactly`` request or one ``firstAvailable`` subrequest, normalised."""

    parent: str
    result_name: str  # "req" or "req/sub"
    class_name: str
    selectors: tuple[str, ...]
    mode: str
    count: int
    admin: bool
    capacity: dict[str, Quantity]
    tolerations: list[dict[str, object]]
    whole: bool = False  # the class is in mode whole-device: every capacity's total
    placement: str = FIRST_FIT  # the class's placement policy (dracap.io/placement)

    def wanted(self, name: str, total: Quantity) -> Quantity | None:
        """The amount of capacity ``name`` asked for (``None``: the policy's default)."""
        return total if self.whole else self.capacity.get(name)


@dataclass(slots=True)
class _Constraint:
    requests: frozenset[str] | None  # None: all requests
    attribute: str
    distinct: bool
    values: list[AttributeValue] = field(default_factory=list)

    def applies(self, spec: _RequestSpec) -> bool:
        return (
            self.requests is None
            or spec.parent in self.requests
            or spec.result_name in self.requests
        )


@dataclass(slots=True)
class _Pick:
    spec: _RequestSpec
    device: int
    consumed: dict[str, Quantity]
    share: bool
    applied: list[_Constraint] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A claim's requests and constraints normalised once (:meth:`Allocator.prepare`).

    For a caller that decides the same claim object many times (``dracap simulate``):
    :meth:`Allocator.allocate` with ``prepared=`` skips normalising it again. Valid
    for the allocator's inventory, the claim object and the admin-access flag it was
    made for; :meth:`Allocator.allocate` prepares afresh when any of them differs.
    Constraints are templates: every decision works on its own copies.
    """

    inventory: Inventory
    claim: ResourceClaim
    admin_access_allowed: bool
    specs: list[list[_RequestSpec]]
    constraints: tuple[tuple[frozenset[str] | None, str, bool], ...]
    invalid: str | None  # the reason when the claim is Invalid before any search


# --- the allocator ----------------------------------------------------------------------------


class Allocator:
    """Decisions over one inventory and a mutable allocated state."""

    def __init__(
        self,
        inventory: Inventory,
        allocated: AllocatedState | None = None,
        *,
        new_share_id: Callable[[], str] = lambda: str(uuid.uuid4()),
    ) -> None:
        self.inventory = inventory
        self.allocated = allocated if allocated is not None else AllocatedState()
        self.new_share_id = new_share_id
        self._lists: dict[tuple[str | None, str, tuple[str, ...]], CandidateList] = {}
        self._members: dict[int, list[CandidateList]] = {}

    # -- state changes
    def commit(self, outcome: Allocated) -> None:
        """Add an allocation's grants to the allocated state."""
        self._apply(outcome.grants, 1)

    def release(self, outcome: Allocated) -> None:
        """Remove an allocation's grants from the allocated state."""
        self._apply(outcome.grants, -1)

    def add_grants(self, grants: Iterable[Grant]) -> None:
        """Record grants of claims allocated elsewhere (e.g. from the event log)."""
        self._apply(list(grants), 1)

    def _apply(self, grants: Sequence[Grant], sign: int) -> None:
        add = self.allocated.add
        by_key = self.inventory.by_key
        for grant in grants:
            add(grant, sign=sign)
            index = by_key.get(grant.device)
            if index is not None:
                self._refresh(index)

    def _refresh(self, index: int) -> None:
        """Bring device ``index``'s leaves in every candidate list up to date.

        What :meth:`_usable` and :meth:`_free` say, inlined (this runs on every commit and
        release); a leaf that did not change is left alone.
        """
        members = self._members.get(index)
        if not members:
            return
        entry = self.inventory.devices[index]
        allocated = self.allocated
        key = entry.key
        usable = key not in allocated.exclusive and (entry.multi or key not in allocated.shared)
        per_device = allocated.consumed.get(key) if usable else None
        capacities = entry.capacities
        for clist in members:
            pos = clist.position[index]
            flags = clist.usable
            if flags is not None:
                flag = 1 if usable else 0
                if flags.data[flags.size + pos] != flag:
                    flags.set(pos, flag)
            indexes = clist.indexes
            for name, tree in clist.trees.items():
                value = UNUSABLE
                if usable:
                    info = capacities.get(name)
                    if info is not None:
                        value = info.total.nanos - (per_device.get(name, 0) if per_device else 0)
                old = tree.data[tree.size + pos]
                if old == value:
                    continue
                index_ = indexes.get(name)
                if index_ is not None:
                    index_.move(pos, old, value)
                tree.set(pos, value)

    # -- helpers over the state
    def _usable(self, entry: DeviceEntry) -> bool:
        return entry.key not in self.allocated.exclusive and not self._still_shared(entry)

    def _still_shared(self, entry: DeviceEntry) -> bool:
        """A dedicated device that live shares still hold (it allowed sharing when granted).

        Upstream 1.34-1.36 lets a request that fits next to the shares take it exclusively;
        dracap counts it as in use until the last share is released (upstream 1.37).
        """
        return not entry.multi and entry.key in self.allocated.shared

    def _free(self, entry: DeviceEntry, name: str) -> int:
        info = entry.capacities.get(name)
        if info is None:
            return UNUSABLE
        return info.total.nanos - self.allocated.consumed_nanos(entry.key, name)

    def _candidates(self, node: str | None, spec: _RequestSpec) -> CandidateList:
        key = (node, spec.class_name, spec.selectors)
        clist = self._lists.get(key)
        if clist is None:
            dclass = self.inventory.classes[spec.class_name]
            expressions = [
                (s.cel.expression, True) for s in (dclass.spec.selectors or []) if s.cel is not None
            ]
            expressions.extend((e, False) for e in spec.selectors)
            devices, errors = self._select(self.inventory.visible_devices(node), expressions)
            clist = CandidateList(devices, errors)
            clist.usable = MaxTree(
                [1 if self._usable(self.inventory.devices[d]) else 0 for d in devices]
            )
            for index in devices:
                self._members.setdefault(index, []).append(clist)
            self._lists[key] = clist
        return clist

    def _select(
        self, indices: Sequence[int], expressions: Sequence[tuple[str, bool]]
    ) -> tuple[list[int], list[tuple[int, SelectorError]]]:
        """The devices every expression matches, and the first error of each other one.

        The class's selectors (trusted) come first, then the request's; a device is
        tried on an expression only if every earlier one matched it, as upstream does.
        May raise :class:`SelectorsPending` (a tenant's heavy selector).
        """
        survivors = list(indices)
        errors: list[tuple[int, SelectorError]] = []
        for expression, trusted in expressions:
            results = self.inventory.filter(expression, survivors, trusted=trusted)
            matched: list[int] = []
            for index in survivors:
                result = results[index]
                if result is True:
                    matched.append(index)
                elif isinstance(result, SelectorError):
                    errors.append((index, result))
            survivors = matched
        errors.sort(key=lambda item: item[0])
        return survivors, errors

    def _tree(self, clist: CandidateList, name: str) -> MaxTree:
        tree = clist.trees.get(name)
        if tree is None:
            values = []
            for index in clist.devices:
                entry = self.inventory.devices[index]
                values.append(self._free(entry, name) if self._usable(entry) else UNUSABLE)
            tree = clist.trees[name] = MaxTree(values)
        return tree

    def _whole_names(self, clist: CandidateList) -> tuple[str, ...]:
        """Capacities every candidate has with a total > 0 (a whole take leaves them 0 free)."""
        if clist.whole is None:
            names: set[str] | None = None
            for index in clist.devices:
                caps = self.inventory.devices[index].capacities
                mine = {n for n, info in caps.items() if info.total.nanos > 0}
                names = mine if names is None else names & mine
            clist.whole = tuple(sorted(names or ()))
        return clist.whole

    def _index(self, clist: CandidateList, name: str) -> FreeIndex:
        """The candidates grouped by free ``name`` (built with, and kept like, its tree)."""
        found = clist.indexes.get(name)
        if found is None:
            tree = self._tree(clist, name)
            found = clist.indexes[name] = FreeIndex(
                tree.data[tree.size : tree.size + len(clist.devices)]
            )
        return found

    # -- the decision
    def allocate(
        self,
        claim: ResourceClaim,
        *,
        node: str | None = None,
        any_node: bool = False,
        admin_access_allowed: bool = False,
        explain: bool = True,
        prepared: Prepared | None = None,
    ) -> Outcome:
        """Decide one claim on ``node`` (or, with ``any_node``, on the first node that fits).

        ``explain=False`` leaves an :class:`Unschedulable`'s reason empty, saving the scan
        of every candidate that explains it (the simulation of ``dracap simulate``).
        ``prepared`` (:meth:`prepare` of this claim) saves normalising its requests again;
        the decision is the same with or without it.
        """
        ref = f"{claim.metadata.namespace}/{claim.metadata.name}"
        if (
            prepared is None
            or prepared.claim is not claim
            or prepared.inventory is not self.inventory
            or prepared.admin_access_allowed != admin_access_allowed
        ):
            prepared = self.prepare(claim, admin_access_allowed=admin_access_allowed)
        try:
            return self._allocate(claim, ref, node, any_node, prepared, explain)
        except SelectorsPending as pending:
            return Deferred(claim=ref, expression=pending.expression)

    def prepare(self, claim: ResourceClaim, *, admin_access_allowed: bool = False) -> Prepared:
        """Normalise ``claim``'s requests and constraints once, for :meth:`allocate`."""
        try:
            specs, constraints = self._prepare(claim, admin_access_allowed)
        except _InvalidClaimError as exc:
            return Prepared(self.inventory, claim, admin_access_allowed, [], (), str(exc))
        templates = tuple((c.requests, c.attribute, c.distinct) for c in constraints)
        return Prepared(self.inventory, claim, admin_access_allowed, specs, templates, None)

    def _allocate(
        self,
        claim: ResourceClaim,
        ref: str,
        node: str | None,
        any_node: bool,
        prepared: Prepared,
        explain: bool = True,
    ) -> Outcome:
        if prepared.invalid is not None:
            return Invalid(claim=ref, reason=prepared.invalid)
        specs = prepared.specs
        templates = prepared.constraints
        nodes: list[str | None] = [node]
        if any_node and node is None:
            nodes = list(self.inventory.nodes()) or [None]
        failed: list[_Search] = []  # explained only if no node fits (the scan is not free)
        for candidate_node in nodes:
            constraints = [_Constraint(*t) for t in templates]
            search = _Search(self, claim, specs, constraints, candidate_node)
            try:
                picks = search.run()
            except _InvalidClaimError as exc:
                return Invalid(claim=ref, reason=str(exc))
            if picks is not None:
                return self._result(claim, ref, candidate_node, picks)
            failed.append(search)
        if not explain:
            return Unschedulable(claim=ref, reason="")
        reasons = [search.explain() for search in failed]
        if len(reasons) == 1:
            return Unschedulable(claim=ref, reason=reasons[0])
        return Unschedulable(claim=ref, reason="; ".join(reasons))

    def _prepare(
        self, claim: ResourceClaim, admin_allowed: bool
    ) -> tuple[list[list[_RequestSpec]], list[_Constraint]]:
        gates = self.inventory.gates
        devices = claim.spec.devices
        requests: list[DeviceRequest] = (devices.requests if devices else None) or []
        specs: list[list[_RequestSpec]] = []
        for req in requests:
            if req.first_available:
                if not gates.prioritized_list:
                    raise _InvalidClaimError(
                        f"request {req.name}: firstAvailable needs "
                        "the DRAPrioritizedList feature gate"
                    )
                options = [
                    self._spec(
                        req.name,
                        f"{req.name}/{sub.name}",
                        sub.device_class_name,
                        sub.selectors,
                        sub.allocation_mode,
                        sub.count,
                        False,
                        sub.capacity.requests if sub.capacity else None,
                        sub.tolerations,
                    )
                    for sub in req.first_available
                ]
            elif req.exactly is not None:
                ex = req.exactly
                if ex.admin_access:
                    if not gates.admin_access:
                        raise _InvalidClaimError(
                            f"request {req.name}: adminAccess needs the DRAAdminAccess feature gate"
                        )
                    if not admin_allowed:
                        raise _InvalidClaimError(
                            f"request {req.name}: adminAccess is only allowed in namespaces "
                            "labelled resource.kubernetes.io/admin-access=true"
                        )
                options = [
                    self._spec(
                        req.name,
                        req.name,
                        ex.device_class_name,
                        ex.selectors,
                        ex.allocation_mode,
                        ex.count,
                        bool(ex.admin_access),
                        ex.capacity.requests if ex.capacity else None,
                        ex.tolerations,
                    )
                ]
            else:
                raise _InvalidClaimError(f"request {req.name}: needs exactly or firstAvailable")
            specs.append(options)
        minimum = sum(
            min(o.count if o.mode == ALLOCATION_MODE_EXACT_COUNT else 1 for o in opts)
            for opts in specs
        )
        if minimum > MAX_DEVICES_PER_CLAIM:
            raise _InvalidClaimError(
                f"claim needs at least {minimum} devices, more than the maximum of "
                f"{MAX_DEVICES_PER_CLAIM} allocation results"
            )
        constraints = []
        for i, c in enumerate((devices.constraints if devices else None) or []):
            constraints.append(self._constraint(i, c))
        return specs, constraints

    def _spec(
        self,
        parent: str,
        result_name: str,
        class_name: str,
        selectors: Sequence[object] | None,
        mode: str | None,
        count: int | None,
        admin: bool,
        capacity: Mapping[str, Quantity] | None,
        tolerations: list[dict[str, object]] | None,
    ) -> _RequestSpec:
        gates = self.inventory.gates
        if capacity and not gates.consumable_capacity:
            raise _InvalidClaimError(
                f"request {result_name}: capacity requests need "
                "the DRAConsumableCapacity feature gate"
            )
        if class_name not in self.inventory.classes:
            raise _InvalidClaimError(
                f"request {result_name}: device class {class_name} does not exist"
            )
        class_mode = self.inventory.class_modes.get(class_name, "consumable")
        if class_mode == "disabled":
            raise _InvalidClaimError(
                f"request {result_name}: device class {class_name} is disabled"
            )
        if capacity and class_mode == "whole-device":
            raise _InvalidClaimError(
                f"request {result_name}: capacity requests need the DRAConsumableCapacity "
                f"feature gate, which is off for device class {class_name} (whole-device)"
            )
        mode = mode or ALLOCATION_MODE_EXACT_COUNT
        if mode == ALLOCATION_MODE_EXACT_COUNT:
            count = 1 if count is None else count
            if count <= 0:
                raise _InvalidClaimError(f"request {result_name}: count must be greater than 0")
            if count > MAX_DEVICES_PER_CLAIM:
                raise _InvalidClaimError(
                    f"request {result_name}: count {count} exceeds the maximum of "
                    f"{MAX_DEVICES_PER_CLAIM} devices"
                )
        elif mode == ALLOCATION_MODE_ALL:
            count = 0
        else:
            raise _InvalidClaimError(f"request {result_name}: unsupported allocation mode {mode!r}")
        expressions = tuple(
            s.cel.expression  # type: ignore[attr-defined]
            for s in selectors or []
            if getattr(s, "cel", None) is not None
        )
        return _RequestSpec(
            parent,
            result_name,
            class_name,
            expressions,
            mode,
            count,
            admin,
            dict(capacity or {}),
            list(tolerations or []),
            class_mode == "whole-device",
            placement(self.inventory.classes[class_name]),
        )

    def _constraint(self, i: int, c: DeviceConstraint) -> _Constraint:
        requests = frozenset(c.requests) if c.requests else None
        if c.distinct_attribute:
            if not self.inventory.gates.consumable_capacity:
                raise _InvalidClaimError(
                    f"constraints[{i}]: distinctAttribute needs "
                    "the DRAConsumableCapacity feature gate"
                )
            return _Constraint(requests, c.distinct_attribute, True)
        if c.match_attribute:
            return _Constraint(requests, c.match_attribute, False)
        raise _InvalidClaimError(
            f"constraints[{i}]: empty constraint: set matchAttribute or distinctAttribute"
        )

    def _result(
        self, claim: ResourceClaim, ref: str, node: str | None, picks: list[_Pick]
    ) -> Allocated:
        results: list[DeviceRequestAllocationResult] = []
        grants: list[Grant] = []
        namespace = claim.metadata.namespace or ""
        devices = self.inventory.devices
        for pick in picks:
            key = devices[pick.device].key
            spec = pick.spec
            share_id = self.new_share_id() if pick.share else None
            driver, pool, name = key
            results.append(
                DeviceRequestAllocationResult(
                    request=spec.result_name,
                    driver=driver,
                    pool=pool,
                    device=name,
                    admin_access=True if spec.admin else None,
                    share_id=share_id,
                    consumed_capacity=dict(pick.consumed) if pick.share and pick.consumed else None,
                )
            )
            grants.append(
                Grant(
                    request=spec.result_name,
                    device=key,
                    share_id=share_id,
                    admin_access=spec.admin,
                    consumed=dict(pick.consumed) if pick.share else {},
                    namespace=namespace,
                )
            )
        allocation = AllocationResult(
            devices=DeviceAllocationResult(
                results=results, config=self._configs(claim, picks) or None
            ),
            node_selector=self._node_selector(node, picks),
        )
        return Allocated(claim=ref, node=node, allocation=allocation, grants=grants)

    def _configs(
        self, claim: ResourceClaim, picks: list[_Pick]
    ) -> list[DeviceAllocationConfiguration]:
        classes = self.inventory.classes
        by_class: dict[str, list[str]] = {}  # only classes with a config: they add entries
        for pick in picks:
            spec = pick.spec
            if not classes[spec.class_name].spec.config:
                continue
            names = by_class.setdefault(spec.class_name, [])
            if spec.result_name not in names:
                names.append(spec.result_name)
        configs: list[DeviceAllocationConfiguration] = []
        for class_name, names in by_class.items():
            for cfg in classes[class_name].spec.config or []:
                configs.append(
                    DeviceAllocationConfiguration(
                        source="FromClass", requests=names, opaque=cfg.opaque
                    )
                )
        devices = claim.spec.devices
        return configs + claim_configs(devices.config if devices else None)

    def _node_selector(self, node: str | None, picks: list[_Pick]) -> NodeSelector | None:
        expressions: list[NodeSelectorRequirement] = []
        fields: list[NodeSelectorRequirement] = []
        for pick in picks:
            entry = self.inventory.devices[pick.device]
            spec = entry.slice.spec
            device = entry.device
            if spec.node_name or device.node_name or device.binds_to_node:
                name = node or spec.node_name or device.node_name or ""
                return NodeSelector(
                    node_selector_terms=[
                        NodeSelectorTerm(
                            match_fields=[
                                NodeSelectorRequirement(
                                    key="metadata.name", operator="In", values=[name]
                                )
                            ]
                        )
                    ]
                )
            selector = spec.node_selector or device.node_selector
            if selector is not None:
                for term in selector.node_selector_terms:
                    for req in term.match_expressions or []:
                        if req not in expressions:
                            expressions.append(req)
                    for req in term.match_fields or []:
                        if req not in fields:
                            fields.append(req)
        if not expressions and not fields:
            return None
        return NodeSelector(
            node_selector_terms=[
                NodeSelectorTerm(match_expressions=expressions or None, match_fields=fields or None)
            ]
        )


# --- the depth-first search -------------------------------------------------------------------


class _Search:
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
        allocator: Allocator,
        claim: ResourceClaim,
        specs: list[list[_RequestSpec]],
        constraints: list[_Constraint],
        node: str | None,
    ) -> None:
        self.a = allocator
        self.inv = allocator.inventory
        self.claim = claim
        self.namespace = claim.metadata.namespace or ""
        self.specs = specs
        self.constraints = constraints
        self.node = node
        self.picks: list[_Pick] = []
        self.in_call: dict[int, dict[str, int]] = {}
        self.dedicated: set[int] = set()
        self.budget = SEARCH_BUDGET
        self.failed_spec: _RequestSpec | None = None
        self.depth_failed = -1
        self.invalid_pool_seen: str | None = None

    def run(self) -> list[_Pick] | None:
        try:
            ok = self._solve(0)
        except _BudgetExhaustedError:
            self.failed_spec = None
            self.depth_failed = -2
            return None
        if ok:
            return list(self.picks)
        if self.invalid_pool_seen is not None:
            raise _InvalidClaimError(self.invalid_pool_seen)
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

    def _note_failure(self, ri: int, spec: _RequestSpec) -> None:
        if ri >= self.depth_failed:
            self.depth_failed = ri
            self.failed_spec = spec

    # ExactCount
    def _solve_slot(self, ri: int, spec: _RequestSpec, slot: int) -> bool:
        if slot == spec.count:
            return self._solve(ri + 1)
        clist = self.a._candidates(self.node, spec)
        if spec.placement != FIRST_FIT and spec.capacity and not spec.admin:
            return self._solve_ranked(ri, spec, slot, clist)
        trees: list[tuple[MaxTree, int]] = []
        if not spec.admin:
            # a capacity tree holds UNUSABLE (-1) wherever the usable tree holds 0, so a
            # threshold >= 0 on it already prunes what the usable tree would
            pruned = False
            for name, amount in spec.capacity.items():
                trees.append((self.a._tree(clist, name), amount.nanos))
                pruned = pruned or amount.nanos >= 0
            if spec.whole:  # a whole take needs every capacity untouched: free >= 1 prunes
                for name in self.a._whole_names(clist):
                    trees.append((self.a._tree(clist, name), 1))
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

    def _solve_ranked(self, ri: int, spec: _RequestSpec, slot: int, clist: CandidateList) -> bool:
        """One ExactCount slot with the candidates in the order of the class's placement."""
        self._check_errors(clist, spec, None)  # every candidate is looked at: any error counts
        name = min(spec.capacity)
        amount = spec.capacity[name].nanos
        sizes = self.a.allocated.sizes.get(name)
        devices = clist.devices
        for pos in placement_order(spec.placement, self.a._index(clist, name), amount, sizes):
            pick = self._try(spec, devices[pos])
            if pick is not None and self._push(pick):
                if self._solve_slot(ri, spec, slot + 1):
                    return True
                self._pop()
        self._note_failure(ri, spec)
        return False

    def _check_errors(self, clist: CandidateList, spec: _RequestSpec, before: int | None) -> None:
        """Raise the first CEL error the upstream search would have met before ``before``."""
        for index, error in clist.errors:
            if before is not None and index > before:
                return
            if not self._in_use(spec, index):
                raise _InvalidClaimError(f"request {spec.result_name}: {error}")

    # All
    def _all_devices(self, spec: _RequestSpec) -> list[int]:
        for pool in self.inv.visible_pools(self.node):
            if not pool.complete:
                raise _InvalidClaimError(
                    f"request {spec.result_name}: asks for all devices, but pool "
                    f"{pool.driver}/{pool.name} is incomplete (being updated)"
                )
            if pool.invalid_reason:
                raise _InvalidClaimError(
                    f"request {spec.result_name}: asks for all devices, but {pool.invalid_reason}"
                )
        clist = self.a._candidates(self.node, spec)
        if clist.errors:
            raise _InvalidClaimError(f"request {spec.result_name}: {clist.errors[0][1]}")
        return [
            d for d in clist.devices if self._capacity_fits(spec, self.inv.devices[d], False)[0]
        ]

    def _solve_all(self, ri: int, spec: _RequestSpec, devices: list[int], slot: int) -> bool:
        if slot == len(devices):
            return self._solve(ri + 1)
        if slot + len(self.picks) >= MAX_DEVICES_PER_CLAIM + 1:
            raise _InvalidClaimError(
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
    def _in_use(self, spec: _RequestSpec, index: int) -> bool:
        if index in self.dedicated:
            return True
        if spec.admin:
            return False
        entry = self.inv.devices[index]
        return entry.key in self.a.allocated.exclusive or self.a._still_shared(entry)

    def _foreign(self, spec: _RequestSpec, index: int) -> bool:
        """Whether an isolated device is held by another namespace (admin access: never)."""
        if spec.admin or not self.inv.isolated(index):
            return False
        return self.a.allocated.held_by_others(self.inv.devices[index].key, self.namespace)

    def _try(self, spec: _RequestSpec, index: int, *, all_mode: bool = False) -> _Pick | None:
        self.budget -= 1
        if self.budget < 0:
            raise _BudgetExhaustedError
        inv = self.inv
        entry = inv.devices[index]
        if self._in_use(spec, index) or self._foreign(spec, index):
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
        return _Pick(spec, index, consumed, entry.multi)

    def _capacity_fits(
        self, spec: _RequestSpec, entry: DeviceEntry, in_call: bool
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
    def _push(self, pick: _Pick, *, all_mode: bool = False) -> bool:
        entry = self.inv.devices[pick.device]
        applied: list[_Constraint] = []
        for constraint in self.constraints:
            if not constraint.applies(pick.spec):
                continue
            value = entry.attribute(constraint.attribute)
            ok = value is not None and _constraint_accepts(constraint, value)
            if not ok:
                for c in applied:
                    c.values.pop()
                if all_mode:
                    raise _InvalidClaimError(
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

    # explaining a failure
    def explain(self) -> str:
        where = f" on node {self.node}" if self.node else ""
        if self.depth_failed == -2:
            return f"search gave up after {SEARCH_BUDGET} device checks{where}"
        spec = self.failed_spec
        if spec is None:
            return f"no solution{where}"
        return f"request {spec.result_name}: " + _diagnose(self, spec) + where


def _constraint_accepts(constraint: _Constraint, value: AttributeValue) -> bool:
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


def _diagnose(search: _Search, spec: _RequestSpec) -> str:
    """Why no device of the candidate list could take ``spec`` (a failure-path scan)."""
    inv = search.inv
    clist = search.a._candidates(search.node, spec)
    visible = len(inv.visible_devices(search.node))
    if not clist.devices:
        return f"none of the {visible} devices reachable matches class {spec.class_name}" + (
            " and the request's selectors" if spec.selectors else ""
        )
    in_use = still_shared = foreign = missing = policy = full = lost = weak = unhealthy = 0
    policy_detail = full_detail = missing_detail = lost_detail = weak_detail = ""
    unhealthy_detail = ""
    for index in clist.devices:
        entry = inv.devices[index]
        taint = inv.lost(entry) if inv.lost_nodes else None
        if taint is not None:
            lost += 1
            lost_detail = lost_detail or taint
            continue
        sick = inv.unhealthy.get(entry.key) if inv.unhealthy else None
        if sick is not None:
            unhealthy += 1
            unhealthy_detail = unhealthy_detail or f"{'/'.join(entry.key)}: {sick}"
            continue
        below = inv.below_minimum(entry, spec.class_name) if inv.min_enforcement else None
        if below is not None:
            weak += 1
            weak_detail = weak_detail or below
            continue
        if search._in_use(spec, index):
            if index in search.dedicated or entry.key in search.a.allocated.exclusive:
                in_use += 1
            else:
                still_shared += 1
            continue
        if search._foreign(spec, index):
            foreign += 1
            continue
        absent = [n for n in spec.capacity if n not in entry.capacities]
        if absent:
            missing += 1
            missing_detail = missing_detail or f"no capacity {absent[0]}"
            continue
        for name, info in entry.capacities.items():
            amount = consumed_amount(info.total, info.policy, spec.wanted(name, info.total))
            if violates_policy(amount, info.policy):
                policy += 1
                policy_detail = policy_detail or (
                    f"{name} {amount} is not allowed by the request policy "
                    f"({describe_policy(info.policy)})"
                )
                break
            free = info.total.nanos - search.a.allocated.consumed_nanos(entry.key, name)
            if amount.nanos > free:
                full += 1
                full_detail = full_detail or (
                    f"needs {amount} of {name}, largest free is "
                    f"{_largest_free(search, spec, clist.devices, name)}"
                )
                break
    parts = []
    if lost:
        parts.append(
            f"{lost} on a lost node, tainted {lost_detail}: their unknown shares keep "
            "the capacity until the node is fenced or its agent returns"
        )
    if unhealthy:
        parts.append(f"{unhealthy} reported unhealthy by their node agent ({unhealthy_detail})")
    if weak:
        parts.append(f"{weak} on nodes below the class's minimum enforcement ({weak_detail})")
    if in_use:
        parts.append(f"{in_use} in exclusive use")
    if still_shared:
        parts.append(
            f"{still_shared} still shared (dedicated now, in use until its live shares "
            "are released)"
        )
    if foreign:
        parts.append(
            f"{foreign} held by another namespace (not shared across namespaces: "
            "dracap.io/shared-across-namespaces=deny)"
        )
    if missing:
        parts.append(f"{missing} lack the capacity ({missing_detail})")
    if policy:
        parts.append(f"{policy} refuse the amount ({policy_detail})")
    if full:
        parts.append(f"{full} have too little free ({full_detail})")
    if not parts:
        parts.append("the claim's constraints cannot be met together")
    return f"{len(clist.devices)} devices of class {spec.class_name} match; " + ", ".join(parts)


def _largest_free(search: _Search, spec: _RequestSpec, devices: list[int], name: str) -> Quantity:
    best: Quantity | None = None
    for index in devices:
        entry = search.inv.devices[index]
        info = entry.capacities.get(name)
        if info is None or search._in_use(spec, index):
            continue
        free = info.total - Quantity(search.a.allocated.consumed_nanos(entry.key, name))
        if best is None or free > best:
            best = free
    return best if best is not None else Quantity(0)
