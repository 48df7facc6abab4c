"""A simulated fleet of identical devices, as the real allocator sees it. Pure.

The simulation decides with :class:`services.reservation.allocating.Allocator` on a
real :class:`events.inventory.Inventory`, so each mode is expressed with the objects
an operator would write:

The DeviceClass has no selector: the inventory holds only the fleet's devices (one
driver), so every device matches, as with ``device.driver == "sim.dracap.io"``, without
evaluating a CEL expression per device (about a millisecond each, most of a short run).

``consumable``
    ``devices`` shareable devices (``allowMultipleAllocations``) with capacity
    ``memory`` = ``capacity`` and no request policy; a claim asks for
    ``capacity.requests.memory`` = its size. The class carries the placement policy
    (``dracap.io/placement``).
``whole-device``
    the same devices, the class in mode ``whole-device`` (``ClassModeSet``); a claim
    asks for one device and takes it whole, whatever its size.
``fixed-slices:SIZE``
    every device pre-partitioned (MIG-style) into ``capacity // SIZE`` dedicated slices
    of ``SIZE`` (not shareable); a claim takes one whole slice, as a process sees one MIG
    instance: a claim larger than ``SIZE`` fits no slice. The remainder of a device that
    is not a whole slice is never usable. Slices are tried in upstream order (slices of
    the first device first); placement policies do not apply to dedicated devices.

A claim larger than a device (or than its slices) fits no fleet: the simulation
rejects it on arrival without asking the allocator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from events import model
from events.inventory import Inventory
from events.quantities import Format, Quantity
from events.tenancy import PLACEMENT, PLACEMENTS
from services.exitcodes import CommandError, ExitCode
from services.planning.traces import format_bytes, parse_bytes

__all__ = [
    "CONSUMABLE",
    "FIXED_SLICES",
    "WHOLE_DEVICE",
    "Fleet",
    "Mode",
    "parse_mode",
]

CONSUMABLE: Final = "consumable"
WHOLE_DEVICE: Final = "whole-device"
FIXED_SLICES: Final = "fixed-slices"

DRIVER: Final = "sim.dracap.io"
CLASS: Final = "sim.dracap.io"
CAPACITY: Final = "memory"
NAMESPACE: Final = "sim"
PER_SLICE: Final = 128  # devices per ResourceSlice
_NANO: Final = 10**9


@dataclass(frozen=True, slots=True)
class Mode:
    """How devices are handed out: ``kind`` and, for fixed slices, the slice size (bytes)."""

    kind: str
    slice_size: int = 0

    def __str__(self) -> str:
        if self.kind == FIXED_SLICES:
            return f"{FIXED_SLICES}:{format_bytes(self.slice_size)}"
        return self.kind


def parse_mode(text: str) -> Mode:
    """``consumable``, ``whole-device`` or ``fixed-slices:SIZE``; CommandError (2) otherwise."""
    kind, _, size = text.strip().partition(":")
    if kind in (CONSUMABLE, WHOLE_DEVICE) and not size:
        return Mode(kind)
    if kind == FIXED_SLICES and size:
        try:
            slice_size = parse_bytes(size)
        except ValueError as exc:
            raise CommandError(
                f"--modes: fixed-slices:SIZE: SIZE must be a quantity like 10Gi ({exc})",
                ExitCode.BAD_INPUT,
            ) from None
        if slice_size > 0:
            return Mode(FIXED_SLICES, slice_size)
    raise CommandError(
        f"--modes: {text!r}: must be consumable, whole-device or fixed-slices:SIZE "
        "(SIZE a quantity > 0, like 10Gi)",
        ExitCode.BAD_INPUT,
    )


def _quantity(size: int) -> Quantity:
    return Quantity(size * _NANO, Format.BINARY_SI)


@dataclass(frozen=True, slots=True)
class Fleet:
    """``devices`` devices of ``capacity`` bytes, handed out in ``mode`` under ``placement``."""

    devices: int
    capacity: int
    mode: Mode
    placement: str = PLACEMENTS[0]

    def __post_init__(self) -> None:
        if self.devices <= 0:
            raise CommandError("--devices: must be a whole number > 0", ExitCode.BAD_INPUT)
        if self.capacity <= 0:
            raise CommandError("--capacity: must be a quantity > 0", ExitCode.BAD_INPUT)
        if self.placement not in PLACEMENTS:
            raise CommandError(
                f"--policies: {self.placement!r}: must be one of {', '.join(PLACEMENTS)}",
                ExitCode.BAD_INPUT,
            )
        if self.mode.kind == FIXED_SLICES and self.mode.slice_size > self.capacity:
            raise CommandError(
                f"--modes: {self.mode}: a slice must not be larger than a device "
                f"({format_bytes(self.capacity)})",
                ExitCode.BAD_INPUT,
            )

    @property
    def label(self) -> str:
        """``consumable/binpack``, ``whole-device``, ``fixed-slices:10Gi``."""
        return f"{self.mode}/{self.placement}" if self.mode.kind == CONSUMABLE else str(self.mode)

    @property
    def total(self) -> int:
        """Bytes of all devices together."""
        return self.devices * self.capacity

    @property
    def slices_per_device(self) -> int:
        return self.capacity // self.mode.slice_size if self.mode.kind == FIXED_SLICES else 1

    def need(self, size: int) -> int:
        """Bytes of one device a claim of ``size`` takes (0: fits no device)."""
        kind = self.mode.kind
        if kind == CONSUMABLE:
            return size if size <= self.capacity else 0
        if kind == WHOLE_DEVICE:
            return self.capacity if size <= self.capacity else 0
        return self.mode.slice_size if size <= self.mode.slice_size else 0

    def usable_free(self, free: int) -> int:
        """Of ``free`` bytes left on one device, those claims can still take."""
        if self.mode.kind == FIXED_SLICES:
            return free - free % self.mode.slice_size
        return free

    # -- the objects the allocator sees

    def inventory(self) -> Inventory:
        """The DeviceClass and ResourceSlices of the fleet, indexed."""
        annotations = {PLACEMENT: self.placement} if self.mode.kind == CONSUMABLE else {}
        dclass = model.convert(
            {
                "apiVersion": model.API_VERSION,
                "kind": "DeviceClass",
                "metadata": {"name": CLASS, "annotations": annotations},
                "spec": {},  # no selector: every device of the fleet (one driver) matches
            },
            model.DeviceClass,
        )
        devices = self._devices()
        count = -(-len(devices) // PER_SLICE)
        slices = [
            model.convert(
                {
                    "apiVersion": model.API_VERSION,
                    "kind": "ResourceSlice",
                    "metadata": {"name": f"sim-{i}"},
                    "spec": {
                        "driver": DRIVER,
                        "allNodes": True,
                        "pool": {"name": "sim", "generation": 1, "resourceSliceCount": count},
                        "devices": devices[i * PER_SLICE : (i + 1) * PER_SLICE],
                    },
                },
                model.ResourceSlice,
            )
            for i in range(count)
        ]
        modes = {CLASS: WHOLE_DEVICE} if self.mode.kind == WHOLE_DEVICE else None
        return Inventory([dclass], slices, class_modes=modes)

    def _devices(self) -> list[dict[str, Any]]:
        if self.mode.kind != FIXED_SLICES:
            value = _quantity(self.capacity).canonical()
            return [
                {
                    "name": f"dev-{d}",
                    "allowMultipleAllocations": True,
                    "capacity": {CAPACITY: {"value": value}},
                }
                for d in range(self.devices)
            ]
        value = _quantity(self.mode.slice_size).canonical()
        return [
            {
                "name": f"dev-{d}-slice-{s}",
                "capacity": {CAPACITY: {"value": value}},
            }
            for d in range(self.devices)
            for s in range(self.slices_per_device)
        ]

    def device_of(self) -> Callable[[str], int]:
        """The device (0..devices-1) that an inventory device name belongs to."""
        if self.mode.kind == FIXED_SLICES:
            return lambda name: int(name.split("-", 2)[1])
        return lambda name: int(name[4:])

    def claim(self, size: int) -> model.ResourceClaim:
        """A claim of ``size`` in this fleet's mode (one object serves every equal size)."""
        exactly: dict[str, Any] = {"deviceClassName": CLASS}
        devices: dict[str, Any] = {"requests": [{"name": "dev", "exactly": exactly}]}
        if self.mode.kind == CONSUMABLE:
            exactly["capacity"] = {"requests": {CAPACITY: _quantity(size).canonical()}}
        return model.convert(
            {
                "apiVersion": model.API_VERSION,
                "kind": "ResourceClaim",
                "metadata": {"name": f"size-{size}", "namespace": NAMESPACE},
                "spec": {"devices": devices},
            },
            model.ResourceClaim,
        )
