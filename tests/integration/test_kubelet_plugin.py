"""The kubelet transport over real gRPC on Unix sockets, driven as the kubelet drives it.

Each test starts a :class:`KubeletPlugin` around a small in-test handler (no dracap
logic) in its own temporary directory, and talks to it with
:class:`~tests.fixtures.kubeletclient.KubeletClient` — or with the generated stubs,
to prove the hand-registered method paths are the ``.proto`` files'. Nothing waits on
time: tests wait for the plugin's ``registered`` event, for stream messages, or for
the calls to return.
"""

from __future__ import annotations

import asyncio
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.runtime.ground.metrics import REGISTRY
from services.runtime.kubeletplugin import (
    ClaimRef,
    DeviceHealthReport,
    KubeletPlugin,
    PluginCallFailed,
    PluginConfigError,
    PluginUnavailable,
    PreparedDevice,
    PrepareResult,
    RegistrationRefused,
)
from services.runtime.kubeletplugin.api import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    pluginregistration_pb2,
    pluginregistration_pb2_grpc,
)
from services.runtime.kubeletplugin.serving import staging_path
from tests.fixtures.kubeletclient import KubeletClient, PluginConnection

DRIVER = "gpu.example.com"


def claim(uid: str) -> ClaimRef:
    return ClaimRef(namespace="team-a", name=f"claim-{uid}", uid=uid)


def device(uid: str) -> PreparedDevice:
    return PreparedDevice(
        request_names=("gpu",),
        pool_name="node-1",
        device_name=f"gpu-{uid}",
        cdi_device_ids=(f"example.com/gpu=share-{uid}",),
    )


class Driver:
    """A handler: prepares every claim with one device, except as told.

    ``refused`` claims get an error result, ``raising`` ones make the handler raise,
    ``hanging`` ones never finish, ``forgotten`` ones are left out of the answer.
    """

    def __init__(
        self,
        *,
        refused: frozenset[str] = frozenset(),
        raising: frozenset[str] = frozenset(),
        hanging: frozenset[str] = frozenset(),
        forgotten: frozenset[str] = frozenset(),
    ) -> None:
        self.refused, self.raising, self.hanging = refused, raising, hanging
        self.forgotten = forgotten
        self.batches: list[list[str]] = []
        self.cancelled = asyncio.Event()

    async def _check(self, claims: list[ClaimRef]) -> None:
        self.batches.append([c.uid for c in claims])
        if any(c.uid in self.raising for c in claims):
            raise RuntimeError("device is wedged")
        if any(c.uid in self.hanging for c in claims):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise

    async def prepare(self, claims: list[ClaimRef]) -> dict[str, PrepareResult]:
        await self._check(claims)
        return {
            c.uid: PrepareResult(error=f"{c.uid} is not allocated here")
            if c.uid in self.refused
            else PrepareResult(devices=(device(c.uid),))
            for c in claims
            if c.uid not in self.forgotten
        }

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str]:
        await self._check(claims)
        return {
            c.uid: f"{c.uid} is busy" if c.uid in self.refused else ""
            for c in claims
            if c.uid not in self.forgotten
        }


class HealthyDriver(Driver):
    """A handler that also reports health: each list put in ``updates`` is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.updates: asyncio.Queue[list[DeviceHealthReport]] = asyncio.Queue()

    async def health_updates(self) -> AsyncIterator[list[DeviceHealthReport]]:
        while True:
            yield await self.updates.get()


def health(device_name: str, status: str, at: int) -> DeviceHealthReport:
    return DeviceHealthReport(
        pool_name="node-1",
        device_name=device_name,
        health=status,  # type: ignore[arg-type]
        last_updated_unix=at,
    )


def new_plugin(tmp_path: Path, handler: Driver, **options: float) -> KubeletPlugin:
    return KubeletPlugin(
        DRIVER,
        handler,
        registration_dir=tmp_path / "reg",
        plugin_dir=tmp_path / "plug",
        **options,
    )


async def registered(tmp_path: Path, plugin: KubeletPlugin) -> PluginConnection:
    await plugin.start()
    connection = await KubeletClient(tmp_path / "reg").discover(DRIVER)
    await asyncio.wait_for(plugin.registered.wait(), 30)
    return connection


def calls(method: str, outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "dracap_kubelet_calls_total", {"method": method, "outcome": outcome}
    )
    return value or 0.0


# --- registration ---------------------------------------------------------------------


async def test_registration_handshake_advertises_only_what_is_served(tmp_path: Path) -> None:
    plugin = new_plugin(tmp_path, Driver())
    try:
        connection = await registered(tmp_path, plugin)
        async with connection:
            assert plugin.registration_socket == tmp_path / "reg" / f"{DRIVER}-reg.sock"
            assert connection.driver_name == DRIVER
            assert connection.endpoint == tmp_path / "plug" / "dra.sock" == plugin.endpoint
            assert connection.supported_versions == ("v1.DRAPlugin",)
            assert plugin.registration_error is None
            for sock in (plugin.registration_socket, plugin.endpoint):  # the kubelet's only
                assert stat.S_IMODE(sock.stat().st_mode) == 0o600, sock
    finally:
        await plugin.stop()


async def test_the_generated_stubs_reach_the_served_methods(tmp_path: Path) -> None:
    plugin = new_plugin(tmp_path, Driver())
    await plugin.start()
    try:
        target = f"unix:{plugin.registration_socket}"
        async with grpc.aio.insecure_channel(target) as channel:
            info = await pluginregistration_pb2_grpc.RegistrationStub(channel).GetInfo(
                pluginregistration_pb2.InfoRequest()
            )
        assert info.type == "DRAPlugin"
        assert list(info.supported_versions) == ["v1.DRAPlugin"]
        async with grpc.aio.insecure_channel(f"unix:{info.endpoint}") as channel:
            request = dra_v1_pb2.NodePrepareResourcesRequest(
                claims=[dra_v1_pb2.Claim(namespace="team-a", name="claim-a", uid="a")]
            )
            reply = await dra_v1_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(request)
        assert reply.claims["a"].error == ""
        assert list(reply.claims["a"].devices[0].cdi_device_ids) == ["example.com/gpu=share-a"]
    finally:
        await plugin.stop()


async def test_a_refused_registration_is_recorded(tmp_path: Path) -> None:
    plugin = new_plugin(tmp_path, Driver())
    plugin.supported_versions = ("v1beta1.DRAPlugin",)  # a version this kubelet lacks
    before = calls("NotifyRegistrationStatus", "refused")
    await plugin.start()
    try:
        with pytest.raises(RegistrationRefused, match="supported_versions"):
            await KubeletClient(tmp_path / "reg").discover(DRIVER)
        assert plugin.registration_error is not None
        assert "v1.DRAPlugin" in plugin.registration_error
        assert not plugin.registered.is_set()
        assert calls("NotifyRegistrationStatus", "refused") == before + 1
    finally:
        await plugin.stop()


# --- prepare and unprepare ------------------------------------------------------------


async def test_every_claim_gets_an_entry_and_an_error_fails_only_its_claim(
    tmp_path: Path,
) -> None:
    plugin = new_plugin(tmp_path, Driver(refused=frozenset({"b"})))
    before_ok = calls("NodePrepareResources", "ok")
    before_failed = calls("NodePrepareResources", "claim_error")
    try:
        async with await registered(tmp_path, plugin) as kubelet:
            prepared = await kubelet.prepare([claim("a"), claim("b"), claim("c")])
            assert prepared == {
                "a": PrepareResult(devices=(device("a"),)),
                "b": PrepareResult(error="b is not allocated here"),
                "c": PrepareResult(devices=(device("c"),)),
            }
            assert await kubelet.prepare([claim("a")]) == {"a": prepared["a"]}
            assert await kubelet.unprepare([claim("a"), claim("b"), claim("never")]) == {
                "a": "",
                "b": "b is busy",
                "never": "",
            }
            assert await kubelet.prepare([]) == {}
        assert calls("NodePrepareResources", "claim_error") == before_failed + 1
        assert calls("NodePrepareResources", "ok") == before_ok + 2
    finally:
        await plugin.stop()


async def test_a_handler_exception_fails_only_its_claim(tmp_path: Path) -> None:
    driver = Driver(raising=frozenset({"b"}))
    plugin = new_plugin(tmp_path, driver)
    try:
        async with await registered(tmp_path, plugin) as kubelet:
            prepared = await kubelet.prepare([claim("a"), claim("b"), claim("c")])
            assert prepared["a"] == PrepareResult(devices=(device("a"),))
            assert prepared["c"] == PrepareResult(devices=(device("c"),))
            assert prepared["b"].devices == ()
            assert prepared["b"].error.startswith("HandlerRaised: ")
            assert "team-a/claim-b (b)" in prepared["b"].error
            assert "RuntimeError: device is wedged" in prepared["b"].error
            # the batch first, then each claim alone
            assert driver.batches == [["a", "b", "c"], ["a"], ["b"], ["c"]]
            unprepared = await kubelet.unprepare([claim("b"), claim("a")])
            assert unprepared["a"] == ""
            assert unprepared["b"].startswith("HandlerRaised: ")
            # and the plugin still serves
            assert await kubelet.prepare([claim("a")]) == {"a": prepared["a"]}
    finally:
        await plugin.stop()


async def test_a_claim_missing_from_the_answer_gets_an_error(tmp_path: Path) -> None:
    plugin = new_plugin(tmp_path, Driver(forgotten=frozenset({"b"})))
    try:
        async with await registered(tmp_path, plugin) as kubelet:
            prepared = await kubelet.prepare([claim("a"), claim("b")])
            assert prepared["a"].error == ""
            assert prepared["b"].error.startswith("ResultMissing: ")
            unprepared = await kubelet.unprepare([claim("b")])
            assert unprepared["b"].startswith("ResultMissing: ")
    finally:
        await plugin.stop()


async def test_a_slow_prepare_fails_its_claim_at_the_deadline(tmp_path: Path) -> None:
    driver = Driver(hanging=frozenset({"slow"}))
    plugin = new_plugin(tmp_path, driver, call_timeout=0.5)
    before = calls("NodePrepareResources", "deadline")
    try:
        async with await registered(tmp_path, plugin) as kubelet:
            prepared = await kubelet.prepare([claim("slow")])
            assert prepared["slow"].error.startswith("DeadlineExceeded: ")
            assert "team-a/claim-slow (slow)" in prepared["slow"].error
            await asyncio.wait_for(driver.cancelled.wait(), 30)  # the handler was cancelled
            assert calls("NodePrepareResources", "deadline") == before + 1
            unprepared = await kubelet.unprepare([claim("slow")])
            assert unprepared["slow"].startswith("DeadlineExceeded: ")
    finally:
        await plugin.stop()


# --- sockets --------------------------------------------------------------------------


def _leave_stale_socket(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # closed without unlinking: what a killed plugin leaves


async def test_stale_sockets_are_replaced(tmp_path: Path) -> None:
    plugin = new_plugin(tmp_path, Driver())
    for path in (plugin.registration_socket, plugin.endpoint):
        _leave_stale_socket(path)
        _leave_stale_socket(staging_path(path))  # killed while starting
    try:
        async with await registered(tmp_path, plugin) as kubelet:
            assert (await kubelet.prepare([claim("a")]))["a"].error == ""
    finally:
        await plugin.stop()


async def test_a_socket_appears_only_once_its_server_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet registers as soon as it sees the file: a socket bound and not yet
    listening refuses it, and the refused channel backs off (once seen on a loaded
    machine, as "Connection refused" from a restarted agent). The file is only put in
    place once its server has started."""
    plugin = new_plugin(tmp_path, Driver())
    seen_before_start: list[list[str]] = []
    start = grpc.aio._server.Server.start

    async def watched_start(self: Any) -> None:
        paths = (plugin.endpoint, plugin.registration_socket)
        seen_before_start.append([p.name for p in paths if p.exists()])
        await start(self)

    monkeypatch.setattr(grpc.aio._server.Server, "start", watched_start)
    try:
        async with await registered(tmp_path, plugin) as kubelet:
            assert (await kubelet.prepare([claim("a")]))["a"].error == ""
    finally:
        await plugin.stop()
    assert seen_before_start == [[], ["dra.sock"]]  # the endpoint's, then the registration's
    for path in (plugin.endpoint, plugin.registration_socket):
        assert not staging_path(path).exists()
    assert staging_path(plugin.endpoint).name == ".dra"


async def test_two_plugins_starting_at_once_in_one_registration_directory_keep_their_own(
    tmp_path: Path,
) -> None:
    """Two drivers' plugins on one node share the kubelet's registration directory;
    started at once, each one's socket is its own (a shared staging name let the second
    remove the first's socket, and the first rename the second's as its own)."""
    plugins = [
        KubeletPlugin(
            name,
            Driver(),
            registration_dir=tmp_path / "reg",
            plugin_dir=tmp_path / name,
        )
        for name in (DRIVER, "nic.example.com")
    ]
    await asyncio.gather(*(plugin.start() for plugin in plugins))
    try:
        kubelet = KubeletClient(tmp_path / "reg")
        for plugin in plugins:
            async with await kubelet.register(plugin.registration_socket) as connection:
                assert connection.driver_name == plugin.driver_name
                assert connection.endpoint == plugin.endpoint
                assert (await connection.prepare([claim("a")]))["a"].error == ""
    finally:
        await asyncio.gather(*(plugin.stop() for plugin in plugins))
    assert sorted(p.name for p in (tmp_path / "reg").iterdir()) == []


async def test_a_socket_that_cannot_be_put_in_place_fails_the_start_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin = new_plugin(tmp_path, Driver())

    def refused(source: Path, target: Path) -> None:
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr("services.runtime.kubeletplugin.serving.os.replace", refused)
    with pytest.raises(PluginConfigError, match=f"cannot put the socket at {plugin.endpoint}"):
        await plugin.start()
    for path in (plugin.endpoint, plugin.registration_socket):  # nothing served, nothing left
        assert not path.exists() and not staging_path(path).exists()


async def test_a_file_that_is_not_a_socket_is_not_replaced(tmp_path: Path) -> None:
    plugin = new_plugin(tmp_path, Driver())
    plugin.endpoint.parent.mkdir(parents=True)
    plugin.endpoint.write_text("not a socket")
    with pytest.raises(PluginConfigError, match=f"{plugin.endpoint} exists and is not a socket"):
        await plugin.start()
    assert plugin.endpoint.read_text() == "not a socket"
    assert not plugin.registration_socket.exists()


async def test_stop_removes_the_sockets_and_the_endpoint_goes_away(tmp_path: Path) -> None:
    plugin = new_plugin(tmp_path, Driver())
    kubelet = await registered(tmp_path, plugin)
    assert plugin.registration_socket.exists()
    assert plugin.endpoint.exists()
    await plugin.stop()
    await plugin.stop()  # idempotent
    assert not plugin.registered.is_set()
    assert not plugin.registration_socket.exists()
    assert not plugin.endpoint.exists()
    assert KubeletClient(tmp_path / "reg").registration_sockets() == []
    async with kubelet:
        with pytest.raises(PluginUnavailable, match="NodePrepareResources: UNAVAILABLE"):
            await kubelet.prepare([claim("a")])


# --- device health --------------------------------------------------------------------


async def test_the_health_stream_sends_complete_lists_to_every_watcher(tmp_path: Path) -> None:
    driver = HealthyDriver()
    plugin = new_plugin(tmp_path, driver)
    assert plugin.serves_health
    first = [health("gpu-0", "healthy", 100), health("gpu-1", "healthy", 100)]
    second = [health("gpu-0", "healthy", 100), health("gpu-1", "unhealthy", 160)]
    try:
        async with await registered(tmp_path, plugin) as kubelet:
            watch = kubelet.watch_health()
            await driver.updates.put(first)
            assert await anext(watch) == first
            await driver.updates.put(second)
            assert await anext(watch) == second
            # a kubelet that (re)connects now gets the latest complete list at once
            late = kubelet.watch_health()
            assert await anext(late) == second
            await driver.updates.put([health("gpu-1", "unknown", 200)])
            assert await anext(watch) == await anext(late) == [health("gpu-1", "unknown", 200)]
            await watch.aclose()
            await late.aclose()
    finally:
        await plugin.stop()


async def test_a_plugin_without_health_does_not_serve_it(tmp_path: Path) -> None:
    plugin = new_plugin(tmp_path, Driver())
    assert not plugin.serves_health
    try:
        async with await registered(tmp_path, plugin) as kubelet:
            with pytest.raises(PluginCallFailed, match="UNIMPLEMENTED"):
                await anext(kubelet.watch_health())
    finally:
        await plugin.stop()


async def test_stop_ends_open_health_streams(tmp_path: Path) -> None:
    driver = HealthyDriver()
    plugin = new_plugin(tmp_path, driver)
    kubelet = await registered(tmp_path, plugin)
    async with kubelet:
        watch = kubelet.watch_health()
        await driver.updates.put([health("gpu-0", "healthy", 1)])
        assert len(await anext(watch)) == 1
        await plugin.stop()
        with pytest.raises(StopAsyncIteration):
            await anext(watch)


async def test_a_stopped_plugin_starts_again(tmp_path: Path) -> None:
    driver = HealthyDriver()
    plugin = new_plugin(tmp_path, driver)
    async with await registered(tmp_path, plugin):
        pass
    await plugin.stop()
    try:
        async with await registered(tmp_path, plugin) as kubelet:
            assert (await kubelet.prepare([claim("a")]))["a"].error == ""
            watch = kubelet.watch_health()
            await driver.updates.put([health("gpu-0", "healthy", 2)])
            assert await anext(watch) == [health("gpu-0", "healthy", 2)]
            await watch.aclose()
    finally:
        await plugin.stop()
