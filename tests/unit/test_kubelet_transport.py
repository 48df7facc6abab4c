"""The kubelet transport without gRPC: answering every claim, settings and socket paths,
conversions, and the health feed (over gRPC: tests/integration/test_kubelet_plugin.py)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.runtime.kubeletplugin import wire
from services.runtime.kubeletplugin.api import dra_health_v1alpha1_pb2 as health_pb
from services.runtime.kubeletplugin.calling import answer_claims
from services.runtime.kubeletplugin.contract import (
    ClaimRef,
    DeviceHealthReport,
    PreparedDevice,
    PrepareResult,
)
from services.runtime.kubeletplugin.errors import (
    DeadlineExceeded,
    HandlerRaised,
    PluginConfigError,
    ResultMissing,
    SocketPathTooLong,
)
from services.runtime.kubeletplugin.healthfeed import HealthFeed
from services.runtime.kubeletplugin.serving import KubeletPlugin
from services.runtime.kubeletplugin.sockets import (
    SUN_PATH_MAX_BYTES,
    checked_socket_path,
    clear_stale_socket,
)


def claim(uid: str) -> ClaimRef:
    return ClaimRef(namespace="ns", name=uid, uid=uid)


class Recorder:
    """A handler call that answers "done <uid>", raising for ``raising`` claims."""

    def __init__(self, raising: frozenset[str] = frozenset(), extra: str | None = None) -> None:
        self.raising, self.extra = raising, extra
        self.batches: list[list[str]] = []

    async def __call__(self, claims: list[ClaimRef]) -> dict[str, str]:
        self.batches.append([c.uid for c in claims])
        if any(c.uid in self.raising for c in claims):
            raise ValueError("bad claim")
        answer = {c.uid: f"done {c.uid}" for c in claims}
        if self.extra:
            answer[self.extra] = "not asked"
        return answer


async def test_a_batch_is_one_call_and_a_repeated_uid_is_asked_once() -> None:
    call = Recorder()
    answers = await answer_claims(
        [claim("a"), claim("b"), claim("a")], call, deadline_s=30, what="prepare"
    )
    assert answers == {"a": "done a", "b": "done b"}
    assert call.batches == [["a", "b"]]


async def test_an_empty_batch_is_not_passed_on() -> None:
    call = Recorder()
    assert await answer_claims([], call, deadline_s=30, what="prepare") == {}
    assert call.batches == []


async def test_answers_for_claims_not_asked_for_are_dropped() -> None:
    answers = await answer_claims([claim("a")], Recorder(extra="z"), deadline_s=30, what="p")
    assert answers == {"a": "done a"}


async def test_an_exception_is_isolated_by_asking_claim_by_claim() -> None:
    call = Recorder(raising=frozenset({"b"}))
    answers = await answer_claims(
        [claim("a"), claim("b"), claim("c")], call, deadline_s=30, what="prepare"
    )
    assert answers["a"] == "done a"
    assert answers["c"] == "done c"
    failure = answers["b"]
    assert isinstance(failure, HandlerRaised)
    assert failure.uid == "b"
    assert str(failure) == "prepare of claim ns/b (b) failed: ValueError: bad claim"
    assert call.batches[0] == ["a", "b", "c"]
    assert sorted(call.batches[1:]) == [["a"], ["b"], ["c"]]


async def test_a_single_claim_that_raises_is_not_asked_again() -> None:
    call = Recorder(raising=frozenset({"a"}))
    answers = await answer_claims([claim("a")], call, deadline_s=30, what="prepare")
    assert isinstance(answers["a"], HandlerRaised)
    assert call.batches == [["a"]]


async def test_a_missing_answer_is_named() -> None:
    async def forgetful(claims: list[ClaimRef]) -> dict[str, str]:
        return {"a": ""}

    answers = await answer_claims([claim("a"), claim("b")], forgetful, deadline_s=30, what="x")
    assert answers["a"] == ""
    assert isinstance(answers["b"], ResultMissing)
    assert "no result for claim ns/b (b)" in str(answers["b"])


async def test_the_deadline_keeps_finished_answers_and_fails_the_rest() -> None:
    release = asyncio.Event()  # never set: "slow" hangs until cancelled
    cancelled: list[str] = []

    async def call(claims: list[ClaimRef]) -> dict[str, str]:
        if len(claims) > 1:
            raise ValueError("one of them is bad")  # forces the per-claim calls
        if claims[0].uid == "slow":
            try:
                await release.wait()
            except asyncio.CancelledError:
                cancelled.append("slow")
                raise
        return {claims[0].uid: "done"}

    answers = await answer_claims(
        [claim("fast"), claim("slow")], call, deadline_s=1.0, what="prepare"
    )
    assert answers["fast"] == "done"
    assert isinstance(answers["slow"], DeadlineExceeded)
    assert "did not finish within 1 s" in str(answers["slow"])
    assert cancelled == ["slow"]
    assert list(answers) == ["fast", "slow"]  # in the order asked


# --- socket paths ---------------------------------------------------------------------


def test_a_path_of_107_bytes_fits_and_108_does_not(tmp_path: Path) -> None:
    room = SUN_PATH_MAX_BYTES - len(str(tmp_path)) - 1
    fits = tmp_path / ("s" * room)
    assert checked_socket_path(fits) == fits
    with pytest.raises(SocketPathTooLong, match=f"{fits}s is 108 bytes"):
        checked_socket_path(str(fits) + "s")


def test_a_relative_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert checked_socket_path("plugin.sock") == tmp_path / "plugin.sock"


def test_only_a_socket_is_cleared(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(stale))
    assert clear_stale_socket(stale)
    assert not stale.exists()
    assert not clear_stale_socket(stale)  # nothing there
    regular = tmp_path / "file"
    regular.write_text("keep me")
    with pytest.raises(PluginConfigError, match="is not a socket"):
        clear_stale_socket(regular)
    assert regular.read_text() == "keep me"


class Idle:
    async def prepare(self, claims: list[ClaimRef]) -> dict[str, PrepareResult]:
        return {}

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str]:
        return {}


DRIVER = "gpu.example.com"


@pytest.mark.parametrize("where", ["registration_dir", "plugin_dir"])
def test_a_socket_path_too_long_is_refused_by_name(tmp_path: Path, where: str) -> None:
    long_dir = tmp_path / ("d" * 110)
    dirs = {"registration_dir": tmp_path / "reg", "plugin_dir": tmp_path / "plug"}
    dirs[where] = long_dir
    with pytest.raises(SocketPathTooLong, match="at most 107 bytes") as raised:
        KubeletPlugin(DRIVER, Idle(), **dirs)  # type: ignore[arg-type]
    assert str(long_dir) in str(raised.value)
    assert raised.value.path.startswith(str(long_dir))


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"driver_name": "GPU_example"}, "driver_name"),
        ({"driver_name": "a/b"}, "driver_name"),
        ({"call_timeout": 45.0}, "call_timeout"),
        ({"call_timeout": 0.0}, "call_timeout"),
    ],
)
def test_bad_settings_are_refused_by_name(
    tmp_path: Path, options: dict[str, object], field: str
) -> None:
    settings: dict[str, object] = {
        "driver_name": DRIVER,
        "registration_dir": tmp_path / "reg",
        "plugin_dir": tmp_path / "plug",
        **options,
    }
    name = settings.pop("driver_name")
    with pytest.raises(PluginConfigError, match=f"^{field} "):
        KubeletPlugin(name, Idle(), **settings)  # type: ignore[arg-type]


# --- conversions ----------------------------------------------------------------------


def test_prepare_and_unprepare_replies_read_back_as_sent() -> None:
    prepared = PrepareResult(
        devices=(
            PreparedDevice(
                request_names=("a", "b"),
                pool_name="pool",
                device_name="gpu-0",
                cdi_device_ids=("example.com/gpu=x", "example.com/gpu=y"),
            ),
        )
    )
    failed = DeadlineExceeded("too slow", uid="u2")
    reply = wire.prepare_reply({"u1": prepared, "u2": failed, "u3": PrepareResult(error="no")})
    assert wire.prepare_results(reply) == {
        "u1": prepared,
        "u2": PrepareResult(error="DeadlineExceeded: too slow"),
        "u3": PrepareResult(error="no"),
    }
    unreply = wire.unprepare_reply({"u1": "", "u2": HandlerRaised("boom", uid="u2")})
    assert wire.unprepare_results(unreply) == {"u1": "", "u2": "HandlerRaised: boom"}


def test_health_reads_back_as_sent_and_an_unknown_status_reads_unknown() -> None:
    reports = [
        DeviceHealthReport(pool_name="p", device_name=name, health=status, last_updated_unix=7)
        for name, status in (("a", "healthy"), ("b", "unhealthy"), ("c", "unknown"))
    ]
    reply = wire.health_reply(reports)
    assert [d.health for d in reply.devices] == [
        health_pb.HEALTHY,
        health_pb.UNHEALTHY,
        health_pb.UNKNOWN,
    ]
    assert wire.health_reports(reply) == reports
    reply.devices[0].health = 9  # type: ignore[assignment]  # a status from a newer kubelet
    assert wire.health_reports(reply)[0].health == "unknown"


def test_method_paths_come_from_the_protos() -> None:
    assert (
        wire.method_path(wire.DRA_SERVICE, "NodePrepareResources")
        == "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
    )
    with pytest.raises(KeyError):
        wire.method_path(wire.DRA_SERVICE, "NodePrepareResource")


# --- the health feed ------------------------------------------------------------------


def report(at: int) -> list[DeviceHealthReport]:
    return [
        DeviceHealthReport(pool_name="p", device_name="d", health="healthy", last_updated_unix=at)
    ]


async def test_a_watcher_gets_the_latest_list_then_newer_ones_until_the_feed_ends() -> None:
    feed = HealthFeed()
    source: asyncio.Queue[list[DeviceHealthReport] | None] = asyncio.Queue()

    async def updates() -> AsyncIterator[list[DeviceHealthReport]]:
        while (item := await source.get()) is not None:
            yield item

    following = asyncio.create_task(feed.follow(updates()))
    early = feed.watch()
    await source.put(report(1))
    assert await anext(early) == report(1)
    await source.put(report(2))
    await source.put(report(3))
    latest = await anext(early)
    if latest == report(2):  # it may skip a list, never go back
        latest = await anext(early)
    assert latest == report(3)
    late = feed.watch()
    assert await anext(late) == report(3)  # a new watcher gets the latest at once
    await source.put(None)
    await following
    assert [x async for x in late] == []
    assert [x async for x in early] == []
    assert feed.failure is None


async def test_a_failing_source_is_recorded_and_ends_the_watchers() -> None:
    feed = HealthFeed()

    async def updates() -> AsyncIterator[list[DeviceHealthReport]]:
        yield report(1)
        raise OSError("sensor gone")

    watcher = feed.watch()
    with pytest.raises(OSError, match="sensor gone"):
        await feed.follow(updates())
    assert isinstance(feed.failure, OSError)
    assert [x async for x in watcher] == [report(1)]
