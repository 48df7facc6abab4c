"""Usage as amount x time, per namespace, DeviceClass, capacity, hour and state: pure.

A share is billed from its reservation (``CapacityReserved``) to its release
(``CapacityReleased``, or a fence of its node that counts), at the amounts it consumes,
under the DeviceClass of the claim's request it serves (the claim's latest
``ClaimSubmitted``: ``exactly.deviceClassName``, or a ``firstAvailable`` alternative's for
a ``request/alternative`` result). Time spent *unknown* — from ``ShareMarkedUnknown`` or
an expiry of its node's lease that counts, to ``ShareConfirmed``, the fence or the
release — is billed apart (state ``unknown``), so a tenant can be charged or credited
for it by policy. Admin-access shares consume nothing and are not billed. Times are
the events' ``recorded_at``: the log's own clock, so the same log gives the same bill.

Each closed stretch (a *segment*) is cut at hour boundaries (:func:`hourly`) and added
to the hour's row: ``unit_seconds`` = amount in the capacity's base unit (bytes of
``memory``, bit/s of ``bandwidth``) x seconds, exact (:class:`~decimal.Decimal`,
computed from the quantity's nano-units and whole microseconds). ``dracap usage`` shows
it as GiB-hours and Gbit/s-hours (:func:`display`).

Expiries and fences older than the node's newest lease or fence are stale and change
nothing, by the fold's one rule (:class:`events.transitions.NodeEpochs`). Billing reads
what each event means (:func:`events.transitions.meaning`), not the event classes.
The service applies the log in order, so a share's reservation comes before what
follows it; on a log written by hand, a reservation whose claim was never submitted
is billed under the class ``""``, and an event about a share never reserved changes
nothing.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Final, Literal, TypeAlias

import msgspec

from events.catalog import ClaimSubmitted
from events.envelopes import Envelope
from events.model import ResourceClaim
from events.transitions import (
    ClaimEntered,
    NodeEpochs,
    NodeFencedOff,
    NodeLost,
    NodeReturned,
    ShareHeld,
    ShareKnownAgain,
    ShareReleased,
    ShareUnknown,
    meaning,
)

__all__ = [
    "BILLED",
    "HOUR",
    "BillingShare",
    "NodeEpochs",
    "Segment",
    "State",
    "Update",
    "UsageRow",
    "apply",
    "display",
    "hourly",
    "needs",
    "request_classes",
]

#: The transitions billing acts on (:func:`apply` ignores the others).
BILLED: Final = (
    ClaimEntered,
    ShareHeld,
    ShareReleased,
    ShareUnknown,
    ShareKnownAgain,
    NodeReturned,
    NodeLost,
    NodeFencedOff,
)
HOUR: Final = datetime.timedelta(hours=1)
_MICRO: Final = datetime.timedelta(microseconds=1)
_NANO_MICRO: Final = Decimal(10) ** 15  # nano-units x microseconds -> units x seconds
State: TypeAlias = Literal["held", "unknown", "closed"]

#: How ``dracap usage`` shows a capacity: (unit, divisor of unit-seconds).
DISPLAY: Final[Mapping[str, tuple[str, Decimal]]] = {
    "memory": ("GiB-hours", Decimal(2**30) * 3600),
    "bandwidth": ("Gbit/s-hours", Decimal(10**9) * 3600),
}


class BillingShare(msgspec.Struct, frozen=True, kw_only=True):
    """One share's billing state (``billing_shares``): amounts in nano-units."""

    share_id: str
    namespace: str
    device_class: str
    node: str | None
    amounts: dict[str, int]
    billed: bool
    state: State
    since: datetime.datetime
    position: int


class Segment(msgspec.Struct, frozen=True, kw_only=True):
    """A closed stretch of one share in one state."""

    namespace: str
    device_class: str
    amounts: dict[str, int]
    state: Literal["held", "unknown"]
    start: datetime.datetime
    end: datetime.datetime


class UsageRow(msgspec.Struct, frozen=True, kw_only=True):
    """Usage added to one hour (``billing_usage``)."""

    namespace: str
    device_class: str
    capacity: str
    hour: datetime.datetime
    state: Literal["held", "unknown"]
    unit_seconds: Decimal


class Update(msgspec.Struct, kw_only=True):
    """What :func:`apply` wants written."""

    claims: dict[tuple[str, str], dict[str, str]] = {}
    shares: dict[str, BillingShare] = {}
    nodes: dict[str, NodeEpochs] = {}
    segments: list[Segment] = []

    def usage(self) -> list[UsageRow]:
        """The segments cut per hour and summed per row key."""
        return usage_rows(self.segments)


def request_classes(claim: ResourceClaim) -> dict[str, str]:
    """The DeviceClass of each request name a result may carry (``req``, ``req/alt``)."""
    out: dict[str, str] = {}
    for request in (claim.spec.devices.requests or []) if claim.spec.devices else []:
        if request.exactly is not None:
            out[request.name] = request.exactly.device_class_name
        for alternative in request.first_available or ():
            out[f"{request.name}/{alternative.name}"] = alternative.device_class_name
    return out


def hourly(start: datetime.datetime, end: datetime.datetime) -> list[tuple[datetime.datetime, int]]:
    """``[start, end)`` cut at hour boundaries (UTC): (hour, whole microseconds) each."""
    out: list[tuple[datetime.datetime, int]] = []
    if end <= start:
        return out
    start, end = start.astimezone(datetime.UTC), end.astimezone(datetime.UTC)
    hour = start.replace(minute=0, second=0, microsecond=0)
    while hour < end:
        nxt = hour + HOUR
        overlap = min(end, nxt) - max(start, hour)
        if overlap > datetime.timedelta(0):
            out.append((hour, overlap // _MICRO))
        hour = nxt
    return out


def usage_rows(segments: Iterable[Segment]) -> list[UsageRow]:
    """Segments cut per hour, summed per (namespace, class, capacity, hour, state)."""
    sums: dict[tuple[str, str, str, datetime.datetime, str], Decimal] = {}
    for seg in segments:
        for hour, micros in hourly(seg.start, seg.end):
            for capacity, nanos in seg.amounts.items():
                key = (seg.namespace, seg.device_class, capacity, hour, seg.state)
                sums[key] = sums.get(key, Decimal(0)) + Decimal(nanos * micros) / _NANO_MICRO
    return [
        UsageRow(
            namespace=k[0],
            device_class=k[1],
            capacity=k[2],
            hour=k[3],
            state=k[4],  # type: ignore[arg-type]
            unit_seconds=v,
        )
        for k, v in sorted(sums.items())
    ]


def display(capacity: str, unit_seconds: Decimal) -> tuple[Decimal, str]:
    """``unit_seconds`` of ``capacity`` in the unit people read (GiB-hours, ...)."""
    unit, divisor = DISPLAY.get(capacity, (f"{capacity}-hours", Decimal(3600)))
    return unit_seconds / divisor, unit


def needs(envs: Iterable[Envelope]) -> tuple[set[tuple[str, str]], set[str], set[str]]:
    """Claims, ShareIDs and nodes whose known state :func:`apply` needs for ``envs``."""
    claims: set[tuple[str, str]] = set()
    shares: set[str] = set()
    nodes: set[str] = set()
    for env in envs:
        for t in meaning(env.event):
            match t:
                case ShareHeld():
                    claims.add((t.namespace, t.claim))
                case ShareUnknown() | ShareKnownAgain() | ShareReleased():
                    shares.add(t.share_id)
                case NodeLost() | NodeFencedOff() | NodeReturned():
                    nodes.add(t.node)
    return claims, shares, nodes


def apply(
    envs: Sequence[Envelope],
    claims: Mapping[tuple[str, str], Mapping[str, str]],
    shares: Mapping[str, BillingShare],
    nodes: Mapping[str, NodeEpochs],
) -> Update:
    """Billing's changes for ``envs`` (in log order), given what it knew before them.

    ``shares`` must hold the shares ``envs`` name and every open share of the nodes
    they expire or fence.
    """
    out = Update()
    known = dict(shares)
    request_of = {k: dict(v) for k, v in claims.items()}
    epochs = dict(nodes)

    def put(share: BillingShare) -> None:
        known[share.share_id] = out.shares[share.share_id] = share

    def close(share: BillingShare, at: datetime.datetime, then: State, position: int) -> None:
        if share.state == "closed" or position <= share.position:
            return  # released already, or an event billing has applied before
        if share.billed:
            out.segments.append(
                Segment(
                    namespace=share.namespace,
                    device_class=share.device_class,
                    amounts=share.amounts,
                    state=share.state,
                    start=share.since,
                    end=max(at, share.since),
                )
            )
        put(msgspec.structs.replace(share, state=then, since=at, position=position))

    for env in sorted(envs, key=lambda e: e.position):
        at, position = env.recorded_at, env.position
        for t in meaning(env.event):
            match t:
                case ClaimEntered():
                    assert isinstance(env.event, ClaimSubmitted)  # the manifest's classes
                    key = (t.namespace, t.name)
                    request_of[key] = out.claims[key] = request_classes(env.event.claim)
                case ShareHeld():
                    if t.share_id in known:
                        continue
                    classes = request_of.get((t.namespace, t.claim), {})  # {}: never submitted
                    device_class = classes.get(t.request) or classes.get(
                        t.request.partition("/")[0], ""
                    )
                    put(
                        BillingShare(
                            share_id=t.share_id,
                            namespace=t.namespace,
                            device_class=device_class,
                            node=t.node,
                            amounts={k: v.nanos for k, v in sorted(t.amounts.items())},
                            billed=not t.admin,
                            state="held",
                            since=at,
                            position=position,
                        )
                    )
                case ShareReleased() | ShareUnknown() | ShareKnownAgain():
                    share = known.get(t.share_id)
                    if share is None:
                        continue  # never reserved in this log: nothing billed, nothing to close
                    if isinstance(t, ShareReleased):
                        close(share, at, "closed", position)
                    elif isinstance(t, ShareUnknown) and share.state == "held":
                        close(share, at, "unknown", position)
                    elif isinstance(t, ShareKnownAgain) and share.state == "unknown":
                        close(share, at, "held", position)
                case NodeReturned() | NodeLost() | NodeFencedOff():
                    outcome = epochs.get(t.node, NodeEpochs(node=t.node)).outcome(t)
                    if outcome is None:  # stale
                        continue
                    epochs[t.node] = out.nodes[t.node] = outcome.epochs
                    if outcome.shares == "kept":
                        continue
                    on_node = sorted(
                        s.share_id
                        for s in known.values()
                        if s.node == t.node and s.state != "closed"
                    )
                    for share_id in on_node:
                        share = known[share_id]
                        if outcome.shares == "released":
                            close(share, at, "closed", position)
                        elif share.state == "held":
                            close(share, at, "unknown", position)
    return out
