"""A fold state compared, summarised and stored: plain data, digests and snapshots. Pure.

:func:`to_builtins` gives a deterministic plain-data form of a
:class:`~events.state.ClusterState` (tuple keys joined with ``/``, maps sorted), and
:func:`state_digest` a short summary with its SHA-256: what ``dracap replay verify`` and
the snapshot check compare. :func:`same_state` compares two states field by field and
falls back to the digests when they are equal in meaning but not in representation.

Snapshots are JSON (msgpack's 64-bit integers cannot hold the nanos of a device above
~18 GiB; JSON integers are unbounded), tagged with :data:`SNAPSHOT_FORMAT`. A format-2
snapshot kept each claim's whole manifest and allocation; it is upcast on read to what
the fold keeps today (:func:`~events.claimspecs.claim_spec`,
:func:`~events.claimspecs.allocation_without_config`), so a snapshot decodes to exactly
the state the same steps would have folded. The live-claim index is not stored: it is
rebuilt from the claims.
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

import msgspec

from events.claimspecs import allocation_without_config, claim_spec
from events.errors import SnapshotError
from events.model import ResourceClaim, ResourceSlice, decode_hook, encode_hook
from events.state import (
    REUSABLE_PHASES,
    ClaimKey,
    ClaimState,
    ClusterState,
    DeviceClassState,
    DeviceKey,
    DeviceState,
    NamespaceState,
    NodeState,
    PoolState,
    ShareState,
    TrackedDict,
)

__all__ = [
    "SNAPSHOT_FORMAT",
    "same_state",
    "snapshot_decode",
    "snapshot_encode",
    "state_digest",
    "to_builtins",
]


def _joined_keys(mapping: dict[Any, Any]) -> dict[str, Any]:
    return {"/".join(k) if isinstance(k, tuple) else k: v for k, v in mapping.items()}


def to_builtins(state: ClusterState) -> dict[str, Any]:
    """A deterministic plain-data form of ``state`` (tuple keys joined with ``/``)."""
    plain = {
        "position": state.position,
        "classes": state.classes,
        "slices": state.slices,
        "pools": _joined_keys(state.pools),
        "devices": _joined_keys(state.devices),
        "claims": _joined_keys(state.claims),
        "shares": state.shares,
        "nodes": state.nodes,
        "namespaces": state.namespaces,
        "dead_letters": state.dead_letters,
        "refused": state.refused,
    }
    out = msgspec.to_builtins(plain, enc_hook=encode_hook, order="sorted")
    assert isinstance(out, dict)
    return out


def state_digest(state: ClusterState) -> dict[str, Any]:
    """A short, comparable summary: counts plus a SHA-256 of :func:`to_builtins`."""
    body = msgspec.json.encode(to_builtins(state), order="sorted")
    live = sum(1 for s in state.shares.values() if s.state != "released")
    return {
        "position": state.position,
        "devices": len(state.devices),
        "claims": len(state.claims),
        "shares": len(state.shares),
        "live_shares": live,
        "sha256": hashlib.sha256(body).hexdigest(),
    }


def same_state(a: ClusterState, b: ClusterState) -> bool:
    """Whether two states hold the same fold (a snapshot or checkpoint against the fold
    at its position). ``live_claims`` and the last event's journal (``phases_before``,
    ``shares_before``) are not compared; two states equal in meaning but not in
    representation (a tuple decoded where the fold kept a list) count as the same: then
    the digests, which compare plain data, decide."""
    if all(getattr(a, f) == getattr(b, f) for f in _COMPARED):
        return True
    return state_digest(a) == state_digest(b)


#: the indexes the steps keep beside the fold (neither stored nor compared)
_INDEXES: Final = frozenset({"live_claims", "phases_before", "shares_before"})
_COMPARED: Final = tuple(f for f in ClusterState.__struct_fields__ if f not in _INDEXES)

#: 1 was msgpack, which overflowed on large devices; 2 kept each claim's whole manifest
#: (``ClaimState.claim``) and allocation, which 3 keeps compact (:func:`_upcast_claim`)
SNAPSHOT_FORMAT: Final = 3
_FORMAT_2: Final = 2


class _Snapshot(msgspec.Struct, kw_only=True):
    """JSON has only string keys: tuple-keyed maps travel as lists of pairs."""

    format: int
    position: int
    classes: dict[str, DeviceClassState]
    slices: dict[str, ResourceSlice]
    pools: list[tuple[tuple[str, str], PoolState]]
    devices: list[tuple[DeviceKey, DeviceState]]
    claims: list[tuple[ClaimKey, ClaimState]]
    shares: dict[str, ShareState]
    nodes: dict[str, NodeState]
    namespaces: dict[str, NamespaceState]
    dead_letters: int
    refused: dict[int, str] = {}  # absent from snapshots written before refusals


class _ClaimStateV2(ClaimState, kw_only=True, gc=False):
    """A claim of a format-2 snapshot: its whole manifest beside the rest."""

    claim: ResourceClaim | None = None


class _SnapshotV2(_Snapshot, kw_only=True):
    claims: list[tuple[ClaimKey, _ClaimStateV2]]  # type: ignore[assignment]


_SNAPSHOT_ENCODER: Final = msgspec.json.Encoder(enc_hook=encode_hook)
_SNAPSHOT_DECODER: Final = msgspec.json.Decoder(_Snapshot, dec_hook=decode_hook)
_SNAPSHOT_V2_DECODER: Final = msgspec.json.Decoder(_SnapshotV2, dec_hook=decode_hook)


def snapshot_encode(state: ClusterState) -> bytes:
    """JSON bytes of ``state``, tagged with the snapshot format."""
    snap = _Snapshot(
        format=SNAPSHOT_FORMAT,
        position=state.position,
        classes=state.classes,
        slices=state.slices,
        pools=list(state.pools.items()),
        devices=list(state.devices.items()),
        claims=list(state.claims.items()),
        shares=state.shares,
        nodes=state.nodes,
        namespaces=state.namespaces,
        dead_letters=state.dead_letters,
        refused=state.refused,
    )
    return _SNAPSHOT_ENCODER.encode(snap)


def snapshot_decode(data: bytes) -> ClusterState:
    """The state stored by :func:`snapshot_encode`; raises :class:`SnapshotError`."""
    try:
        snap = _SNAPSHOT_DECODER.decode(data)
        if snap.format == _FORMAT_2:
            snap = _upcast_snapshot(_SNAPSHOT_V2_DECODER.decode(data))
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"snapshot does not decode: {exc}") from exc
    if snap.format != SNAPSHOT_FORMAT:
        raise SnapshotError(f"snapshot format {snap.format} is not {SNAPSHOT_FORMAT}")
    claims = TrackedDict(snap.claims)
    live: dict[str, int] = {}
    for (namespace, _), claim in claims.items():
        if claim.phase not in REUSABLE_PHASES:
            live[namespace] = live.get(namespace, 0) + 1
    return ClusterState(
        position=snap.position,
        classes=snap.classes,
        slices=snap.slices,
        pools=TrackedDict(snap.pools),
        devices=TrackedDict(snap.devices),
        claims=claims,
        shares=snap.shares,
        nodes=snap.nodes,
        namespaces=snap.namespaces,
        dead_letters=snap.dead_letters,
        refused=snap.refused,
        live_claims=live,
    )


def _upcast_snapshot(old: _SnapshotV2) -> _Snapshot:
    """A format-2 snapshot as format 3: each claim as the fold keeps it now."""
    claims = [(key, _upcast_claim(claim)) for key, claim in old.claims]
    fields = msgspec.structs.asdict(old)
    fields.update(format=SNAPSHOT_FORMAT, claims=claims)
    return _Snapshot(**fields)


def _upcast_claim(old: _ClaimStateV2) -> ClaimState:
    """What the fold of today keeps of a claim stored whole (the same steps' result)."""
    fields = msgspec.structs.asdict(old)
    manifest = fields.pop("claim")
    claim = ClaimState(**fields)
    if manifest is not None:
        claim.spec = claim_spec(manifest)
    if claim.allocation is not None:
        claim.allocation, claim.allocation_configs = allocation_without_config(claim.allocation)
    return claim
