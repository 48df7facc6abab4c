"""How long a standby relay takes over: two ``dracap serve relay``, the active one killed
or paused, under a steady stream of appends.

On a fresh database (``--admin-url``) and the given nats-server, two relay processes run
with one subject prefix, each with its metrics port; this process appends a batch of
events every ``--interval`` seconds from its own store. Each round faults the relay
whose ``dracap_service_active`` is 1:

* ``kill``: SIGKILL (its session ends with its socket: the lock is released at once);
* ``pause``: SIGSTOP (its session stays open until the server's ``idle_session_timeout``
  ends it, :data:`services.runtime.ops.leadership.TTL_S`), SIGCONT once the other took over.

and measures, from the moment the faulted relay can publish no more (its process
reaped, or its state ``T``):

* **lease**: until the other relay's ``dracap_service_active`` is 1;
* **publishing**: until the stream holds an event appended after that moment (the
  stream's message count passes the log's head read then): the takeover as the
  consumers see it.

A killed relay is started again (it stands by); a paused one, continued, finds its lease
gone and stands by too. At the end the stream must hold the log once (its message count
is the log's head): each round's republished window was dropped as duplicates. Report
the table with the command.

Usage::

    .venv/bin/python -m benchmarks.takeover --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from benchmarks import stopping
from benchmarks.pipeline import add_server_arguments, fresh_database, scrape
from events.subjects import BusNames
from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import EventStore
from tests.integration.test_bus import append_burst

Rounds = dict[str, list[tuple[float, float]]]
ACTIVE = ("dracap_service_active", '{service="relay"}')


class Relays:
    """Two relay processes and their metrics ports."""

    def __init__(self, settings: Settings, names: BusNames, work: Path) -> None:
        self.settings, self.names, self.work = settings, names, work
        self.processes: dict[int, asyncio.subprocess.Process] = {}  # port -> process

    async def start(self) -> int:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
        argv = [sys.executable, "-m", "services.cli", "serve", "relay"]
        argv += ["--database-url", self.settings.database_url, "--nats", self.settings.nats_url]
        argv += ["--prefix", self.names.prefix, "--data-dir", str(self.work)]
        argv += ["--metrics-port", str(port)]
        with (self.work / f"relay-{port}.log").open("wb") as log:
            self.processes[port] = await asyncio.create_subprocess_exec(
                *argv, stdout=log, stderr=log
            )
        await until(lambda: asyncio.to_thread(_answers, port), "a relay's metrics", 60)
        return port

    async def active(self) -> int:
        async def find() -> int | None:
            for port in self.processes:
                if await asyncio.to_thread(_active, port):
                    return port
            return None

        found: int = await until(find, "an active relay", 60)
        return found

    async def stop(self) -> None:
        for process in self.processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGCONT)
                    process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            await process.wait()


def _answers(port: int) -> bool:
    try:
        scrape(port, "dracap_build_info")
    except OSError:
        return False
    return True


def _active(port: int) -> bool:
    try:
        return scrape(port, *ACTIVE) == 1
    except OSError:
        return False


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("T")


async def until(check, what: str, within: float):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not (value := await check()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)
    return value


async def _messages(js, names: BusNames) -> int:  # type: ignore[no-untyped-def]
    return int((await js.stream_info(names.stream)).state.messages)


async def fault(relays: Relays, store: EventStore, js, kind: str) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """One fault of the active relay: (lease, publishing) seconds."""
    port = await relays.active()
    process = relays.processes[port]
    if kind == "kill":
        process.send_signal(signal.SIGKILL)
        await process.wait()
    else:
        process.send_signal(signal.SIGSTOP)
        await until(lambda: asyncio.to_thread(_stopped, process.pid), "the relay stopped", 10)
    began, head = time.monotonic(), await store.head()
    other = next(p for p in relays.processes if p != port)
    await until(lambda: asyncio.to_thread(_active, other), "the takeover", 60)
    lease = time.monotonic() - began
    await until(lambda: _passed(js, relays.names, head), "publishing", 60)
    publishing = time.monotonic() - began
    if kind == "kill":
        del relays.processes[port]
        await relays.start()
    else:
        process.send_signal(signal.SIGCONT)
        await until(lambda: asyncio.to_thread(lambda: not _active(port)), "standing by", 60)
    return lease, publishing


async def _passed(js, names: BusNames, head: int) -> bool:  # type: ignore[no-untyped-def]
    return await _messages(js, names) > head


async def _load(store: EventStore, interval: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await append_burst(store, 10, 10)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


@contextlib.asynccontextmanager
async def _running(settings: Settings, names: BusNames, work: Path) -> AsyncIterator[Relays]:
    relays = Relays(settings, names, work)
    try:
        await relays.start()
        await relays.active()
        await relays.start()
        yield relays
    finally:
        await relays.stop()


async def measure(
    settings: Settings, args: argparse.Namespace
) -> dict[str, list[tuple[float, float]]]:
    names = BusNames(prefix=f"b{uuid.uuid4().hex[:8]}")
    results: Rounds = {kind: [] for kind in args.faults}
    work = Path(tempfile.mkdtemp(prefix="dracap-takeover-"))
    nc, js = await connect_bus(settings.nats_url)
    stop = asyncio.Event()
    async with await EventStore.open(settings) as store, _running(settings, names, work) as relays:
        load = asyncio.create_task(_load(store, args.interval, stop))
        try:
            for _ in range(args.rounds):
                for kind in args.faults:
                    results[kind].append(await fault(relays, store, js, kind))
        finally:
            stop.set()
            await load
        head = await store.head()
        await until(lambda: _passed(js, names, head - 1), "the stream caught up", 60)
        held = await _messages(js, names)
        print(f"log {head} events, stream {held} messages (equal: nothing stored twice)")
        await js.delete_stream(names.stream)
    await nc.close()
    return results


def report(results: Rounds) -> None:
    print(f"{'fault':<7} {'n':>3} {'lease p50':>10} {'max':>7} {'publishing p50':>15} {'max':>7}")
    for kind, rows in results.items():
        lease, publishing = [r[0] for r in rows], [r[1] for r in rows]
        print(
            f"{kind:<7} {len(rows):>3} {statistics.median(lease):>9.2f}s {max(lease):>6.2f}s "
            f"{statistics.median(publishing):>14.2f}s {max(publishing):>6.2f}s"
        )


async def main(args: argparse.Namespace) -> None:
    async with fresh_database(args) as settings:
        report(await measure(settings, args))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5, help="faults of each kind")
    parser.add_argument(
        "--faults", default="kill,pause", type=lambda s: s.split(","), help="kill,pause"
    )
    parser.add_argument("--interval", type=float, default=0.01, help="seconds between appends")
    parser.add_argument("--pool", type=int, default=4)
    parser.add_argument("--embedded", action="store_true", help="start embedded servers")
    parser.add_argument("--keep", action="store_true", help="keep the benchmark database")
    return parser.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("DRACAP_LOG_LEVEL", "WARNING")
    stopping.run("takeover", main(parse()))
