"""``benchmarks.stopping.run``: a benchmark stopped by Ctrl-C or SIGTERM stops what it
started (its ``finally`` blocks run), then ends with one line and status 130."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

from tests.fixtures.polling import until
from tests.fixtures.procstat import alive, interruptible, reaped

ROOT = Path(__file__).resolve().parents[2]

# a "benchmark" that starts a child process, says so, and waits; its finally stops it
BENCHMARK = """
import asyncio, sys
from benchmarks import stopping

async def main():
    child = await asyncio.create_subprocess_exec("sleep", "600")
    try:
        print(child.pid, flush=True)
        await asyncio.sleep(600)
    finally:
        child.kill()
        await child.wait()

stopping.run("toy", main())
"""


@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
async def test_a_stopped_benchmark_stops_what_it_started_and_says_so_in_one_line(
    sent: signal.Signals,
) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        BENCHMARK,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=interruptible,
    )
    async with reaped(process):
        assert process.stdout is not None
        async with asyncio.timeout(60):
            child = int(await process.stdout.readline())
        assert alive(child)
        process.send_signal(sent)
        async with asyncio.timeout(60):
            _, err = await process.communicate()
    assert process.returncode == 130
    assert err.decode() == "toy: interrupted; what it started is stopped\n"
    await until(lambda: not alive(child), within=10, what="the child's end")
