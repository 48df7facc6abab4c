"""Pipeline throughput and latency: ``claims.apply`` -> Ready through the real services.

One run, one fresh database on the given server (created, migrated, dropped at the end
unless ``--keep``) and one unique subject prefix on the given nats-server. In the same
run and on the same database it measures:

1. **raw commit rate**: single-row ``INSERT`` autocommits/s on one asyncpg connection
   (the floor every event-sourced write pays: one WAL flush per commit);
2. **sustained throughput**: ``--claims`` claims applied through the claims API with
   ``--concurrency`` requests in flight (closed loop), each counted when its watch
   update says ``ready`` — claims/s from the first apply to the last Ready. A closed
   loop measures in-flight / latency until it has enough in flight to saturate the
   services: 64 gave ~1,300/s with the service process at ~65 % of a core, 256 gives
   the capacity (~1,600-1,900/s here), and the default is 256; it starts after 100
   claims to warm up and once ``dracap up`` is quiet (:func:`quiet`, below: its audit
   and billing process starts beside it);
3. **latency at half that rate**: claims applied open-loop at 50% of (2) for
   ``--seconds``; apply->Ready per claim, p50 / p99 / max.

**The client's loop.** The benchmark itself (the raw commits, the applies, the watch)
runs on the services' event loop (:func:`services.runtime.ground.eventloop.run`:
uvloop, or the standard loop with ``DRACAP_EVENT_LOOP=asyncio``); on the standard loop
until 2026-12-07 it took 18-30 % more CPU per claim at half rate on a 2-core machine
that it shares with what it measures, and its single-connection commits ran 5-20 %
slower, understating the raw rate (``docs/services.md``, "The benchmark's client on the
services' loop").

**Placement.** Every GPU has room for every claim of a run, and the allocator takes the
first device that fits, so by default every claim lands on the first node's first GPU:
one node agent does all the enforcing, in groups as large as the rate makes them, and
the other agents idle. ``--spread`` gives each node's GPUs a driver and class of their
own and each claim the class its name hashes to, so the claims land on every node
evenly, as a cluster's pods do: every agent then views and reports its own, smaller
groups (more round trips per claim through the enforcement service).

**Growth** (``--live N,N,...``, issue 25): whether a claim costs more when many are
already live. For each N, in ascending order and on the same ``dracap up``, claims are
applied (256 in flight) until N of them are live and left live; then the latency run at
``--live-rate`` (default 50 claims/s) for ``--live-seconds`` (default 20: 1,000 claims,
so that its p99 is not the fourth-slowest of 400 — such a p99 swung by tens of percent
between runs of the same code), the sustained run of
``--claims`` and the latency run at half its rate. The claims of earlier phases stay
live too, so phase N starts with at least N live claims. The GPUs are sized to hold
every claim of the run (``--gpu-memory``, default: enough), so capacity never decides.
The table at the end gives each figure per N and its change from the first N (goal:
within 20 %), and ``dracap up``'s CPU per claim (``/proc``) of the fixed-rate run
(``cpu@50``: the same rate at every N, so the same batching — what a claim costs the
process, whatever the machine's load does to the latencies) and of the sustained run,
and the whole machine's (``mach@sust``, ``/proc/stat``: every process on it, the servers
and this load generator included) of the sustained run, which says whether what grows
is ``dracap up``'s or the servers' (a second table splits ``mach@sust`` by process, as
below). A phase starts once the subscribers have caught up
(below) and ``dracap up`` is quiet (:func:`quiet`: it and its audit and billing process
each under 5 % of a core, no snapshot encoder alive): the fill's own tail — the encoding
of a snapshot the fill made due, the last batches — is the fill's cost, not that of a
claim with N live; and the first phase, with no fill before it, does not meet ``dracap
up``'s start instead (its audit and billing process starting and catching up: before
this wait, the first two seconds of the run at 50/s with 0 live took 50-110 ms a claim).
Each phase also names the runs during which ``dracap up`` was encoding a snapshot of its
state (``snapshot during``: ``rate``, ``sust``, ``half``; its forked encoder seen alive,
sampled every 0.2 s by :class:`ForkWatch`): at 100,000 live claims an encoding takes a
core for over a second, in a forked child at the lowest priority, and any such work
costs a 2-core machine a fifth of the sustained rate while it runs (a ``nice`` 19 or
``SCHED_IDLE`` busy loop did, ``docs/services.md``), so a 3,000-claim sustained run that
meets one says as much about when the writer's interval fell as about what a claim
costs with N live. (The writer waits for a lull in the claims coming in, so a run meets
one only when it is twice due: ``services/runtime/store/snapshots.py``.)
And each phase records the machine's **pace** just before its runs and just after them
(``pace``, ms, before/after: a fixed fold of 20,000 events timed in this process,
:mod:`benchmarks.pace`), and the change of their mean from the first phase is printed
beside the goals: on a shared machine the same code runs slower in some minutes than in
others, and a figure that moved as much as the pace moved with the machine. The pace is
taken between runs; what the machine did *during* them shows in the load generator's
own CPU per claim of the sustained run (``bench`` in the second table: the same work at
every N), whose change is printed too.

**Settled runs**: every run starts once the audit and billing projectors have read the
log up to its head as of that moment (their positions in ``ledger_positions``; at most
``SETTLE_S``), and the wait is printed. A run right after the fill of 100,000 claims, or
right after the closed-loop sustained run, otherwise measures how fast the subscribers
work off that backlog (they trail the log by design: ``docs/audit-billing.md``), not
what one more claim costs with N live. ``--no-settle`` starts each run at once (the
figures before this step).

**The machine's bound**: the sustained run also prints the CPU the whole machine spent
per claim during it (every process: ``dracap up``, its nats-server, PostgreSQL, this
load generator; ``/proc/stat``), ``dracap up``'s share and its audit and billing
process's (``dracap serve ledger``, its child; it trails the log by a second, so part
of what it spends on a run's claims falls after the run), and the same split over every
process on the machine (``by process``: ``dracap up`` with its forked snapshot
encoders, its ledger process, PostgreSQL's processes, nats-server's, this load
generator, the rest; each process's ``/proc/<pid>/stat`` read before and after the run,
one born meanwhile counted whole, one reaped meanwhile through its parent's children's
time; the half-rate run and each ``--rates`` run print the same split per claim of
their own, the cost of a claim at that rate), each split with the share of the
machine's cores it kept busy over the run (``the machine N % busy``: near 100 % every
process waits for a core after each wake-up); the ratios end with what the
machine's cores could sustain at that cost if every one of them were busy with it
(cores / CPU per claim), and what ``dracap up``'s one thread could sustain at its own
CPU per claim, each against the raw commit rate: a ratio goal above either bound is out
of reach at that cost per claim.

**Stages** (``--stages``): after each latency run, p50 / p99 of each step of its claims
from the log's ``recorded_at`` (apply -> submitted -> admitted -> capacity_reserved ->
allocation_bound -> limit_applied -> ready): where the time goes, seen from outside.

**Timeline** (``--timeline FILE``): every claim's run, send time and apply->Ready
latency as CSV, to see a percentile's tail over time: a window in which every claim is
late is a stall of the whole pipeline (a pause of one process, a checkpoint of the
database server), a tail spread over the run is queueing.

The system under test is ``dracap up`` itself, started as its own process with the URLs
of the servers in its environment — relay, live state, claims API, ``--workers``
reservation workers (default 1, as ``dracap up``) and one agent (NoneEnforcer) per node,
exactly what an operator runs. This process is the tenants' side: it applies claims over
NATS request/reply and follows them on the watch subject, as ``dracap claim`` does, so
the load generator's own work is not charged to the control plane (nor the reverse). The
inventory is synthetic (an inventory file handed to ``dracap up``): ``--nodes`` nodes of
8 shareable GPUs with 1000Gi each, so capacity never limits the run; every claim asks
for 1Gi of memory. Goals (issue 25): throughput >= 0.5x the raw commit rate, p99 <= 35 ms
at 50 claims/s, p99 <= 50 ms at half the max rate.

Ctrl-C or SIGTERM (a ``timeout`` around it) ends a run at any point: ``dracap up`` is
stopped and the run's database dropped (unless ``--keep``), then one line and status
130; a server it cannot use, or a claim stuck for a minute, ends it with one line and
status 1.

Usage::

    .venv/bin/python -m benchmarks.pipeline --claims 4000 --seconds 10
    .venv/bin/python -m benchmarks.pipeline --rates 100,300,500,700   # the latency curve too
    .venv/bin/python -m benchmarks.pipeline --embedded   # servers of `dracap up`
    .venv/bin/python -m benchmarks.pipeline --live 0,10000,100000 --claims 3000 --seconds 8
    .venv/bin/python -m benchmarks.pipeline --rates 50 --stages   # where the time goes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import gc
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
import zlib
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import asyncpg
import nats.js.errors

from benchmarks import databases, stopping
from benchmarks.pace import Pace
from events.subjects import BusNames
from events.tenancy import MAX_CLAIMS
from services.commands.up import READY_LINE
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.credentials import Credential, read_credential
from services.runtime.bus.endpoints import EndpointError, read_connection
from services.runtime.bus.flushing import flushed
from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground import eventloop
from services.runtime.ground.gctuning import tune_for_long_lived_state
from services.runtime.ground.settings import Settings
from services.runtime.ops.embedded import embedded_servers, free_port

NAMESPACE = "bench"
DRIVER = "gpu.bench.dracap.io"
CLASS = "gpu.bench.dracap.io"
GPUS_PER_NODE = 8
READY = b'"ready":true'  # how a ready ClaimView reads on the watch subject (compact JSON)
R = TypeVar("R")


# --- inventory and claims ------------------------------------------------------------------


def driver_of(k: int) -> str:
    """The driver (and class) of the ``k``-th node's GPUs under ``--spread``; the first is
    :data:`DRIVER`, the one every node has without it."""
    return DRIVER if k == 0 else f"gpu{k}.bench.dracap.io"


def device_class(k: int = 0) -> dict[str, Any]:
    """The class of :func:`driver_of` ``k``'s devices (named as its driver)."""
    driver = driver_of(k)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": driver},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
    }


def resource_slice(node: str, memory: str = "1000Gi", driver: str = DRIVER) -> dict[str, Any]:
    devices = [
        {
            "name": f"gpu-{i}",
            "allowMultipleAllocations": True,
            "capacity": {"memory": {"value": memory}},
        }
        for i in range(GPUS_PER_NODE)
    ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-bench"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": f"{node}-gpus", "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def claim(name: str, classes: int = 1) -> bytes:
    """A claim for 1Gi of one GPU; with ``classes`` > 1, of the class its name hashes to
    (``--spread``: the claims of a run land on every node, evenly)."""
    k = zlib.crc32(name.encode()) % classes if classes > 1 else 0
    request = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": driver_of(k),
            "capacity": {"requests": {"memory": "1Gi"}},
        },
    }
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [request]}},
    }
    return json.dumps(body).encode()


def namespace(name: str = NAMESPACE, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": metadata}


def write_inventory(
    path: Path,
    nodes: list[str],
    namespaces: tuple[str, ...] = (NAMESPACE,),
    memory: str = "1000Gi",
    annotations: dict[str, str] | None = None,
    spread: bool = False,
) -> Path:
    """The synthetic inventory as one JSON ``List``; ``memory``: each GPU's;
    ``annotations``: the tenants' (``dracap.io/`` tenancy rules); ``spread``: each node's
    GPUs of a driver and class of their own (:func:`driver_of`), else all of one."""
    tenants = [namespace(n, annotations) for n in namespaces]
    kinds = len(nodes) if spread else 1
    slices = [resource_slice(n, memory, driver_of(k if spread else 0)) for k, n in enumerate(nodes)]
    documents = [*(device_class(k) for k in range(kinds)), *tenants, *slices]
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": documents}))
    return path


# --- measuring -----------------------------------------------------------------------------


class Reach(NamedTuple):
    """Where the benchmark's ``dracap up`` answers, and the login to use."""

    nats_url: str
    credential: Credential | None
    pid: int = 0  #: the ``dracap up`` process
    metrics_port: int = 0  #: where it serves its metrics


class ReadyTracker:
    """Times each claim from the apply request to the first watch update saying ready."""

    def __init__(self, classes: int = 1) -> None:
        self.classes = classes  #: the classes claims are spread over (``--spread``: per node)
        self.sent: dict[str, float] = {}
        self.ready: dict[str, float] = {}
        self.waiters: dict[str, asyncio.Future[None]] = {}
        #: add to a perf_counter() reading for the wall clock (the log's ``recorded_at``)
        self.wall_offset = time.time() - time.perf_counter()

    def on_view(self, view: dict[str, Any]) -> None:
        name = view.get("name", "")
        if view.get("ready") and name in self.sent and name not in self.ready:
            self.ready[name] = time.perf_counter()
            waiter = self.waiters.pop(name, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def apply(self, api: ApiClient, name: str) -> None:
        waiter = self.waiters[name] = asyncio.get_running_loop().create_future()
        self.sent[name] = time.perf_counter()
        reply = await api.claims(NAMESPACE, "apply", claim(name, self.classes))
        self.on_view(reply["claim"])
        await waiter

    def latencies_ms(self, names: list[str]) -> list[float]:
        return sorted((self.ready[n] - self.sent[n]) * 1000 for n in names if n in self.ready)


@contextlib.asynccontextmanager
async def watching(api: ApiClient, tracker: ReadyTracker) -> AsyncIterator[None]:
    subject = (await api.claims(NAMESPACE, "watch", {"name": None}))["subject"]

    async def on_message(msg: Any) -> None:
        if READY in msg.data:  # most updates are not the one waited for: skip the parse
            tracker.on_view(json.loads(msg.data))

    sub = await api.nc.subscribe(subject, cb=on_message)
    await flushed(api.nc)
    try:
        yield
    finally:
        await sub.unsubscribe()


async def raw_commit_rate(url: str, commits: int) -> float:
    connection = await asyncpg.connect(url)
    try:
        await connection.execute(
            "CREATE TABLE pipeline_raw (id bigserial PRIMARY KEY, payload jsonb NOT NULL)"
        )
        payload = json.dumps({"type": "claims.admitted", "namespace": NAMESPACE, "name": "x" * 40})
        started = time.perf_counter()
        for _ in range(commits):
            await connection.execute("INSERT INTO pipeline_raw (payload) VALUES ($1)", payload)
        return commits / (time.perf_counter() - started)
    finally:
        await connection.close()


class RunError(Exception):
    """A run that cannot go on: a claim not Ready in time, ``dracap up`` gone."""


@contextlib.asynccontextmanager
async def stalls_are_run_errors() -> AsyncIterator[None]:
    """While ``dracap up`` runs, its NATS server not answering is the run failing."""
    try:
        yield
    except EndpointError as exc:
        raise RunError(str(exc)) from exc


async def applied(api: ApiClient, tracker: ReadyTracker, name: str) -> None:
    """Apply ``name`` and wait for Ready; a claim stuck for a minute stops the run."""
    try:
        await asyncio.wait_for(tracker.apply(api, name), 60)
    except TimeoutError:
        view = (await api.claims(NAMESPACE, "get", {"name": name}))["claim"]
        raise RunError(f"{name} not ready after 60 s: {view['phase']} {view['reason']}") from None


#: The longest a run waits for the subscribers to catch up (module docstring).
SETTLE_S = 600.0
#: The subscribers whose positions say they have caught up.
SUBSCRIBERS = ("audit", "billing")


async def settled(url: str, args: argparse.Namespace) -> None:
    """Wait until audit and billing have read the log up to its head as of this call."""
    if not url or getattr(args, "no_settle", False):
        return
    connection = await asyncpg.connect(url)
    try:
        started = time.perf_counter()
        head = await connection.fetchval("SELECT coalesce(max(position), 0) FROM events")
        while time.perf_counter() - started < SETTLE_S:
            there = await connection.fetchval(
                "SELECT count(*) FROM ledger_positions WHERE subscriber = ANY($1) "
                "AND position >= $2",
                list(SUBSCRIBERS),
                head,
            )
            if there == len(SUBSCRIBERS):
                break
            await asyncio.sleep(0.2)
        waited = time.perf_counter() - started
        if waited >= 1.0:
            print(f"  (subscribers caught up with position {head:,} in {waited:.1f} s)", flush=True)
    finally:
        await connection.close()


class ForkWatch:
    """When ``dracap up`` (``pid``) had a forked child — its snapshot encoder
    (:func:`services.runtime.store.snapshots.detach`), a child whose command line is its
    own — sampled every ``every_s`` from ``/proc/<pid>/task/<pid>/children`` (module
    docstring, growth)."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.pid = pid
        self.every_s = every_s
        self.seen: list[float] = []  #: wall-clock times a forked child was there

    def forked(self) -> bool:
        """Whether ``dracap up`` has a forked child now."""
        try:
            own = Path(f"/proc/{self.pid}/cmdline").read_bytes()
            children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        except OSError:
            return False
        for child in children:
            try:
                if Path(f"/proc/{child}/cmdline").read_bytes() == own:
                    return True
            except OSError:
                continue
        return False

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            if self.forked():
                self.seen.append(time.time())
            await asyncio.sleep(self.every_s)

    def during(self, runs: dict[str, tuple[float, float]]) -> tuple[str, ...]:
        """The runs (label -> wall-clock start and end) with a forked child seen in them."""
        return tuple(
            label
            for label, (start, end) in runs.items()
            if any(start <= t <= end for t in self.seen)
        )


#: ``dracap up``'s CPU (cores) under which it counts as idle (timers and polls: 0-4 %)
QUIET_CORES = 0.05


async def quiet(
    pid: int, forks: ForkWatch | None, limit_s: float = 60.0, after: str = "the fill"
) -> bool:
    """Wait until ``dracap up`` (``pid``) has worked off what came before a phase (module
    docstring, growth): it and its audit and billing process each under
    :data:`QUIET_CORES` of a core over half a second, and no forked snapshot encoder
    alive; at most ``limit_s``. The wait is printed (``after``: what came before) when
    it took a second or more; False when either was still busy at the end of it."""
    started = time.perf_counter()
    calm = False
    ledger = ledger_pid(pid)  # found once: a scan of /proc
    watched = [pid] if ledger is None else [pid, ledger]
    while not calm and time.perf_counter() - started < limit_s:
        before = [cpu_seconds(p) for p in watched]
        await asyncio.sleep(0.5)
        busy = max(cpu_seconds(p) - b for p, b in zip(watched, before, strict=True)) / 0.5
        calm = busy < QUIET_CORES and (forks is None or not forks.forked())
    waited = time.perf_counter() - started
    if waited >= 1.0:
        state = "quiet" if calm else "still busy"
        print(f"  (dracap up {state} after {after}, {waited:.1f} s)", flush=True)
    return calm


async def throughput(
    api: ApiClient, tracker: ReadyTracker, count: int, concurrency: int, label: str = "tp"
) -> float:
    names = iter(f"{label}-{i}" for i in range(count))

    async def lane() -> None:
        for name in names:
            await applied(api, tracker, name)

    started = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return count / (time.perf_counter() - started)


async def latency(
    api: ApiClient, tracker: ReadyTracker, rate: float, seconds: float, label: str = "lat"
) -> list[float]:
    count = max(1, int(rate * seconds))
    names = [f"{label}-{i}" for i in range(count)]
    started = time.perf_counter()
    tasks = []
    for i, name in enumerate(names):
        delay = started + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(applied(api, tracker, name)))
    await asyncio.gather(*tasks)
    return tracker.latencies_ms(names)


def gpu_memory(args: argparse.Namespace) -> str:
    """Each GPU's memory: 1000Gi, or enough for every 1Gi claim a ``--live`` run applies."""
    live = max(getattr(args, "live", None) or [0])
    rates = sum(getattr(args, "rates", None) or [])
    claims = getattr(args, "claims", 0)
    phases = len(getattr(args, "live", None) or [0])
    # per phase: the sustained run, the half-rate run (at most its claims), the live rate
    fixed = getattr(args, "live_rate", 50) * getattr(args, "live_seconds", args_seconds(args))
    per_phase = 100 + 2 * claims + fixed + rates * args_seconds(args)
    total = live + phases * per_phase
    gpus = max(1, getattr(args, "nodes", 1) * GPUS_PER_NODE)
    return f"{max(1000, 2 * int(total / gpus) + 1)}Gi"


def args_seconds(args: argparse.Namespace) -> float:
    return float(getattr(args, "seconds", 10.0))


def percentile(values: list[float], p: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[int(p * 10) - 1]


# --- where the time goes (--stages) --------------------------------------------------------

#: the log's steps of a claim, in order: (label, event type)
STEPS = (
    ("submitted", "claims.submitted"),
    ("admitted", "claims.admitted"),
    ("capacity_reserved", "reservation.capacity_reserved"),
    ("allocation_bound", "reservation.allocation_bound"),
    ("limit_applied", "enforcement.limit_applied"),
)

_STAGE_ROWS = """
SELECT e.type, e.stream, e.payload->>'name', e.payload->>'share_id', e.recorded_at
  FROM events e
 WHERE e.recorded_at >= $1 AND e.type = ANY($2::text[])
"""


async def stage_times(url: str, tracker: ReadyTracker, names: list[str]) -> dict[str, list[float]]:
    """Per claim of ``names``: each step's time since the step before, in ms.

    The steps are apply (the request sent), the log's ``recorded_at`` of each event of
    :data:`STEPS` (the first ``capacity_reserved``, the last ``limit_applied`` of the
    claim's shares: the one it waited for), and ready (the watch update). The log's
    clock is the database's; both run on this machine, so the wall clocks agree.
    """
    wanted = {n for n in names if n in tracker.ready}
    if not wanted:
        return {}
    since = min(tracker.sent[n] for n in wanted) + tracker.wall_offset - 1.0
    connection = await asyncpg.connect(url)
    try:
        rows = await connection.fetch(
            _STAGE_ROWS,
            datetime.datetime.fromtimestamp(since, datetime.UTC),
            [t for _, t in STEPS],
        )
    finally:
        await connection.close()
    return steps_of([tuple(r) for r in rows], tracker, wanted)


def steps_of(
    rows: list[tuple[Any, ...]], tracker: ReadyTracker, wanted: set[str]
) -> dict[str, list[float]]:
    """:func:`stage_times` of the log's rows (type, stream, name, share id, recorded at)."""
    at: dict[str, dict[str, float]] = {n: {} for n in wanted}
    share_claim: dict[str, str] = {}
    applied: list[tuple[str, float]] = []
    prefix = f"claim:{NAMESPACE}/"
    for kind, stream, name, share, recorded in rows:
        t = recorded.timestamp()
        if kind == "enforcement.limit_applied":
            applied.append((share, t))
            continue
        if name is None and stream.startswith(prefix):
            name = stream[len(prefix) :]
        if name not in at:
            continue
        if kind == "reservation.capacity_reserved":
            share_claim[share] = name
            at[name][kind] = min(t, at[name].get(kind, t))
        else:
            at[name].setdefault(kind, t)
    for share, t in applied:
        name = share_claim.get(share)
        if name is not None:
            at[name]["enforcement.limit_applied"] = max(
                t, at[name].get("enforcement.limit_applied", t)
            )
    out: dict[str, list[float]] = {label: [] for label, _ in STEPS}
    out["ready"] = []
    for name, times in at.items():
        previous = tracker.sent[name] + tracker.wall_offset
        for label, kind in STEPS:
            if kind in times:
                out[label].append((times[kind] - previous) * 1000)
                previous = times[kind]
        out["ready"].append((tracker.ready[name] + tracker.wall_offset - previous) * 1000)
    return out


def write_timeline(path: Path, tracker: ReadyTracker) -> None:
    """``--timeline``: one CSV row per claim applied, in the order sent — its run (the
    name's label: ``warm``, ``tp``, ``lat``, ``r50``, ``l0r``, ...), the wall time it was
    sent (Unix seconds) and its apply->Ready latency in ms (empty: never ready). Latency
    over time shows what a percentile hides: a stall of the whole pipeline (every claim
    sent in one window late) against a slow tail spread over the run."""
    rows = sorted(tracker.sent.items(), key=lambda item: item[1])
    with path.open("w") as out:
        out.write("run,sent_unix_s,latency_ms\n")
        for name, sent in rows:
            ready = tracker.ready.get(name)
            latency_ms = "" if ready is None else f"{(ready - sent) * 1000:.2f}"
            label = name.rsplit("-", 1)[0].rstrip("-")
            out.write(f"{label},{sent + tracker.wall_offset:.4f},{latency_ms}\n")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) process ``pid`` has used so far; 0.0 when unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ledger_pid(parent: int) -> int | None:
    """The pid of ``parent``'s child ``dracap serve ledger`` (``dracap up``'s audit and
    billing process); None when there is none."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == parent and b"serve" in words and b"ledger" in words:
            return int(entry.name)
    return None


def ledger_cpu_seconds(parent: int) -> float:
    """CPU time the audit and billing process of ``dracap up`` (``parent``) has used so
    far; 0.0 when there is none."""
    pid = ledger_pid(parent)
    return 0.0 if pid is None else cpu_seconds(pid)


#: the groups of :func:`cpu_by_process`, in the order they are printed
CPU_GROUPS = ("up", "ledger", "postgres", "nats", "bench", "other")


def cpu_by_process(up: int) -> dict[int, tuple[str, float]]:
    """Each process's group and CPU seconds so far (``/proc``): ``up`` (``dracap up``,
    pid ``up``, with its forked snapshot encoders; 0: none), ``ledger`` (its audit and
    billing child), ``postgres``, ``nats`` (nats-server), ``bench`` (this process) or
    ``other``. A process's seconds include those of the children it has reaped (a
    snapshot encoder that ended is in ``dracap up``'s, a backend that closed in the
    postmaster's)."""
    out: dict[int, tuple[str, float]] = {}
    me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm, rest = (entry / "stat").read_text().rsplit(")", 1)
        except OSError:
            continue
        pid, fields = int(entry.name), rest.split()
        name, ppid = comm.split("(", 1)[1], int(fields[1])
        if name.startswith("postgres"):
            group = "postgres"
        elif name.startswith("nats-server"):
            group = "nats"
        elif up and pid == up:
            group = "up"
        elif up and ppid == up:
            try:
                ledger = b"ledger" in (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            group = "ledger" if ledger else "up"
        else:
            group = "bench" if pid == me else "other"
        # utime, stime, and cutime, cstime: the children it waited for
        out[pid] = (group, sum(int(f) for f in fields[11:15]) / tick)
    return out


def cpu_split(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds each group of :func:`cpu_by_process` spent between two readings (a
    process born meanwhile counts whole; one that ended and was reaped meanwhile counts
    in its parent's seconds, less what the first reading had of it, taken off its own
    group: the parent's group, for a snapshot encoder or a backend)."""
    split = dict.fromkeys(CPU_GROUPS, 0.0)
    for pid, (group, cpu) in after.items():
        earlier = before.get(pid)
        split[group] += cpu - (earlier[1] if earlier is not None and earlier[0] == group else 0.0)
    for pid, (group, cpu) in before.items():
        if pid not in after:  # reaped: its whole time is in its parent's now
            split[group] -= cpu
    return split


def split_cells(split: dict[str, float], claims: int) -> str:
    """A :func:`cpu_split` as ``group ms, ...``: each group's CPU per claim of ``claims``."""
    return ", ".join(f"{group} {cpu * 1000 / claims:.3f}" for group, cpu in split.items())


def busy(split: dict[str, float], seconds: float) -> str:
    """What share of the machine's cores a :func:`cpu_split` over ``seconds`` of wall
    time kept busy, as ``; the machine N % busy`` (nothing when ``seconds`` is 0): near
    100 % the processes wait for a core after each wake-up, and every step's latency
    grows with that wait, whatever the code does."""
    if seconds <= 0:
        return ""
    share = sum(split.values()) / (seconds * (os.cpu_count() or 1))
    return f"; the machine {share * 100:.0f} % busy"


def machine_cpu_seconds() -> float:
    """CPU time all cores of the machine have spent busy so far (``/proc/stat``: user,
    nice, system, irq, softirq, steal); 0.0 when unknown."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        user, nice, system, _, _, irq, softirq, steal = (int(f) for f in fields[1:9])
    except (OSError, ValueError):
        return 0.0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def scrape(port: int, name: str, labels: str = "") -> float:
    """One sample of a metric from a process's metrics endpoint (0 when it has none)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    wanted = f"{name}{labels} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(wanted):
            return float(line.split()[-1])
    return 0.0


#: the histogram every append statement is timed in
APPENDS_METRIC = "dracap_log_append_duration_seconds"


class Appends(NamedTuple):
    """``dracap up``'s appends to the log so far (:data:`APPENDS_METRIC`)."""

    count: float = 0.0
    seconds: float = 0.0

    def since(self, before: Appends, claims: int) -> str:
        """The appends between ``before`` and these, per claim, and their mean time."""
        count, seconds = self.count - before.count, self.seconds - before.seconds
        if not count or not claims:
            return "log appends: none counted"
        return (
            f"log appends: {count / claims:.2f} per claim, "
            f"{seconds * 1000 / count:.2f} ms each on average"
        )


async def appends_of(port: int) -> Appends:
    """Read ``dracap up``'s append count and time from its metrics on ``port`` (nothing
    when it does not answer: the line then says none were counted)."""

    def read() -> Appends:
        return Appends(
            scrape(port, f"{APPENDS_METRIC}_count"), scrape(port, f"{APPENDS_METRIC}_sum")
        )

    try:
        return await asyncio.to_thread(read)
    except OSError:
        return Appends()


async def report_stages(
    url: str, tracker: ReadyTracker, label: str, title: str, cpu_s: float = 0.0
) -> None:
    """Print p50 / p99 of each step of the run ``label`` (``--stages``), and ``cpu_s``,
    the CPU ``dracap up`` used during it, per claim."""
    names = [n for n in tracker.sent if n.startswith(label + "-")]
    steps = await stage_times(url, tracker, names)
    print(f"  stages of {title} (ms since the step before; p50 / p99 / claims):", flush=True)
    if cpu_s and names:
        print(f"    dracap up CPU per claim {cpu_s * 1000 / len(names):16.2f} ms", flush=True)
    previous = "apply"
    for label, values in steps.items():
        if values:
            values.sort()
            print(
                f"    {previous + ' -> ' + label:<38} {percentile(values, 50):7.1f} "
                f"{percentile(values, 99):8.1f} {len(values):>7}",
                flush=True,
            )
            previous = label


# --- the run -------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def dracap_up(
    settings: Settings,
    args: argparse.Namespace,
    names: BusNames,
    work: Path,
    namespaces: tuple[str, ...] = (NAMESPACE,),
    annotations: dict[str, str] | None = None,
) -> AsyncIterator[Reach]:
    """``dracap up`` as its own process on this database, until the block ends.

    As a user runs it: secure, with its own nats-server started from the broker's
    accounts (yields its URL and the operator's credential); with ``--insecure``, open,
    on the benchmark's NATS server.
    """
    nodes = [f"node-{i}" for i in range(args.nodes)]
    metrics_port = free_port()
    memory = getattr(args, "gpu_memory", None) or gpu_memory(args)
    spread = getattr(args, "spread", False)
    inventory = write_inventory(
        work / "inventory.json", nodes, namespaces, memory, annotations, spread=spread
    )
    env = dict(
        os.environ,
        DRACAP_DATABASE_URL=settings.database_url,
        DRACAP_POOL_MAX_SIZE=str(args.pool),
    )
    env.pop("DRACAP_NATS_URL", None)
    command = [
        *(sys.executable, "-m", "services.cli", "up", "--data-dir", str(work / "data")),
        *("--inventory", str(inventory), "--workers", str(args.workers)),
        *("--metrics-port", str(metrics_port), "--ledger-metrics-port", "0"),
        *("--prefix", names.prefix),
    ]
    if args.insecure:
        env["DRACAP_NATS_URL"] = settings.nats_url
        command.append("--insecure")
    process = await asyncio.create_subprocess_exec(
        *command, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    assert process.stdout is not None
    output: list[str] = []
    try:
        async with asyncio.timeout(120):
            while True:
                line = (await process.stdout.readline()).decode()
                if not line:
                    raise RunError("dracap up ended:\n" + "".join(output))
                output.append(line)
                if line.startswith(READY_LINE):
                    break
        drain = asyncio.create_task(_keep_output(process.stdout, args.up_log))
        connection = read_connection(work / "data")
        assert connection is not None
        credential = read_credential(connection.creds) if connection.creds else None
        yield Reach(connection.nats_url, credential, process.pid, metrics_port)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            try:
                async with asyncio.timeout(30):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
    drain.cancel()


async def _keep_output(stream: asyncio.StreamReader, path: str | None) -> None:
    """Read ``dracap up``'s output to the end (into ``path`` when given)."""
    sink = await asyncio.to_thread(open, path or os.devnull, "ab")
    try:
        while line := await stream.readline():
            sink.write(line)
    finally:
        sink.close()


async def measure(settings: Settings, args: argparse.Namespace) -> dict[str, float]:
    out: dict[str, float] = {}
    out["raw"] = await raw_commit_rate(settings.database_url, args.commits)
    print(f"  raw single-connection commits        {out['raw']:>10,.0f}/s", flush=True)
    names = BusNames(prefix=f"bench{uuid.uuid4().hex[:8]}")
    async with contextlib.AsyncExitStack() as cleanup:
        if not args.keep and args.insecure:  # the stream goes with the database
            cleanup.push_async_callback(_delete_stream, settings.nats_url, names.stream)
        await _measure_pipeline(settings, args, names, out)
    return out


async def _delete_stream(nats_url: str, stream: str) -> None:
    nc, js = await connect_bus(nats_url)
    try:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_stream(stream)
    finally:
        await nc.close()


class Phase(NamedTuple):
    """The figures of one ``--live`` phase."""

    live: int  #: claims live when it started
    fill_rate: float  #: claims/s while applying the live ones (0: none applied)
    p50_at_rate: float
    p99_at_rate: float
    throughput: float
    half_rate: float
    p50_at_half: float
    p99_at_half: float
    cpu_at_rate: float = 0.0  #: ms of ``dracap up``'s CPU per claim of the fixed-rate run
    cpu_sustained: float = 0.0  #: the same, of the sustained run
    #: ms of the whole machine's CPU per claim of the sustained run (every process on it)
    machine_sustained: float = 0.0
    #: the same per group of processes (:func:`cpu_split`)
    split_sustained: dict[str, float] = {}
    #: the runs (``rate``, ``sust``, ``half``) during which a snapshot was being encoded
    snapshots: tuple[str, ...] = ()
    #: the machine's pace just before the runs and just after them (:mod:`benchmarks.pace`,
    #: ms; 0: not taken)
    pace_ms: float = 0.0
    pace_after_ms: float = 0.0

    def pace(self) -> float:
        """The mean of the two paces (ms)."""
        return (self.pace_ms + self.pace_after_ms) / 2


async def growth(
    api: ApiClient, tracker: ReadyTracker, args: argparse.Namespace, url: str = "", pid: int = 0
) -> list[Phase]:
    """The ``--live`` phases (module docstring), one line printed per phase; ``pid``:
    ``dracap up``'s, whose CPU per claim of the fixed-rate and sustained runs is kept
    (the fixed rate's is the one to compare across N: same rate, same batching)."""
    phases: list[Phase] = []
    applied = 0  # claims of the "live" label so far
    pace = Pace()
    forks = ForkWatch(pid) if pid else None
    watching = asyncio.create_task(forks.run()) if forks is not None else None
    try:
        await throughput(api, tracker, min(100, args.claims), args.concurrency, "warm")
        for n in sorted(args.live):
            fill = 0.0
            if n > applied:
                fill = await throughput(
                    api, tracker, n - applied, args.concurrency, f"live{applied}-"
                )
                applied = n
            if pid:  # the phase is measured all the same
                await quiet(pid, forks, after="the fill" if fill else "the start")
            pace_ms = pace.measure()  # blocks this loop ~1 s: between runs, up quiet
            runs: dict[str, tuple[float, float]] = {}
            splits: dict[str, dict[str, float]] = {}
            step = functools.partial(_settled_run, url, args, pid, runs, splits)
            at, cpu_at, _ = await step(
                "rate", latency(api, tracker, args.live_rate, args.live_seconds, f"l{n}r")
            )
            sustained, cpu_sustained, machine_sustained = await step(
                "sust", throughput(api, tracker, args.claims, args.concurrency, f"l{n}tp")
            )
            half, cpu_half, _ = await step(
                "half", latency(api, tracker, sustained / 2, args.seconds, f"l{n}h")
            )
            pace_after_ms = pace.measure()
            phase = Phase(
                live=n,
                fill_rate=fill,
                p50_at_rate=percentile(at, 50),
                p99_at_rate=percentile(at, 99),
                throughput=sustained,
                half_rate=sustained / 2,
                p50_at_half=percentile(half, 50),
                p99_at_half=percentile(half, 99),
                cpu_at_rate=cpu_at * 1000 / max(1, len(at)),
                cpu_sustained=cpu_sustained * 1000 / max(1, args.claims),
                machine_sustained=machine_sustained * 1000 / max(1, args.claims),
                split_sustained={
                    group: cpu * 1000 / max(1, args.claims) for group, cpu in splits["sust"].items()
                },
                snapshots=forks.during(runs) if forks is not None else (),
                pace_ms=pace_ms,
                pace_after_ms=pace_after_ms,
            )
            phases.append(phase)
            print(
                f"  live {n:>7,}: at {args.live_rate:g}/s p50 {phase.p50_at_rate:6.1f} ms "
                f"p99 {phase.p99_at_rate:6.1f} ms | sustained {sustained:7,.0f}/s | "
                f"at {sustained / 2:,.0f}/s p50 {phase.p50_at_half:6.1f} ms "
                f"p99 {phase.p99_at_half:6.1f} ms"
                + (f" | filled at {fill:,.0f}/s" if fill else "")
                + f" | pace {pace_ms:.1f} ms, after {pace_after_ms:.1f}"
                + (f" | snapshot during: {', '.join(phase.snapshots)}" if phase.snapshots else ""),
                flush=True,
            )
            if getattr(args, "stages", False) and url:
                title = f"live {n:,} at {args.live_rate:g}/s"
                await report_stages(url, tracker, f"l{n}r", title, cpu_at)
                await report_stages(url, tracker, f"l{n}h", f"live {n:,} at half rate", cpu_half)
    finally:
        if watching is not None:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
    return phases


async def _settled_run(
    url: str,
    args: argparse.Namespace,
    pid: int,
    runs: dict[str, tuple[float, float]],
    splits: dict[str, dict[str, float]],
    label: str,
    run: Awaitable[R],
) -> tuple[R, float, float]:
    """``run`` once the subscribers caught up (:func:`settled`); what it returned, the
    CPU seconds ``dracap up`` (``pid``, 0: none) used meanwhile and those of the whole
    machine; its wall-clock start and end go into ``runs`` under ``label``
    (:meth:`ForkWatch.during`), the CPU seconds of each group of processes
    (:func:`cpu_split`) into ``splits``."""
    await settled(url, args)
    cpu, began = cpu_seconds(pid) if pid else 0.0, time.time()
    machine, processes = machine_cpu_seconds(), cpu_by_process(pid)
    result = await run
    runs[label] = (began, time.time())
    own = cpu_seconds(pid) - cpu if pid else 0.0
    splits[label] = cpu_split(processes, cpu_by_process(pid))
    return result, own, machine_cpu_seconds() - machine


def _pace_cell(phase: Phase) -> str:
    return f"{phase.pace_ms:.0f}/{phase.pace_after_ms:.0f}"


def report_growth(phases: list[Phase], raw: float, rate: float) -> None:
    """The ``--live`` table, each figure's change from the first phase, and the goals."""
    first = phases[0]
    print(f"\ngrowth (raw commit rate {raw:,.0f}/s; change from live {first.live:,}):")
    print(
        f"  {'live':>8} {'p50@' + format(rate, 'g'):>9} {'p99@' + format(rate, 'g'):>9} "
        f"{'claims/s':>9} {'p50@half':>9} {'p99@half':>9} {'cpu@' + format(rate, 'g'):>9} "
        f"{'cpu@sust':>9} {'mach@sust':>9} {'pace':>9}  snapshot during"
    )
    for p in phases:
        print(
            f"  {p.live:>8,} {p.p50_at_rate:>9.1f} {p.p99_at_rate:>9.1f} {p.throughput:>9,.0f} "
            f"{p.p50_at_half:>9.1f} {p.p99_at_half:>9.1f} {p.cpu_at_rate:>9.2f} "
            f"{p.cpu_sustained:>9.2f} {p.machine_sustained:>9.2f} {_pace_cell(p):>9}  "
            f"{','.join(p.snapshots) or '-'}"
        )
    print("  the sustained run's CPU per claim by process (ms):")
    print(f"  {'live':>8} " + " ".join(f"{group:>8}" for group in CPU_GROUPS))
    for p in phases:
        cells = " ".join(f"{p.split_sustained.get(group, 0.0):>8.3f}" for group in CPU_GROUPS)
        print(f"  {p.live:>8,} {cells}")
    if len(phases) > 1:
        last = phases[-1]
        for label, before, after in (
            ("p99 at the fixed rate", first.p99_at_rate, last.p99_at_rate),
            ("sustained throughput", first.throughput, last.throughput),
            ("p99 at half rate", first.p99_at_half, last.p99_at_half),
        ):
            print(f"  {label:<24} {(after / before - 1) * 100:+6.1f} %  [within +-20 %]")
        if first.pace() and last.pace():
            pace = "the machine's pace"
            print(
                f"  {pace:<24} {(last.pace() / first.pace() - 1) * 100:+6.1f} %"
                "  (the same fold timed before and after each phase: a figure that moved as much "
                "moved with the machine)"
            )
        bench_before, bench_after = (p.split_sustained.get("bench", 0.0) for p in (first, last))
        if bench_before and bench_after:
            print(
                f"  {'the load generator':<24} {(bench_after / bench_before - 1) * 100:+6.1f} %"
                "  (its CPU per claim in the sustained run, the same work at every N: "
                "the machine during the runs)"
            )
    print(f"  throughput / raw (first phase)  {first.throughput / raw:6.2f}x  [>= 0.5]")
    print(f"  p99 at {rate:g}/s (first phase)      {first.p99_at_rate:6.1f} ms [<= 35]")
    print(f"  p99 at half rate (first phase)  {first.p99_at_half:6.1f} ms [<= 50]")


async def _measure_pipeline(
    settings: Settings, args: argparse.Namespace, names: BusNames, out: dict[str, float]
) -> None:
    url = settings.database_url
    with (
        tempfile.TemporaryDirectory(prefix="dracap-bench-") as work,
        contextlib.ExitStack() as cleanup,
    ):
        quota = {MAX_CLAIMS: str(args.max_claims)} if args.max_claims else None
        async with (
            dracap_up(settings, args, names, Path(work), annotations=quota) as reach,
            stalls_are_run_errors(),
        ):
            login = reach.credential
            async with ApiClient.connect(reach.nats_url, names.prefix, login) as api:
                tracker = ReadyTracker(args.nodes if args.spread else 1)
                if args.timeline:
                    cleanup.callback(write_timeline, Path(args.timeline), tracker)
                async with watching(api, tracker):
                    if args.live:
                        phases = await growth(api, tracker, args, url, reach.pid)
                        report_growth(phases, out["raw"], args.live_rate)
                        return
                    await throughput(api, tracker, min(100, args.claims), args.concurrency, "warm")
                    await quiet(reach.pid, None, after="the start")
                    await settled(url, args)
                    appends = await appends_of(reach.metrics_port)
                    machine, own = machine_cpu_seconds(), cpu_seconds(reach.pid)
                    ledger = ledger_cpu_seconds(reach.pid)
                    processes, began = cpu_by_process(reach.pid), time.monotonic()
                    out["throughput"] = await throughput(
                        api, tracker, args.claims, args.concurrency
                    )
                    split = cpu_split(processes, cpu_by_process(reach.pid))
                    took = time.monotonic() - began
                    out["machine_ms"] = (machine_cpu_seconds() - machine) * 1000 / args.claims
                    out["own_ms"] = (cpu_seconds(reach.pid) - own) * 1000 / args.claims
                    ledger = ledger_cpu_seconds(reach.pid) - ledger
                    out["ledger_ms"] = ledger * 1000 / args.claims
                    print(
                        f"  apply -> Ready, sustained            {out['throughput']:>10,.0f}/s",
                        flush=True,
                    )
                    print(
                        f"  (CPU per claim of it: the machine {out['machine_ms']:.2f} ms, "
                        f"dracap up {out['own_ms']:.2f} ms, its audit and billing process "
                        f"{out['ledger_ms']:.2f} ms)",
                        flush=True,
                    )
                    cells = split_cells(split, args.claims) + busy(split, took)
                    print(f"  (by process, ms per claim: {cells})", flush=True)
                    appended = (await appends_of(reach.metrics_port)).since(appends, args.claims)
                    print(f"  ({appended})", flush=True)
                    await settled(url, args)
                    appends = await appends_of(reach.metrics_port)
                    cpu = cpu_seconds(reach.pid)
                    processes, began = cpu_by_process(reach.pid), time.monotonic()
                    lat = await latency(api, tracker, out["throughput"] / 2, args.seconds)
                    split = cpu_split(processes, cpu_by_process(reach.pid))
                    cells = split_cells(split, len(lat)) + busy(split, time.monotonic() - began)
                    print(f"  (the half-rate run by process, ms per claim: {cells})", flush=True)
                    appended = (await appends_of(reach.metrics_port)).since(appends, len(lat))
                    print(f"  (the half-rate run's {appended})", flush=True)
                    if args.stages:
                        cpu = cpu_seconds(reach.pid) - cpu
                        await report_stages(url, tracker, "lat", "the half-rate run", cpu)
                    for rate in args.rates:  # the curve below the half rate
                        await settled(url, args)
                        appends = await appends_of(reach.metrics_port)
                        cpu = cpu_seconds(reach.pid)
                        processes, began = cpu_by_process(reach.pid), time.monotonic()
                        at = await latency(api, tracker, rate, args.seconds, f"r{rate:g}")
                        split = cpu_split(processes, cpu_by_process(reach.pid))
                        took = time.monotonic() - began
                        cpu = cpu_seconds(reach.pid) - cpu
                        p50, p99 = percentile(at, 50), percentile(at, 99)
                        goal = "  [p99 <= 35]" if rate == 50 else ""
                        figures = f"p50 {p50:6.1f} ms   p99 {p99:6.1f} ms"
                        print(f"  at {rate:>6g} claims/s: {figures}{goal}", flush=True)
                        cells = split_cells(split, len(at)) + busy(split, took)
                        print(f"    (by process, ms per claim: {cells})")
                        appended = (await appends_of(reach.metrics_port)).since(appends, len(at))
                        print(f"    ({appended})", flush=True)
                        if args.stages:
                            label, title = f"r{rate:g}", f"{rate:g}/s"
                            await report_stages(url, tracker, label, title, cpu)
    out["p50"], out["p99"], out["max"] = percentile(lat, 50), percentile(lat, 99), lat[-1]
    out["rate"] = out["throughput"] / 2
    out["samples"] = len(lat)


@contextlib.asynccontextmanager
async def fresh_database(args: argparse.Namespace) -> AsyncIterator[Settings]:
    """A database of the run's own (:func:`benchmarks.databases.fresh`) on ``--admin-url``'s
    server, or on embedded servers started for the run (``--embedded``)."""
    async with contextlib.AsyncExitStack() as stack:
        admin_url, nats_url = args.admin_url, args.nats
        if args.embedded:
            data = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dracap-bench-")))
            servers = await stack.enter_async_context(embedded_servers(data))
            admin_url, nats_url = servers.admin_url, servers.nats_url
        made = databases.fresh(admin_url, pool=args.pool, nats_url=nats_url, keep=args.keep)
        yield await stack.enter_async_context(made)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """``--admin-url`` (a fresh database is made on that server) and ``--nats``."""
    databases.add_admin_url(parser)
    parser.add_argument(
        "--nats", default=os.environ.get("DRACAP_TEST_NATS_URL", "nats://127.0.0.1:4222")
    )


def report(r: dict[str, float]) -> None:
    ratio = r["throughput"] / r["raw"]
    print(f"\nlatency at {r['rate']:,.0f} claims/s ({r['samples']:.0f} claims):")
    print(f"  p50 {r['p50']:.1f} ms   p99 {r['p99']:.1f} ms   max {r['max']:.1f} ms")
    print("\nratios (goal in brackets):")
    print(f"  throughput / raw commit rate         {ratio:6.2f}x  [>= 0.5]")
    if r.get("machine_ms"):  # what the machine's cores allow at that CPU per claim
        cores = os.cpu_count() or 1
        bound = cores * 1000 / r["machine_ms"]
        print(
            f"  the machine's bound ({cores} cores / {r['machine_ms']:.2f} ms per claim) "
            f"{bound:,.0f}/s = {bound / r['raw']:.2f}x"
        )
    if r.get("own_ms"):  # dracap up's services share one thread
        bound = 1000 / r["own_ms"]
        print(
            f"  dracap up's thread's bound (1 / {r['own_ms']:.2f} ms per claim) "
            f"{bound:,.0f}/s = {bound / r['raw']:.2f}x"
        )
    print(f"  p99 apply->Ready at half max rate    {r['p99']:6.1f} ms [<= 50]")


async def main(args: argparse.Namespace) -> None:
    # The load generator's own collector pauses would be charged to the system: keep
    # what the imports made out of its collections and collect as `dracap up` does.
    gc.freeze()
    tune_for_long_lived_state()
    async with fresh_database(args) as settings:
        print(f"database {settings.database_url.rsplit('/', 1)[1]}:", flush=True)
        results = await measure(settings, args)
    if not args.live:
        report(results)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--claims", type=int, default=2000, help="claims of the throughput run")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=256,
        help="applies in flight in the throughput run (enough to saturate: a closed loop "
        "with too few measures in-flight / latency, not capacity)",
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the latency run")
    parser.add_argument("--commits", type=int, default=2000, help="raw commits timed")
    parser.add_argument("--nodes", type=int, default=4, help="nodes (one agent each)")
    parser.add_argument(
        "--spread",
        action="store_true",
        help="claims on every node, evenly (default: all on the first node's first GPU)",
    )
    parser.add_argument(
        "--live",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[],
        metavar="N,N,...",
        help="growth: for each N, apply claims until N are live, then measure (docstring)",
    )
    parser.add_argument(
        "--live-rate", type=float, default=50.0, help="the fixed rate of a --live phase"
    )
    parser.add_argument(
        "--live-seconds",
        type=float,
        default=20.0,
        help="the length of a --live phase's fixed-rate run",
    )
    parser.add_argument(
        "--gpu-memory", help="each GPU's memory (default: 1000Gi, or enough for --live)"
    )
    parser.add_argument("--workers", type=int, default=1, help="reservation workers")
    parser.add_argument("--pool", type=int, default=10, help="asyncpg pool size")
    add_server_arguments(parser)
    parser.add_argument("--embedded", action="store_true", help="start embedded servers instead")
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="run dracap up --insecure on --nats (default: secure, with its own nats-server)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the benchmark database")
    parser.add_argument(
        "--no-settle",
        action="store_true",
        help="start each run at once, not after the subscribers caught up (docstring)",
    )
    parser.add_argument(
        "--stages",
        action="store_true",
        help="after each latency run, p50/p99 of each step apply -> submitted -> admitted -> "
        "capacity_reserved -> allocation_bound -> limit_applied -> ready (the log's times)",
    )
    parser.add_argument(
        "--max-claims",
        type=int,
        metavar="N",
        help="give the tenant a quota of N live claims (dracap.io/max-claims; large enough "
        "never to refuse): every admission then carries its quota premise to the database",
    )
    parser.add_argument("--up-log", metavar="FILE", help="append dracap up's output to FILE")
    parser.add_argument(
        "--timeline",
        metavar="FILE",
        help="write every claim's run, send time and apply->Ready latency to FILE (CSV)",
    )
    parser.add_argument(
        "--rates",
        type=lambda text: [float(r) for r in text.split(",") if r],
        default=[],
        metavar="R,R,...",
        help="also measure apply->Ready at these fixed rates (claims/s)",
    )
    return parser.parse_args(argv)


def cli(argv: list[str] | None = None) -> int:
    """Run the benchmark; a server it cannot use, or a run that stalls, ends it with one
    line on stderr and exit status 1; Ctrl-C or SIGTERM, once what it started is stopped,
    with one line and status 130 (:mod:`benchmarks.stopping`); never a traceback."""
    args = parse(argv)
    try:
        eventloop.run(stopping.stoppable(main(args)))  # the services' loop: uvloop
    except (EndpointError, RunError) as exc:
        stalled = isinstance(exc, RunError) and not args.up_log
        hint = " (--up-log FILE keeps dracap up's output)" if stalled else ""
        print(f"pipeline: {exc}{hint}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C, SIGTERM
        stopping.say_interrupted("pipeline")
        return stopping.INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(cli())
