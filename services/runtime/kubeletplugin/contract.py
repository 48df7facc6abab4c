"""What a DRA driver's node logic gives the kubelet transport, and what it gets.

The transport (:class:`~services.runtime.kubeletplugin.serving.KubeletPlugin`) speaks
gRPC to the kubelet and calls a :class:`DriverHandler` with plain msgspec values, so the
driver logic never sees protobuf. The types mirror the kubelet's messages:

* :class:`ClaimRef` is all the kubelet says about a claim (namespace, name, UID); the
  handler reads the ResourceClaim itself and must check that its UID matches.
* :meth:`DriverHandler.prepare` answers a :class:`PrepareResult` per claim UID: the
  prepared devices, or an ``error`` that fails that claim alone. It is called again for
  claims already prepared and must return the same devices (idempotent), and the CDI
  spec files of ``cdi_device_ids`` must exist before it returns.
* :meth:`DriverHandler.unprepare` answers an error text per UID (``""``: done); a claim
  the driver does not know is done.
* A handler that also offers :meth:`HealthReporting.health_updates` gets the device
  health service: each item is the complete list of the driver's devices on the node.

A handler may be called concurrently, and is cancelled when a call's deadline passes:
it must leave its state consistent on ``CancelledError`` (the kubelet will ask again).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal, Protocol, runtime_checkable

import msgspec

__all__ = [
    "ClaimRef",
    "DeviceHealthReport",
    "DriverHandler",
    "Health",
    "HealthReporting",
    "PrepareResult",
    "PreparedDevice",
]

Health = Literal["unknown", "healthy", "unhealthy"]


class ClaimRef(msgspec.Struct, frozen=True, kw_only=True):
    """A ResourceClaim as the kubelet names it."""

    namespace: str
    name: str
    uid: str


class PreparedDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One device prepared for a claim; ``cdi_device_ids`` are ``vendor/class=name``."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...] = ()


class PrepareResult(msgspec.Struct, frozen=True, kw_only=True):
    """The answer for one claim: its devices, or a non-empty ``error``."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class DeviceHealthReport(msgspec.Struct, frozen=True, kw_only=True):
    """The health of one device, as last found (seconds since the Unix epoch)."""

    pool_name: str
    device_name: str
    health: Health
    last_updated_unix: int


class DriverHandler(Protocol):
    """The driver's node logic, as the transport calls it (results keyed by claim UID)."""

    async def prepare(self, claims: list[ClaimRef]) -> dict[str, PrepareResult]:
        """Prepare the claims' devices; one result per claim UID."""
        ...

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str]:
        """Undo the claims' prepares; an error text per claim UID, ``""`` when done."""
        ...


@runtime_checkable
class HealthReporting(DriverHandler, Protocol):
    """A handler that also reports device health (served as DRAResourceHealth)."""

    def health_updates(self) -> AsyncIterator[list[DeviceHealthReport]]:
        """The complete list of the driver's devices and their health, on every change."""
        ...
