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
device is taken" is a dict lookup whatever the number of shares
(:mod:`services.reservation.allocated`). Candidate lists with max-trees
(:mod:`services.reservation.candidates`) skip full devices.

Where each part lives: the pre-checks and the normalised requests
(:mod:`services.reservation.requestspecs`), the search and its checks per candidate
(:mod:`services.reservation.searching`), why a claim is unschedulable
(:mod:`services.reservation.diagnosis`); this module holds the :class:`Allocator` that
owns the allocated state and the candidate lists, runs a search per node and turns its
picks into an ``AllocationResult``.

Decisions do not change the allocated state; :meth:`Allocator.commit` and
:meth:`Allocator.release` do, so a caller can decide, persist, then commit.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from msgspec.structs import replace

from events.errors import SelectorError
from events.inventory import DeviceEntry, Inventory, SelectorsPending
from events.model import (
    AllocationResult,
    DeviceAllocationConfiguration,
    DeviceAllocationResult,
    DeviceClaimConfiguration,
    DeviceRequestAllocationResult,
    NodeSelector,
    NodeSelectorRequirement,
    NodeSelectorTerm,
    ResourceClaim,
)
from services.reservation import diagnosis
from services.reservation.allocated import AllocatedState
from services.reservation.candidates import UNUSABLE, CandidateList, FreeIndex, MaxTree
from services.reservation.outcomes import (
    Allocated,
    Deferred,
    Grant,
    Invalid,
    Outcome,
    Unschedulable,
)
from services.reservation.requestspecs import (
    Constraint,
    InvalidClaimError,
    Pick,
    RequestSpec,
    normalise,
)
from services.reservation.searching import Search


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
    specs: list[list[RequestSpec]]
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
        return entry.key not in self.allocated.exclusive and not self.still_shared(entry)

    def still_shared(self, entry: DeviceEntry) -> bool:
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

    def candidates(self, node: str | None, spec: RequestSpec) -> CandidateList:
        """The devices ``spec``'s class and selectors match on ``node``, built once and kept
        current on every commit and release (the search reads them)."""
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

    def free_tree(self, clist: CandidateList, name: str) -> MaxTree:
        """The candidates' free ``name`` as a max-tree (unusable devices: ``UNUSABLE``)."""
        tree = clist.trees.get(name)
        if tree is None:
            values = []
            for index in clist.devices:
                entry = self.inventory.devices[index]
                values.append(self._free(entry, name) if self._usable(entry) else UNUSABLE)
            tree = clist.trees[name] = MaxTree(values)
        return tree

    def whole_names(self, clist: CandidateList) -> tuple[str, ...]:
        """Capacities every candidate has with a total > 0 (a whole take leaves them 0 free)."""
        if clist.whole is None:
            names: set[str] | None = None
            for index in clist.devices:
                caps = self.inventory.devices[index].capacities
                mine = {n for n, info in caps.items() if info.total.nanos > 0}
                names = mine if names is None else names & mine
            clist.whole = tuple(sorted(names or ()))
        return clist.whole

    def free_index(self, clist: CandidateList, name: str) -> FreeIndex:
        """The candidates grouped by free ``name`` (built with, and kept like, its tree)."""
        found = clist.indexes.get(name)
        if found is None:
            tree = self.free_tree(clist, name)
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
            specs, constraints = normalise(self.inventory, claim, admin_access_allowed)
        except InvalidClaimError as exc:
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
        failed: list[Search] = []  # explained only if no node fits (the scan is not free)
        for candidate_node in nodes:
            constraints = [Constraint(*t) for t in templates]
            search = Search(self, claim, specs, constraints, candidate_node)
            try:
                picks = search.run()
            except InvalidClaimError as exc:
                return Invalid(claim=ref, reason=str(exc))
            if picks is not None:
                return self._result(claim, ref, candidate_node, picks)
            failed.append(search)
        if not explain:
            return Unschedulable(claim=ref, reason="")
        reasons = [diagnosis.explain(search) for search in failed]
        if len(reasons) == 1:
            return Unschedulable(claim=ref, reason=reasons[0])
        return Unschedulable(claim=ref, reason="; ".join(reasons))

    def _result(
        self, claim: ResourceClaim, ref: str, node: str | None, picks: list[Pick]
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
        self, claim: ResourceClaim, picks: list[Pick]
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

    def _node_selector(self, node: str | None, picks: list[Pick]) -> NodeSelector | None:
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
