"""``dracap up``'s keeper of a child process (:mod:`services.runtime.ops.children`), with
real processes: a child that exits is started again and its trouble says why; stop is
SIGTERM, then SIGKILL past the grace period; a child stops with its parent, even one
killed with SIGKILL. Every wait is for a condition, with a deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from services.runtime.ground.waiting import wait_for
from services.runtime.ops.children import LOG_TAG_ENV, PARENT_PID_ENV, ChildService, log_tag
from tests.fixtures.procstat import alive, niceness

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 30.0
T = TypeVar("T")


async def _until(check: Callable[[], T | None], what: str) -> T:
    deadline = time.monotonic() + DEADLINE_S
    while not (result := check()):
        assert time.monotonic() < deadline, f"not within {DEADLINE_S:.0f} s: {what}"
        await asyncio.sleep(0.02)
    return result


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


async def test_a_child_that_exits_is_started_again_and_its_trouble_says_why(
    tmp_path: Path,
) -> None:
    runs = tmp_path / "runs"
    code = f"open({str(runs)!r}, 'a').write('x'); raise SystemExit(3)"
    child = ChildService("worker", _python(code), os.environ, first_delay_s=0.05)
    assert await child.trouble() == "worker is starting"
    stop = asyncio.Event()
    task = asyncio.create_task(child.run(stop))
    await _until(lambda: runs.exists() and len(runs.read_text()) >= 3, "three runs")
    # The third run has written but may not have exited yet: wait for its back-off.
    exited = "worker exited (status 3)"
    await _until(lambda: child.problem == exited, "the trouble names the exit")
    assert await child.trouble() == exited
    stop.set()
    await wait_for(task, DEADLINE_S)
    assert child.starts >= 3 and child.pid is None


async def test_a_running_child_is_healthy_and_stop_ends_it_with_sigterm(tmp_path: Path) -> None:
    said = tmp_path / "said"
    code = (
        "import signal, sys, time\n"
        f"def bye(*_): open({str(said)!r}, 'w').write('terminated'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        f"open({str(said)!r}, 'w').write('running')\n"
        "time.sleep(600)\n"
    )
    child = ChildService("worker", _python(code), os.environ)
    stop = asyncio.Event()
    task = asyncio.create_task(child.run(stop))
    await _until(lambda: said.exists() and said.read_text() == "running", "the child runs")
    pid = child.pid
    assert pid is not None and await child.trouble() is None
    assert os.getsid(pid) == pid  # a session of its own: the terminal's Ctrl-C is not its
    stop.set()
    await wait_for(task, DEADLINE_S)
    assert said.read_text() == "terminated" and not alive(pid)
    assert child.starts == 1


async def test_a_child_knows_the_name_its_log_lines_carry(tmp_path: Path) -> None:
    said = tmp_path / "said"
    code = (
        "from services.runtime.ops.children import log_tag\n"
        f"open({str(said)!r}, 'w').write(str(log_tag()))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = ChildService("ledger", _python(code), env, first_delay_s=30)
    stop = asyncio.Event()
    task = asyncio.create_task(child.run(stop))
    await _until(lambda: said.exists() and said.read_text(), "the child ran")
    stop.set()
    await wait_for(task, DEADLINE_S)
    assert said.read_text() == "ledger"


def test_a_tagged_log_line_names_the_child() -> None:
    code = (
        "import logging\n"
        "from services.runtime.ground.eventloop import log_to_stderr\n"
        "log_to_stderr('ledger')\n"
        "logging.getLogger('dracap.health').warning('postgres is down: gone')\n"
    )
    done = subprocess.run(
        _python(code), capture_output=True, text=True, cwd=ROOT, timeout=DEADLINE_S, check=True
    )
    assert " [ledger] dracap.health WARNING postgres is down: gone" in done.stderr
    assert log_tag({LOG_TAG_ENV: "ledger"}) == "ledger"
    assert log_tag({}) is None and log_tag({LOG_TAG_ENV: "a%(b)s"}) is None  # not a format


async def test_a_nicer_child_runs_at_a_lower_priority_than_its_parent(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = f"import time; open({str(ready)!r}, 'w').write('1'); time.sleep(600)"
    child = ChildService("subscriber", _python(code), os.environ, niceness=5)
    stop = asyncio.Event()
    task = asyncio.create_task(child.run(stop))
    await _until(ready.exists, "the child runs")
    assert child.pid is not None
    assert niceness(child.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 5)
    stop.set()
    await wait_for(task, DEADLINE_S)


async def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(
    tmp_path: Path,
) -> None:
    ready = tmp_path / "ready"
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(ready)!r}, 'w').write('1')\n"
        "time.sleep(600)\n"
    )
    child = ChildService("stubborn", _python(code), os.environ, grace_s=0.5)
    stop = asyncio.Event()
    task = asyncio.create_task(child.run(stop))
    await _until(ready.exists, "the child runs")
    pid = child.pid
    assert pid is not None
    stop.set()
    await wait_for(task, DEADLINE_S)
    assert not alive(pid)


async def test_a_child_that_cannot_start_says_so_and_is_tried_again(tmp_path: Path) -> None:
    child = ChildService("missing", [str(tmp_path / "no-such-program")], os.environ)
    child.first_delay_s = child.max_delay_s = 60.0  # only retry_now starts it again
    stop = asyncio.Event()
    task = asyncio.create_task(child.run(stop))
    reason = await _until(
        lambda: child.problem if "could not" in (child.problem or "") else None,
        "the failed start is reported",
    )
    assert reason.startswith("missing could not start (") and "No such file" in reason
    program = tmp_path / "no-such-program"
    program.write_text("#!/bin/sh\nexec sleep 600\n")
    program.chmod(0o755)
    child.retry_now()  # a health check passed again: no waiting out the back-off
    await _until(lambda: child.pid is not None, "the child runs after retry_now")
    stop.set()
    await wait_for(task, DEADLINE_S)


def test_a_child_stops_with_its_parent_killed_with_sigkill(tmp_path: Path) -> None:
    said = tmp_path / "said"
    child = (
        "import signal, sys, time\n"
        "from services.runtime.ops.children import stop_with_parent\n"
        f"def bye(*_): open({str(said)!r}, 'w').write('terminated'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "assert stop_with_parent()\n"
        f"open({str(said)!r}, 'w').write('running')\n"
        "time.sleep(600)\n"
    )
    parent = (
        "import os, subprocess, sys, time\n"
        f"env = dict(os.environ, {PARENT_PID_ENV}=str(os.getpid()))\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child!r}], env=env)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    process = subprocess.Popen(_python(parent), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        pid = int(process.stdout.readline())
        deadline = time.monotonic() + DEADLINE_S
        while not (said.exists() and said.read_text() == "running"):
            assert time.monotonic() < deadline, "the child never ran"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait()
        while alive(pid):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.02)
        assert said.read_text() == "terminated"  # SIGTERM: it drained, it was not killed
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def test_a_child_whose_parent_is_gone_before_it_asks_exits_at_once() -> None:
    code = (
        "import os\n"
        "from services.runtime.ops.children import stop_with_parent\n"
        f"print(stop_with_parent({{{PARENT_PID_ENV!r}: str(os.getppid() + 1)}}))\n"
    )
    done = subprocess.run(_python(code), cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
