"""The fault harness's installation: replicated servers and two of every service, on loopback.

What ``benchmarks/ha.py`` throws faults at, built as a production installation is
(docs/operations.md, "Installing without `dracap up`" and "High availability"), with
the servers of :mod:`tests.fixtures.replicas`:

* ``dracap auth init`` writes the broker's accounts and every user's seed; three
  clustered nats-servers with JetStream include those accounts
  (:func:`~tests.fixtures.replicas.nats_cluster`);
* a PostgreSQL primary with a synchronous streaming standby
  (:func:`~tests.fixtures.replicas.postgres_pair`); ``dracap db upgrade`` and ``dracap
  db logins`` run with the pair's multi-host URL, so every service's own login URL names
  both servers (``target_session_attrs=read-write``);
* :data:`REPLICAS` processes of every service — relay (``--stream-replicas 3``), claims
  API, reservation, enforcement, reclamation, audit, billing, snapshot writer — each
  its own process with ``--data-dir``, so each logs in to NATS with its own credential
  and to PostgreSQL with its kind's login; one node agent per node (``--enforcer
  none``: NATS only, no database URL in its environment).

:class:`Topology` starts and stops all of it and applies faults to single processes
(:meth:`Topology.kill`, :meth:`Topology.pause`, :meth:`Topology.resume`, and
:meth:`Process.start` again) and, as a supervisor does, starts again a process that
ended on its own (:meth:`Topology.supervise`); faults to servers go through
:attr:`Topology.nats` and :attr:`Topology.pg`. Every process logs to
``<root>/logs/<name>-<replica>.log``, appended across restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import asyncpg

from services.runtime.bus.credentials import AuthDir
from tests.fixtures.replicas import NatsCluster, PostgresPair, nats_cluster, postgres_pair

ROOT: Final = Path(__file__).resolve().parents[1]
PREFIX: Final = "dracap"
NAMESPACE: Final = "bench"
REPLICAS: Final = 2
DATABASE: Final = "dracap"
#: seconds a service waits through a failover before it refuses (above what one takes here)
FAILOVER_TIMEOUT_S: Final = 60
STOP_S: Final = 30.0

#: every replicated service: its name and its command (``--data-dir`` is added)
SERVICES: Final = {
    "relay": ["serve", "relay"],
    "claims": ["serve", "claims"],
    "reservation": ["serve", "reservation"],
    "enforcement": ["serve", "enforcement"],
    "reclamation": ["reclaim"],
    "audit": ["audit", "serve", "--creds", "{auth}/creds/service-ledger.nk"],
    "billing": ["usage", "serve", "--creds", "{auth}/creds/service-ledger.nk"],
    "snapshots": ["replay", "snapshot", "--every-events", "2000"],
}


@dataclass
class Process:
    """One service process (a replica, or a node's agent) and how to start it again."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    #: killed by the harness, to be started again by it (the supervisor leaves it down)
    held: bool = False

    def start(self) -> None:
        """Start the process (again); called on the event loop only, as the supervisor
        and the faults are, so that no two of them start one process."""
        with self.log.open("ab") as handle:
            self.popen = subprocess.Popen(
                self.argv,
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=handle,
                start_new_session=True,
            )
        self.held = False

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, number: signal.Signals) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(number)

    def stop(self) -> int | None:
        """SIGCONT and SIGTERM, SIGKILL after :data:`STOP_S`; the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGCONT)
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


@dataclass
class Topology:
    """The installation (see the module docstring)."""

    root: Path
    nats: NatsCluster
    pg: PostgresPair
    nodes: list[str]
    processes: dict[str, list[Process]] = field(default_factory=dict)

    @property
    def data(self) -> Path:
        return self.root / "dracap"

    @property
    def auth(self) -> AuthDir:
        return AuthDir(self.data / "auth")

    @property
    def admin_url(self) -> str:
        """The superuser's multi-host URL of the installation's database."""
        return self.pg.url

    def replica(self, service: str, index: int) -> Process:
        return self.processes[service][index]

    def kill(self, process: Process) -> None:
        """SIGKILL, and reaped; down until :meth:`Process.start`."""
        process.held = True
        if process.popen is not None and process.popen.poll() is None:
            process.popen.kill()
            process.popen.wait()

    def pause(self, process: Process) -> None:
        process.signal(signal.SIGSTOP)

    def resume(self, process: Process) -> None:
        process.signal(signal.SIGCONT)

    def supervise(self) -> list[str]:
        """Start again every process that ended on its own, as a supervisor (Kubernetes,
        compose's ``restart``) would; for each, its name, exit code and last log line."""
        restarted = []
        for group in self.processes.values():
            for process in group:
                if process.popen is None or process.popen.poll() is None or process.held:
                    continue
                lines = process.log.read_text(errors="replace").splitlines() or ["?"]
                restarted.append(f"{process.name} (exit {process.popen.returncode}): {lines[-1]}")
                process.start()
        return restarted

    def logs(self, tail: int = 1500) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
            for p in sorted((self.root / "logs").glob("*.log"))
        )

    def tracebacks(self) -> dict[str, list[str]]:
        """Log name -> the distinct last lines of the tracebacks it holds (an expected
        failure should print none)."""
        found: dict[str, list[str]] = {}
        for path in sorted((self.root / "logs").glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()
            starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
            ends = {_traceback_end(lines, i) for i in starts}
            if ends:
                found[path.stem] = sorted(ends)
        return found


def _traceback_end(lines: list[str], start: int) -> str:
    """The exception line that ends the traceback starting at ``lines[start]``."""
    for line in lines[start + 1 :]:
        if line and not line.startswith((" ", "Traceback", "During handling", "The above")):
            return line[:200]
    return "?"


def _environment(nats_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRACAP_")}
    env.update(
        DRACAP_NATS_URL=nats_url,
        DRACAP_STREAM_REPLICAS="3",
        DRACAP_NATS_PING_INTERVAL_S="1",
        DRACAP_FAILOVER_TIMEOUT_S=str(FAILOVER_TIMEOUT_S),
        DRACAP_POOL_MIN_SIZE="1",
        DRACAP_POOL_MAX_SIZE="4",
    )
    return env


async def _dracap(*words: str, env: dict[str, str]) -> None:
    """A one-shot command; it must end with 0."""
    done = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", *words,
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await done.communicate()
    if done.returncode != 0:
        raise RuntimeError(f"dracap {' '.join(words)}: exit {done.returncode}\n{out.decode()}")


async def _create_database(pg: PostgresPair) -> None:
    connection = await asyncpg.connect(pg.server_url(pg.primary, "postgres"))
    try:
        await connection.execute(f"CREATE DATABASE {DATABASE}")
    finally:
        await connection.close()
    pg.database = DATABASE


def _processes(topology: Topology, env: dict[str, str]) -> dict[str, list[Process]]:
    cli = [sys.executable, "-m", "services.cli"]
    data = ["--data-dir", str(topology.data)]
    logs = topology.root / "logs"
    found: dict[str, list[Process]] = {}
    for name, words in SERVICES.items():
        argv = [*cli, *(w.format(auth=topology.auth.path) for w in words), *data]
        found[name] = [
            Process(f"{name}-{i}", argv, env, logs / f"{name}-{i}.log") for i in range(REPLICAS)
        ]
    agent_env = {k: v for k, v in env.items() if not k.startswith("DRACAP_DATABASE")}
    found["agent"] = []
    for node in topology.nodes:
        argv = [*cli, "agent", "--node", node, *data, "--metrics-port", "0"]
        argv += ["--checkpoint", str(topology.data / f"{node}.checkpoint.json")]
        log = logs / f"agent-{node}.log"
        found["agent"].append(Process(f"agent-{node}", argv, agent_env, log))
    return found


@contextlib.asynccontextmanager
async def running_topology(nodes: list[str], keep: bool = False) -> AsyncIterator[Topology]:
    """The whole installation, started; every process stopped and removed after
    (``keep``: the directory with the logs stays, and its path is printed)."""
    root = Path(tempfile.mkdtemp(prefix="dracap-ha-"))
    try:
        async with _running(root, nodes) as topology:
            yield topology
    except Exception:  # the logs' ends, before they go: all a test's failure can show
        print_log_ends(root / "logs")
        raise
    finally:
        if keep:
            print(f"logs kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


#: lines printed from the end of each log when a run fails
LOG_END_LINES: Final = 6


def print_log_ends(logs: Path) -> None:
    """The last :data:`LOG_END_LINES` lines of every log under ``logs``, on stdout."""
    for log in sorted(logs.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()[-LOG_END_LINES:]
        print(f"--- the end of {log.name}" + ("" if lines else " (empty)"))
        for line in lines:
            print(f"  {line[:300]}")


@contextlib.asynccontextmanager
async def _running(root: Path, nodes: list[str]) -> AsyncIterator[Topology]:
    (root / "logs").mkdir()
    env = _environment("")
    node_flags = [w for n in nodes for w in ("--node", n)]
    data = root / "dracap"
    await _dracap("auth", "init", "--data-dir", str(data), *node_flags,
                  "--namespace", NAMESPACE, env=env)  # fmt: skip
    with contextlib.ExitStack() as servers:
        accounts = AuthDir(data / "auth").accounts
        # (blocking: they wait on the servers, and the pair runs an event loop of its own)
        nats = await asyncio.to_thread(servers.enter_context, nats_cluster(3, include=accounts))
        pg = await asyncio.to_thread(servers.enter_context, postgres_pair())
        topology = Topology(root, nats, pg, nodes)
        env = _environment(nats.url)
        try:
            await _create_database(pg)
            admin = {**env, "DRACAP_DATABASE_URL": pg.url}
            await _dracap("db", "upgrade", env=admin)
            await _dracap("db", "logins", "--data-dir", str(data), env=admin)
            topology.processes = _processes(topology, env)
            for group in topology.processes.values():
                for process in group:
                    process.start()
            yield topology
        finally:
            for group in topology.processes.values():
                for process in group:
                    await asyncio.to_thread(process.stop)
            _keep_server_logs(topology)


def _keep_server_logs(topology: Topology) -> None:
    """The servers' logs beside the services' (their directories are removed with them)."""
    logs = topology.root / "logs"
    for server in (topology.pg.primary, topology.pg.standby):
        with contextlib.suppress(OSError):
            shutil.copy(server.log, logs / f"postgres-{server.name}.log")
    for node in topology.nats.nodes:
        with contextlib.suppress(OSError):
            shutil.copy(node.log, logs / f"nats-{node.name}.log")
