"""The audit's records, built from the log's envelopes: pure, no I/O.

One :class:`AuditRecord` per decision or change: every event of the log gives one,
keyed by its log position (``seq`` 0), and an expiry or a fence that counts (not stale,
as the fold decides: an epoch older than the node's lease or fence changes nothing)
gives one more per live share of the node (``seq`` 1, 2, ... in ShareID order), so a
tenant sees its share marked unknown or released by the fence in its own namespace.

Events that carry only a ShareID (limits, releases, unknown, confirmed) are named with
what the audit learnt of the share when it was reserved (:class:`ShareInfo`, kept by
the service in ``audit_shares``). The service applies the log in order, so a share's
reservation always comes first; a share the log never reserved (a log written by hand)
gets a record with its ShareID and node and no namespace, which only operators see,
instead of stopping the audit.

:func:`build` is deterministic: the same envelopes and the same known shares give the
same records, which is what makes the audit table identical after any redelivery.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from events.actors import ActorError, parse_actor
from events.catalog import (
    AppendRefused,
    CapacityReleased,
    CapacityReserved,
    ClaimRejected,
    ClaimSubmitted,
    Envelope,
    NodeFenced,
    NodeLeaseAcquired,
    NodeLeaseExpired,
    tag_of,
)
from events.quantities import Quantity

__all__ = [
    "AuditRecord",
    "NodeEpochs",
    "ShareInfo",
    "Update",
    "build",
    "device_name",
    "needs",
]


class ShareInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the audit knows of one share (``audit_shares``)."""

    share_id: str
    namespace: str
    claim: str
    request: str
    device: str
    node: str | None
    amounts: dict[str, str]
    policy_version: int
    live: bool = True


class NodeEpochs(msgspec.Struct, frozen=True, kw_only=True):
    """A node's newest lease epoch (acquired or expired) and fence epoch (``audit_nodes``)."""

    node: str
    lease_epoch: int = 0
    fenced_epoch: int = 0

    def stale(self, epoch: int) -> bool:
        """Whether an expiry or fence at ``epoch`` changes nothing (the fold's rule)."""
        return epoch < self.lease_epoch or epoch < self.fenced_epoch


class AuditRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One row of ``audit_records`` (and of ``dracap audit -o json``)."""

    position: int
    seq: int
    event_id: str
    recorded_at: datetime.datetime
    type: str
    decision: str
    reason: str = ""
    namespace: str | None = None
    claim: str | None = None
    request: str | None = None
    share_id: str | None = None
    device: str | None = None
    node: str | None = None
    amounts: dict[str, str] = {}
    policy_version: int | None = None
    actor: str
    actor_kind: str
    actor_name: str
    actor_epoch: int | None = None


class Update(msgspec.Struct, kw_only=True):
    """What :func:`build` wants written: records, and shares and nodes it changed."""

    records: list[AuditRecord] = []
    shares: dict[str, ShareInfo] = {}
    nodes: dict[str, NodeEpochs] = {}


def device_name(driver: str, pool: str, device: str) -> str:
    """``driver/pool/device``."""
    return f"{driver}/{pool}/{device}"


def _amounts(values: Mapping[str, Quantity] | None) -> dict[str, str]:
    return {k: v.canonical() for k, v in sorted((values or {}).items())}


def _reason(event: object) -> str:
    if isinstance(event, ClaimRejected):
        return event.summary
    if isinstance(event, AppendRefused):
        return f"epoch {event.epoch} stale (current {event.current_epoch}): " + ", ".join(
            event.types
        )
    reason = getattr(event, "reason", "")
    return reason if isinstance(reason, str) else ""


def _actor_fields(text: str) -> dict[str, object]:
    try:
        actor = parse_actor(text)
    except ActorError:  # written by a tool outside the grammar: kept as it was written
        return {"actor": text, "actor_kind": "unknown", "actor_name": text}
    name = f"{actor.name}@{actor.namespace}" if actor.kind == "tenant" else actor.name
    return {"actor": text, "actor_kind": actor.kind, "actor_name": name, "actor_epoch": actor.epoch}


def needs(envs: Iterable[Envelope]) -> tuple[set[str], set[str]]:
    """The ShareIDs and nodes whose known state :func:`build` needs for ``envs``."""
    shares: set[str] = set()
    nodes: set[str] = set()
    for env in envs:
        share_id = getattr(env.event, "share_id", None)
        if isinstance(share_id, str) and not isinstance(env.event, CapacityReserved):
            shares.add(share_id)
        node = getattr(env.event, "node", None)
        if isinstance(env.event, NodeFenced | NodeLeaseExpired | NodeLeaseAcquired) and node:
            nodes.add(node)
    return shares, nodes


def build(
    envs: Sequence[Envelope],
    shares: Mapping[str, ShareInfo],
    node_shares: Mapping[str, Sequence[str]],
    nodes: Mapping[str, NodeEpochs],
) -> Update:
    """The records of ``envs`` (in log order), given what is known before them.

    ``shares``: the known shares that ``envs`` name; ``node_shares``: the live shares of
    each node an expiry or fence of ``envs`` names; ``nodes``: those nodes' epochs.
    """
    out = Update()
    known = dict(shares)
    on_node = {node: set(ids) for node, ids in node_shares.items()}
    epochs = dict(nodes)
    for env in sorted(envs, key=lambda e: e.position):
        event = env.event
        tag = tag_of(event)
        base: dict[str, object] = {
            "position": env.position,
            "event_id": env.event_id,
            "recorded_at": env.recorded_at,
            "type": tag,
            "decision": tag.rpartition(".")[2],
            "reason": _reason(event),
            **_actor_fields(env.actor),
        }
        fields: dict[str, object] = {
            "namespace": env.namespace,
            "node": getattr(event, "node", None),
        }
        name = getattr(event, "name", None)
        if isinstance(event, ClaimSubmitted):
            fields["claim"] = event.claim.metadata.name
        elif isinstance(name, str) and env.namespace is not None:
            fields["claim"] = name
        if isinstance(event, CapacityReserved):
            info = ShareInfo(
                share_id=event.share_id,
                namespace=event.namespace,
                claim=event.name,
                request=event.request,
                device=device_name(event.driver, event.pool, event.device),
                node=event.node,
                amounts=_amounts(event.consumed),
                policy_version=event.policy_version,
            )
            known[info.share_id] = out.shares[info.share_id] = info
            if info.node is not None:
                on_node.setdefault(info.node, set()).add(info.share_id)
            fields.update(_share_fields(info))
        elif isinstance(share_id := getattr(event, "share_id", None), str):
            seen = known.get(share_id)
            if seen is None:  # never reserved in this log: named by what the event says
                fields.update(share_id=share_id, namespace=None, claim=None)
                seen = ShareInfo(
                    share_id=share_id,
                    namespace="",
                    claim="",
                    request="",
                    device="",
                    node=getattr(event, "node", None),
                    amounts={},
                    policy_version=0,
                    live=False,
                )
            else:
                fields.update(_share_fields(seen))
            fields["node"] = getattr(event, "node", None) or seen.node
            if isinstance(event, CapacityReleased) and seen.live:
                released = msgspec.structs.replace(seen, live=False)
                known[share_id] = out.shares[share_id] = released
                if seen.node is not None:
                    on_node.get(seen.node, set()).discard(share_id)
        elif getattr(event, "device", None) is not None and hasattr(event, "driver"):
            fields["device"] = device_name(event.driver, event.pool, event.device)  # type: ignore[union-attr]
        for key in ("policy_version", "request"):
            value = getattr(event, key, None)
            if value is not None and key not in fields:
                fields[key] = value
        out.records.append(AuditRecord(seq=0, **base, **fields))  # type: ignore[arg-type]
        if isinstance(event, NodeLeaseAcquired):
            node = epochs.get(event.node, NodeEpochs(node=event.node))
            epochs[event.node] = out.nodes[event.node] = msgspec.structs.replace(
                node, lease_epoch=max(node.lease_epoch, event.epoch)
            )
        elif isinstance(event, NodeLeaseExpired | NodeFenced):
            _node_wide(out, env, base, known, on_node, epochs)
    return out


def _share_fields(info: ShareInfo) -> dict[str, object]:
    return {
        "namespace": info.namespace,
        "claim": info.claim,
        "request": info.request,
        "share_id": info.share_id,
        "device": info.device,
        "node": info.node,
        "amounts": dict(info.amounts),
        "policy_version": info.policy_version,
    }


def _node_wide(
    out: Update,
    env: Envelope,
    base: dict[str, object],
    known: dict[str, ShareInfo],
    on_node: dict[str, set[str]],
    epochs: dict[str, NodeEpochs],
) -> None:
    """An expiry or fence that counts: a record per live share of the node."""
    event = env.event
    assert isinstance(event, NodeLeaseExpired | NodeFenced)
    node = epochs.get(event.node, NodeEpochs(node=event.node))
    if node.stale(event.epoch):
        return
    fenced = isinstance(event, NodeFenced)
    epochs[event.node] = out.nodes[event.node] = msgspec.structs.replace(
        node,
        lease_epoch=max(node.lease_epoch, event.epoch),
        fenced_epoch=max(node.fenced_epoch, event.epoch) if fenced else node.fenced_epoch,
    )
    decision = "released-by-fence" if fenced else "unknown-by-expiry"
    live = sorted(on_node.get(event.node, ()))
    for seq, share_id in enumerate(live, start=1):
        info = known.get(share_id)
        if info is None:
            continue
        if fenced:
            known[share_id] = out.shares[share_id] = msgspec.structs.replace(info, live=False)
        out.records.append(
            AuditRecord(seq=seq, **{**base, "decision": decision}, **_share_fields(info))  # type: ignore[arg-type]
        )
    if fenced:
        on_node[event.node] = set()
