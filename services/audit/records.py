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
from events.catalog import AppendRefused, ClaimRejected, tag_of
from events.envelopes import Envelope
from events.quantities import Quantity
from events.transitions import (
    ClaimEntered,
    NodeEpochs,
    NodeFencedOff,
    NodeLost,
    NodeReturned,
    ShareHeld,
    ShareReleased,
    first,
    meaning,
)

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
        transitions = meaning(env.event)
        share_id = getattr(env.event, "share_id", None)
        if isinstance(share_id, str) and not any(isinstance(t, ShareHeld) for t in transitions):
            shares.add(share_id)
        for t in transitions:
            if isinstance(t, NodeReturned | NodeLost | NodeFencedOff):
                nodes.add(t.node)
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
        transitions = meaning(event)
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
        entered = first(transitions, ClaimEntered)
        if entered is not None:
            fields["claim"] = entered.name
        elif isinstance(name, str) and env.namespace is not None:
            fields["claim"] = name
        held = first(transitions, ShareHeld)
        if held is not None:
            info = ShareInfo(
                share_id=held.share_id,
                namespace=held.namespace,
                claim=held.claim,
                request=held.request,
                device=device_name(held.driver, held.pool, held.device),
                node=held.node,
                amounts=_amounts(held.amounts),
                policy_version=held.policy_version,
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
            if first(transitions, ShareReleased) is not None and seen.live:
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
        for t in transitions:
            if isinstance(t, NodeReturned | NodeLost | NodeFencedOff):
                _node_change(out, t, base, known, on_node, epochs)
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


def _node_change(
    out: Update,
    change: NodeReturned | NodeLost | NodeFencedOff,
    base: dict[str, object],
    known: dict[str, ShareInfo],
    on_node: dict[str, set[str]],
    epochs: dict[str, NodeEpochs],
) -> None:
    """A node's epochs move; an expiry or fence that counts: a record per live share."""
    outcome = epochs.get(change.node, NodeEpochs(node=change.node)).outcome(change)
    if outcome is None:  # stale
        return
    epochs[change.node] = out.nodes[change.node] = outcome.epochs
    if outcome.shares == "kept":
        return
    fenced = outcome.shares == "released"
    decision = "released-by-fence" if fenced else "unknown-by-expiry"
    live = sorted(on_node.get(change.node, ()))
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
        on_node[change.node] = set()
