"""``dracap claim ...`` / ``dracap devices`` against the real services, and ``dracap up``.

The first tests start the whole stack in-process (:class:`services.up.Stack`) on the
test's own database and a unique subject prefix, load the example inventory through
the admin API, and drive it only through ``services.cli.main`` — as a user would.
The last one runs ``dracap up`` as a subprocess with no server URLs at all (embedded
servers under a temporary data directory), stops it with SIGINT and starts it again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from events.subjects import BusNames
from services import cli
from services.claims.command import ApiClient
from services.runtime.bus import connect_bus
from services.runtime.settings import Settings
from services.up import READY_LINE, Stack, load_inventory, read_inventory

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"

TRAIN_SMALL = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: train-small, namespace: tenant-a}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu-memory.dracap.io
          capacity: {requests: {memory: 10Gi}}
"""


@pytest.fixture
async def stack_flags(settings: Settings, nats_url: str) -> AsyncIterator[list[str]]:
    """The stack running in-process; yields the CLI flags that reach it."""
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:10]}")
    inventory = read_inventory([str(EXAMPLES)])
    async with Stack.running(
        msgspec.structs.replace(settings, nats_url=nats_url),
        names,
        nodes=inventory.nodes,
        workers=2,
    ):
        async with ApiClient.connect(nats_url, names.prefix) as api:
            assert await load_inventory(api, inventory) == len(inventory.slices)
            assert await load_inventory(api, inventory) == 0  # already loaded
        yield ["--nats", nats_url, "--prefix", names.prefix]
    nc, js = await connect_bus(nats_url)  # the test's stream goes with it
    try:
        await js.delete_stream(names.stream)
    finally:
        await nc.close()


async def dracap(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Run ``dracap ARGV`` (in a thread: the CLI runs its own event loop)."""
    capsys.readouterr()
    code = await asyncio.to_thread(cli.main, list(argv))
    return code, capsys.readouterr().out


def _gpu0(devices: list[dict[str, Any]]) -> dict[str, Any]:
    found = [d for d in devices if d["pool"] == "node-a-gpus" and d["device"] == "gpu-0"]
    assert len(found) == 1, devices
    return found[0]


async def test_apply_get_delete_gives_capacity_back(
    stack_flags: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    manifest = tmp_path / "claim.yaml"
    manifest.write_text(TRAIN_SMALL)
    code, out = await dracap(capsys, "claim", "apply", "-f", str(manifest), "--wait", *stack_flags)
    assert code == 0, out
    assert "ready" in out

    code, out = await dracap(
        capsys, "claim", "get", "train-small", "-n", "tenant-a", "-o", "json", *stack_flags
    )
    assert code == 0
    view = json.loads(out)
    assert view["phase"] == "ready" and view["ready"] is True
    [share] = view["shares"]
    assert share["share_id"] and share["consumed"] == {"memory": "10Gi"}

    code, out = await dracap(capsys, "claim", "get", "train-small", "-n", "tenant-a", *stack_flags)
    assert code == 0 and share["share_id"] in out and "memory=10Gi" in out

    code, out = await dracap(capsys, "devices", "-o", "json", *stack_flags)
    assert code == 0
    assert _gpu0(json.loads(out))["capacity"]["memory"]["consumed"] == "10Gi"

    code, out = await dracap(
        capsys, "claim", "delete", "train-small", "-n", "tenant-a", *stack_flags
    )
    assert code == 0, out
    deadline = time.monotonic() + 10
    while True:
        code, out = await dracap(capsys, "devices", "-o", "json", *stack_flags)
        memory = _gpu0(json.loads(out))["capacity"]["memory"]
        if memory["consumed"] in ("0", "0Gi") or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert memory["consumed"] in ("0", "0Gi") and memory["free"] == memory["total"]

    code, out = await dracap(capsys, "devices", *stack_flags)
    assert code == 0 and "node-a-gpus/gpu-0" in out and "memory" in out


async def test_exit_codes(
    stack_flags: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _ = await dracap(capsys, "claim", "get", "nope", "-n", "tenant-a", *stack_flags)
    assert code == cli.EXIT_NOT_FOUND
    code, _ = await dracap(capsys, "claim", "delete", "nope", "-n", "tenant-a", *stack_flags)
    assert code == cli.EXIT_NOT_FOUND

    outsider = tmp_path / "outsider.yaml"  # a namespace without access to any class
    outsider.write_text(TRAIN_SMALL.replace("tenant-a", "tenant-z"))
    code, out = await dracap(capsys, "claim", "apply", "-f", str(outsider), *stack_flags)
    assert code == cli.EXIT_REJECTED, out

    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: ResourceClaim\nmetadata: [")
    code, _ = await dracap(capsys, "claim", "apply", "-f", str(broken), *stack_flags)
    assert code == cli.EXIT_BAD_INPUT


async def test_list_and_watch(
    stack_flags: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    manifest = tmp_path / "claim.yaml"
    manifest.write_text(TRAIN_SMALL)
    code, _ = await dracap(capsys, "claim", "apply", "-f", str(manifest), "--wait", *stack_flags)
    assert code == 0
    code, out = await dracap(capsys, "claim", "list", "-n", "tenant-a", "-o", "yaml", *stack_flags)
    assert code == 0 and "name: train-small" in out
    watch = ("claim", "watch", "train-small", "-n", "tenant-a", "-o", "json", "--timeout", "0.5")
    code, out = await dracap(capsys, *watch, *stack_flags)
    assert code == 0
    assert json.loads(out.splitlines()[0])["phase"] == "ready"


# --- dracap up as a user runs it ----------------------------------------------------------


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRACAP_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start_up(data_dir: Path) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "services.cli", "up", "--data-dir", str(data_dir)]
    command += ["--inventory", str(EXAMPLES), "--metrics-port", "0"]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_ready(process: subprocess.Popen[str], timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(READY_LINE):
            return lines
    process.kill()
    raise AssertionError("dracap up did not get ready:\n" + "".join(lines))


def _stop(process: subprocess.Popen[str]) -> str:
    process.send_signal(signal.SIGINT)
    try:
        rest, _ = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 0, rest
    return rest


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *argv],
        cwd=ROOT,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_dracap_up_stops_cleanly_and_resumes(tmp_path: Path) -> None:
    data_dir = tmp_path / "dracap"
    manifest = tmp_path / "claim.yaml"
    manifest.write_text(TRAIN_SMALL)

    process = _start_up(data_dir)
    try:
        lines = _wait_for_ready(process, 45)
        assert any("inventory:" in line and "loaded" in line for line in lines)
        connection = json.loads((data_dir / "connection.json").read_text())
        assert connection["nats_url"].startswith("nats://127.0.0.1:")
        applied = _cli("claim", "apply", "-f", str(manifest), "--wait", "--data-dir", str(data_dir))
        assert applied.returncode == 0, applied.stderr + applied.stdout
    finally:
        rest = _stop(process)
    assert "stopped" in rest
    assert not (data_dir / "postgres" / "postmaster.pid").exists()

    process = _start_up(data_dir)
    try:
        lines = _wait_for_ready(process, 45)
        assert any("inventory: already loaded" in line for line in lines)
        got = _cli(
            "claim",
            "get",
            "train-small",
            "-n",
            "tenant-a",
            "-o",
            "json",
            "--data-dir",
            str(data_dir),
        )
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["phase"] == "ready"
    finally:
        _stop(process)
