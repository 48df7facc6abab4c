"""The kubelet's side of a DRA driver's sockets, for tests and benchmarks.

:class:`KubeletClient` does what the kubelet's plugin watcher and DRA manager do with a
driver, over the same gRPC: it watches a registration directory for ``*-reg.sock``,
asks the plugin's GetInfo, checks the answer (type ``DRAPlugin``, a name, an absolute
endpoint, a version it speaks — only ``v1.DRAPlugin`` here), tells the plugin the
verdict with NotifyRegistrationStatus, and returns a :class:`PluginConnection` on the
advertised endpoint for NodePrepareResources, NodeUnprepareResources and
NodeWatchResources. Replies come back as the values of
:mod:`services.runtime.kubeletplugin.contract`; a failed call raises
:class:`~services.runtime.kubeletplugin.errors.PluginUnavailable` (retryable: the
socket is gone, the call timed out) or ``PluginCallFailed``.

The directory is polled (``poll_interval``) rather than watched with inotify: this is
a test and benchmark tool, and the kubelet's own watcher is not what is under test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from types import TracebackType
from typing import Final, Self, TypeVar

import grpc
from google.protobuf.message import Message

from services.runtime.kubeletapi import dra_health_v1alpha1_pb2 as health_pb
from services.runtime.kubeletapi import dra_v1_pb2 as dra_pb
from services.runtime.kubeletapi import pluginregistration_pb2 as reg_pb
from services.runtime.kubeletplugin import wire
from services.runtime.kubeletplugin.contract import ClaimRef, DeviceHealthReport, PrepareResult
from services.runtime.kubeletplugin.errors import (
    PluginUnavailable,
    RegistrationRefused,
    map_rpc_error,
)
from services.runtime.kubeletplugin.sockets import checked_socket_path, unix_target

__all__ = ["KUBELET_VERSIONS", "KubeletClient", "PluginConnection"]

#: The DRA service versions this client speaks.
KUBELET_VERSIONS: Final = (wire.DRA_VERSION,)
_KUBELET_TIMEOUT_S: Final = 45.0

Request = TypeVar("Request", bound=Message)
Reply = TypeVar("Reply", bound=Message)


class PluginConnection:
    """Calls on a registered plugin's endpoint, as the kubelet makes them."""

    def __init__(self, info: reg_pb.PluginInfo, *, call_timeout: float) -> None:
        self.driver_name = info.name
        self.endpoint = Path(info.endpoint)
        self.supported_versions = tuple(info.supported_versions)
        self.call_timeout = call_timeout
        self._channel = grpc.aio.insecure_channel(unix_target(self.endpoint))
        dra = wire.DRA_SERVICE
        self._prepare = _unary(
            self._channel,
            wire.method_path(dra, "NodePrepareResources"),
            dra_pb.NodePrepareResourcesRequest,
            dra_pb.NodePrepareResourcesResponse,
        )
        self._unprepare = _unary(
            self._channel,
            wire.method_path(dra, "NodeUnprepareResources"),
            dra_pb.NodeUnprepareResourcesRequest,
            dra_pb.NodeUnprepareResourcesResponse,
        )
        self._watch = self._channel.unary_stream(
            wire.method_path(wire.HEALTH_SERVICE, "NodeWatchResources"),
            request_serializer=health_pb.NodeWatchResourcesRequest.SerializeToString,
            response_deserializer=health_pb.NodeWatchResourcesResponse.FromString,
        )

    async def prepare(self, claims: Iterable[ClaimRef]) -> dict[str, PrepareResult]:
        """NodePrepareResources: the plugin's answer per claim UID."""
        request = dra_pb.NodePrepareResourcesRequest(claims=wire.claims_request(claims))
        try:
            reply = await self._prepare(request, timeout=self.call_timeout)
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc, method="NodePrepareResources") from exc
        return wire.prepare_results(reply)

    async def unprepare(self, claims: Iterable[ClaimRef]) -> dict[str, str]:
        """NodeUnprepareResources: an error text per claim UID (``""``: done)."""
        request = dra_pb.NodeUnprepareResourcesRequest(claims=wire.claims_request(claims))
        try:
            reply = await self._unprepare(request, timeout=self.call_timeout)
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc, method="NodeUnprepareResources") from exc
        return wire.unprepare_results(reply)

    async def watch_health(self) -> AsyncIterator[list[DeviceHealthReport]]:
        """NodeWatchResources: each complete list the plugin sends, until it ends."""
        call = self._watch(health_pb.NodeWatchResourcesRequest())
        try:
            async for reply in call:
                yield wire.health_reports(reply)
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc, method="NodeWatchResources") from exc
        finally:
            call.cancel()

    async def close(self) -> None:
        """Close the channel to the endpoint."""
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class KubeletClient:
    """Finds, registers and connects to DRA plugins in a registration directory."""

    def __init__(
        self,
        registration_dir: Path | str,
        *,
        call_timeout: float = _KUBELET_TIMEOUT_S,
        poll_interval: float = 0.05,
    ) -> None:
        self.registration_dir = Path(registration_dir)
        self.call_timeout = call_timeout
        self.poll_interval = poll_interval

    def registration_sockets(self) -> list[Path]:
        """The ``*-reg.sock`` files in the directory now, sorted."""
        if not self.registration_dir.is_dir():
            return []
        return sorted(self.registration_dir.glob("*-reg.sock"))

    async def wait_for_socket(self, driver_name: str | None = None, *, within_s: float) -> Path:
        """The first registration socket (of ``driver_name`` if given) to appear.

        :class:`PluginUnavailable` when none appears within ``within_s`` seconds.
        """
        wanted = f"{driver_name}-reg.sock" if driver_name else None
        deadline = time.monotonic() + within_s
        while True:
            found = [p for p in self.registration_sockets() if wanted in (None, p.name)]
            if found:
                return found[0]
            if time.monotonic() >= deadline:
                raise PluginUnavailable(
                    f"no {wanted or '*-reg.sock'} in {self.registration_dir} after {within_s:g} s"
                )
            await asyncio.sleep(self.poll_interval)

    async def register(self, registration_socket: Path) -> PluginConnection:
        """GetInfo, check it, notify the verdict; the connection to the endpoint.

        :class:`RegistrationRefused` (after notifying the plugin) when the answer is not
        acceptable.
        """
        target = unix_target(checked_socket_path(registration_socket))
        async with grpc.aio.insecure_channel(target) as channel:
            registration = wire.REGISTRATION_SERVICE
            get_info = _unary(
                channel,
                wire.method_path(registration, "GetInfo"),
                reg_pb.InfoRequest,
                reg_pb.PluginInfo,
            )
            notify = _unary(
                channel,
                wire.method_path(registration, "NotifyRegistrationStatus"),
                reg_pb.RegistrationStatus,
                reg_pb.RegistrationStatusResponse,
            )
            try:
                info = await get_info(reg_pb.InfoRequest(), timeout=self.call_timeout)
                problem = _registration_problem(info)
                status = reg_pb.RegistrationStatus(plugin_registered=not problem, error=problem)
                await notify(status, timeout=self.call_timeout)
            except grpc.aio.AioRpcError as exc:
                raise map_rpc_error(exc, method="Registration") from exc
        if problem:
            raise RegistrationRefused(f"{registration_socket}: {problem}")
        return PluginConnection(info, call_timeout=self.call_timeout)

    async def discover(
        self, driver_name: str | None = None, *, within_s: float = 10.0
    ) -> PluginConnection:
        """Wait for a plugin's registration socket, then register it."""
        return await self.register(await self.wait_for_socket(driver_name, within_s=within_s))


def _unary(
    channel: grpc.aio.Channel, path: str, request: type[Request], reply: type[Reply]
) -> grpc.aio.UnaryUnaryMultiCallable[Request, Reply]:
    """A typed unary call on ``channel``."""
    return channel.unary_unary(
        path, request_serializer=request.SerializeToString, response_deserializer=reply.FromString
    )


def _registration_problem(info: reg_pb.PluginInfo) -> str:
    """Why the kubelet would refuse ``info``; ``""`` when it is acceptable."""
    if info.type != wire.PLUGIN_TYPE:
        return f"type {info.type!r}: must be {wire.PLUGIN_TYPE!r}"
    if not info.name:
        return "name: required"
    if not Path(info.endpoint).is_absolute():
        return f"endpoint {info.endpoint!r}: must be an absolute socket path"
    if not set(info.supported_versions) & set(KUBELET_VERSIONS):
        return (
            f"supported_versions {list(info.supported_versions)}: none of {list(KUBELET_VERSIONS)}"
        )
    return ""
