"""The fault harness: an installation of replicated servers and services, a claim workload,
and faults on a schedule (issue 29, item 4).

Everything runs on loopback (:mod:`benchmarks.hatopology`): three clustered nats-servers
with JetStream, a PostgreSQL primary with a synchronous streaming standby, two processes
of every service (each with its own NATS credential and database login), one node agent
per node. The tenants' side is this process: ``--workers`` tenants, each applying a
claim, keeping it a moment and deleting it (``--rate`` operations a second in all), an
operation asked again until the claims API acknowledges it (asking twice changes
nothing). Two nodes of two GPUs of 8Gi take claims of 2, 4 or 6Gi: a claim may wait
for another's release, so the capacity check has something to check.

The schedule is ``--rounds`` rounds of one fault of each kind (:data:`KINDS`), in turn:

* ``nats-kill``: SIGKILL to one nats-server (each in turn), started again after
  ``--hold`` seconds; ``nats-pause``: SIGSTOP, SIGCONT after ``--hold``;
* ``service-kill``: SIGKILL to one replica of every service at once (the first
  replicas, then the second ones), each started again after ``--hold`` (as a
  supervisor would); ``service-pause``: SIGSTOP to them, SIGCONT after ``--hold``;
* ``postgres-failover``: SIGKILL to the primary's every process, the standby promoted
  one second later (a failover manager), and — once the faults' checks passed — the
  lost primary rebuilt as the new standby, synchronous again;
* ``postgres-pause``: SIGSTOP to the primary's every process, SIGCONT after ``--hold``.

A fault starts after ``--gap`` quiet seconds; with it a probe claim is applied (asked
again until acknowledged). The fault has **converged** when the probe is Ready and every
claim acknowledged before the fault is in its end state (Ready, or released/withdrawn
once the log holds its delete), read from the log (:mod:`benchmarks.hachecks`); the time
from the fault's start to then is its convergence time. After each fault, and at the end
(the workload stopped, every claim converged), the harness checks: every acknowledged
apply and delete is in the log; no device ever held more than its total (the log
replayed); the fold refused nothing; ``replay verify`` is clean. It prints each kind's
convergence p50 / p99 / max and the throughput (acknowledged operations a second)
during faults (from a fault's start to its convergence) and without; exit 1 on any
finding. A service process that ends on its own is started again, as a supervisor
would, and named at the end with its last log line (a process that is starting when
the database fails over exits: a server it cannot reach at its start is exit 1), as is
every service log that holds a traceback.

Usage::

    .venv/bin/python -m benchmarks.ha --rounds 5            # each kind 5 times
    .venv/bin/python -m benchmarks.ha --rounds 1 --gap 2    # one of each (the test)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import random
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import nats
from nats.aio.client import Client

from benchmarks.hachecks import Book, DeviceKey, LogView, findings, told, unconverged
from benchmarks.hatopology import NAMESPACE, PREFIX, Topology, running_topology
from events.quantities import Quantity
from events.subjects import BusNames
from services.replay.verify import summary, verify
from services.runtime.bus.apiclient import ApiClient, ApiError
from services.runtime.bus.credentials import Credential
from services.runtime.bus.endpoints import ServerUnavailable
from services.runtime.ground.settings import Settings

KINDS: Final = (
    "nats-kill",
    "nats-pause",
    "service-kill",
    "service-pause",
    "postgres-failover",
    "postgres-pause",
)
NODES: Final = ["node-a", "node-b"]
DRIVER: Final = "gpu.ha.dracap.io"
GPUS_PER_NODE: Final = 2
GPU_MEMORY_GI: Final = 8
SIZES_GI: Final = (2, 4, 6)
REQUEST_TIMEOUT_S: Final = 5.0
CONVERGE_S: Final = 180.0  #: a fault that has not converged by then is a finding
PROMOTE_AFTER_S: Final = 1.0


# --- the inventory and the claims -----------------------------------------------------------


def _inventory() -> list[tuple[str, dict[str, Any]]]:
    """The admin API's operations that load the class and every node's slice."""
    v1 = "resource.k8s.io/v1"
    cel = {"cel": {"expression": f'device.driver == "{DRIVER}"'}}
    device_class = {"metadata": {"name": DRIVER}, "spec": {"selectors": [cel]}}
    found = [("deviceclasses.apply", {"apiVersion": v1, "kind": "DeviceClass", **device_class})]
    memory = {"memory": {"value": f"{GPU_MEMORY_GI}Gi"}}
    for node in NODES:
        devices = [
            {"name": f"gpu-{i}", "allowMultipleAllocations": True, "capacity": memory}
            for i in range(GPUS_PER_NODE)
        ]
        pool = {"name": node, "generation": 1, "resourceSliceCount": 1}
        spec = {"driver": DRIVER, "nodeName": node, "devices": devices, "pool": pool}
        rslice = {"metadata": {"name": f"{node}-gpus"}, "spec": spec}
        found.append(("slices.apply", {"apiVersion": v1, "kind": "ResourceSlice", **rslice}))
    return found


def _totals() -> dict[DeviceKey, Quantity]:
    total = Quantity.parse(f"{GPU_MEMORY_GI}Gi")
    return {(DRIVER, n, f"gpu-{i}"): total for n in NODES for i in range(GPUS_PER_NODE)}


def _claim(name: str, size_gi: int) -> bytes:
    exactly = {"deviceClassName": DRIVER, "capacity": {"requests": {"memory": f"{size_gi}Gi"}}}
    doc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }
    return json.dumps(doc).encode()


# --- the tenants' side ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _client(url: str, credential: Credential) -> AsyncIterator[ApiClient]:
    """An API client whose connection goes on reconnecting for as long as the run lasts
    (a CLI command's gives up after one try per server)."""

    async def quiet(exc: Exception) -> None:
        return None  # a lost server is what the harness does; the requests tell

    nc: Client = await nats.connect(
        servers=url.split(","),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
        ping_interval=1,
        max_outstanding_pings=2,
        error_cb=quiet,
        **credential.connect_options(),
    )
    try:
        yield ApiClient(nc, BusNames(prefix=PREFIX), timeout=REQUEST_TIMEOUT_S)
    finally:
        await nc.close()


async def _until_acknowledged(ask: Callable[[], Awaitable[Any]], stop_at: float) -> None:
    """Ask until the API answers (any answer but a refusal to serve is an answer)."""
    while True:
        try:
            await ask()
            return
        except ApiError as exc:
            if exc.code != "unavailable" or time.monotonic() > stop_at:
                raise
        except Exception:
            if time.monotonic() > stop_at:
                raise
        await asyncio.sleep(0.2)


@dataclass
class Workload:
    """The tenants: apply, keep a moment, delete; each operation asked until acknowledged."""

    api: ApiClient
    book: Book
    rate: float
    workers: int
    rng: random.Random
    acks: list[float] = field(default_factory=list)
    _names: itertools.count[int] = field(default_factory=itertools.count)

    async def apply(self, name: str) -> None:
        size = self.rng.choice(SIZES_GI)
        deadline = time.monotonic() + CONVERGE_S
        body = _claim(name, size)
        replies: list[dict[str, Any]] = []

        async def ask() -> None:
            replies.append(await self.api.claims(NAMESPACE, "apply", body))

        await _until_acknowledged(ask, deadline)
        self.book.replies[name] = str(replies[-1].get("claim", {}).get("phase"))
        self.book.applied[name] = now = time.monotonic()
        self.acks.append(now)

    async def delete(self, name: str) -> None:
        deadline = time.monotonic() + CONVERGE_S
        body = {"name": name}
        await _until_acknowledged(lambda: self.api.claims(NAMESPACE, "delete", body), deadline)
        self.book.deleted[name] = now = time.monotonic()
        self.acks.append(now)

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(*(self._tenant(stop) for _ in range(self.workers)))

    async def _tenant(self, stop: asyncio.Event) -> None:
        period = 2 * self.workers / self.rate  # two operations a cycle
        while not stop.is_set():
            started = time.monotonic()
            name = f"c{next(self._names):05d}"
            await self.apply(name)
            await _pause(stop, self.rng.uniform(0.3, 0.7) * period)
            if stop.is_set():
                return  # left live: the end checks it is Ready
            await self.delete(name)
            await _pause(stop, period - (time.monotonic() - started))


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    if seconds > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)


# --- faults ---------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    target: str
    started: float
    converged_s: float | None = None
    problems: list[str] = field(default_factory=list)


class Injector:
    """Applies each kind of fault to the topology (see the module docstring)."""

    def __init__(self, topology: Topology, hold_s: float) -> None:
        self.topology, self.hold_s = topology, hold_s
        self.count: dict[str, int] = {}

    async def inject(self, kind: str) -> tuple[str, asyncio.Task[None]]:
        """Start the fault; its target and the task that ends it (restarts, resumes)."""
        n = self.count[kind] = self.count.get(kind, -1) + 1
        topology = self.topology
        if kind.startswith("nats-"):
            node = topology.nats.nodes[n % len(topology.nats.nodes)]
            if kind == "nats-kill":
                topology.nats.kill(node)
                return node.name, self._later(lambda: topology.nats.restart(node))
            topology.nats.pause(node)
            return node.name, self._later(lambda: topology.nats.resume(node))
        if kind.startswith("service-"):
            index = n % 2
            replicas = [g[index] for s, g in topology.processes.items() if s != "agent"]
            for process in replicas:
                (topology.kill if kind == "service-kill" else topology.pause)(process)

            def end() -> None:
                for process in replicas:
                    process.start() if kind == "service-kill" else topology.resume(process)

            return f"replica {index} of each", self._later(end, blocking=False)
        if kind == "postgres-failover":
            target = topology.pg.primary.name
            topology.pg.kill_primary()
            task = self._later(topology.pg.promote, PROMOTE_AFTER_S)
            return target, task
        topology.pg.pause_primary()
        return topology.pg.primary.name, self._later(topology.pg.resume_primary)

    def _later(
        self, end: Callable[[], None], after: float | None = None, *, blocking: bool = True
    ) -> asyncio.Task[None]:
        """``end`` after the hold (or ``after`` s): in a thread when it waits on a server,
        on the loop when it starts processes (as the supervisor does: never both at once)."""

        async def run() -> None:
            await asyncio.sleep(self.hold_s if after is None else after)
            if blocking:
                await asyncio.to_thread(end)
            else:
                end()

        return asyncio.create_task(run())


# --- the run --------------------------------------------------------------------------------


class Harness:
    def __init__(self, topology: Topology, args: argparse.Namespace) -> None:
        self.topology = topology
        self.args = args
        self.book = Book()
        settings = Settings(database_url=topology.admin_url, failover_timeout_s=CONVERGE_S)
        self.settings = settings
        self.view = LogView(settings, NAMESPACE, _totals())
        self.faults: list[Fault] = []
        self.problems: list[str] = []
        self.restarts: list[str] = []  #: processes that ended on their own, started again

    async def supervise(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.restarts += self.topology.supervise()  # (on the loop: faults are too)
            await _pause(stop, 0.5)

    async def refresh(self) -> None:
        with contextlib.suppress(Exception):  # (a failover: read again on the next call)
            await self.view.refresh()

    async def converge(self, names: list[str], within: float) -> bool:
        deadline = time.monotonic() + within
        while True:
            await self.refresh()
            if not unconverged(self.book, self.view, names):
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.25)

    async def check(self, when: str) -> list[str]:
        """Every check of the module docstring, now; what failed."""
        read_at = time.monotonic()  # (the tenants go on meanwhile)
        for attempt in range(3):
            try:
                await self.view.refresh()
                break
            except Exception:  # a connection lost in a failover: one more on a new one
                if attempt == 2:
                    raise
        found = findings(self.book, self.view, read_at)
        report = await verify(self.settings)
        if not report.ok:
            found.append(f"replay verify: {summary(report)}")
        return [f"{when}: {f}" for f in found]

    async def fault(self, kind: str, injector: Injector, workload: Workload) -> Fault:
        before = list(self.book.applied)
        started = time.monotonic()
        target, ending = await injector.inject(kind)
        fault = Fault(kind, target, started)
        probe = f"probe-{len(self.faults):03d}"
        try:
            await workload.apply(probe)
            if await self.converge([*before, probe], CONVERGE_S):
                fault.converged_s = time.monotonic() - started
            else:
                late = unconverged(self.book, self.view, [*before, probe])
                where = "; ".join(told(self.book, self.view, n) for n in late[:3])
                fault.problems.append(
                    f"did not converge in {CONVERGE_S:.0f} s: {late[:10]}; {where}"
                )
        finally:
            await ending
        fault.problems += await self.check(f"after {kind} #{injector.count[kind]} ({target})")
        if kind == "postgres-failover":
            await asyncio.to_thread(self.topology.pg.rebuild_standby)
        await workload.delete(probe)
        return fault

    async def run(self) -> int:
        operator = self.topology.auth.operator()
        tenant = self.topology.auth.tenant(NAMESPACE, NAMESPACE)
        done = asyncio.Event()
        # from the start, as a supervisor would: a process may end while the servers
        # settle (both claims APIs did once, their first flush lost in a reconnect)
        supervisor = asyncio.create_task(self.supervise(done))
        try:
            async with _client(self.topology.nats.url, operator) as admin:
                deadline = time.monotonic() + 120
                for op, body in _inventory():
                    await _until_acknowledged(functools.partial(admin.admin, op, body), deadline)
                access = {"namespace": NAMESPACE, "classes": ["*"]}
                await _until_acknowledged(
                    lambda: admin.admin("namespaces.access", access), deadline
                )
            return await self._run(tenant)
        finally:
            done.set()
            await supervisor

    async def _run(self, tenant: Credential) -> int:
        args = self.args
        async with _client(self.topology.nats.url, tenant) as api:
            workload = Workload(api, self.book, args.rate, args.workers, random.Random(args.seed))
            await workload.apply("warm-up")
            if not await self.converge(["warm-up"], CONVERGE_S):
                self.problems.append("the installation never made a claim Ready")
                return self.report(workload, 0.0)
            stop = asyncio.Event()
            began = time.monotonic()
            tenants = asyncio.create_task(workload.run(stop))
            injector = Injector(self.topology, args.hold)
            try:
                for _ in range(args.rounds):
                    for kind in KINDS:
                        await asyncio.sleep(args.gap)
                        fault = await self.fault(kind, injector, workload)
                        self.faults.append(fault)
                        self.problems += fault.problems
                        self.progress(fault)
            finally:
                stop.set()
                await tenants
            ran = time.monotonic() - began
            if not await self.converge(list(self.book.applied), CONVERGE_S):
                late = unconverged(self.book, self.view)
                told_ = "; ".join(told(self.book, self.view, n) for n in late[:10])
                self.problems.append(f"at the end, not converged: {told_}")
            self.problems += await self.check("at the end")
            return self.report(workload, ran)

    def progress(self, fault: Fault) -> None:
        took = "-" if fault.converged_s is None else f"{fault.converged_s:.2f} s"
        ok = "ok" if not fault.problems else f"{len(fault.problems)} problem(s)"
        print(f"{fault.kind:18} {fault.target:22} converged after {took:>9}  {ok}", flush=True)
        for problem in fault.problems:
            print(f"  ! {problem}", flush=True)

    def report(self, workload: Workload, ran: float) -> int:
        print()
        print(f"{'fault':18} {'n':>3} {'p50 s':>7} {'p99 s':>7} {'max s':>7}")
        for kind in KINDS:
            times = sorted(f.converged_s for f in self.faults if f.kind == kind and f.converged_s)
            if times:
                p50, p99 = _percentile(times, 50), _percentile(times, 99)
                print(f"{kind:18} {len(times):3d} {p50:7.2f} {p99:7.2f} {times[-1]:7.2f}")
        during, quiet = _throughput(workload.acks, self.faults, ran)
        print(f"throughput (acknowledged operations/s): {quiet:.2f} without faults, "
              f"{during:.2f} during them")  # fmt: skip
        print(f"claims applied: {len(self.book.applied)}, deleted: {len(self.book.deleted)}, "
              f"log head: {self.view.state.position}")  # fmt: skip
        print(f"load (uptime): {_uptime()}")
        for restart in self.restarts:
            print(f"noted: ended on its own and started again: {restart[:300]}")
        for log, ends in self.topology.tracebacks().items():
            for end in ends:
                print(f"noted: a traceback in {log}'s log: {end}")
        for problem in self.problems:
            print(f"FAIL {problem}")
        print("PASS" if not self.problems else f"FAIL: {len(self.problems)} finding(s)")
        return 0 if not self.problems else 1


def _percentile(values: list[float], pct: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[pct - 1]


def _throughput(acks: list[float], faults: list[Fault], ran: float) -> tuple[float, float]:
    """Acknowledged operations a second inside the faults' windows, and outside them."""
    windows = [(f.started, f.started + f.converged_s) for f in faults if f.converged_s]
    inside = sum(1 for t in acks if any(a <= t <= b for a, b in windows))
    span = sum(b - a for a, b in windows)
    outside_span = max(ran - span, 1e-9)
    return inside / span if span else 0.0, (len(acks) - inside) / outside_span


def _uptime() -> str:
    with open("/proc/loadavg") as handle:
        return "load average " + " ".join(handle.read().split()[:3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="faults of each kind")
    parser.add_argument("--rate", type=float, default=4.0, help="operations a second, all tenants")
    parser.add_argument("--workers", type=int, default=4, help="tenants (claims live at once)")
    parser.add_argument("--hold", type=float, default=3.0, help="seconds a fault lasts")
    parser.add_argument("--gap", type=float, default=5.0, help="quiet seconds before a fault")
    parser.add_argument("--seed", type=int, default=29)
    parser.add_argument("--keep", action="store_true", help="keep the directory with the logs")
    args = parser.parse_args(argv)

    async def run() -> int:
        this = asyncio.current_task()
        assert this is not None
        # SIGTERM (a test's timeout) stops every process and server the run started
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, this.cancel)
        async with running_topology(NODES, keep=args.keep) as topology:
            harness = Harness(topology, args)
            try:
                return await harness.run()
            finally:
                await harness.view.close()

    try:
        return asyncio.run(run())
    except asyncio.CancelledError:  # SIGTERM: everything it started is stopped
        print("stopped (SIGTERM)", file=sys.stderr)
        return 130
    except ServerUnavailable as exc:  # e.g. no API answered in time: the logs' ends above
        print(f"FAIL: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
