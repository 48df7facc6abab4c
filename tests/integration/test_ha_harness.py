"""The fault harness passes a short schedule: one fault of each kind (issue 29, item 4).

``benchmarks/ha.py`` runs as an operator would run it, as its own process, with one
round (``--rounds 1``): a nats-server killed and one paused, one replica of every
service killed and one paused, the PostgreSQL primary killed (the standby promoted)
and one paused, under a claim workload. It must exit 0 — every acknowledged apply and
delete in the log, no device over its total, ``replay verify`` clean, every claim in its
end state after each fault and at the end — and name each fault kind once. Its timings
are the benchmark's to report (docs/operations.md), not this test's to assert.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from benchmarks.ha import KINDS
from tests.fixtures.replicas import nats_binary, postgres_binaries

ROOT = Path(__file__).resolve().parents[2]
#: the harness bounds each of its own waits; this only keeps a hung run from hanging CI
RUN_S = 600

pytestmark = pytest.mark.skipif(
    nats_binary() is None or postgres_binaries() is None,
    reason="no nats-server binary or no PostgreSQL server binaries (initdb, pg_basebackup)",
)


async def test_the_harness_passes_one_fault_of_each_kind() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRACAP_")}
    argv = ["-m", "benchmarks.ha", "--rounds", "1", "--gap", "1", "--hold", "2"]
    done = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(RUN_S):
            out, _ = await done.communicate()
    finally:
        if done.returncode is None:
            done.terminate()  # it stops every process and server it started
            await done.wait()
    text = out.decode(errors="replace")
    assert done.returncode == 0, text
    assert text.rstrip().endswith("PASS"), text
    faults = [line.split()[0] for line in text.splitlines() if "converged after" in line]
    assert faults == list(KINDS), text
