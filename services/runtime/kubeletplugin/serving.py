"""The kubelet side of a DRA driver: gRPC on two Unix sockets, around a handler.

:class:`KubeletPlugin` serves

* ``Registration`` (``pluginregistration``) on ``<registration_dir>/<driver>-reg.sock``,
  where the kubelet's plugin watcher finds it: GetInfo answers type ``DRAPlugin``, the
  driver name, the endpoint and the versions served (only ``v1.DRAPlugin``: v1beta1 is
  not served, so it is not advertised); NotifyRegistrationStatus is recorded in
  :attr:`~KubeletPlugin.registered` and :attr:`~KubeletPlugin.registration_error`;
* ``DRAPlugin`` v1 on the endpoint ``<plugin_dir>/dra.sock``, answering every claim of
  a call through :func:`~services.runtime.kubeletplugin.calling.answer_claims`
  (per-claim errors, a deadline below the kubelet's 45 s);
* ``DRAResourceHealth`` v1alpha1 on the same endpoint when the handler is
  :class:`~services.runtime.kubeletplugin.contract.HealthReporting`.

Start-up order: the endpoint is bound and serving before the registration socket
appears, so a kubelet that finds the registration can call at once. Stop reverses it:
the registration socket goes first (the kubelet deregisters the driver), then the
health streams end, then the endpoint. Each server is a separate ``grpc.aio`` server,
so the registration socket answers only Registration. Both socket paths are checked
against the ``sun_path`` limit when the plugin is made; stale socket files are removed
on start and the sockets are removed on stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from events.fieldchecks import DRIVER_NAME_MAX_LENGTH, is_dns_subdomain
from services.runtime.kubeletplugin import metering, wire
from services.runtime.kubeletplugin.api import dra_health_v1alpha1_pb2 as health_pb
from services.runtime.kubeletplugin.api import dra_v1_pb2 as dra_pb
from services.runtime.kubeletplugin.api import pluginregistration_pb2 as reg_pb
from services.runtime.kubeletplugin.calling import answer_claims
from services.runtime.kubeletplugin.contract import DriverHandler, HealthReporting
from services.runtime.kubeletplugin.errors import ClaimFailure, DeadlineExceeded, PluginConfigError
from services.runtime.kubeletplugin.healthfeed import HealthFeed
from services.runtime.kubeletplugin.sockets import (
    checked_socket_path,
    clear_stale_socket,
    unix_target,
)

__all__ = [
    "DEFAULT_CALL_TIMEOUT_S",
    "DEFAULT_PLUGINS_DIR",
    "DEFAULT_REGISTRATION_DIR",
    "KUBELET_CALL_TIMEOUT_S",
    "KubeletPlugin",
]

DEFAULT_REGISTRATION_DIR: Final = Path("/var/lib/kubelet/plugins_registry")
#: The endpoint's directory is ``<this>/<driver name>`` unless given.
DEFAULT_PLUGINS_DIR: Final = Path("/var/lib/kubelet/plugins")
#: How long the kubelet waits for a prepare or unprepare before it gives up.
KUBELET_CALL_TIMEOUT_S: Final = 45.0
DEFAULT_CALL_TIMEOUT_S: Final = 40.0
#: Kept free of a caller's own deadline, so the reply reaches it before it gives up.
_REPLY_MARGIN_S: Final = 0.5

_log = logging.getLogger(__name__)


class KubeletPlugin:
    """A DRA driver's kubelet-facing gRPC servers around ``handler``; see the module."""

    def __init__(
        self,
        driver_name: str,
        handler: DriverHandler,
        *,
        registration_dir: Path | str = DEFAULT_REGISTRATION_DIR,
        plugin_dir: Path | str | None = None,
        call_timeout: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        if not is_dns_subdomain(driver_name, DRIVER_NAME_MAX_LENGTH):
            raise PluginConfigError(
                f"driver_name {driver_name!r}: must be a DNS subdomain of at most "
                f"{DRIVER_NAME_MAX_LENGTH} characters"
            )
        if not 0 < call_timeout < KUBELET_CALL_TIMEOUT_S:
            raise PluginConfigError(
                f"call_timeout {call_timeout!r}: must be above 0 and below the kubelet's "
                f"{KUBELET_CALL_TIMEOUT_S:g} s"
            )
        self.driver_name = driver_name
        self.call_timeout = call_timeout
        plugins = DEFAULT_PLUGINS_DIR / driver_name if plugin_dir is None else Path(plugin_dir)
        self.registration_socket = checked_socket_path(
            Path(registration_dir) / f"{driver_name}-reg.sock"
        )
        self.endpoint = checked_socket_path(plugins / "dra.sock")
        #: The versions of the DRA service served, as GetInfo advertises them.
        self.supported_versions: tuple[str, ...] = (wire.DRA_VERSION,)
        #: Set once the kubelet reports the registration done; cleared on a refusal.
        self.registered = asyncio.Event()
        #: The kubelet's reason when it last refused the registration; None otherwise.
        self.registration_error: str | None = None
        self._handler = handler
        self._health = handler if isinstance(handler, HealthReporting) else None
        self._feed = HealthFeed()
        self._health_task: asyncio.Task[None] | None = None
        self._endpoint_server: grpc.aio.Server | None = None
        self._registration_server: grpc.aio.Server | None = None

    @property
    def serves_health(self) -> bool:
        """Whether DRAResourceHealth is served (the handler reports health)."""
        return self._health is not None

    async def start(self) -> None:
        """Bind and serve the endpoint, then the registration socket."""
        if self._endpoint_server is not None:
            raise PluginConfigError(f"plugin {self.driver_name} is already started")
        handlers = [self._dra_handler()]
        self._feed = HealthFeed()  # a fresh one: a stopped plugin's feed has ended
        if self._health is not None:
            handlers.append(self._health_handler())
            self._health_task = asyncio.create_task(self._follow_health(self._health))
        methods = [*wire.DRA_SERVICE.methods_by_name, *wire.REGISTRATION_SERVICE.methods_by_name]
        if self._health is not None:
            methods.extend(wire.HEALTH_SERVICE.methods_by_name)
        metering.initialise_series(methods)
        try:
            self._endpoint_server = await _serve(self.endpoint, handlers)
            self._registration_server = await _serve(
                self.registration_socket, [self._registration_handler()]
            )
        except BaseException:
            await self.stop(grace=0)
            raise
        _log.info(
            "DRA plugin %s serving on %s, registration at %s",
            self.driver_name,
            self.endpoint,
            self.registration_socket,
        )

    async def stop(self, grace: float = 1.0) -> None:
        """Remove the registration, end the health streams, stop serving; idempotent."""
        self.registered.clear()
        registration, self._registration_server = self._registration_server, None
        if registration is not None:
            await _stop(registration, self.registration_socket, 0)
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.wait([self._health_task])
            self._health_task = None
        endpoint, self._endpoint_server = self._endpoint_server, None
        if endpoint is not None:
            await _stop(endpoint, self.endpoint, grace)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # --- serving ----------------------------------------------------------------------

    def _registration_handler(self) -> grpc.GenericRpcHandler:
        return _service(
            wire.REGISTRATION_SERVICE,
            GetInfo=self._get_info,
            NotifyRegistrationStatus=self._notify_registration_status,
        )

    def _dra_handler(self) -> grpc.GenericRpcHandler:
        return _service(
            wire.DRA_SERVICE,
            NodePrepareResources=self._prepare,
            NodeUnprepareResources=self._unprepare,
        )

    def _health_handler(self) -> grpc.GenericRpcHandler:
        return _service(wire.HEALTH_SERVICE, NodeWatchResources=self._watch_resources)

    # --- the calls --------------------------------------------------------------------

    async def _get_info(self, request: reg_pb.InfoRequest, context: Any) -> reg_pb.PluginInfo:
        with metering.measured("GetInfo"):
            return reg_pb.PluginInfo(
                type=wire.PLUGIN_TYPE,
                name=self.driver_name,
                endpoint=str(self.endpoint),
                supported_versions=self.supported_versions,
            )

    async def _notify_registration_status(
        self, request: reg_pb.RegistrationStatus, context: Any
    ) -> reg_pb.RegistrationStatusResponse:
        with metering.measured("NotifyRegistrationStatus") as outcome:
            if request.plugin_registered:
                self.registration_error = None
                self.registered.set()
                _log.info("DRA plugin %s: registered with the kubelet", self.driver_name)
            else:
                outcome.value = "refused"
                self.registration_error = request.error or "refused without a reason"
                self.registered.clear()
                _log.error(
                    "DRA plugin %s: the kubelet refused the registration: %s",
                    self.driver_name,
                    self.registration_error,
                )
            return reg_pb.RegistrationStatusResponse()

    async def _prepare(
        self,
        request: dra_pb.NodePrepareResourcesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> dra_pb.NodePrepareResourcesResponse:
        with metering.measured("NodePrepareResources") as outcome:
            answers = await answer_claims(
                wire.claims_from(request.claims),
                self._handler.prepare,
                deadline_s=self._deadline(context),
                what=f"{self.driver_name} prepare",
            )
            outcome.value = _claims_outcome(
                a if isinstance(a, ClaimFailure) else a.error for a in answers.values()
            )
            return wire.prepare_reply(answers)

    async def _unprepare(
        self,
        request: dra_pb.NodeUnprepareResourcesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> dra_pb.NodeUnprepareResourcesResponse:
        with metering.measured("NodeUnprepareResources") as outcome:
            answers = await answer_claims(
                wire.claims_from(request.claims),
                self._handler.unprepare,
                deadline_s=self._deadline(context),
                what=f"{self.driver_name} unprepare",
            )
            outcome.value = _claims_outcome(answers.values())
            return wire.unprepare_reply(answers)

    async def _watch_resources(
        self,
        request: health_pb.NodeWatchResourcesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[health_pb.NodeWatchResourcesResponse]:
        with metering.measured("NodeWatchResources", timed=False) as outcome:
            outcome.value = "cancelled"  # unless the feed ends first
            async for reports in self._feed.watch():
                yield wire.health_reply(reports)
            outcome.value = "ok"
            if self._feed.failure is not None:
                outcome.value = "error"
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{self.driver_name}: device health updates failed: {self._feed.failure!r}",
                )

    def _deadline(self, context: grpc.aio.ServicerContext[Any, Any]) -> float:
        """The configured timeout, shortened to the caller's own deadline (less a margin)."""
        remaining = context.time_remaining()
        if remaining is None:
            return self.call_timeout
        return max(0.0, min(self.call_timeout, remaining - _REPLY_MARGIN_S))

    async def _follow_health(self, handler: HealthReporting) -> None:
        try:
            await self._feed.follow(handler.health_updates())
        except Exception:
            _log.exception("DRA plugin %s: device health updates failed", self.driver_name)
        else:
            _log.warning("DRA plugin %s: device health updates ended", self.driver_name)


def staging_path(path: Path) -> Path:
    """Where the socket of ``path`` is bound before it is moved there: its name without
    the suffix, after a dot (``.dra``, ``.<driver>-reg``). The kubelet's plugin watcher
    ignores names that start with a dot; the name is shorter than the socket's own, so
    it fits ``sun_path`` wherever that does; and it is the socket's alone, so two
    plugins (two drivers' agents on one node) that start at once in the shared
    registration directory never take each other's."""
    return path.with_name(f".{path.stem}")


async def _serve(path: Path, handlers: list[grpc.GenericRpcHandler]) -> grpc.aio.Server:
    """A started server on the socket at ``path`` (a stale socket file replaced).

    The socket is bound at :func:`staging_path`, made its owner's only (mode 0600;
    a directory made for it, 0700: the kubelet runs as root, and nobody else on the
    node may prepare or unprepare claims), and renamed to ``path`` once the server
    serves. So the file the kubelet watches for appears only when a connection to it
    is answered: bound and not yet listening, a socket refuses, and a gRPC channel
    that was refused waits out a back-off before it tries again.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    clear_stale_socket(path)
    staging = staging_path(path)
    clear_stale_socket(staging)  # a process killed while starting left it
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(handlers)
    try:
        server.add_insecure_port(unix_target(staging))
    except RuntimeError as exc:
        raise PluginConfigError(f"cannot listen on {path}: {exc}") from exc
    await server.start()
    try:
        os.chmod(staging, 0o600)
        os.replace(staging, path)
    except OSError as exc:
        await server.stop(0)
        raise PluginConfigError(f"cannot put the socket at {path}: {exc}") from exc
    return server


def _service(service: ServiceDescriptor, **behaviours: Any) -> grpc.GenericRpcHandler:
    """The handler of every method of ``service``, by its proto name.

    Each method's request and reply types, and whether it streams, come from the
    descriptor, so they are the ``.proto`` file's; a method left out (or one the proto
    lacks) is a programming error.
    """
    unmatched = set(service.methods_by_name) ^ set(behaviours)
    if unmatched:
        raise AssertionError(f"{service.full_name}: methods not matched: {sorted(unmatched)}")
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for name, behaviour in behaviours.items():
        method = service.methods_by_name[name]
        request, reply = GetMessageClass(method.input_type), GetMessageClass(method.output_type)
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[name] = make(
            behaviour,
            request_deserializer=request.FromString,
            response_serializer=reply.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _claims_outcome(answers: Iterable[str | ClaimFailure]) -> str:
    """``deadline``, ``claim_error`` or ``ok`` for a call's answers (failures or error texts)."""
    errors = [a for a in answers if isinstance(a, ClaimFailure) or a]
    if any(isinstance(a, DeadlineExceeded) for a in errors):
        return "deadline"
    return "claim_error" if errors else "ok"


async def _stop(server: grpc.aio.Server, path: Path, grace: float) -> None:
    await server.stop(grace)
    _remove(path)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
