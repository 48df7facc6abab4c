"""What is taken: the allocated state every allocation decision reads. Pure.

Kept per device, never as a list of shares, so "how much of this device is taken" is
a dict lookup whatever the number of shares. The allocator adds and removes
:class:`~services.reservation.outcomes.Grant` s (:meth:`AllocatedState.add`); the
search only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.reservation.outcomes import DeviceKey, Grant

__all__ = ["AllocatedState"]


@dataclass(slots=True)
class AllocatedState:
    """What is taken: consumption per device and capacity, exclusive holds, and holders.

    Keyed by device, so lookups cost the same with ten shares or ten million.
    """

    consumed: dict[DeviceKey, dict[str, int]] = field(default_factory=dict)
    exclusive: dict[DeviceKey, int] = field(default_factory=dict)  # hold counts
    #: per device, the namespaces holding non-admin grants (grant counts)
    holders: dict[DeviceKey, dict[str, int]] = field(default_factory=dict)
    #: per device, the live non-admin shares (grants with a ShareID): they keep a device
    #: republished as dedicated in use until the last one is released
    shared: dict[DeviceKey, int] = field(default_factory=dict)
    shares: int = 0
    #: per capacity name, how many live shares consume each amount (nanos): the request
    #: sizes the fragmentation-aware placement expects next
    sizes: dict[str, dict[int, int]] = field(default_factory=dict)

    def add(self, grant: Grant, *, sign: int = 1) -> None:
        """Record (sign=1) or forget (sign=-1) one non-admin grant."""
        if grant.admin_access:
            return
        device = grant.device
        namespaces = self.holders.get(device)
        if namespaces is None:
            namespaces = self.holders[device] = {}
        namespace = grant.namespace
        count = namespaces.get(namespace, 0) + sign
        if count > 0:
            namespaces[namespace] = count
        else:
            namespaces.pop(namespace, None)
            if not namespaces:
                del self.holders[device]
        if grant.share_id is None:
            count = self.exclusive.get(device, 0) + sign
            if count > 0:
                self.exclusive[device] = count
            else:
                self.exclusive.pop(device, None)
            return
        self.shares += sign
        shared = self.shared
        count = shared.get(device, 0) + sign
        if count > 0:
            shared[device] = count
        else:
            shared.pop(device, None)
        per_device = self.consumed.get(device)
        if per_device is None:
            per_device = self.consumed[device] = {}
        sizes = self.sizes
        for name, amount in grant.consumed.items():
            nanos = amount.nanos
            per_device[name] = per_device.get(name, 0) + sign * nanos
            counts = sizes.get(name)
            if counts is None:
                counts = sizes[name] = {}
            count = counts.get(nanos, 0) + sign
            if count > 0:
                counts[nanos] = count
            else:
                counts.pop(nanos, None)

    def consumed_nanos(self, key: DeviceKey, name: str) -> int:
        per_device = self.consumed.get(key)
        return per_device.get(name, 0) if per_device else 0

    def held_by_others(self, key: DeviceKey, namespace: str) -> bool:
        """Whether a namespace other than ``namespace`` holds a grant on the device."""
        namespaces = self.holders.get(key)
        if not namespaces:
            return False
        return len(namespaces) > 1 or namespace not in namespaces
