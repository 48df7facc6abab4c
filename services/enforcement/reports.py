"""What a node agent may report, checked against the fold before anything is appended.

The enforcement service (:mod:`services.enforcement.service`) appends a node agent's
reports as ``agent:<node>#<epoch>``; the agent never touches the log. A report is a
list of batches of events (:class:`~services.enforcement.protocol.Report`), and
:func:`refusal` (pure) says why one may not be appended, or ``None``. The rules are the
database's node scope for agents (``docs/database-roles.md``), restated on the fold:

=============================================== ===========================================
event                                           its node
=============================================== ===========================================
``LimitApplied``, ``LimitFailed``,              ``node`` is the agent's, and the share is
``LimitRemoved``, ``ShareConfirmed``,           the agent's (its node, or no node)
``ShareUsed``
``CapacityReleased``                            the share is the agent's
``EnforcementReconciled``,                      ``node``
``EnforcementCheckpointSetAside``
``DeviceHealthChanged``                         ``node``, and the device is the node's
``ResourceSlicePublished``                      ``nodeName``; no slice of that name, nor of
                                                that pool, is another node's
``ResourceSliceWithdrawn``                      the slice is the node's
``MessageDeadLettered``                         the consumer is the node's (``agent-<node>``)
anything else                                   not a node agent's report: refused
=============================================== ===========================================

Each event goes to its own stream (:func:`~events.envelopes.stream_of`); a batch without
events is a version check, allowed on the node's stream and the streams of the node's
claims (it writes nothing; it makes the append conflict if the claim moved). A lease
is taken with the ``lease`` verb, never reported. The service then folds the events
on a copy of what they touch; a refusal of the fold is a conflict there (the agent
decided on an older state) — this module says only what is never the agent's to write.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal, TypeAlias

from events.catalog import (
    CapacityReleased,
    DeviceHealthChanged,
    EnforcementCheckpointSetAside,
    EnforcementReconciled,
    Event,
    LimitApplied,
    LimitFailed,
    LimitRemoved,
    MessageDeadLettered,
    ResourceSlicePublished,
    ResourceSliceWithdrawn,
    ShareConfirmed,
    ShareUsed,
    tag_of,
)
from events.envelopes import node_stream, stream_of
from events.state import ClusterState
from services.enforcement.protocol import consumer_name

__all__ = [
    "AGENT_REPORTS",
    "SHARE_REPORTS",
    "Refused",
    "refusal",
    "shares_of",
    "version_check_refusal",
]

#: Reports about one share (its ``share_id``).
SHARE_REPORTS: Final = (
    LimitApplied,
    LimitFailed,
    LimitRemoved,
    ShareConfirmed,
    ShareUsed,
    CapacityReleased,
)
#: Every event a node agent reports.
AGENT_REPORTS: Final = (
    *SHARE_REPORTS,
    EnforcementReconciled,
    EnforcementCheckpointSetAside,
    DeviceHealthChanged,
    ResourceSlicePublished,
    ResourceSliceWithdrawn,
    MessageDeadLettered,
)


#: Why a report may not be appended: ``invalid`` (never an agent's to write that way) or
#: ``forbidden`` (another node's), and the reason.
Refused: TypeAlias = tuple[Literal["invalid", "forbidden"], str]


def refusal(state: ClusterState, node: str, stream: str, event: Event) -> Refused | None:
    """Why ``node``'s agent may not append ``event`` to ``stream``; ``None`` when it may."""
    tag = tag_of(event)
    if not isinstance(event, AGENT_REPORTS):
        return "invalid", f"{tag} is not a node agent's report"
    if stream != stream_of(event):
        return "invalid", f"{tag} belongs to stream {stream_of(event)!r}, not {stream!r}"
    why = _scope_refusal(state, node, event)
    return ("forbidden", why) if why is not None else None


def _scope_refusal(state: ClusterState, node: str, event: Event) -> str | None:
    """Why ``event`` is not ``node``'s to report (see the module docstring)."""
    tag = tag_of(event)
    reported = getattr(event, "node", node)
    if reported != node:
        return f"{tag} for node {reported!r}: this agent reports for {node!r} only"
    if isinstance(event, SHARE_REPORTS):
        share = state.shares.get(event.share_id)
        if share is None:
            return f"{tag}: share {event.share_id} is not in the log"
        if share.node not in (None, node):
            return f"{tag}: share {event.share_id} is on node {share.node!r}, not {node!r}"
        return None
    if isinstance(event, DeviceHealthChanged):
        device = state.devices.get((event.driver, event.pool, event.device))
        if device is None or device.node != node:
            where = f"{event.driver}/{event.pool}/{event.device}"
            return f"{tag}: device {where} is not a device of node {node!r}"
        return None
    if isinstance(event, ResourceSlicePublished):
        return _slice_refusal(state, node, event)
    if isinstance(event, ResourceSliceWithdrawn):
        known = state.slices.get(event.name)
        if known is None or known.spec.node_name != node:
            return f"{tag}: slice {event.name!r} is not a slice of node {node!r}"
        return None
    if isinstance(event, MessageDeadLettered) and event.consumer != consumer_name(node):
        return f"{tag}: consumer {event.consumer!r} is not node {node!r}'s"
    return None


def _slice_refusal(state: ClusterState, node: str, event: ResourceSlicePublished) -> str | None:
    spec = event.slice.spec
    name = event.slice.metadata.name
    if spec.node_name != node:
        return f"slice {name!r} names node {spec.node_name!r}, not {node!r}"
    known = state.slices.get(name)
    if known is not None and known.spec.node_name != node:
        return f"slice {name!r} is node {known.spec.node_name!r}'s"
    pool = state.pools.get((spec.driver, spec.pool.name))
    for other in pool.slices if pool is not None else ():
        held = state.slices.get(other)
        if held is not None and held.spec.node_name != node:
            return (
                f"pool {spec.driver}/{spec.pool.name} holds node {held.spec.node_name!r}'s slices"
            )
    return None


def version_check_refusal(state: ClusterState, node: str, stream: str) -> str | None:
    """Why ``node``'s agent may not check the version of ``stream`` (a batch without
    events); ``None`` for its node's stream and the streams of its node's claims."""
    if stream == node_stream(node):
        return None
    kind, _, rest = stream.partition(":")
    namespace, _, name = rest.partition("/")
    claim = state.claims.get((namespace, name)) if kind == "claim" else None
    if claim is None or claim.node != node:
        return f"stream {stream!r} is not one of node {node!r}'s claims"
    return None


def shares_of(events: Sequence[Event]) -> list[str]:
    """The shares ``events`` report about, in order, once each."""
    seen: dict[str, None] = {}
    for event in events:
        if isinstance(event, SHARE_REPORTS):
            seen.setdefault(event.share_id, None)
    return list(seen)
