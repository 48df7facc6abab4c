"""One planning round of the reservation service, as a pure decision. No I/O.

:func:`decide_round` takes the folded state, the allocator kept for it, and the
service's backlog (:class:`Backlog`: the pending claims in admission order and what
is known about their earlier tries), and returns a :class:`Round`: the events to
append, each with the claim it is about, and what the service should remember.

The rules, in order, for each pending claim (phase ``admitted`` or ``unschedulable``):

* first come first served: claims are decided in admission order, and each claim that
  fits is committed *tentatively* in the allocator, so the claims behind it see its
  grants. A claim that does not fit does not block those behind it (no head-of-line
  blocking: a smaller claim may pass a large one that waits);
* an ``unschedulable`` claim is tried again only when capacity was freed or the
  inventory changed since its last try (its try's *capacity epoch* is older than the
  backlog's), so a busy cluster does not re-decide every waiting claim each round;
* a claim waiting for a tenant selector that is still being evaluated is skipped;
  one whose selector is too expensive to evaluate here is *deferred*
  (:class:`~services.reservation.outcomes.Deferred`) and decided in a later round;
* a claim that fits gets ``CapacityReserved`` on each device's stream (a share id for
  every result: the allocator's for shareable devices, a new one for dedicated
  devices, whose Kubernetes ``AllocationResult`` carries none, as upstream) and
  ``AllocationBound`` on its claim stream, at the next allocation version;
* a newly admitted claim that does not fit gets ``ClaimUnschedulable`` (once: retries
  that still fail write nothing); an invalid one says that it cannot be allocated as
  written.

A claim is decided on what the fold keeps of it (:class:`~events.claimspecs.ClaimSpec`:
its requests and constraints), not on its manifest. The manifest's configuration,
which the allocation carries (``FromClaim``) but no rule reads, is not in the fold: the
round lists the allocated claims that have one (:attr:`Round.configured`), the service
reads their manifests from the log and :meth:`Round.configure` adds it to their
``AllocationBound`` — the events are then exactly those of a decision on the whole claim.

The tentative commits are undone before :func:`decide_round` returns: it leaves the
allocator as it found it (the allocator's state is the log's between rounds). Share
ids come from ``new_share_id``, so a test passes a counter and gets the same events
every time. Expected stream versions are not the decision's business: the service
reads them on the same state and builds the append (:meth:`Round.by_stream` gives the
events grouped per stream, device streams first).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Final

import msgspec

from events.catalog import AllocationBound, CapacityReserved, ClaimUnschedulable, Event
from events.envelopes import claim_stream, device_stream
from events.model import ResourceClaim
from events.state import ClaimKey, ClaimState, ClusterState
from services.reservation.allocating import Allocator, with_claim_configs
from services.reservation.outcomes import Allocated, Deferred, Invalid

__all__ = ["PENDING_PHASES", "Backlog", "Round", "decide_round"]

#: Claim phases that wait for a reservation.
PENDING_PHASES: Final = frozenset({"admitted", "unschedulable"})


class Backlog(msgspec.Struct, frozen=True, kw_only=True):
    """What the service knows of its pending claims when a round starts."""

    order: Sequence[ClaimKey]  #: pending claims, in admission order
    epoch: int = 0  #: the capacity epoch now (bumped when capacity is freed)
    tried: Mapping[ClaimKey, int] = {}  #: unschedulable claims -> epoch of their last try
    waiting: Mapping[ClaimKey, str] = {}  #: deferred claims -> the selector they wait for
    evaluating: Collection[str] = frozenset()  #: selectors being evaluated now


class Round(msgspec.Struct, kw_only=True):
    """What one round decided (see the module docstring)."""

    #: events per stream, in the order decided, each with the claim it is about
    writes: dict[str, list[tuple[Event, ClaimKey]]] = {}
    allocated: list[ClaimKey] = []  #: claims reserved this round
    unschedulable: list[ClaimKey] = []  #: claims newly found unschedulable
    tried: list[ClaimKey] = []  #: claims that failed at this epoch (tried again once freed)
    deferred: dict[ClaimKey, str] = {}  #: claims now waiting for a selector -> the selector
    settled: list[ClaimKey] = []  #: claims no longer waiting for a selector
    #: allocated claims with a configuration, which their ``AllocationBound`` still lacks
    #: (the fold does not keep it): :meth:`configure` adds it from their manifests
    configured: list[ClaimKey] = []

    def add(self, event: Event, stream: str, claim: ClaimKey) -> None:
        """Add ``event`` about ``claim`` to ``stream``."""
        self.writes.setdefault(stream, []).append((event, claim))

    def configure(self, manifests: Mapping[ClaimKey, ResourceClaim]) -> list[ClaimKey]:
        """Give each :attr:`configured` claim's ``AllocationBound`` the configuration of its
        manifest (as the allocator gives a whole claim's); a claim whose manifest is not
        in ``manifests`` is taken out of the round (it stays pending). Returns those."""
        missing = [key for key in self.configured if key not in manifests]
        for key in self.configured:
            manifest = manifests.get(key)
            if manifest is None:
                continue
            devices = manifest.spec.devices
            config = devices.config if devices is not None else None
            events = self.writes[claim_stream(*key)]
            for i, (event, about) in enumerate(events):
                if isinstance(event, AllocationBound):
                    allocation = with_claim_configs(event.allocation, config)
                    events[i] = (msgspec.structs.replace(event, allocation=allocation), about)
        if missing:
            gone = set(missing)
            for stream, writes in list(self.writes.items()):
                kept = [(event, key) for event, key in writes if key not in gone]
                if kept:
                    self.writes[stream] = kept
                else:
                    del self.writes[stream]
            self.allocated = [key for key in self.allocated if key not in gone]
        self.configured = []
        return missing

    def by_stream(self) -> list[tuple[str, list[Event], list[ClaimKey]]]:
        """Per stream: its events and their claims; device streams first.

        Every ``CapacityReserved`` of the round precedes every ``AllocationBound``, so
        the store projects each kind in one statement.
        """
        streams = sorted(self.writes.items(), key=lambda item: not item[0].startswith("device:"))
        return [(s, [e for e, _ in w], [c for _, c in w]) for s, w in streams]


def decide_round(
    state: ClusterState,
    allocator: Allocator,
    backlog: Backlog,
    new_share_id: Callable[[], str],
) -> Round:
    """Decide every pending claim that may fit now, in admission order."""
    out = Round()
    tentative: list[Allocated] = []
    try:
        for key in backlog.order:
            claim = state.claims.get(key)
            if claim is None or claim.spec is None or claim.phase not in PENDING_PHASES:
                continue
            if claim.phase == "unschedulable" and backlog.tried.get(key) == backlog.epoch:
                continue
            if backlog.waiting.get(key) in backlog.evaluating:
                continue  # its selector is still being evaluated: nothing new to try
            access = state.namespaces.get(key[0])
            outcome = allocator.allocate(
                claim.spec.as_claim(*key),
                any_node=True,
                admin_access_allowed=access is not None and access.admin_access,
            )
            if isinstance(outcome, Allocated):
                allocator.commit(outcome)
                tentative.append(outcome)
                _reserve(out, state, claim, outcome, new_share_id)
                out.settled.append(key)
            elif isinstance(outcome, Deferred):  # decided once its selector is in
                out.deferred[key] = outcome.expression
            else:
                out.settled.append(key)
                out.tried.append(key)
                if claim.phase == "admitted":
                    reason = outcome.reason
                    if isinstance(outcome, Invalid):
                        reason = f"cannot be allocated as written: {reason}"
                    event = ClaimUnschedulable(namespace=key[0], name=key[1], reason=reason)
                    out.add(event, claim_stream(*key), key)
                    out.unschedulable.append(key)
    finally:
        for allocated in tentative:
            allocator.release(allocated)
    return out


def _reserve(
    out: Round,
    state: ClusterState,
    claim: ClaimState,
    outcome: Allocated,
    new_share_id: Callable[[], str],
) -> None:
    """``CapacityReserved`` per device result and ``AllocationBound`` for ``claim``."""
    key = (claim.namespace, claim.name)
    version = claim.allocation_version + 1
    share_ids: list[str] = []
    for grant in outcome.grants:
        share_id = grant.share_id or new_share_id()
        share_ids.append(share_id)
        driver, pool, device = grant.device
        reserved = CapacityReserved(
            namespace=claim.namespace,
            name=claim.name,
            allocation_version=version,
            request=grant.request,
            driver=driver,
            pool=pool,
            device=device,
            node=outcome.node,
            share_id=share_id,
            shared=grant.share_id is not None,
            admin_access=grant.admin_access,
            consumed=dict(grant.consumed),
            policy_version=state.devices[grant.device].policy_version,
        )
        out.add(reserved, device_stream(driver, pool, device), key)
    bound = AllocationBound(
        namespace=claim.namespace,
        name=claim.name,
        allocation_version=version,
        node=outcome.node,
        allocation=outcome.allocation,
        share_ids=share_ids,
    )
    out.add(bound, claim_stream(claim.namespace, claim.name), key)
    out.allocated.append(key)
    if claim.spec is not None and claim.spec.configs:
        out.configured.append(key)
