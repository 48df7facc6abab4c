"""The service event loop: uvloop unless told otherwise."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import uvloop

from services.runtime.ground import eventloop


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_services_run_on_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DRACAP_EVENT_LOOP", raising=False)
    assert eventloop.loop_name() == "uvloop"
    assert issubclass(eventloop.run(_loop_type()), uvloop.Loop)


def test_the_standard_loop_can_be_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRACAP_EVENT_LOOP", "asyncio")
    assert eventloop.loop_name() == "asyncio"
    assert not issubclass(eventloop.run(_loop_type()), uvloop.Loop)


_SIGTERMED = """
import asyncio, os, signal, sys
from services.runtime.ground.eventloop import cancel_on_sigterm

async def main():
    cancel_on_sigterm()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(60)
    finally:
        open(sys.argv[1], "w").write("stopped what it started")

try:
    asyncio.run(main())
except asyncio.CancelledError:
    sys.exit(3)
"""


def test_sigterm_cancels_a_run_so_its_finally_blocks_run(tmp_path: Path) -> None:
    done = tmp_path / "done"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", _SIGTERMED, str(done)], cwd=root, timeout=60, check=False
    )
    assert result.returncode == 3, "SIGTERM's default action ended the process at once"
    assert done.read_text() == "stopped what it started"
