"""``dracap up`` looks after its embedded servers: killed, restarted, the tour works again.

Each test runs ``dracap up`` as a user does — a subprocess with no server URLs in its
environment, so it starts its own PostgreSQL and nats-server under a temporary data
directory — and kills one of those servers with SIGKILL. ``dracap up`` must start it
again (or, with restarts off, exit with status 1 and one line), serve the tour again
within 30 s using the commands its banner printed, say what is down on ``/readyz``
meanwhile, and keep its log short: one line per change of state, no tracebacks.

Nothing here sleeps for a fixed time: every step waits for a condition (a line in the
log, an HTTP answer, a command that succeeds), with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from services.commands.up import READY_LINE
from services.runtime.ops.embedded import free_port
from tests.fixtures.procstat import niceness

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"
START_S = 90.0  # initdb and two servers on a loaded 2-core machine
RECOVER_S = 30.0  # the bound: back to serving, or exited, within 30 s
#: The log written from a kill until recovery stays under this (today: about 1 KB;
#: before supervision, reconnect tracebacks came at about 2 KB/s without end).
QUIET_LOG_BYTES = 4096
#: A claim of its own for a second tour (the example claims are applied by the first).
EXTRA_CLAIM = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: after-restart, namespace: tenant-a}
spec:
  devices:
    requests:
      - name: gpu
        exactly:
          deviceClassName: gpu-memory.dracap.io
          capacity: {requests: {memory: 5Gi}}
"""

T = TypeVar("T")


def _eventually(check: Callable[[], T | None], within: float, what: str) -> T:
    """Poll ``check`` until it returns something other than None (or False)."""
    deadline = time.monotonic() + within
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within:.0f} s: {what}")
        time.sleep(0.1)


def _metrics_port() -> int:
    """A port for ``--metrics-port`` with the ledger process's (+2) free too, below the
    kernel's ephemeral range (``free_port``): a client connection (every pool
    reconnecting after a server restart) could otherwise take the ledger's port before
    its restarted process binds it again (CI saw "Address already in use")."""
    return free_port(also=(2,))


class Up:
    """``dracap up`` on embedded servers in ``data_dir``; its output goes to a file."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.data_dir = tmp_path / "dracap"
        self.log = tmp_path / "up.log"
        self.metrics_port = _metrics_port()
        command = [sys.executable, "-m", "services.cli", "up", "--data-dir", str(self.data_dir)]
        command += ["--inventory", str(EXAMPLES), "--metrics-port", str(self.metrics_port)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DRACAP_")}
        env["PYTHONUNBUFFERED"] = "1"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [*command, *extra], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def text(self, since: int = 0) -> str:
        with self.log.open("rb") as handle:
            handle.seek(since)
            return handle.read().decode(errors="replace")

    def size(self) -> int:
        return self.log.stat().st_size

    def wait_ready(self) -> str:
        """The banner, once ``dracap up`` printed its ready line."""

        def ready() -> str | None:
            assert self.process.poll() is None, f"dracap up exited:\n{self.text()}"
            text = self.text()
            return text if f"\n{READY_LINE}" in text else None

        return _eventually(ready, START_S, "dracap up prints its ready line")

    def hint(self, banner: str, words: str) -> list[str]:
        """The command of the banner's hint that contains ``words``, as argv."""
        [line] = [line for line in banner.splitlines() if words in line]
        return shlex.split(line)

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        """GET ``path`` of the metrics port: status and JSON body."""
        url = f"http://127.0.0.1:{self.metrics_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def metric(self, sample: str) -> float | None:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(sample + " "):
                    return float(line.split()[-1])
        return None

    def kill(self, server: str) -> None:
        """SIGKILL the embedded ``postgres`` (its postmaster) or ``nats`` server."""
        if server == "nats":
            pid = int((self.data_dir / "nats.pid").read_text())
        else:
            pid = int((self.data_dir / "postgres" / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """SIGINT; a ``dracap up`` that does not stop is killed, and its servers with it."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            for server in ("nats", "postgres"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    self.kill(server)


@pytest.fixture
def up_factory(tmp_path: Path) -> Iterator[Callable[..., Up]]:
    started: list[Up] = []

    def start(*extra: str) -> Up:
        up = Up(tmp_path, *extra)
        started.append(up)
        return up

    yield start
    for up in started:
        up.stop()


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRACAP_")}
    return subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RECOVER_S, check=False
    )


def _tour(up: Up, banner: str, manifest: Path | None = None) -> str:
    """Apply claims with the banner's own ``claim apply`` hint until they are all ready."""
    argv = [*up.hint(banner, "claim apply"), "--timeout", "10"]
    if manifest is not None:
        argv[argv.index("-f") + 1] = str(manifest)

    def applied() -> str | None:
        try:
            done = _run(argv)
        except subprocess.TimeoutExpired:
            return None
        return done.stdout if done.returncode == 0 and "ready" in done.stdout else None

    return _eventually(applied, RECOVER_S, f"{shlex.join(argv)} succeeds")


def _ready(up: Up) -> None:
    _eventually(lambda: up.get("/readyz")[0] == 200, RECOVER_S, "/readyz says 200")


def _assert_quiet(log: str, check: str, max_bytes: int = QUIET_LOG_BYTES) -> None:
    """No tracebacks, a short log; each change of the check's state said once by
    ``dracap up`` (its ledger process, whose lines carry ``[ledger]``, has checks of
    its own and says them in its own time)."""
    assert "Traceback" not in log, log
    assert len(log.encode()) < max_bytes, log
    own = "\n".join(line for line in log.splitlines() if " [ledger] " not in line)
    downs, ups = own.count(f"{check} is down:"), own.count(f"{check} is up again")
    assert downs >= 1 and downs == ups, log


@pytest.mark.parametrize("server", ["nats", "postgres"])
def test_a_killed_server_is_restarted_and_the_tour_works_again(
    up_factory: Callable[..., Up], tmp_path: Path, server: str
) -> None:
    up = up_factory()
    banner = up.wait_ready()
    _tour(up, banner)  # the example claims, through the printed hint
    _ready(up)
    mark = up.size()

    up.kill(server)
    manifest = tmp_path / "extra.yaml"
    manifest.write_text(EXTRA_CLAIM)
    out = _tour(up, banner, manifest)
    assert "after-restart" in out and "ready" in out

    _ready(up)
    assert up.process.poll() is None
    log = up.text(mark)
    _assert_quiet(log, server)
    assert f"embedded {server}: " in log and "restarting it" in log
    restarts = f'dracap_embedded_server_restarts_total{{server="{server}"}}'
    assert up.metric(restarts) == 1.0


def test_readyz_names_a_dead_server_until_it_runs_again(
    up_factory: Callable[..., Up], tmp_path: Path
) -> None:
    up = up_factory("--max-server-restarts", "50")
    banner = up.wait_ready()
    _ready(up)
    # PostgreSQL reads its configuration only when it starts: a broken line keeps the
    # running server as it is, and makes every restart fail until it is taken out.
    config = up.data_dir / "postgres" / "postgresql.auto.conf"
    original = config.read_text()
    config.write_text(original + "\nthis is not a setting\n")
    mark = up.size()
    up.kill("postgres")

    def down() -> dict[str, Any] | None:
        status, body = up.get("/readyz")
        return body if status == 503 and "postgres" in body["down"] else None

    body = _eventually(down, RECOVER_S, "/readyz says 503 naming postgres")
    assert body["ready"] is False and body["checks"]["postgres"]["reason"]
    assert body["checks"]["nats"]["up"] is True
    _eventually(lambda: "did not start again" in up.text(mark), RECOVER_S, "a restart fails")
    status, live = up.get("/healthz")
    assert status == 200 and live["alive"] is True and "postgres" in live["supervising"]
    assert down() is not None  # still down: every restart fails

    config.write_text(original)
    _ready(up)
    manifest = tmp_path / "extra.yaml"
    manifest.write_text(EXTRA_CLAIM)
    _tour(up, banner, manifest)
    log = up.text(mark)
    _assert_quiet(log, "postgres", max_bytes=4 * QUIET_LOG_BYTES)  # a line per failed start
    assert log.count("embedded postgres: running again") == 1


def test_with_restarts_off_a_dead_server_ends_it_with_one_line(
    up_factory: Callable[..., Up],
) -> None:
    up = up_factory("--max-server-restarts", "0")
    up.wait_ready()
    mark = up.size()
    up.kill("nats")
    try:
        code = up.process.wait(RECOVER_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"dracap up still runs:\n{up.text(mark)}") from None
    log = up.text(mark)
    assert code == 1, log
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, log
    assert "embedded nats: killed by SIGKILL" in errors[0] and "restarts are off" in errors[0]
    assert "Traceback" not in log
    assert not (up.data_dir / "postgres" / "postmaster.pid").exists()  # stopped cleanly


def _ledger_pids(data_dir: Path) -> list[int]:
    """The ``dracap serve ledger`` processes of the ``dracap up`` on ``data_dir``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            words = (entry / "cmdline").read_bytes().split(b"\0")
            if b"ledger" in words and str(data_dir).encode() in words:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] != "Z":
                    found.append(int(entry.name))
    return found


def _environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_audit_and_billing_run_as_a_process_of_their_own_with_the_ledger_login(
    up_factory: Callable[..., Up], tmp_path: Path
) -> None:
    up = up_factory()
    banner = up.wait_ready()
    assert "audit and billing in a process of their own" in banner
    [pid] = _eventually(lambda: _ledger_pids(up.data_dir), RECOVER_S, "the ledger process runs")
    assert os.getpgid(pid) != os.getpgid(up.process.pid)  # Ctrl-C reaches dracap up only
    assert niceness(pid) > niceness(up.process.pid)  # claims first, the ledger after
    # its logins: the ledger's own, in its environment; no secret on its command line
    env = _environment(pid)
    assert "dracap_ledger_login" in env["DRACAP_DATABASE_URL_LEDGER"]
    assert Path(env["DRACAP_NATS_CREDS"]).name == "service-ledger.nk"
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert b"postgresql://" not in cmdline and b".nk" not in cmdline
    _tour(up, banner)
    hint = up.hint(banner, "claim list")
    audit = [*hint[: hint.index("claim")], "audit", "--claim", "train-small"]
    audit += ["--data-dir", str(up.data_dir), "-o", "json"]

    def audited(decision: str) -> bool:
        done = _run(audit)
        return done.returncode == 0 and decision in done.stdout

    _eventually(lambda: audited("limit_applied"), RECOVER_S, "the audit has the tour")
    _ready(up)
    mark = up.size()

    os.kill(pid, signal.SIGKILL)  # started again; the audit answers again, and follows
    _eventually(lambda: _ledger_pids(up.data_dir) not in ([], [pid]), RECOVER_S, "a new one")
    _run([*up.hint(banner, "claim delete")])
    _eventually(lambda: audited("capacity_released"), RECOVER_S, "the audit follows the log")
    _ready(up)
    log = up.text(mark)
    assert "ledger exited (killed by SIGKILL); starting it again" in log, log
    assert "Traceback" not in log, log

    [again] = _ledger_pids(up.data_dir)
    up.process.send_signal(signal.SIGKILL)  # no orphan: the ledger stops with dracap up
    up.process.wait()
    _eventually(lambda: not _ledger_pids(up.data_dir), RECOVER_S, f"ledger {again} stops")
    for server in ("nats", "postgres"):  # the servers of a killed dracap up are its test's
        with contextlib.suppress(OSError, ValueError, IndexError):
            up.kill(server)
