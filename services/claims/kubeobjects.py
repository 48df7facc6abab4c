"""Claims as the Kubernetes API shows them: ``status.devices`` and the whole ResourceClaim.

One home for the shape both the Kubernetes bridge and the CLI print, so that ``dracap
claim get -o yaml`` and ``kubectl get resourceclaim -o yaml`` agree on every field
Kubernetes defines:

* :func:`device_statuses` is ``status.devices[]``: one entry per share (driver, pool,
  device, ``shareID``) with one condition, ``Ready``, that says whether the node agent
  applied the share's limit and at which level, and the applied limit as ``data``
  (``{"enforcement": {"level": "hard", "actual": {"bandwidth": "1G"}}, "state": ...}``).
  A claim dracap refused (its allocation would break the ledger's invariants) has no
  shares; each of its results on dracap's drivers gets an entry whose condition says why.
  ``lastTransitionTime`` is kept from the entry written before while the condition's
  status and reason stay the same, so re-writing the same state changes nothing;
* :func:`resource_claim_object` is the ResourceClaim (``apiVersion``, ``kind``,
  ``metadata``, ``spec``, ``status.allocation``, ``status.reservedFor``,
  ``status.devices``) with dracap's own view (phase, reason, shares with their levels)
  under one extra top-level key, ``dracap``, which Kubernetes tools ignore;
* :func:`class_objects`, :func:`slice_objects` and :func:`namespace_objects` are the
  inventory as ``dracap get`` shows it: each DeviceClass and ResourceSlice as the log
  holds it (with the class's mode under ``dracap``), each namespace's access as the
  Namespace whose ``dracap.io/`` annotations ask for it (:func:`events.tenancy.
  namespace_object`, with its live claims under ``dracap``). Applying what they print
  records nothing new.

Pure: no I/O; the time is an argument.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Final

from events.model import API_VERSION, AllocationResult, ResourceClaim
from events.model import to_builtins as model_builtins
from events.state import ClaimState, ClusterState, ShareState
from events.tenancy import NamespacePolicy, namespace_object
from services.claims.adminwrites import consumer_ref, consumer_uid

__all__ = [
    "CONDITION_READY",
    "DRACAP_KEY",
    "class_objects",
    "device_statuses",
    "namespace_objects",
    "resource_claim_object",
    "rfc3339",
    "slice_objects",
]

CONDITION_READY: Final = "Ready"
DRACAP_KEY: Final = "dracap"  #: the extra key of :func:`resource_claim_object`

#: share state -> (condition status, reason) when the claim itself is not refused/failed
_BY_STATE: Final[dict[str, tuple[str, str]]] = {
    "reserved": ("False", "LimitPending"),
    "bound": ("False", "LimitPending"),
    "ready": ("True", "LimitApplied"),
    "unknown": ("Unknown", "NodeUnreachable"),
    "releasing": ("False", "Releasing"),
    "released": ("False", "Released"),
}


def rfc3339(when: datetime.datetime) -> str:
    """``when`` as Kubernetes writes times: UTC, seconds, ``Z``."""
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(status: str, reason: str, message: str, since: str) -> dict[str, Any]:
    return {
        "type": CONDITION_READY,
        "status": status,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": since,
    }


def _key(entry: Mapping[str, Any]) -> tuple[str, str, str, str]:
    return (
        str(entry.get("driver", "")),
        str(entry.get("pool", "")),
        str(entry.get("device", "")),
        str(entry.get("shareID", "")),
    )


def _since(
    previous: Mapping[tuple[str, str, str, str], Mapping[str, Any]],
    key: tuple[str, str, str, str],
    status: str,
    reason: str,
    now: str,
) -> str:
    """The earlier ``lastTransitionTime`` when the condition did not change, else ``now``."""
    for cond in previous.get(key, {}).get("conditions") or ():
        if (
            cond.get("type") == CONDITION_READY
            and cond.get("status") == status
            and cond.get("reason") == reason
        ):
            return str(cond.get("lastTransitionTime") or now)
    return now


def _share_condition(claim: ClaimState, share: ShareState) -> tuple[str, str, str]:
    """``(status, reason, message)`` of a share's ``Ready`` condition."""
    waiting = (
        "waiting for the kubelet to prepare the claim on its node"
        if claim.source == "kubernetes"
        else "waiting for the node agent to apply the limit"
    )
    if claim.phase == "failed" and share.live:
        return "False", "LimitFailed", claim.reason or share.last_error or "the limit failed"
    if claim.phase == "retrying" and share.state == "bound":
        return "False", "LimitRetrying", claim.reason or share.last_error or "retrying the limit"
    status, reason = _BY_STATE[share.state]
    if share.state == "ready":
        message = f"{share.limit_level or 'none'} limit applied on node {share.node or '-'}"
    elif share.state in ("reserved", "bound"):
        message = waiting
    elif share.state == "unknown":
        message = f"node {share.node or '-'} lost its lease; the share keeps its capacity"
    else:
        message = claim.reason or f"the share is {share.state}"
    return status, reason, message


def _share_data(share: ShareState) -> dict[str, Any]:
    data: dict[str, Any] = {"state": share.state}
    if share.limit_level is not None:
        actual = {k: v.canonical() for k, v in sorted((share.actual or {}).items())}
        data["enforcement"] = {"level": share.limit_level, "actual": actual}
    if share.consumed:
        data["consumed"] = {k: v.canonical() for k, v in sorted(share.consumed.items())}
    return data


def device_statuses(
    state: ClusterState,
    claim: ClaimState,
    now: datetime.datetime,
    *,
    drivers: Collection[str] | None = None,
    previous: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """``status.devices[]`` of ``claim`` (see the module docstring); ``drivers``: only theirs."""
    stamp = rfc3339(now)
    before = {_key(entry): entry for entry in previous}
    out: list[dict[str, Any]] = []
    if claim.phase == "rejected":
        for result in claim.spec.results if claim.spec is not None else ():
            if drivers is not None and result.driver not in drivers:
                continue
            entry: dict[str, Any] = {
                "driver": result.driver,
                "pool": result.pool,
                "device": result.device,
            }
            if result.share_id:
                entry["shareID"] = result.share_id
            reason, message = "AllocationRefused", claim.reason or "refused by dracap"
            since = _since(before, _key(entry), "False", reason, stamp)
            entry["conditions"] = [_condition("False", reason, message, since)]
            out.append(entry)
        return out
    for share_id in claim.share_ids:
        share = state.shares.get(share_id)
        if share is None or (drivers is not None and share.driver not in drivers):
            continue
        entry = {"driver": share.driver, "pool": share.pool, "device": share.device}
        if share.shared:
            entry["shareID"] = share_id
        status, reason, message = _share_condition(claim, share)
        since = _since(before, _key(entry), status, reason, stamp)
        entry["conditions"] = [_condition(status, reason, message, since)]
        entry["data"] = _share_data(share)
        out.append(entry)
    return out


def resource_claim_object(
    state: ClusterState,
    claim: ClaimState,
    view: Mapping[str, Any],
    now: datetime.datetime,
    *,
    recorded: ResourceClaim | None = None,
    allocation: AllocationResult | None = None,
) -> dict[str, Any]:
    """``claim`` as a ResourceClaim of ``resource.k8s.io/v1``, ``view`` under ``dracap``.

    ``recorded``: the manifest as submitted, ``allocation``: the current allocation whole,
    both read from the log (the fold keeps neither whole: ``services.runtime.store.recorded``);
    without them, ``metadata`` and ``spec`` are bare and the allocation is the fold's.
    """
    metadata: dict[str, Any] = {}
    spec: dict[str, Any] = {}
    if recorded is not None:
        metadata = model_builtins(recorded.metadata)
        spec = model_builtins(recorded.spec)
    metadata["name"] = claim.name
    metadata["namespace"] = claim.namespace
    if claim.uid:
        metadata["uid"] = claim.uid
    status: dict[str, Any] = {}
    allocation = allocation or claim.allocation
    if allocation is not None and claim.phase not in ("released", "rejected", "withdrawn"):
        status["allocation"] = model_builtins(allocation)
    mirrored: dict[str, str] = {}  # Kubernetes mode: the uids the API server gave
    if recorded is not None and recorded.status is not None:
        mirrored = {ref.name: ref.uid for ref in recorded.status.reserved_for or () if ref.uid}
    consumers = []
    for consumer in claim.reserved_for:
        ref = consumer_ref(consumer)
        uid = ref.uid or mirrored.get(ref.name) or consumer_uid(claim.namespace, claim.name, ref)
        consumers.append({"resource": f"{ref.resource}s", "name": ref.name, "uid": uid})
    if consumers:
        status["reservedFor"] = consumers
    devices = device_statuses(state, claim, now)
    if devices:
        status["devices"] = devices
    out: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaim",
        "metadata": metadata,
        "spec": spec,
    }
    if status:
        out["status"] = status
    out[DRACAP_KEY] = dict(view)
    return out


def _named(names: Collection[str], name: str | None) -> list[str]:
    return sorted(names) if name is None else [name] if name in names else []


def class_objects(state: ClusterState, name: str | None = None) -> list[dict[str, Any]]:
    """Every DeviceClass (or the one named) as recorded, its mode under ``dracap``."""
    out = []
    for key in _named(state.classes.keys(), name):
        recorded = state.classes[key]
        obj = model_builtins(recorded.device_class)
        obj[DRACAP_KEY] = {
            "mode": recorded.mode,
            "min_enforcement": recorded.min_enforcement,
            "rollout": recorded.rollout,
        }
        out.append(obj)
    return out


def slice_objects(state: ClusterState, name: str | None = None) -> list[dict[str, Any]]:
    """Every ResourceSlice (or the one named) as recorded."""
    return [model_builtins(state.slices[key]) for key in _named(state.slices.keys(), name)]


def namespace_objects(state: ClusterState, name: str | None = None) -> list[dict[str, Any]]:
    """Every namespace with an access record (or the one named) as the Namespace that asks
    for it, its live claims under ``dracap``."""
    out = []
    for key in _named(state.namespaces.keys(), name):
        record = state.namespaces[key]
        policy = NamespacePolicy(
            namespace=key,
            classes=list(record.classes),
            admin_access=record.admin_access,
            opaque_config_classes=list(record.opaque_config_classes),
            max_claims=record.max_claims,
            max_requests_per_claim=record.max_requests_per_claim,
        )
        obj = model_builtins(namespace_object(policy))
        obj[DRACAP_KEY] = {"live_claims": state.live_claims.get(key, 0)}
        out.append(obj)
    return out
