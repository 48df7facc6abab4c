"""What the APIs reply: claim and device views of the fold. Pure.

Every reply of the tenant and admin APIs is one JSON object, either
``{"ok": true, ...}`` or ``{"ok": false, "error": {code, field, rule, message}}``
(:func:`services.runtime.bus.queries.ok_reply` / ``error_reply``, shared with the audit and
billing queries). Views are computed from
:class:`events.state.ClusterState` on demand, never stored:

* :class:`ClaimView`: a claim's phase and reason, ``ready`` (true only once the node
  agent reported every limit applied: invariant 7), its node, the Kubernetes
  ``AllocationResult`` JSON of the current allocation and one :class:`ShareView` per
  share of that allocation (ShareID, device, consumed amounts, state, enforcement level).
  The fold keeps an allocation without its opaque configuration (``devices.config``);
  the API reads it whole from the log for the claims that have one, so a view shows
  the allocation exactly as it was bound.
* :class:`DeviceView`: per device and capacity the total, what live shares consume and
  what is free, plus the number of live shares and the namespaces holding them (the
  operator's ``devices.list``).
* :class:`TenantDeviceView`: what a tenant may see of a device (``claims.devices``):
  only devices of classes the namespace may use, the classes, per capacity the total
  and what is free, and only the attributes those classes allow-list
  (``dracap.io/tenant-attributes``, :mod:`events.tenancy`). No shares, no tenants.

Quantities are written in canonical Kubernetes form (``"10Gi"``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from events.envelopes import Envelope
from events.fieldchecks import split_qualified_name
from events.inventory import DeviceEntry, Inventory, lost_nodes
from events.model import AllocationResult, DeviceAttribute, DeviceClass, describe_policy
from events.model import to_builtins as model_builtins
from events.state import (
    LIVE_SHARE_STATES,
    ClaimKey,
    ClaimState,
    ClusterState,
    DeviceState,
    NamespaceState,
    ShareState,
)
from events.tenancy import allow_list, class_allowed, tenant_attributes
from events.transitions import (
    AccessChanged,
    ClaimEntered,
    DeviceHealth,
    LimitsRemoved,
    LimitsSettled,
    NodeFencedOff,
    NodeLost,
    ShareHeld,
    ShareKnownAgain,
    ShareReleased,
    ShareUnknown,
    Transition,
    meaning,
)

__all__ = [
    "CapacityView",
    "ClaimView",
    "ConditionView",
    "DevicePoliciesView",
    "DeviceView",
    "ShareView",
    "TenantCapacityView",
    "TenantDeviceView",
    "claim_view",
    "device_views",
    "policy_views",
    "tenant_device_views",
]


class ShareView(msgspec.Struct, frozen=True, kw_only=True):
    """One share (ShareID) of a claim's current allocation."""

    share_id: str
    driver: str
    pool: str
    device: str
    consumed: dict[str, str]
    state: str
    level: str | None
    #: why the device's node agent reports it failing (``None``: healthy)
    unhealthy: str | None = None
    #: when its agent tries the limit again after a retryable failure (ISO 8601)
    retry_at: str | None = None


class ConditionView(msgspec.Struct, frozen=True, kw_only=True):
    """A condition of a claim, in the Kubernetes shape (``status`` is "True"/"False")."""

    type: str
    status: str
    reason: str
    message: str


class ClaimView(msgspec.Struct, frozen=True, kw_only=True):
    """A claim as a tenant sees it.

    ``conditions``: what is wrong with a live allocation beyond its phase — today
    ``DeviceHealthy=False`` for each device of a live share its node agent reported
    failing.
    """

    namespace: str
    name: str
    phase: str
    reason: str | None
    ready: bool
    node: str | None
    allocation: dict[str, Any] | None
    shares: list[ShareView]
    conditions: list[ConditionView] = []
    reserved_for: list[str] = []  #: consumers that reserved it (``status.reservedFor``)


class CapacityView(msgspec.Struct, frozen=True, kw_only=True):
    """One capacity of one device."""

    total: str
    consumed: str
    free: str


class DeviceView(msgspec.Struct, frozen=True, kw_only=True):
    """One published device as an operator sees it."""

    driver: str
    pool: str
    device: str
    node: str | None
    capacity: dict[str, CapacityView]
    shares: int
    tenants: list[str]


class PolicyView(msgspec.Struct, frozen=True, kw_only=True):
    """The request policy of one capacity, and the device policy version it came with."""

    capacity: str
    version: int
    policy: str  # describe_policy's form: "default 5Gi, min 5Gi, step 5Gi, max 40Gi"


class SharePolicyView(msgspec.Struct, frozen=True, kw_only=True):
    """A live share and the policy version (and so the policies) it was granted under."""

    share_id: str
    claim: str  # namespace/name
    state: str
    policy_version: int
    consumed: dict[str, str]
    policies: dict[str, str]  # capacity -> the policy at policy_version


class DevicePoliciesView(msgspec.Struct, frozen=True, kw_only=True):
    """``policies.list``: one device's policies now, and its live shares' snapshots."""

    driver: str
    pool: str
    device: str
    node: str | None
    policy_version: int
    policies: list[PolicyView]
    shares: list[SharePolicyView]


class TenantCapacityView(msgspec.Struct, frozen=True, kw_only=True):
    """One capacity of one device, as a tenant sees it."""

    total: str
    free: str


class TenantDeviceView(msgspec.Struct, frozen=True, kw_only=True):
    """One device of a class the tenant may use, as the tenant sees it."""

    driver: str
    pool: str
    device: str
    node: str | None
    classes: list[str]  #: the classes the namespace may use that select the device
    capacity: dict[str, TenantCapacityView]
    attributes: dict[str, Any]  #: allow-listed attributes, fully qualified names


def claim_view(
    state: ClusterState, claim: ClaimState, allocation: AllocationResult | None = None
) -> ClaimView:
    """The view of ``claim`` in ``state``; ``allocation``: its current allocation whole, read
    from the log for a claim whose allocation has a configuration the fold does not keep
    (``ClaimState.allocation_configs``)."""
    shares: list[ShareView] = []
    conditions: list[ConditionView] = []
    for share_id in claim.share_ids:
        share = state.shares.get(share_id)
        if share is None:
            continue
        dev = state.devices.get(share.device_key)
        sick = dev.unhealthy if dev is not None and share.live else None
        if sick is not None:
            where = "/".join(share.device_key)
            conditions.append(
                ConditionView(
                    type="DeviceHealthy",
                    status="False",
                    reason="DeviceUnhealthy",
                    message=f"device {where} of share {share_id}: {sick}",
                )
            )
        shares.append(
            ShareView(
                share_id=share_id,
                driver=share.driver,
                pool=share.pool,
                device=share.device,
                consumed={k: v.canonical() for k, v in sorted(share.consumed.items())},
                state=share.state,
                level=share.limit_level,
                unhealthy=sick,
                retry_at=share.retry_at.isoformat() if share.retry_at is not None else None,
            )
        )
    whole = allocation or claim.allocation
    return ClaimView(
        namespace=claim.namespace,
        name=claim.name,
        phase=claim.phase,
        reason=claim.reason,
        ready=claim.phase in ("ready", "stalled"),  # stalled: limits in force, unused
        node=claim.node,
        allocation=model_builtins(whole) if whole is not None else None,
        shares=shares,
        conditions=conditions,
        reserved_for=list(claim.reserved_for),
    )


def _device_view(dev: DeviceState, shares: int, tenants: set[str]) -> DeviceView:
    consumed = dev.consumed()
    capacity = {
        name: CapacityView(
            total=total.canonical(),
            consumed=consumed[name].canonical(),
            free=dev.free(name).canonical(),
        )
        for name, total in sorted(dev.total.items())
    }
    return DeviceView(
        driver=dev.driver,
        pool=dev.pool,
        device=dev.name,
        node=dev.node,
        capacity=capacity,
        shares=shares,
        tenants=sorted(tenants),
    )


def device_views(state: ClusterState) -> list[DeviceView]:
    """Every published device, sorted by driver, pool and name."""
    counts: dict[tuple[str, str, str], int] = {}
    tenants: dict[tuple[str, str, str], set[str]] = {}
    for share in state.shares.values():
        if share.state in LIVE_SHARE_STATES:
            key = share.device_key
            counts[key] = counts.get(key, 0) + 1
            tenants.setdefault(key, set()).add(share.claim[0])
    return [
        _device_view(dev, counts.get(key, 0), tenants.get(key, set()))
        for key, dev in sorted(state.devices.items())
        if dev.present
    ]


def policy_views(state: ClusterState) -> list[DevicePoliciesView]:
    """Every published device with a capacity: policies now, live shares and theirs."""
    shares: dict[tuple[str, str, str], list[SharePolicyView]] = {}
    for share in state.shares.values():
        if share.state not in LIVE_SHARE_STATES:
            continue
        dev = state.devices.get(share.device_key)
        if dev is None:
            continue
        shares.setdefault(share.device_key, []).append(
            SharePolicyView(
                share_id=share.share_id,
                claim="/".join(share.claim),
                state=share.state,
                policy_version=share.policy_version,
                consumed={n: q.canonical() for n, q in sorted(share.consumed.items())},
                policies={
                    n: describe_policy(dev.policy_at(n, share.policy_version))
                    for n in sorted(dev.total)
                },
            )
        )
    return [
        DevicePoliciesView(
            driver=dev.driver,
            pool=dev.pool,
            device=dev.name,
            node=dev.node,
            policy_version=dev.policy_version,
            policies=[
                PolicyView(
                    capacity=name,
                    version=dev.capacity_policy_versions.get(name, dev.policy_version),
                    policy=describe_policy(dev.policies.get(name)),
                )
                for name in sorted(dev.total)
            ],
            shares=sorted(shares.get(key, []), key=lambda v: (v.policy_version, v.claim)),
        )
        for key, dev in sorted(state.devices.items())
        if dev.present and dev.total
    ]


def tenant_device_views(
    state: ClusterState, inventory: Inventory, record: NamespaceState | None
) -> list[TenantDeviceView]:
    """The devices a namespace with access ``record`` may use, sorted by driver, pool, name."""
    if record is None:
        return []
    usable = [
        c for name, c in sorted(inventory.classes.items()) if class_allowed(record.classes, name)
    ]
    views: list[TenantDeviceView] = []
    for entry in inventory.devices:
        dev = state.devices.get(entry.key)
        if dev is None or not dev.present:
            continue
        classes = [c for c in usable if inventory.class_matches(c, entry.index)]
        if classes:
            views.append(_tenant_view(dev, entry, classes))
    return sorted(views, key=lambda v: (v.driver, v.pool, v.device))


def _tenant_view(
    dev: DeviceState, entry: DeviceEntry, classes: list[DeviceClass]
) -> TenantDeviceView:
    allowed: dict[tuple[str, str], None] = {}
    for dclass in classes:
        allowed.update(allow_list(tenant_attributes(dclass), dev.driver))
    attributes: dict[str, Any] = {}
    for name, attribute in sorted((entry.device.attributes or {}).items()):
        domain, ident = split_qualified_name(name, dev.driver)
        if (domain, ident) in allowed:
            attributes[f"{domain}/{ident}"] = _attribute_json(attribute)
    capacity = {
        name: TenantCapacityView(total=total.canonical(), free=dev.free(name).canonical())
        for name, total in sorted(dev.total.items())
    }
    return TenantDeviceView(
        driver=dev.driver,
        pool=dev.pool,
        device=dev.name,
        node=dev.node,
        classes=[c.metadata.name for c in classes],
        capacity=capacity,
        attributes=attributes,
    )


class ClassView(msgspec.Struct, kw_only=True):
    """One DeviceClass as ``dracap class list`` shows it."""

    name: str
    mode: str
    min_enforcement: str
    rollout: str


def class_views(state: ClusterState) -> list[ClassView]:
    """Every DeviceClass the log holds, by name."""
    return [
        ClassView(name=name, mode=c.mode, min_enforcement=c.min_enforcement, rollout=c.rollout)
        for name, c in sorted(state.classes.items())
    ]


class LeaseRow(msgspec.Struct, frozen=True, kw_only=True):
    """A node's row of ``node_leases``, with its ages measured by the database's clock."""

    node: str
    epoch: int
    boot_id: str
    ttl_ms: int
    renewed_ago_s: float
    expires_in_s: float


class UnknownShareView(msgspec.Struct, kw_only=True):
    share_id: str
    claim: str
    device: str
    consumed: dict[str, str]


class NodeView(msgspec.Struct, kw_only=True):
    """One node as ``dracap node list`` / ``get`` show it."""

    node: str
    lease: str  #: live, expired, fenced (the fold's view), or none: no agent ever leased it
    epoch: int
    boot_id: str
    lease_age_s: float | None  #: since the last renewal (None: no lease row)
    expires_in_s: float | None  #: negative: past its expiry
    ttl_s: float | None
    taints: list[str]
    reason: str | None
    live_shares: int
    unknown_shares: list[UnknownShareView]


def node_views(state: ClusterState, leases: dict[str, LeaseRow]) -> list[NodeView]:
    """Every node the log or the lease table knows, sorted by name."""
    lost = lost_nodes(state)
    out = []
    for name in sorted(set(state.nodes) | set(leases)):
        node = state.nodes.get(name)
        row = leases.get(name)
        unknown = []
        live = 0
        if node is not None:
            for share_id in sorted(node.live_shares):
                share = state.shares[share_id]
                live += 1
                if share.state == "unknown":
                    unknown.append(
                        UnknownShareView(
                            share_id=share_id,
                            claim="/".join(share.claim),
                            device="/".join(share.device_key),
                            consumed={k: q.canonical() for k, q in share.consumed.items()},
                        )
                    )
        has_lease = node is not None and (node.lease_epoch or node.fenced_epoch)
        out.append(
            NodeView(
                node=name,
                lease=node.lease if node is not None and has_lease else "none",
                epoch=max(node.lease_epoch, node.fenced_epoch) if node is not None else 0,
                boot_id=node.boot_id if node is not None else (row.boot_id if row else ""),
                lease_age_s=round(row.renewed_ago_s, 3) if row is not None else None,
                expires_in_s=round(row.expires_in_s, 3) if row is not None else None,
                ttl_s=row.ttl_ms / 1000 if row is not None else None,
                taints=[lost[name]] if name in lost else [],
                reason=node.reason if node is not None else None,
                live_shares=live,
                unknown_shares=unknown,
            )
        )
    return out


def _attribute_json(attribute: DeviceAttribute) -> Any:
    for value in (attribute.int_, attribute.bool_, attribute.string, attribute.version):
        if value is not None:
            return value
    return None


def claims_touched(state: ClusterState, env: Envelope) -> list[ClaimKey]:
    """The claims whose view ``env`` may have changed, read off the whole state (a node-wide
    event or a device's health walks every share): what :class:`ClaimsTouched` answers
    at the cost of what the event names; kept as its reference."""
    transitions = meaning(env.event)
    for t in transitions:
        match t:
            case DeviceHealth():
                key = (t.driver, t.pool, t.device)
                return sorted(
                    {s.claim for s in state.shares.values() if s.live and s.device_key == key}
                )
            case NodeLost() | NodeFencedOff():
                return sorted(
                    {
                        s.claim
                        for s in state.shares.values()
                        if s.node == t.node
                        and (s.state == "unknown" or s.released_at == env.position)
                    }
                )
    return _named(state, env, transitions)


def _named(
    state: ClusterState, env: Envelope, transitions: tuple[Transition, ...]
) -> list[ClaimKey]:
    """The claim an event names, directly or through its share (none for the others)."""
    event = env.event
    for t in transitions:
        match t:
            case ClaimEntered():
                return [(t.namespace, t.name)]
            case AccessChanged():  # a namespace's, no claim's
                return []
            case (
                LimitsSettled()
                | LimitsRemoved()
                | ShareReleased()
                | ShareUnknown()
                | ShareKnownAgain()
            ):
                share = state.shares.get(t.share_id)
                return [share.claim] if share is not None else []
    namespace, name = getattr(event, "namespace", None), getattr(event, "name", None)
    if isinstance(namespace, str) and isinstance(name, str):
        return [(namespace, name)]
    return []


class ClaimsTouched:
    """The claims whose view each folded event may have changed, at the cost of what the
    event names (the answers of :func:`claims_touched`).

    A node-wide event (an expiry, a fence) concerns the claims of the shares on the
    node, and a device's health those of the live shares on the device: both are found
    through an index of the live shares of each node, kept here from the events (a
    reservation adds its share, a release and a fence drop what they released), instead
    of walking every share of the log. Call it for every event, in log order, once the
    fold has applied it.
    """

    def __init__(self, state: ClusterState) -> None:
        self._on_node: dict[str, set[str]] = {
            name: set(node.live_shares) for name, node in state.nodes.items() if node.live_shares
        }

    def __call__(self, state: ClusterState, env: Envelope) -> list[ClaimKey]:
        transitions = meaning(env.event)
        for t in transitions:
            match t:
                case ShareHeld(node=str(node)):
                    self._on_node.setdefault(node, set()).add(t.share_id)
                case ShareReleased():
                    share = state.shares.get(t.share_id)
                    if share is not None and share.node is not None and not share.live:
                        self._on_node.get(share.node, set()).discard(share.share_id)
                case DeviceHealth():
                    return self._on_device(state, (t.driver, t.pool, t.device))
                case NodeLost() | NodeFencedOff():
                    on_node = self._on_node.get(t.node, set())
                    shares = [state.shares[s] for s in on_node if s in state.shares]
                    touched = {
                        s.claim
                        for s in shares
                        if s.state == "unknown" or s.released_at == env.position
                    }
                    on_node.difference_update(s.share_id for s in shares if not s.live)
                    return sorted(touched)
        return _named(state, env, transitions)

    def _on_device(self, state: ClusterState, device: tuple[str, str, str]) -> list[ClaimKey]:
        dev = state.devices.get(device)
        if dev is None or dev.node is None:  # a device of no node: its shares are not indexed
            shares: Iterable[ShareState] = state.shares.values()
        else:
            shares = (state.shares[s] for s in self._on_node.get(dev.node, ()))
        return sorted({s.claim for s in shares if s.live and s.device_key == device})
