"""``benchmarks/pipeline.py`` stopped by Ctrl-C or SIGTERM mid-run: one line, status
130, and nothing it started left behind (its ``dracap up``, its database).

A ``timeout`` around the benchmark sends SIGTERM; before, that ended the process at
once and left ``dracap up`` running and the run's database behind, and Ctrl-C ended it
with a traceback.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import asyncpg
import pytest

from tests.fixtures.polling import until
from tests.fixtures.procstat import alive, interruptible, reaped

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
async def test_an_interrupted_run_stops_dracap_up_and_drops_its_database(
    sent: signal.Signals, postgres_admin_url: str, nats_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "benchmarks.pipeline", "--admin-url", postgres_admin_url]
    command += ["--nats", nats_url, "--claims", "100", "--commits", "100", "--seconds", "600"]
    with out.open("w") as stdout:
        process = await asyncio.create_subprocess_exec(
            *command,
            cwd=ROOT,
            stdout=stdout,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=interruptible,
        )
    async with reaped(process):
        # the latency run at half the sustained rate lasts 600 s: it is in it that the
        # signal arrives
        await until(
            lambda: (
                "apply -> Ready, sustained" in out.read_text() or process.returncode is not None
            ),
            within=180,
            what="the sustained run",
        )
        if process.returncode is not None:  # it ended before the signal: say why
            assert process.stderr is not None
            why = (await process.stderr.read()).decode()
            pytest.fail(f"the benchmark ended early ({process.returncode}): {out.read_text()}{why}")
        database = out.read_text().split("\n", 1)[0].removeprefix("database ").rstrip(":")
        started = _children(process.pid)
        assert started, "dracap up runs as the benchmark's child"
        process.send_signal(sent)
        async with asyncio.timeout(120):
            _, stderr = await process.communicate()
    err = stderr.decode()
    assert process.returncode == 130, err
    assert err == "pipeline: interrupted; what it started is stopped\n"
    await until(lambda: not any(alive(pid) for pid in started), within=30, what="dracap up's end")
    connection = await asyncpg.connect(postgres_admin_url)
    try:
        left = await connection.fetchval(
            "SELECT count(*) FROM pg_database WHERE datname = $1", database
        )
    finally:
        await connection.close()
    assert database.startswith("dracap_bench_") and left == 0
