"""Between the kubelet's protobuf messages and the transport's msgspec values.

One home for every conversion, both ways: the plugin side (requests to
:class:`ClaimRef`, answers to replies) and the kubelet side of
:mod:`tests.fixtures.kubeletclient` (replies back to values). Service and method
names are read from the generated descriptors, so they are the ``.proto`` files' and
cannot be misspelt here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from google.protobuf.descriptor import ServiceDescriptor

from services.runtime.kubeletplugin.api import dra_health_v1alpha1_pb2 as health_pb
from services.runtime.kubeletplugin.api import dra_v1_pb2 as dra_pb
from services.runtime.kubeletplugin.api import pluginregistration_pb2 as reg_pb
from services.runtime.kubeletplugin.contract import (
    ClaimRef,
    DeviceHealthReport,
    Health,
    PreparedDevice,
    PrepareResult,
)
from services.runtime.kubeletplugin.errors import ClaimFailure

__all__ = [
    "DRA_SERVICE",
    "DRA_VERSION",
    "HEALTH_SERVICE",
    "PLUGIN_TYPE",
    "REGISTRATION_SERVICE",
    "claims_from",
    "claims_request",
    "failure_text",
    "health_reply",
    "health_reports",
    "method_path",
    "prepare_reply",
    "prepare_results",
    "unprepare_reply",
    "unprepare_results",
]

REGISTRATION_SERVICE: Final = reg_pb.DESCRIPTOR.services_by_name["Registration"]
DRA_SERVICE: Final = dra_pb.DESCRIPTOR.services_by_name["DRAPlugin"]
HEALTH_SERVICE: Final = health_pb.DESCRIPTOR.services_by_name["DRAResourceHealth"]
#: ``PluginInfo.type`` of a DRA driver.
PLUGIN_TYPE: Final = "DRAPlugin"
#: The one DRA service version served (and so advertised): v1.
DRA_VERSION: Final = "v1.DRAPlugin"

_TO_STATUS: Final[dict[Health, health_pb.HealthStatus]] = {
    "unknown": health_pb.UNKNOWN,
    "healthy": health_pb.HEALTHY,
    "unhealthy": health_pb.UNHEALTHY,
}
_FROM_STATUS: Final[dict[int, Health]] = {int(v): k for k, v in _TO_STATUS.items()}


def method_path(service: ServiceDescriptor, method: str) -> str:
    """The gRPC path ``/package.Service/Method`` (KeyError for a method not in the proto)."""
    return f"/{service.full_name}/{service.methods_by_name[method].name}"


def failure_text(failure: ClaimFailure) -> str:
    """A claim's ``error`` for the kubelet: the failure's type and message."""
    return f"{type(failure).__name__}: {failure}"


# --- the plugin side ------------------------------------------------------------------


def claims_from(claims: Iterable[dra_pb.Claim]) -> list[ClaimRef]:
    """The claims of a request, in order."""
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]


def prepare_reply(
    answers: Mapping[str, PrepareResult | ClaimFailure],
) -> dra_pb.NodePrepareResourcesResponse:
    """The reply to NodePrepareResources: one entry per UID."""
    reply = dra_pb.NodePrepareResourcesResponse()
    for uid, answer in answers.items():
        entry = reply.claims[uid]
        if isinstance(answer, ClaimFailure):
            entry.error = failure_text(answer)
            continue
        entry.error = answer.error
        for device in answer.devices:
            entry.devices.add(
                request_names=device.request_names,
                pool_name=device.pool_name,
                device_name=device.device_name,
                cdi_device_ids=device.cdi_device_ids,
            )
    return reply


def unprepare_reply(
    answers: Mapping[str, str | ClaimFailure],
) -> dra_pb.NodeUnprepareResourcesResponse:
    """The reply to NodeUnprepareResources: one entry per UID."""
    reply = dra_pb.NodeUnprepareResourcesResponse()
    for uid, answer in answers.items():
        error = failure_text(answer) if isinstance(answer, ClaimFailure) else answer
        reply.claims[uid].error = error
    return reply


def health_reply(reports: Iterable[DeviceHealthReport]) -> health_pb.NodeWatchResourcesResponse:
    """One message of the health stream: the complete list."""
    return health_pb.NodeWatchResourcesResponse(
        devices=[
            health_pb.DeviceHealth(
                device=health_pb.DeviceIdentifier(pool_name=r.pool_name, device_name=r.device_name),
                health=_TO_STATUS[r.health],
                last_updated_time=r.last_updated_unix,
            )
            for r in reports
        ]
    )


# --- the kubelet side -----------------------------------------------------------------


def claims_request(claims: Iterable[ClaimRef]) -> list[dra_pb.Claim]:
    """The ``claims`` of a prepare or unprepare request."""
    return [dra_pb.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]


def prepare_results(reply: dra_pb.NodePrepareResourcesResponse) -> dict[str, PrepareResult]:
    """A NodePrepareResources reply as values, by UID."""
    return {
        uid: PrepareResult(
            devices=tuple(
                PreparedDevice(
                    request_names=tuple(d.request_names),
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    cdi_device_ids=tuple(d.cdi_device_ids),
                )
                for d in entry.devices
            ),
            error=entry.error,
        )
        for uid, entry in reply.claims.items()
    }


def unprepare_results(reply: dra_pb.NodeUnprepareResourcesResponse) -> dict[str, str]:
    """A NodeUnprepareResources reply as error texts (``""``: done), by UID."""
    return {uid: entry.error for uid, entry in reply.claims.items()}


def health_reports(reply: health_pb.NodeWatchResourcesResponse) -> list[DeviceHealthReport]:
    """One health message as values (a status this code does not know reads as unknown)."""
    return [
        DeviceHealthReport(
            pool_name=d.device.pool_name,
            device_name=d.device.device_name,
            health=_FROM_STATUS.get(int(d.health), "unknown"),
            last_updated_unix=d.last_updated_time,
        )
        for d in reply.devices
    ]
