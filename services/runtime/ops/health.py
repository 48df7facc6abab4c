"""Health of every dracap process: checks, one log line per change, ``/healthz`` and ``/readyz``.

Checks
------
:class:`HealthMonitor` runs its named checks together every :data:`CHECK_INTERVAL_S`,
each bounded by :data:`CHECK_TIMEOUT_S`. A check (:data:`Probe`) is an async callable
that returns ``None`` when healthy and a one-line reason when not; an exception it
raises is the reason (``Type: message``). ``dracap up`` declares three:

* ``postgres`` — ``SELECT 1`` on a connection of the monitor's own
  (:class:`PostgresProbe`, reopened after a failure), so a busy pool never reads as an
  outage;
* ``nats`` — the services' NATS connection is connected and JetStream answers for the
  events stream (:func:`nats_probe`);
* ``services`` — every supervised service of the stack runs (``Stack.trouble``).

A check declared but not registered yet (during start-up) reads as down, "starting".

Every other service process (``dracap serve X``, ``reclaim``, ``audit serve``, ``usage
serve``, ``replay snapshot``, ``agent``) runs the same monitor through
:func:`service_health`, with the checks of what it uses (:data:`SERVICE_CHECKS`):

* ``postgres`` — as above (:class:`PostgresProbe`), for every process with a database;
* ``nats`` — connected, and a round trip to the server answers (:func:`bus_probe`): it
  asks nothing of JetStream, so it holds for a login with few permissions (an agent,
  the claims API);
* ``consumers`` — each of the process's durable consumers is attached: its pull loop
  runs and its durable is not missing (:func:`consumers_probe`);
* ``state`` — what the process acts on is fresh: its live view of the log is tailing
  and has reached every head it heard of within :data:`STALE_STATE_S`
  (:func:`live_probe`), or, for a projector (audit, billing), its batches succeed and
  follow the head as closely (:func:`projector_probe`). Both compare with the head the
  store heard of (NOTIFY), in memory: no query per round.

The node agent talks to NATS only: its readiness is ``nats`` and ``consumers``.

One line per change
-------------------
A check's changes of state are logged once each — ``postgres is down: <reason>``
(warning), ``postgres is up again (down 4.2 s)`` (info) — and exported as
``dracap_health_check_up{check}``; a check that passes again also runs the
:meth:`HealthMonitor.on_recovery` callbacks (``dracap up`` ends its services'
back-offs there). Everything else that fails *because* a server is
away would log once per retry; ``dracap up`` keeps those lines out of its log while
:meth:`HealthMonitor.outage` says so (:mod:`services.runtime.ground.outages`).

Endpoints
---------
:func:`serve` adds two paths to the metrics server (``/metrics`` serves the metrics, any
other path is 404: :func:`services.runtime.ground.metrics.start_metrics_server`). They are
answered on the HTTP server's thread from the monitor's last round, never by probing on
request:

* ``/healthz`` — 200 while the process is alive and supervising: no round is older
  than :data:`STALE_LIVENESS_S` (the event loop is not stuck) and the watchdog of the
  embedded servers has not given up; else 503.
* ``/readyz`` — 200 when every check passed in the last round, and that round is at
  most :data:`STALE_READINESS_S` old; else 503.

Both bodies are JSON (:class:`Liveness`, :class:`Readiness`) and name what is down::

    {"ready":false,"down":["nats"],"checks":{"postgres":{"up":true,"reason":null},
     "nats":{"up":false,"reason":"not connected (reconnecting)"},"services":{...}}}
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Final, Protocol
from wsgiref.simple_server import WSGIServer

import asyncpg
import msgspec
from nats.aio.client import Client
from nats.js import JetStreamContext

from services.runtime.ground.metrics import HEALTH_CHECK_UP, start_metrics_server
from services.runtime.ground.outages import one_line
from services.runtime.ground.waiting import wait_for

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

    from services.runtime.ops.supervising import Watchdog

__all__ = [
    "CHECK_INTERVAL_S",
    "CHECK_TIMEOUT_S",
    "SERVICE_CHECKS",
    "STALE_STATE_S",
    "Attachable",
    "CheckState",
    "HealthMonitor",
    "Liveness",
    "PostgresProbe",
    "Probe",
    "Readiness",
    "bus_probe",
    "consumers_probe",
    "live_probe",
    "nats_probe",
    "projector_probe",
    "serve",
    "service_health",
]

log = logging.getLogger("dracap.health")

CHECK_INTERVAL_S: Final = 0.5
CHECK_TIMEOUT_S: Final = 2.0
STALE_READINESS_S: Final = 5.0
STALE_LIVENESS_S: Final = 30.0
#: How long a live view (or a projector) may stay behind a head it heard of and be fresh.
STALE_STATE_S: Final = 30.0

#: The checks of each service process (``/readyz``; ``dracap up`` has its own).
SERVICE_CHECKS: Final[dict[str, tuple[str, ...]]] = {
    "relay": ("postgres", "nats"),
    "claims": ("postgres", "nats", "state"),
    "reservation": ("postgres", "nats", "consumers", "state"),
    "enforcement": ("postgres", "nats", "state"),
    "kubernetes-bridge": ("postgres", "nats", "state"),
    "reclamation": ("postgres", "state"),
    "audit": ("postgres", "nats", "state"),
    "billing": ("postgres", "nats", "state"),
    "ledger": ("postgres", "nats", "state", "audit", "billing"),  # both, on one fold
    "snapshots": ("postgres", "state"),
    "agent": ("nats", "consumers"),
}

#: A check: ``None`` when healthy, else why not (one line).
Probe = Callable[[], Awaitable[str | None]]


class CheckState(msgspec.Struct, frozen=True):
    """One check's outcome in the last round."""

    up: bool
    reason: str | None = None  #: why it is down


class Readiness(msgspec.Struct, frozen=True):
    """The body of ``/readyz``."""

    ready: bool
    down: list[str]  #: the checks that did not pass
    checks: dict[str, CheckState]


class Liveness(msgspec.Struct, frozen=True):
    """The body of ``/healthz``."""

    alive: bool
    reason: str | None = None  #: why not
    supervising: list[str] = []  #: embedded servers the watchdog keeps running
    restarting: dict[str, str] = {}  #: embedded servers being restarted, and why
    restarts: dict[str, int] = {}  #: restarts of each embedded server so far


class _Round(msgspec.Struct, frozen=True):
    """What one round found (read from the HTTP thread: replaced, never changed)."""

    at: float  #: ``time.monotonic()`` at its end
    checks: dict[str, CheckState]
    restarting: dict[str, str]
    restarts: dict[str, int]


_STARTING: Final = CheckState(up=False, reason="starting")
_STATUS: Final = {200: "200 OK", 503: "503 Service Unavailable"}


class HealthMonitor:
    """Runs the checks, logs their changes, and answers liveness and readiness."""

    def __init__(
        self,
        checks: Sequence[str],
        *,
        interval: float = CHECK_INTERVAL_S,
        timeout: float = CHECK_TIMEOUT_S,
    ) -> None:
        self._probes: dict[str, Probe | None] = dict.fromkeys(checks)
        self._states: dict[str, CheckState] = dict.fromkeys(checks, _STARTING)
        for name in checks:  # the series exists (at 0) from the start
            HEALTH_CHECK_UP.labels(check=name).set(0)
        self._since: dict[str, float] = {}  # when each check last changed (once checked)
        self._interval = interval
        self._timeout = timeout
        self._round: _Round | None = None
        self._outage = False
        self._recovery: list[Callable[[str], None]] = []
        self.watchdog: Watchdog | None = None  #: the embedded servers' watchdog, if any

    def register(self, name: str, probe: Probe) -> None:
        """Attach the probe of a declared check."""
        if name not in self._probes:
            raise ValueError(f"check {name!r} was not declared")
        self._probes[name] = probe

    def on_recovery(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(name)`` whenever a check passes again after failing."""
        self._recovery.append(callback)

    def outage(self) -> bool:
        """Whether a check was down in the last round (a ``QuietOutages`` question)."""
        return self._outage

    async def run(self, stop: asyncio.Event) -> None:
        """A round every ``interval`` until ``stop`` is set."""
        while not stop.is_set():
            await self.check_once()
            with contextlib.suppress(TimeoutError):
                await wait_for(stop.wait(), self._interval)

    async def check_once(self) -> None:
        """Run every registered check once, log what changed, publish the round."""
        names = [name for name, probe in self._probes.items() if probe is not None]
        results = await asyncio.gather(*(self._check(name) for name in names))
        for name, reason in zip(names, results, strict=True):
            self._record(name, reason)
        self._outage = any(not self._states[name].up for name in names)
        watchdog = self.watchdog
        self._round = _Round(
            at=time.monotonic(),
            checks=dict(self._states),
            restarting=dict(watchdog.down) if watchdog else {},
            restarts=dict(watchdog.restarts) if watchdog else {},
        )

    async def _check(self, name: str) -> str | None:
        probe = self._probes[name]
        assert probe is not None
        try:
            async with asyncio.timeout(self._timeout):
                return await probe()
        except TimeoutError:
            return f"no answer within {self._timeout:.0f} s"
        except Exception as exc:
            return one_line(exc)

    def _record(self, name: str, reason: str | None) -> None:
        """Keep a check's outcome; a change of up/down is one log line and the gauge."""
        old, now = self._states[name], time.monotonic()
        self._states[name] = CheckState(up=reason is None, reason=reason)
        if name in self._since and old.up == (reason is None):
            return
        changed = self._since.get(name)
        self._since[name] = now
        HEALTH_CHECK_UP.labels(check=name).set(1 if reason is None else 0)
        if reason is not None:
            log.warning("%s is down: %s", name, reason)
        elif changed is not None:
            log.info("%s is up again (down %.1f s)", name, now - changed)
            for callback in self._recovery:
                callback(name)

    # -- answers (called from the HTTP server's thread) -------------------------------

    def readiness(self) -> tuple[int, Readiness]:
        """``/readyz``: 200 when every check passed in a recent round, else 503."""
        last = self._round
        checks = dict(self._states) if last is None else dict(last.checks)
        if last is not None and (age := time.monotonic() - last.at) > STALE_READINESS_S:
            checks["monitor"] = CheckState(up=False, reason=f"last checked {age:.0f} s ago")
        down = [name for name, state in checks.items() if not state.up]
        return (503 if down else 200), Readiness(ready=not down, down=down, checks=checks)

    def liveness(self) -> tuple[int, Liveness]:
        """``/healthz``: 200 while the process runs its rounds and supervises, else 503."""
        last, watchdog = self._round, self.watchdog
        reason = watchdog.gave_up if watchdog else None
        if reason is None and last is not None:
            age = time.monotonic() - last.at
            if age > STALE_LIVENESS_S:
                reason = f"no health round for {age:.0f} s (event loop blocked?)"
        body = Liveness(
            alive=reason is None,
            reason=reason,
            supervising=[s.name for s in watchdog.servers] if watchdog else [],
            restarting=dict(last.restarting) if last else {},
            restarts=dict(last.restarts) if last else {},
        )
        return (200 if reason is None else 503), body


# --- probes --------------------------------------------------------------------------------


class PostgresProbe:
    """``SELECT 1`` on a connection of its own, opened again after any failure."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._connection: asyncpg.Connection | None = None

    async def __call__(self) -> str | None:
        try:
            if self._connection is None or self._connection.is_closed():
                self._connection = await asyncpg.connect(
                    self._url,
                    timeout=CHECK_TIMEOUT_S,
                    server_settings={"application_name": "dracap-health"},
                )
            await self._connection.fetchval("SELECT 1")
        except BaseException:
            self._drop()
            raise
        return None

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.terminate()

    async def close(self) -> None:
        """Close the probe's connection."""
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close(timeout=CHECK_TIMEOUT_S)


def nats_probe(nc: Client, js: JetStreamContext, stream: str) -> Probe:
    """Connected, and JetStream answers for ``stream``."""

    async def probe() -> str | None:
        if not nc.is_connected:
            return "not connected (reconnecting)" if nc.is_reconnecting else "not connected"
        await js.stream_info(stream)
        return None

    return probe


def bus_probe(nc: Client) -> Probe:
    """Connected, and the server answers a round trip (no JetStream permission needed)."""

    async def probe() -> str | None:
        if not nc.is_connected:
            return "not connected (reconnecting)" if nc.is_reconnecting else "not connected"
        await nc.flush(timeout=int(CHECK_TIMEOUT_S))
        return None

    return probe


class Attachable(Protocol):
    """A durable consumer as :func:`consumers_probe` asks it."""

    name: str

    def detached(self) -> str | None:
        """``None`` while attached, else why not."""
        ...


def consumers_probe(consumers: Callable[[], Iterable[Attachable]]) -> Probe:
    """Every consumer ``consumers()`` gives is attached (none given: not started yet)."""

    async def probe() -> str | None:
        found = list(consumers())
        if not found:
            return "no consumer started yet"
        down = [f"{c.name}: {why}" for c in found if (why := c.detached()) is not None]
        return "; ".join(down) or None

    return probe


def _behind(what: str, position: int, heads: _Heads) -> str | None:
    """Why ``position`` is stale against the heads heard of (None: fresh)."""
    since = heads.behind_since(position)
    if since is None or (age := heads.clock() - since) <= STALE_STATE_S:
        return None
    return f"{what} at position {position}, behind the log's head for {age:.0f} s"


class _Heads:
    """When a position was first seen behind the head (one per probe)."""

    def __init__(self, head: Callable[[], int], clock: Callable[[], float]) -> None:
        self._head = head
        self.clock = clock
        self._since: float | None = None
        self._target = 0  # the head to reach that started the wait

    def behind_since(self, position: int) -> float | None:
        head = self._head()
        if position >= self._target:  # the head noted is reached: fresh
            self._since = None
        if position >= head:
            return None
        if self._since is None:
            self._since, self._target = self.clock(), head
        return self._since


class _Store(Protocol):
    @property
    def known_head(self) -> int: ...


class _State(Protocol):
    position: int


class Tailing(Protocol):
    """A live view as :func:`live_probe` asks it (:class:`~services.runtime.store.livestate.
    LiveState`; a protocol, so the node agent's side imports no event store)."""

    @property
    def tailing(self) -> bool: ...
    @property
    def store(self) -> _Store: ...
    @property
    def state(self) -> _State: ...


class Projecting(Protocol):
    """A projector as :func:`projector_probe` asks it (:class:`~services.runtime.
    projecting.Projector`)."""

    name: str
    position: int

    @property
    def store(self) -> _Store: ...
    @property
    def failing(self) -> str | None: ...


def live_probe(live: Tailing, clock: Callable[[], float] = time.monotonic) -> Probe:
    """The live view tails the log and reaches each head it hears of in time."""
    heads = _Heads(lambda: live.store.known_head, clock)

    async def probe() -> str | None:
        if not live.tailing:
            return "the live view is not tailing the log"
        return _behind("live view", live.state.position, heads)

    return probe


def projector_probe(projector: Projecting, clock: Callable[[], float] = time.monotonic) -> Probe:
    """The projector's batches succeed and follow the head it hears of in time."""
    heads = _Heads(lambda: projector.store.known_head, clock)

    async def probe() -> str | None:
        if projector.failing is not None:
            return f"batches fail: {projector.failing}"
        return _behind(f"projector {projector.name}", projector.position, heads)

    return probe


@contextlib.asynccontextmanager
async def service_health(
    service: str,
    port: int,
    addr: str,
    *,
    database_url: str | None = None,
    interval: float = CHECK_INTERVAL_S,
    stop: asyncio.Event | None = None,
) -> AsyncIterator[HealthMonitor]:
    """A service process's monitor while inside: its :data:`SERVICE_CHECKS` declared
    (``postgres`` registered on ``database_url``; the caller registers the others as
    what they check starts), its rounds running until ``stop`` (a service that stops
    takes down what its checks look at: no round logs that as an outage), and with
    ``port`` the metrics server with ``/healthz`` and ``/readyz``."""
    monitor = HealthMonitor(SERVICE_CHECKS[service], interval=interval)
    postgres = PostgresProbe(database_url) if database_url is not None else None
    if postgres is not None and "postgres" in SERVICE_CHECKS[service]:
        monitor.register("postgres", postgres)
    server = None
    if port:
        server, _ = start_metrics_server(port, addr=addr)
        serve(server, monitor)
    done = stop if stop is not None else asyncio.Event()
    task = asyncio.create_task(monitor.run(done), name=f"health-{service}")
    try:
        yield monitor
    finally:
        done.set()
        await task
        if server is not None:
            server.shutdown()
            server.server_close()
        if postgres is not None:
            await postgres.close()


# --- endpoints -----------------------------------------------------------------------------


def serve(server: WSGIServer, monitor: HealthMonitor) -> None:
    """Answer ``/healthz`` and ``/readyz`` on the metrics ``server``; the rest as before."""
    metrics = server.get_app()
    assert metrics is not None, "the metrics server has no application"

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO")
        answer: tuple[int, Readiness | Liveness]
        if path == "/healthz":
            answer = monitor.liveness()
        elif path == "/readyz":
            answer = monitor.readiness()
        else:
            return metrics(environ, start_response)
        body = msgspec.json.encode(answer[1]) + b"\n"
        headers = [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Cache-Control", "no-store"),
        ]
        start_response(_STATUS[answer[0]], headers)
        return [body]

    server.set_app(app)
