"""``benchmarks.pipeline --stages``: each step of a claim from the log's rows."""

from __future__ import annotations

import asyncio
import collections
import datetime
import gc
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from benchmarks import pipeline
from benchmarks.memory import resident_bytes, up_resident_bytes
from benchmarks.pipeline import (
    DRIVER,
    Appends,
    ForkWatch,
    ReadyTracker,
    RunError,
    appends_of,
    busy,
    claim,
    cli,
    cpu_by_process,
    cpu_split,
    ledger_cpu_seconds,
    ledger_pid,
    machine_cpu_seconds,
    quiet,
    split_cells,
    stalls_are_run_errors,
    steps_of,
    write_inventory,
    write_timeline,
)
from services.runtime.bus.endpoints import ServerUnavailable
from services.runtime.ops.embedded import free_port
from tests.fixtures.polling import until


def _at(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(1_000 + seconds, datetime.UTC)


def test_each_step_is_timed_from_the_one_before() -> None:
    tracker = ReadyTracker()
    tracker.wall_offset = 1_000.0
    tracker.sent, tracker.ready = {"a": 0.0, "other": 0.0}, {"a": 0.100, "other": 0.5}
    rows = [
        ("claims.submitted", "claim:bench/a", None, None, _at(0.010)),
        ("claims.admitted", "claim:bench/a", "a", None, _at(0.010)),
        # two shares: the first reservation counts, and the last limit (the one waited for)
        ("reservation.capacity_reserved", "device:d/p/0", "a", "s1", _at(0.030)),
        ("reservation.capacity_reserved", "device:d/p/1", "a", "s2", _at(0.030)),
        ("reservation.allocation_bound", "claim:bench/a", "a", None, _at(0.030)),
        ("enforcement.limit_applied", "share:s2", None, "s2", _at(0.080)),
        ("enforcement.limit_applied", "share:s1", None, "s1", _at(0.060)),
        ("enforcement.limit_applied", "share:zz", None, "zz", _at(0.090)),  # not a's
        ("claims.admitted", "claim:bench/b", "b", None, _at(0.020)),  # not asked for
    ]
    steps = steps_of(rows, tracker, {"a"})
    expected = {
        "submitted": 10.0,
        "admitted": 0.0,
        "capacity_reserved": 20.0,
        "allocation_bound": 0.0,
        "limit_applied": 50.0,
        "ready": 20.0,
    }
    assert steps == {k: [pytest.approx(v, abs=1e-6)] for k, v in expected.items()}


def test_the_timeline_has_a_row_per_claim_in_the_order_sent(tmp_path: Path) -> None:
    tracker = ReadyTracker()
    tracker.wall_offset = 1_000.0
    tracker.sent = {"lat-1": 0.2, "live0--7": 0.1, "tp-3": 0.3}
    tracker.ready = {"lat-1": 0.25, "live0--7": 0.15}
    path = tmp_path / "timeline.csv"
    write_timeline(path, tracker)
    assert path.read_text().splitlines() == [
        "run,sent_unix_s,latency_ms",
        "live0,1000.1000,50.00",
        "lat,1000.2000,50.00",
        "tp,1000.3000,",  # never ready
    ]


def test_the_machines_cpu_counts_this_process_busy_time() -> None:
    """``machine_cpu_seconds`` (the bound printed after the sustained run) counts every
    process's busy time: at least what this one spent between two reads."""
    machine, own = machine_cpu_seconds(), time.process_time()
    while time.process_time() - own < 0.3:
        pass
    spent = time.process_time() - own
    assert machine_cpu_seconds() - machine >= spent - 0.05  # (clock ticks of 10 ms)


def test_the_ledger_process_is_found_among_the_children_and_its_cpu_counted() -> None:
    """``ledger_cpu_seconds`` reads the child ``dracap serve ledger`` of a ``dracap up``:
    a child with those words that spent CPU counts it; a process without one is 0."""
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    child = subprocess.run(  # ends before the read: not a child any more, nothing found
        [sys.executable, "-c", busy, "serve", "ledger"], check=True
    )
    assert child.returncode == 0 and ledger_cpu_seconds(os.getpid()) == 0.0
    code = f"{busy}\nimport sys\nsys.stdout.write('done\\n'); sys.stdout.flush()\ntime.sleep(60)"
    with subprocess.Popen(
        [sys.executable, "-c", code, "serve", "ledger"], stdout=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None and process.stdout.readline() == "done\n"
            assert ledger_cpu_seconds(os.getpid()) >= 0.25
            assert ledger_cpu_seconds(process.pid) == 0.0  # it has no such child
            # the memory benchmark counts it beside the parent, and nothing without it
            own, ledger = up_resident_bytes(os.getpid())
            assert own > 0 and ledger == resident_bytes(process.pid) > 0  # it sleeps: steady
            assert up_resident_bytes(process.pid)[1] == 0
        finally:
            process.kill()


def test_the_cpu_split_charges_each_child_to_its_group_and_counts_a_new_one_whole() -> None:
    """``cpu_by_process`` / ``cpu_split``: a child ``serve ledger`` of ``up`` is the
    ledger's, any other child is ``up``'s (a forked encoder), born between the two
    readings it counts whole; ``bench`` is this process only when it is not ``up``."""
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    code = f"{busy}\nimport sys\nsys.stdout.write('done\\n'); sys.stdout.flush()\ntime.sleep(60)"
    before = cpu_by_process(os.getpid())
    assert before[os.getpid()][0] == "up"
    # another process as `up` (not pid 1: a run started detached has init as its parent,
    # and a child of `up` is `up`'s)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as other:
        try:
            assert cpu_by_process(other.pid)[os.getpid()][0] == "bench"
        finally:
            other.kill()
    children = [
        subprocess.Popen([sys.executable, "-c", code, *words], stdout=subprocess.PIPE, text=True)
        for words in (("serve", "ledger"), ("encode",))
    ]
    with children[0], children[1]:
        try:
            for child in children:
                assert child.stdout is not None and child.stdout.readline() == "done\n"
            after = cpu_by_process(os.getpid())
            assert [after[child.pid][0] for child in children] == ["ledger", "up"]
            split = cpu_split(before, after)
            assert split["ledger"] >= 0.25 and split["up"] >= 0.25
            assert all(cpu >= 0.0 for cpu in split.values())
            # seen by both readings, a child counts only what it spent between them
            assert cpu_split(after, cpu_by_process(os.getpid()))["ledger"] < 0.25
        finally:
            for child in children:
                child.kill()


def test_a_child_reaped_between_the_readings_counts_what_it_spent_between_them() -> None:
    """A snapshot encoder alive at the first reading that ends before the second: its
    time is in ``up``'s children's time then, and only its part after the first reading
    counts (before: lost altogether)."""
    burn = (
        "import sys, time\ndef burn():\n    t = time.process_time()\n"
        "    while time.process_time() - t < 0.3: pass\n"
    )
    code = f"{burn}burn()\nprint('done', flush=True)\nsys.stdin.readline()\nburn()"
    child = subprocess.Popen(
        [sys.executable, "-c", code, "encode"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    with child:
        try:
            assert child.stdout is not None and child.stdout.readline() == "done\n"
            before = cpu_by_process(os.getpid())
            assert before[child.pid][0] == "up" and before[child.pid][1] >= 0.25
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.wait() == 0
            after = cpu_by_process(os.getpid())
            assert child.pid not in after
            assert 0.25 <= cpu_split(before, after)["up"] < 0.55
        finally:
            child.kill()


def test_a_split_is_printed_as_milliseconds_per_claim_in_its_groups_order() -> None:
    assert split_cells({"up": 0.5, "ledger": 0.0125}, 100) == "up 5.000, ledger 0.125"


def test_the_machine_is_said_busy_in_the_share_of_its_cores_the_split_kept_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    # 1.5 s of CPU in every group together over 1 s of two cores: three quarters busy
    assert busy({"up": 0.75, "postgres": 0.5, "nats": 0.25}, 1.0) == "; the machine 75 % busy"
    assert busy({"up": 4.0}, 2.0) == "; the machine 100 % busy"
    assert busy({"up": 1.0}, 0.0) == ""  # no wall time measured: nothing said


def test_the_fork_watch_sees_a_forked_child_and_names_the_runs_it_was_in() -> None:
    watch = ForkWatch(os.getpid())
    assert not watch.forked()  # no child of this process carries its command line
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():  # 3.12+: forking a process with threads (none here)
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:  # a forked child, as the snapshot encoder: wait for the parent's word
        os.close(write_fd)
        os.read(read_fd, 1)
        os._exit(0)
    os.close(read_fd)
    try:
        assert watch.forked()
        watch.seen.append(time.time())
    finally:
        os.close(write_fd)
        os.waitpid(child, 0)
    assert not watch.forked()
    seen = watch.seen[0]
    runs = {
        "before": (seen - 2, seen - 1),
        "during": (seen - 1, seen + 1),
        "after": (seen + 1, seen + 2),
    }
    assert watch.during(runs) == ("during",)


async def test_quiet_waits_for_a_busy_process_and_not_for_an_idle_one() -> None:
    busy = await asyncio.create_subprocess_exec(sys.executable, "-c", "while True: pass")
    idle = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
    try:
        assert await quiet(idle.pid, None, limit_s=30.0)
        assert not await quiet(busy.pid, None, limit_s=1.0)
    finally:
        for process in (busy, idle):
            process.kill()
            await process.wait()


def test_a_server_it_cannot_reach_ends_the_run_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    thresholds = gc.get_threshold()
    try:  # port 1: nothing listens, the connection is refused at once
        status = cli(["--admin-url", "postgresql://postgres@127.0.0.1:1/postgres"])
    finally:  # the benchmark tunes the collector for its own process
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    err = capsys.readouterr().err
    assert status == 1
    assert err.startswith("pipeline: PostgreSQL at postgresql://postgres@127.0.0.1:1/postgres")
    assert "is it running?" in err and "--up-log" not in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("stop", [KeyboardInterrupt, asyncio.CancelledError])
def test_an_interrupted_run_ends_with_one_line_and_status_130(
    stop: type[BaseException], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C (``KeyboardInterrupt``) or SIGTERM (the run cancelled) mid-run: no traceback
    (``tests/integration/test_pipeline_interrupt.py`` runs it for real)."""

    async def interrupted(args: object) -> None:
        raise stop

    monkeypatch.setattr(pipeline, "main", interrupted)
    assert cli(["--admin-url", "postgresql://postgres@127.0.0.1:1/postgres"]) == 130
    assert capsys.readouterr().err == "pipeline: interrupted; what it started is stopped\n"


async def test_a_server_going_silent_while_dracap_up_runs_is_the_run_failing() -> None:
    with pytest.raises(RunError, match="no reply"):
        async with stalls_are_run_errors():
            raise ServerUnavailable("NATS at nats://127.0.0.1:4222: no reply within 10.0s")


async def test_quiet_waits_for_the_audit_and_billing_process_too() -> None:
    # An idle "dracap up" whose child "dracap serve ledger" is busy (starting, catching
    # up) is not quiet: a phase started then measures the child's start.
    parent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'while True: pass', 'serve', 'ledger'])\n"
        "time.sleep(60)",
    )
    try:
        await until(lambda: ledger_pid(parent.pid) is not None, what="the ledger child")
        assert not await quiet(parent.pid, None, limit_s=1.0)
    finally:
        child = ledger_pid(parent.pid)
        if child is not None:
            os.kill(child, signal.SIGKILL)
        parent.kill()
        await parent.wait()


def test_spread_gives_each_node_a_class_and_the_claims_every_class(tmp_path: Path) -> None:
    nodes = [f"node-{i}" for i in range(4)]
    documents = json.loads(write_inventory(tmp_path / "i.json", nodes, spread=True).read_text())
    classes = {d["metadata"]["name"] for d in documents["items"] if d["kind"] == "DeviceClass"}
    drivers = {
        d["spec"]["nodeName"]: d["spec"]["driver"]
        for d in documents["items"]
        if d["kind"] == "ResourceSlice"
    }
    assert len(set(drivers.values())) == 4 and set(drivers.values()) == classes
    asked = collections.Counter(
        json.loads(claim(f"lat-{i}", 4))["spec"]["devices"]["requests"][0]["exactly"][
            "deviceClassName"
        ]
        for i in range(400)
    )
    assert set(asked) == classes
    assert min(asked.values()) > 60  # about 100 each


def test_without_spread_every_node_and_claim_has_the_one_class(tmp_path: Path) -> None:
    nodes = [f"node-{i}" for i in range(4)]
    documents = json.loads(write_inventory(tmp_path / "i.json", nodes).read_text())
    classes = [d["metadata"]["name"] for d in documents["items"] if d["kind"] == "DeviceClass"]
    drivers = {d["spec"]["driver"] for d in documents["items"] if d["kind"] == "ResourceSlice"}
    assert classes == [DRIVER] and drivers == {DRIVER}
    request = json.loads(claim("lat-1"))["spec"]["devices"]["requests"][0]
    assert request["exactly"]["deviceClassName"] == DRIVER


async def test_the_appends_of_a_run_are_read_off_the_metrics_and_said_per_claim() -> None:
    registry = CollectorRegistry()
    appends = Histogram("dracap_log_append_duration_seconds", "appends", registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        before = await appends_of(port)
        for seconds in (0.002, 0.004, 0.006):
            appends.observe(seconds)
        after = await appends_of(port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert before == Appends(0.0, 0.0)
    assert after.count == 3 and after.seconds == pytest.approx(0.012)
    assert after.since(before, 2) == "log appends: 1.50 per claim, 4.00 ms each on average"
    gone = await appends_of(port)  # nobody answers: nothing counted, said so
    assert gone.since(before, 2) == "log appends: none counted"
