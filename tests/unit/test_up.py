"""``dracap up``: hints that name dracap as it can be run here; services that wait out a
back-off restart at once when a server is back."""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import types
from pathlib import Path

import pytest

from events.subjects import BusNames
from services.commands import up
from services.commands.up import invocation
from services.stack import Stack, read_inventory
from tests.fixtures.polling import until


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``<tmp>/.venv/bin/dracap`` as the running console script, cwd ``<tmp>``."""
    path = tmp_path / ".venv" / "bin" / "dracap"
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(path), "up"])
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # no spec
    return path


def test_the_venv_script_when_dracap_is_not_on_path(
    script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert invocation() == ".venv/bin/dracap"


def test_plain_dracap_when_path_finds_this_script(
    script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}/nonexistent")
    assert invocation() == "dracap"


def test_another_dracap_on_path_is_not_this_one(
    script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "elsewhere" / "dracap"
    other.parent.mkdir()
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", str(other.parent))
    assert invocation() == ".venv/bin/dracap"


def test_a_script_outside_the_directory_is_named_by_its_absolute_path(
    script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "work dir"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert invocation() == shlex.quote(str(script))


def test_python_dash_m(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="services.cli")  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.chdir(tmp_path)
    python = tmp_path / "venv" / "bin" / "python"
    monkeypatch.setattr(sys, "executable", str(python))
    assert invocation() == "venv/bin/python -m services.cli"


async def test_a_recovery_ends_the_back_off_of_a_failed_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # without a recovery: no restart here
    monkeypatch.setattr("services.stack.RESTART_MIN_S", 3600.0)
    stack = Stack(store=None, nc=None, js=None, names=BusNames(prefix="t"))  # type: ignore[arg-type]
    runs: list[int] = []
    again = asyncio.Event()

    async def service() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise ConnectionRefusedError(111, "Connection refused")
        again.set()
        await stack.stop.wait()

    stack.spawn("relay", service)
    await until(lambda: "relay" in stack.failing)
    assert await stack.trouble() == (
        "relay restarting after ConnectionRefusedError: [Errno 111] Connection refused"
    )
    stack.retry_now("postgres")
    await asyncio.wait_for(again.wait(), 30)
    assert runs == [0, 1] and await stack.trouble() is None
    await stack.shutdown()


def test_agents_none_means_no_agent() -> None:
    inventory = read_inventory([str(Path(__file__).resolve().parents[2] / "deploy/examples")])
    assert inventory.nodes == ["node-a", "node-b"]
    assert up._nodes("none", inventory) == []
    assert up._nodes("auto", inventory) == ["node-a", "node-b"]
    assert up._nodes("node-a, node-b", inventory) == ["node-a", "node-b"]
