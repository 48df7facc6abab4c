"""The allocator's inputs, derived from the fold. Pure: no I/O.

The allocator (:mod:`services.reservation.allocating`) works on an
:class:`~services.reservation.inventory.Inventory` (DeviceClasses and ResourceSlices)
and an :class:`~services.reservation.allocating.AllocatedState` (what is taken). A
service gets both from the fold of the log, :class:`events.fold.ClusterState`:

* :func:`build_inventory`: the applied classes and the published slices. A
  ``RequestPolicyChanged`` event changes a capacity's request policy in the fold
  without a new slice, so the slices are handed over with every device's *current*
  policies (:func:`current_slices`); otherwise the allocator would round amounts under
  a policy the fold no longer accepts.
* :func:`grant_of` / :func:`live_grants`: one allocator grant per live share (states
  that hold capacity, ``unknown`` and ``releasing`` included). Dedicated devices are
  exclusive holds (no share id for the allocator), admin shares consume nothing.

Both are meant to be computed once and then kept current: the reservation service
rebuilds the inventory only when the fold's inventory changed and adds or removes
single grants as shares come and go.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from events.features import DEFAULT_GATES, FeatureGates
from events.fold import LIVE_SHARE_STATES, ClusterState, ShareState
from events.model import Device, DeviceCapacity, ResourceSlice
from services.reservation.inventory import Inventory
from services.reservation.outcomes import Grant

__all__ = ["build_inventory", "current_slices", "grant_of", "live_grants"]


def _current_device(state: ClusterState, driver: str, pool: str, device: Device) -> Device:
    dev = state.devices.get((driver, pool, device.name))
    if dev is None or not device.capacity:
        return device
    capacity: dict[str, DeviceCapacity] = {}
    changed = False
    for name, cap in device.capacity.items():
        policy = dev.policies.get(name, cap.request_policy)
        if name in dev.capacity_policy_versions and policy != cap.request_policy:
            cap = msgspec.structs.replace(cap, request_policy=policy)
            changed = True
        capacity[name] = cap
    return msgspec.structs.replace(device, capacity=capacity) if changed else device


def current_slices(state: ClusterState) -> list[ResourceSlice]:
    """The published slices, each device carrying the request policies in force now."""
    out: list[ResourceSlice] = []
    for rslice in state.slices.values():
        spec = rslice.spec
        devices = spec.devices or []
        current = [_current_device(state, spec.driver, spec.pool.name, d) for d in devices]
        if any(a is not b for a, b in zip(current, devices, strict=True)):
            spec = msgspec.structs.replace(spec, devices=current)
            rslice = msgspec.structs.replace(rslice, spec=spec)
        out.append(rslice)
    return out


def build_inventory(
    state: ClusterState, gates: FeatureGates = DEFAULT_GATES, *, inline_budget: int | None = None
) -> Inventory:
    """The allocator's inventory for the classes and slices of ``state``."""
    classes = [c.device_class for c in state.classes.values()]
    return Inventory(classes, current_slices(state), gates=gates, inline_budget=inline_budget)


def grant_of(share: ShareState) -> Grant:
    """What one share takes, as the allocator counts it."""
    return Grant(
        request=share.request,
        device=share.device_key,
        share_id=share.share_id if share.shared else None,
        admin_access=share.admin_access,
        consumed=dict(share.consumed) if share.shared else {},
    )


def live_grants(state: ClusterState) -> Iterator[tuple[str, Grant]]:
    """``(share id, grant)`` of every share that holds capacity."""
    for share_id, share in state.shares.items():
        if share.state in LIVE_SHARE_STATES:
            yield share_id, grant_of(share)
