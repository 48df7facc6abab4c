"""What a node agent sees of the log: the fold, cut down to its node and its question.

A node agent holds no fold of its own and no database connection. The enforcement
service (:mod:`services.enforcement.service`) holds the whole fold and answers each of
the agent's questions with a :class:`NodeView`: a :class:`~events.state.ClusterState`
holding only what the agent's pure decisions read for that question, the stream
versions of what it may append to, and nothing of other nodes or unrelated tenants.
The agent decides on ``view.state()`` exactly as it decided on the whole fold before
(:mod:`services.enforcement.decisions`, :mod:`~services.enforcement.reconciling`,
:mod:`~services.enforcement.preparing`): those functions read the claims, shares,
devices and classes they are given, and a view gives them what they look up.

:func:`scope` cuts a view (pure; references to the fold's objects, encoded at once):

* ``claims``: each claim asked for, the shares of its current allocation and the
  ``shares`` asked for (an ``AllocationBound``'s ``share_ids``) that are this node's
  (or on no node), their devices and the DeviceClasses its requests name (a retry
  window lives on the class). A claim not allocated on this node is shown redacted:
  phase, node, source and UID only, and the reason of one mirrored from Kubernetes (a
  kubelet prepare of a claim allocated elsewhere, or not yet, learns where, not what);
* ``shares``: shares by id (a use report), with their claims as above;
* ``node``: the whole node — every live share of it, the node's devices and its
  ResourceSlices (a reconcile, a returning agent, a health check, the first inventory
  scan);
* always the node's :class:`~events.state.NodeState`, whose ``live_shares`` lists only
  the shares the view holds, and the stream versions asked for.

Cost: O(what the question touches), never O(cluster): the node's devices and slices
and its retrying shares come from the service's indexes
(:class:`~services.enforcement.service.NodeIndex`), not from a scan of the fold.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import msgspec

from events.model import ResourceSlice, decode_hook, encode_hook
from events.state import (
    LIVE_SHARE_STATES,
    ClaimKey,
    ClaimState,
    ClusterState,
    DeviceClassState,
    DeviceKey,
    DeviceState,
    NodeState,
    ShareState,
    TrackedDict,
)

__all__ = ["NodeView", "Scope", "decode_view", "encode_view", "scope"]


class NodeView(msgspec.Struct, kw_only=True):
    """A node-scoped cut of the fold at ``position`` (see the module docstring)."""

    node: str
    position: int
    claims: list[tuple[ClaimKey, ClaimState]] = []
    shares: dict[str, ShareState] = {}
    devices: list[tuple[DeviceKey, DeviceState]] = []
    classes: dict[str, DeviceClassState] = {}
    slices: dict[str, ResourceSlice] = {}
    nodes: dict[str, NodeState] = {}
    #: stream -> its version as of ``position`` (what an append made on the view expects)
    versions: dict[str, int] = {}

    def state(self) -> ClusterState:
        """The view as a :class:`ClusterState` the pure decisions read."""
        return ClusterState(
            position=self.position,
            classes=self.classes,
            slices=self.slices,
            devices=TrackedDict(self.devices),
            claims=TrackedDict(self.claims),
            shares=self.shares,
            nodes=self.nodes,
        )


_ENCODER: Final = msgspec.json.Encoder(enc_hook=encode_hook)
_DECODER: Final = msgspec.json.Decoder(NodeView, dec_hook=decode_hook)


def encode_view(view: NodeView) -> bytes:
    """JSON of ``view`` (quantities in their canonical form)."""
    return _ENCODER.encode(view)


def decode_view(data: bytes) -> NodeView:
    """The view :func:`encode_view` wrote (``msgspec.DecodeError`` if it is not one)."""
    return _DECODER.decode(data)


class Scope(msgspec.Struct, frozen=True, kw_only=True):
    """What one view holds (see the module docstring)."""

    claims: tuple[ClaimKey, ...] = ()
    shares: tuple[str, ...] = ()
    node: bool = False


def _mine(share: ShareState, node: str) -> bool:
    return share.node in (None, node)


def _redacted(claim: ClaimState) -> ClaimState:
    """What a node may know of a claim that is not its: where it is, not what it is (and,
    for a claim mirrored from Kubernetes, why dracap refused it: the kubelet of the node
    its Pod was scheduled to shows that reason)."""
    return ClaimState(
        namespace=claim.namespace,
        name=claim.name,
        phase=claim.phase,
        allocation_version=claim.allocation_version,
        node=claim.node,
        source=claim.source,
        uid=claim.uid,
        reason=claim.reason if claim.source == "kubernetes" else None,
    )


class _Cut:
    """The objects a view collects, each once."""

    def __init__(self, state: ClusterState, node: str) -> None:
        self.state = state
        self.node = node
        self.claims: dict[ClaimKey, ClaimState] = {}
        self.shares: dict[str, ShareState] = {}
        self.devices: dict[DeviceKey, DeviceState] = {}
        self.classes: dict[str, DeviceClassState] = {}

    def share(self, share_id: str) -> None:
        share = self.state.shares.get(share_id)
        if share is None or share_id in self.shares or not _mine(share, self.node):
            return
        self.shares[share_id] = share
        device = self.state.devices.get(share.device_key)
        if device is not None:
            self.devices[share.device_key] = device
        self.claim(share.claim, with_shares=False)

    def claim(self, key: ClaimKey, *, with_shares: bool = True) -> None:
        claim = self.state.claims.get(key)
        if claim is None or key in self.claims:
            return
        if claim.node != self.node:  # not allocated here (or not yet at all)
            self.claims[key] = _redacted(claim)
            return
        self.claims[key] = claim
        for name in claim.spec.classes() if claim.spec is not None else ():
            cls = self.state.classes.get(name)
            if cls is not None:
                self.classes[name] = cls
        if with_shares:
            for share_id in claim.share_ids:
                self.share(share_id)


def scope(
    state: ClusterState,
    node: str,
    what: Scope,
    *,
    devices: Iterable[DeviceKey] = (),
    slices: Iterable[str] = (),
    versions: dict[str, int] | None = None,
) -> NodeView:
    """The view of ``state`` for ``node`` holding ``what`` (see the module docstring).

    ``devices`` and ``slices``: the node's own (from the service's index; checked here
    against the fold), added when ``what.node``.
    """
    cut = _Cut(state, node)
    held = state.nodes.get(node)
    for key in what.claims:
        cut.claim(key)
    for share_id in what.shares:
        cut.share(share_id)
    own_slices: dict[str, ResourceSlice] = {}
    if what.node:
        for share_id in sorted(held.live_shares) if held is not None else ():
            cut.share(share_id)
        for device_key in devices:
            device = state.devices.get(device_key)
            if device is not None and device.node == node:
                cut.devices[device_key] = device
        for name in slices:
            found = state.slices.get(name)
            if found is not None and found.spec.node_name == node:
                own_slices[name] = found
    nodes: dict[str, NodeState] = {}
    if held is not None:
        live = {s for s, share in cut.shares.items() if share.state in LIVE_SHARE_STATES}
        nodes[node] = msgspec.structs.replace(held, live_shares=live & held.live_shares)
    return NodeView(
        node=node,
        position=state.position,
        claims=sorted(cut.claims.items()),
        shares=cut.shares,
        devices=sorted(cut.devices.items()),
        classes=cut.classes,
        slices=own_slices,
        nodes=nodes,
        versions=dict(versions or {}),
    )
