"""The MPS enforcer against a stand-in ``nvidia-cuda-mps-control`` (no GPU needed).

``tests/fixtures/fake_mps_control`` runs as a real process: it daemonizes on ``-d``,
reads commands on stdin and records every invocation and command in a JSON-lines file,
so these tests check the exact commands sent, the env the daemon saw, the value read
back and the CDI spec — everything but the GPU driver itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from events.quantities import Quantity
from services.enforcement.cdi import CdiSpecs
from services.enforcement.enforcers import (
    PermanentEnforcementError,
    RetryableEnforcementError,
    ShareLimit,
)
from services.enforcement.mps import MpsEnforcer, MpsSettings, mib_of, parse_limit_reply
from tests.fixtures.procstat import alive
from tests.unit.test_cdi import check_spec

FAKE = Path(__file__).resolve().parents[1] / "fixtures" / "fake_mps_control"
UUID_0 = "GPU-2f6a3c1e-8a34-4d0b-9c6e-0a1b2c3d4e50"
UUID_1 = "GPU-2f6a3c1e-8a34-4d0b-9c6e-0a1b2c3d4e51"
SHARE = "7d3c9a10-5b2e-4f61-9c7d-8e9f0a1b2c3d"


class World:
    """An enforcer over the stand-in, with its record of commands."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = tmp_path / "mps"
        self.record = tmp_path / "record.jsonl"
        self.monkeypatch = monkeypatch
        monkeypatch.setenv("FAKE_MPS_RECORD", str(self.record))
        monkeypatch.setenv("FAKE_MPS_GPUS", f"{UUID_0},{UUID_1}")
        monkeypatch.delenv("FAKE_MPS_MODE", raising=False)
        monkeypatch.delenv("FAKE_MPS_SERVERS", raising=False)
        self.cdi = CdiSpecs(tmp_path / "cdi")
        self.settings = MpsSettings(
            root=self.root,
            control_binary=str(FAKE),
            command_timeout_s=2.0,
            start_timeout_s=1.0,
            stop_timeout_s=2.0,
            poll_interval_s=0.01,
        )
        self.enforcer = MpsEnforcer(
            {"gpu-0": UUID_0, "gpu-1": UUID_1}, cdi=self.cdi, settings=self.settings
        )

    def mode(self, *flags: str) -> None:
        self.monkeypatch.setenv("FAKE_MPS_MODE", ",".join(flags))

    def calls(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]

    def commands(self) -> list[str]:
        return [c["command"] for c in self.calls() if c["command"] is not None]

    def starts(self) -> list[dict[str, Any]]:
        return [c for c in self.calls() if c["argv"] == ["-d"]]

    def forget(self) -> None:
        self.record.unlink(missing_ok=True)

    def kill_daemons(self) -> None:
        """SIGKILL every stand-in daemon and wait until each has exited."""
        pids = []
        for pid_file in self.root.glob("*/pipe/fake-daemon.pid"):
            with contextlib.suppress(ValueError, OSError):
                pid = int(pid_file.read_text())
                os.kill(pid, signal.SIGKILL)
                pids.append(pid)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in pids):
            assert time.monotonic() < deadline, "a stand-in daemon does not die"
            time.sleep(0.01)


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    w = World(tmp_path, monkeypatch)
    try:
        yield w
    finally:
        w.kill_daemons()


def limit(memory: str = "10Gi", *, share_id: str = SHARE, device: str = "gpu-0") -> ShareLimit:
    return ShareLimit(
        share_id=share_id,
        driver="gpu.dracap.io",
        pool="node-a-gpus",
        device=device,
        consumed={"memory": Quantity.parse(memory)},
    )


async def test_apply_starts_a_daemon_sets_and_reads_back_the_limit(world: World) -> None:
    applied = await world.enforcer.apply(limit("10Gi"))

    assert applied.level == "hard"
    assert applied.actual == {"memory": Quantity.parse("10Gi")}
    assert str(applied.actual["memory"]) == "10Gi"
    (start,) = world.starts()
    pipe = world.root / SHARE / "pipe"
    log = world.root / SHARE / "log"
    assert start["env"]["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
    assert start["env"]["CUDA_MPS_LOG_DIRECTORY"] == str(log)
    assert start["env"]["CUDA_VISIBLE_DEVICES"] == UUID_0
    assert world.commands() == [
        f"get_default_device_pinned_mem_limit {UUID_0}",
        f"set_default_device_pinned_mem_limit {UUID_0} 10240M",
        f"get_default_device_pinned_mem_limit {UUID_0}",
    ]
    # Every control command went to this share's daemon.
    assert {c["env"]["CUDA_MPS_PIPE_DIRECTORY"] for c in world.calls()} == {str(pipe)}
    assert (log / "control.log").exists()


async def test_apply_publishes_a_valid_cdi_spec(world: World) -> None:
    await world.enforcer.apply(limit())
    spec = world.cdi.read(SHARE)
    assert spec is not None
    check_spec(spec)
    (device,) = spec["devices"]
    assert device["name"] == SHARE
    env = dict(e.split("=", 1) for e in device["containerEdits"]["env"])
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(world.root / SHARE / "pipe")
    assert env["NVIDIA_VISIBLE_DEVICES"] == UUID_0
    assert env["DRACAP_SHARE_ID"] == SHARE
    host_paths = [m["hostPath"] for m in device["containerEdits"]["mounts"]]
    assert str(world.root / SHARE / "pipe") in host_paths


async def test_limit_is_rounded_down_to_whole_mib(world: World) -> None:
    applied = await world.enforcer.apply(limit("1500000000"))  # 1430.51 MiB
    assert applied.actual == {"memory": Quantity.parse("1430Mi")}
    assert applied.actual["memory"] <= Quantity.parse("1500000000")
    assert f"set_default_device_pinned_mem_limit {UUID_0} 1430M" in world.commands()


async def test_apply_is_idempotent(world: World) -> None:
    first = await world.enforcer.apply(limit())
    spec_path = world.cdi.path_of(SHARE)
    inode = spec_path.stat().st_ino
    world.forget()
    again = await world.enforcer.apply(limit())
    assert again == first
    assert world.starts() == []  # the daemon is running: not started twice
    assert world.commands() == [f"get_default_device_pinned_mem_limit {UUID_0}"]  # verified only
    assert spec_path.stat().st_ino == inode


async def test_apply_after_a_daemon_died_starts_it_again(world: World) -> None:
    await world.enforcer.apply(limit())
    world.kill_daemons()
    world.forget()
    applied = await world.enforcer.apply(limit())
    assert applied.level == "hard"
    assert len(world.starts()) == 1


async def test_remove_quits_the_daemon_and_deletes_spec_and_dirs(world: World) -> None:
    await world.enforcer.apply(limit())
    pid = int((world.root / SHARE / "pipe" / "nvidia-cuda-mps-control.pid").read_text())
    world.forget()
    await world.enforcer.remove(SHARE)
    assert world.commands() == ["quit"]
    assert not world.cdi.path_of(SHARE).exists()
    assert not (world.root / SHARE).exists()
    assert not alive(pid)
    assert await world.enforcer.observe() == {}
    await world.enforcer.remove(SHARE)  # idempotent
    await world.enforcer.remove("never-applied")


async def test_observe_lists_running_daemons_with_their_limits(world: World) -> None:
    await world.enforcer.apply(limit("10Gi"))
    other = "share-two"
    await world.enforcer.apply(limit("5Gi", share_id=other, device="gpu-1"))
    seen = await world.enforcer.observe()
    assert set(seen) == {SHARE, other}
    assert seen[SHARE].level == "hard"
    assert seen[SHARE].actual == {"memory": Quantity.parse("10Gi")}
    assert seen[other].actual == {"memory": Quantity.parse("5Gi")}
    world.kill_daemons()
    assert await world.enforcer.observe() == {}  # a dead daemon enforces nothing


async def test_gib_display_of_the_driver_is_accepted(world: World) -> None:
    world.mode("gib-display")
    applied = await world.enforcer.apply(limit("10Gi"))
    assert applied.actual == {"memory": Quantity.parse("10Gi")}
    assert (await world.enforcer.observe())[SHARE].actual == {"memory": Quantity.parse("10Gi")}


async def test_unknown_device_is_permanent(world: World) -> None:
    with pytest.raises(PermanentEnforcementError, match="no known GPU UUID"):
        await world.enforcer.apply(limit(device="gpu-7"))
    assert world.calls() == []


async def test_gpu_unknown_to_the_driver_is_permanent_and_cleaned_up(world: World) -> None:
    world.monkeypatch.setenv("FAKE_MPS_GPUS", UUID_1)
    with pytest.raises(PermanentEnforcementError, match="refused"):
        await world.enforcer.apply(limit())
    assert not world.cdi.path_of(SHARE).exists()
    assert not (world.root / SHARE).exists()  # daemon quit, dirs gone
    assert world.commands()[-1] == "quit"


async def test_refused_limit_is_permanent(world: World) -> None:
    world.mode("refuse-limit")
    with pytest.raises(PermanentEnforcementError, match="Invalid memory limit"):
        await world.enforcer.apply(limit())
    assert not world.cdi.path_of(SHARE).exists()


async def test_wrong_read_back_is_permanent(world: World) -> None:
    world.mode("wrong-readback")
    with pytest.raises(PermanentEnforcementError, match="reads back '5120M'"):
        await world.enforcer.apply(limit())
    assert not world.cdi.path_of(SHARE).exists()


async def test_daemon_that_fails_to_start_is_retryable(world: World) -> None:
    world.mode("start-fails")
    with pytest.raises(RetryableEnforcementError, match="already running"):
        await world.enforcer.apply(limit())
    assert not world.cdi.path_of(SHARE).exists()


async def test_daemon_still_starting_is_retryable_then_succeeds(world: World) -> None:
    world.mode("never-ready")
    with pytest.raises(RetryableEnforcementError, match="still starting"):
        await world.enforcer.apply(limit())
    assert not world.cdi.path_of(SHARE).exists()
    world.kill_daemons()
    world.mode()
    assert (await world.enforcer.apply(limit())).level == "hard"


async def test_busy_daemon_is_retryable(world: World) -> None:
    await world.enforcer.apply(limit())
    world.mode("busy")
    world.enforcer.settings = MpsSettings(
        root=world.root, control_binary=str(FAKE), command_timeout_s=0.3, poll_interval_s=0.01
    )
    with pytest.raises(RetryableEnforcementError, match="timed out"):
        await world.enforcer.apply(limit())


async def test_missing_control_binary_is_retryable(world: World, tmp_path: Path) -> None:
    world.enforcer.settings = MpsSettings(root=world.root, control_binary=str(tmp_path / "none"))
    with pytest.raises(RetryableEnforcementError, match="cannot run"):
        await world.enforcer.apply(limit())


async def test_changed_limit_with_clients_connected_is_permanent(world: World) -> None:
    await world.enforcer.apply(limit("10Gi"))
    world.monkeypatch.setenv("FAKE_MPS_SERVERS", "4242")
    with pytest.raises(PermanentEnforcementError, match="already serves clients"):
        await world.enforcer.apply(limit("5Gi"))


async def test_changed_limit_without_clients_is_set_again(world: World) -> None:
    await world.enforcer.apply(limit("10Gi"))
    applied = await world.enforcer.apply(limit("5Gi"))
    assert applied.actual == {"memory": Quantity.parse("5Gi")}
    assert f"set_default_device_pinned_mem_limit {UUID_0} 5120M" in world.commands()


@pytest.mark.parametrize(
    ("memory", "capacity", "match"),
    [("512Ki", "memory", "below 1Mi"), ("10Gi", "bandwidth", "no 'bandwidth' capacity")],
)
async def test_limits_that_cannot_be_expressed_are_permanent(
    world: World, memory: str, capacity: str, match: str
) -> None:
    world.enforcer.settings = MpsSettings(
        root=world.root, control_binary=str(FAKE), capacity=capacity
    )
    with pytest.raises(PermanentEnforcementError, match=match):
        await world.enforcer.apply(limit(memory))
    assert world.calls() == []


async def test_unsafe_share_id_is_refused(world: World) -> None:
    with pytest.raises(PermanentEnforcementError, match="not a valid CDI device name"):
        await world.enforcer.apply(limit(share_id="../../etc"))


def test_bad_gpu_uuid_is_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a GPU UUID"):
        MpsEnforcer({"gpu-0": "GPU-x\nquit"}, cdi=CdiSpecs(tmp_path))


@pytest.mark.parametrize(
    ("reply", "proved"),
    [
        ("10240M\n", (10240, 10240)),
        ("3G", (3072, 4095)),
        ("0", None),
        ("", None),
        ("1024 MB", None),
        ("1.5G", None),
        ("1024m", None),
        ("10G\n10G", None),
    ],
)
def test_read_back_grammar_is_strict(reply: str, proved: tuple[int, int] | None) -> None:
    assert parse_limit_reply(reply) == proved


def test_mib_never_exceeds_the_share() -> None:
    for text in ["1Mi", "1048577", "10Gi", "1.5Gi", "999999999"]:
        q = Quantity.parse(text)
        mib = mib_of(limit(text))
        assert mib * 2**20 <= q.nanos // 10**9 < (mib + 1) * 2**20
