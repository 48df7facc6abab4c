"""A small cluster for the decision tables: events appended to an in-memory log, folded.

:class:`Log` gives every event its natural stream (``stream_of``), the next version of
that stream and the next position, so a table row reads as the story the log tells
("a claim was admitted, then reserved, then its release was requested"), and the
decision under test gets the fold of that story plus the messages it reacts to.
:func:`describe` renders an event as one short line, so expected outputs stay
readable in a table.
"""

from __future__ import annotations

import collections
import datetime
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from events import catalog as c
from events.envelopes import Envelope, new_envelope, stream_of
from events.fold import fold
from events.inventory import build_inventory
from events.model import ResourceClaim
from events.state import ClaimKey, ClusterState
from services.enforcement.enforcing import Enforcing
from services.reservation.allocating import Allocator
from services.reservation.deriving import live_grants
from services.reservation.policy import describe_policy
from services.reservation.rounds import PENDING_PHASES, Backlog, decide_round
from tests.unit.allocator_fixtures import claim, device, device_class, request, slice_

NODE = "node-a"
NAMESPACE = "tenant-a"
POOL = f"{NODE}-pool"
T0 = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
POLICY = {"default": "5Gi", "validRange": {"min": "5Gi", "step": "5Gi", "max": "40Gi"}}


class Unscannable(Enforcing):
    """Limits in force that refuse to be listed: a decision that scans them fails (the
    agent's check reads the sums :class:`Enforcing` keeps, at constant cost)."""

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("a decision listed every limit in force")


def gpu(name: str = "gpu-0", total: str = "40Gi", *, shared: bool = True) -> dict[str, object]:
    """A GPU with ``total`` memory (a 5Gi-step policy when shared)."""
    spec: object = (total, POLICY) if shared else total
    return device(name, {"memory": spec}, shared=shared)


def inventory(*devices: dict[str, object], node: str = NODE) -> list[c.Event]:
    """The class, one slice of ``devices`` (one GPU by default) and tenant-a's access."""
    return [
        c.DeviceClassApplied(device_class=device_class(), rollout="immediate"),
        c.ResourceSlicePublished(
            slice=slice_(list(devices or [gpu()]), node=node, name=f"{node}-slice")
        ),
        c.NamespaceAccessSet(namespace=NAMESPACE, classes=["*"]),
    ]


def memory_claim(name: str, memory: str = "10Gi", **kw: Any) -> ResourceClaim:
    """tenant-a's claim ``name`` for ``memory`` of one GPU."""
    return claim(request("gpu", {"memory": memory}, **kw), name=name, namespace=NAMESPACE)


def admitted(rc: ResourceClaim) -> list[c.Event]:
    """``ClaimSubmitted`` + ``ClaimAdmitted`` of ``rc``."""
    meta = rc.metadata
    return [
        c.ClaimSubmitted(claim=rc),
        c.ClaimAdmitted(namespace=meta.namespace or "", name=meta.name),
    ]


def share_ids(prefix: str = "share-") -> Callable[[], str]:
    """``{prefix}1``, ``{prefix}2``, …: deterministic ids for a decision."""
    counter = itertools.count(1)
    return lambda: f"{prefix}{next(counter)}"


class Log:
    """An append-only list of envelopes with stream versions and positions."""

    def __init__(self, *events: c.Event) -> None:
        self.envelopes: list[Envelope] = []
        self._versions: collections.Counter[str] = collections.Counter()
        self._share_ids = share_ids("held-")  # shares reserved by reserve(), held-1, …
        self.add(*events)

    def add(self, *events: c.Event) -> list[Envelope]:
        """Append ``events``; their envelopes."""
        out = []
        for event in events:
            stream = stream_of(event)
            self._versions[stream] += 1
            position = len(self.envelopes) + 1
            env = new_envelope(
                event,
                stream_version=self._versions[stream],
                actor="test",
                event_id=f"e{position}",
                recorded_at=T0,
                position=position,
            )
            self.envelopes.append(env)
            out.append(env)
        return out

    def extend(self, events: Iterable[c.Event]) -> list[Envelope]:
        return self.add(*events)

    def state(self) -> ClusterState:
        return fold(self.envelopes)

    def version(self, stream: str) -> int:
        return self._versions[stream]

    def versions(self, streams: Iterable[str]) -> dict[str, int]:
        return {s: self.version(s) for s in streams}

    def reserve(self, *claims: ResourceClaim) -> list[Envelope]:
        """Admit ``claims`` and append what a planning round decides for them."""
        for rc in claims:
            self.extend(admitted(rc))
        state = self.state()
        allocator = allocator_of(state, new_share_id=self._share_ids)
        decided = decide_round(state, allocator, backlog_of(state), self._share_ids)
        return self.extend(e for _, events, _ in decided.by_stream() for e in events)


def allocator_of(
    state: ClusterState,
    inline_budget: int | None = None,
    new_share_id: Callable[[], str] | None = None,
) -> Allocator:
    """The reservation service's allocator for ``state``: its inventory and live grants."""
    inv = build_inventory(state, inline_budget=inline_budget)
    alloc = Allocator(inv, new_share_id=new_share_id or share_ids())
    alloc.add_grants(grant for _, grant in live_grants(state))
    return alloc


def pending(state: ClusterState) -> list[ClaimKey]:
    """The claims waiting for a reservation, in the order they were submitted."""
    return [key for key, cs in state.claims.items() if cs.phase in PENDING_PHASES]


def backlog_of(state: ClusterState, **kw: Any) -> Backlog:
    return Backlog(order=pending(state), **kw)


def describe(event: c.Event) -> str:
    """One line per event: its kind and what a table needs to tell two apart."""
    match event:
        case c.CapacityReserved():
            memory = event.consumed.get("memory")
            held = f" memory={memory}" if memory is not None else ""
            kind = "shared" if event.shared else "dedicated"
            return (
                f"CapacityReserved {event.name} v{event.allocation_version} {event.device}"
                f"{held} {kind} {event.share_id}"
            )
        case c.AllocationBound():
            return (
                f"AllocationBound {event.name} v{event.allocation_version} {event.node} "
                + ",".join(event.share_ids)
            )
        case c.ClaimUnschedulable():
            return f"ClaimUnschedulable {event.name}: {event.reason}"
        case c.LimitApplied():
            actual = ",".join(f"{k}={v}" for k, v in sorted(event.actual.items()))
            return f"LimitApplied {event.share_id} {event.level} {actual}"
        case c.LimitFailed():
            again = "retryable" if event.retryable else "permanent"
            return f"LimitFailed {event.share_id} {again}: {event.reason}"
        case c.LimitRemoved():
            return f"LimitRemoved {event.share_id}"
        case c.CapacityReleased():
            return f"CapacityReleased {event.share_id} v{event.allocation_version}"
        case c.ReleaseRequested():
            return f"ReleaseRequested {event.name} v{event.allocation_version} {event.node}"
        case c.ClaimWithdrawn():
            return f"ClaimWithdrawn {event.name}"
        case c.DeviceClassApplied():
            return f"DeviceClassApplied {event.device_class.metadata.name}"
        case c.DeviceClassRemoved():
            return f"DeviceClassRemoved {event.name}"
        case c.ClassModeSet():
            return f"ClassModeSet {event.name} {event.mode}"
        case c.ResourceSlicePublished():
            return f"ResourceSlicePublished {event.slice.metadata.name}"
        case c.RequestPolicyChanged():
            return (
                f"RequestPolicyChanged {event.device} {event.capacity} v{event.policy_version} "
                f"{describe_policy(event.policy)}"
            )
        case c.NamespaceAccessSet():
            admin = " adminAccess" if event.admin_access else ""
            extra = ""
            if event.opaque_config_classes:
                extra += f" opaque={','.join(event.opaque_config_classes)}"
            if event.max_claims is not None:
                extra += f" max-claims={event.max_claims}"
            if event.max_requests_per_claim is not None:
                extra += f" max-requests={event.max_requests_per_claim}"
            classes = ",".join(event.classes)
            return f"NamespaceAccessSet {event.namespace} {classes}{admin}{extra}"
    return type(event).__name__


def described(events: Sequence[c.Event]) -> list[str]:
    return [describe(e) for e in events]
