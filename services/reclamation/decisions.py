"""What the reclamation service records, decided on the folded log (pure).

:func:`decide_expiry` turns one lease found past its expiry into
``NodeLeaseExpired(node, epoch)`` plus one ``ShareMarkedUnknown`` per live share the
fold places on the node, in ShareID order. The fold marks every live share of the node
unknown at the expiry itself (so a share reserved after the decision is unknown as
well); the per-share events say which shares that was, for audit and for people.

:func:`fence_by_hook` is the record of a fence hook that reported the node off:
``NodeFenced`` at the epoch that expired, with the hook's command as the reason. The
fold releases every live share of the node at that event and the store's ``fence``
guard gives their capacity back in the same append.

:func:`not_started` lists the Ready claims nobody has used yet — no consumer reserved
them (``status.reservedFor`` is empty) and their agent saw no traffic through any of
their shares — and the claims mirrored from Kubernetes that no kubelet prepared (still
``allocated``, their clock starting at the allocation), whose DeviceClass sets
``dracap.io/not-started-timeout``;
:func:`decide_not_started` says what to record once one has waited that long: its
class's action, ``ReleaseRequested`` with the reason (the agent then releases it like a
delete) or ``ClaimStalled`` (it keeps its capacity and shows the reason; a claim never
prepared cannot stall — only a Ready claim can — so it is released). A claim of
several classes takes the shortest timeout (and that class's action).

Which lease has expired is not decided here: the service reads it from
``node_leases`` and ``node_epochs`` in one statement (the database's clock is the one
clock every lease is measured with).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from events.catalog import (
    ClaimStalled,
    Event,
    NodeFenced,
    NodeLeaseExpired,
    ReleaseRequested,
    ShareMarkedUnknown,
)
from events.state import ClaimKey, ClaimState, ClusterState
from events.tenancy import not_started as class_not_started

__all__ = [
    "NotStarted",
    "candidate_of",
    "decide_expiry",
    "decide_not_started",
    "fence_by_hook",
    "not_started",
    "unknown_shares",
]


def unknown_shares(state: ClusterState, node: str) -> list[str]:
    """The live shares of ``node`` an expiry makes unknown (sorted)."""
    held = state.nodes.get(node)
    if held is None:
        return []
    return sorted(s for s in held.live_shares if state.shares[s].state not in ("released",))


def decide_expiry(state: ClusterState, node: str, epoch: int) -> list[Event]:
    """The events of the expiry of ``node``'s lease ``epoch`` (see the module docstring)."""
    events: list[Event] = [NodeLeaseExpired(node=node, epoch=epoch)]
    events += [ShareMarkedUnknown(share_id=s, node=node) for s in unknown_shares(state, node)]
    return events


def fence_by_hook(node: str, epoch: int, command: str) -> NodeFenced:
    """The record of a fence hook that reported ``node`` off."""
    return NodeFenced(node=node, epoch=epoch, reason=f"fence hook reported the node off: {command}")


class NotStarted(msgspec.Struct, frozen=True, kw_only=True):
    """A claim nobody started yet under a not-started timeout (``since_position``: the log
    position whose time starts the clock; ``prepared``: whether its limits are in force)."""

    key: ClaimKey
    allocation_version: int
    since_position: int
    timeout_s: float
    action: str
    prepared: bool = True


def _classes(claim: ClaimState) -> list[str]:
    return claim.spec.classes() if claim.spec is not None else []


def _waiting_since(claim: ClaimState) -> tuple[int, bool] | None:
    """Where a claim's not-started clock starts, and whether it is prepared; or ``None``.

    A Ready claim that no consumer reserved: from where it became Ready. A claim
    mirrored from Kubernetes that no kubelet prepared (still ``allocated``): from where it
    was allocated — its consumer never reached the node.
    """
    if claim.reserved_for:
        return None
    if claim.phase == "ready" and claim.ready_position:
        return claim.ready_position, True
    if claim.phase == "allocated" and claim.source == "kubernetes" and claim.bound_position:
        return claim.bound_position, False
    return None


def not_started(state: ClusterState, keys: Iterable[ClaimKey] | None = None) -> list[NotStarted]:
    """The claims nobody started yet whose class sets a timeout (see the module); of
    ``keys`` only when given (the service asks about the claims it has queued)."""
    if not any(class_not_started(c.device_class) for c in state.classes.values()):
        return []  # the usual case, checked in O(classes) on every tick
    out: list[NotStarted] = []
    for key in state.claims if keys is None else keys:
        candidate = candidate_of(state, key)
        if candidate is not None:
            out.append(candidate)
    return out


def candidate_of(state: ClusterState, key: ClaimKey) -> NotStarted | None:
    """What :func:`not_started` says of one claim (``None``: not a candidate now)."""
    claim = state.claims.get(key)
    if claim is None:
        return None
    waiting = _waiting_since(claim)
    if waiting is None:
        return None
    if any(state.shares[s].used for s in claim.share_ids if s in state.shares):
        return None
    rules = []
    for name in _classes(claim):
        cls = state.classes.get(name)
        rule = class_not_started(cls.device_class) if cls is not None else None
        if rule is not None:
            rules.append(rule)
    if not rules:
        return None
    timeout, action = min(rules)
    return NotStarted(
        key=key,
        allocation_version=claim.allocation_version,
        since_position=waiting[0],
        timeout_s=timeout,
        action=action,
        prepared=waiting[1],
    )


def _seconds(value: float) -> str:
    return f"{value:g}s"


def decide_not_started(candidate: NotStarted, waited_s: float, node: str | None) -> Event | None:
    """What to record for ``candidate`` after ``waited_s`` seconds Ready (``None``: wait)."""
    if waited_s < candidate.timeout_s:
        return None
    namespace, name = candidate.key
    if candidate.prepared:
        reason = (
            f"not started within {_seconds(candidate.timeout_s)} of becoming Ready: no "
            "consumer reserved it and no use was seen"
        )
    else:
        reason = (
            f"not started within {_seconds(candidate.timeout_s)} of being allocated: no "
            "kubelet prepared it"
        )
    if candidate.action == "stall" and candidate.prepared:
        return ClaimStalled(
            namespace=namespace,
            name=name,
            allocation_version=candidate.allocation_version,
            reason=reason,
        )
    return ReleaseRequested(
        namespace=namespace,
        name=name,
        allocation_version=candidate.allocation_version,
        node=node,
        reason=reason,
    )
