"""Memory per live claim: ``dracap up``'s resident memory, and the fold's snapshot.

Two parts (issue 25, build 5; ``docs/services.md`` has the figures):

1. **Resident memory of** ``dracap up`` **per 1,000 live claims** (``--kinds``; skipped
   with ``--no-up``). For each kind, a fresh database and a fresh ``dracap up`` process
   (the same one ``benchmarks/pipeline.py`` starts: relay, live state, claims API,
   reservation, an agent per node, audit, billing, snapshots, SLO tracker,
   reclamation), whose tenant may pass opaque configuration. After a warm-up of 100
   small claims, its resident set (``VmRSS``) is read, with that of its child ``dracap
   serve ledger`` (audit and billing, a process of their own since 2026-12-05: the
   figures are the sum, and the ledger's part is printed beside); then ``--claims``
   claims of the kind are applied (``--concurrency`` in flight) and left live, each
   waited for until its watch says it was decided (``ready``, or ``unschedulable``); after
   ``--settle`` seconds the resident set is read again, halfway and at the end. The
   figures are the growth per 1,000 claims over all of them, and over the second half
   alone: by then the bounded caches (the consumers' confirmation window of 16,384
   events, ``services/runtime/delivery/confirming.py``) are full, so it is what one more live
   claim costs. Kinds:

   * ``small``: the pipeline's claim (one request for 1Gi of a GPU), Ready;
   * ``large``: the same with ``--config-entries`` (default 1) opaque configurations of
     ``--config-bytes`` (default 10,000) each, Ready (its allocation carries them too);
   * ``unschedulable``: the large claim with a selector no device matches: it waits,
     and the reservation service keeps it pending (the shape of the issue's 200 claims).

   Resident memory is what the kernel says the process holds, allocator slack and all:
   a figure to compare back to back on one machine, not an exact size of the state.

2. **Snapshot size** (``--snapshot-events N``; 0: skipped): the fold of ``N`` events of
   ``benchmarks/eventlog.py``'s history encoded as a snapshot body (JSON) and as the
   database stores it (zlib level 1). ``--manifests`` says what each claim's lifecycle
   starts with: ``none`` (no ``ClaimSubmitted``, the history the figures of
   ``docs/forensics.md`` were measured on), ``small`` (the small claim's manifest) or
   ``large`` (with ``--config-bytes`` of configuration).

Usage::

    .venv/bin/python -m benchmarks.memory --claims 3000 --insecure
    .venv/bin/python -m benchmarks.memory --no-up --snapshot-events 1000000 --manifests small
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

from benchmarks import pipeline, stopping
from benchmarks.eventlog import history
from events.state import ClusterState
from events.statecodec import snapshot_encode
from events.subjects import BusNames
from services.replay.verify import fold_rows, paused_gc
from services.runtime.bus.apiclient import ApiClient
from services.runtime.bus.flushing import flushed
from services.runtime.ground.gctuning import tune_for_long_lived_state

KINDS = ("small", "large", "unschedulable")
DECIDED = ("ready", "unschedulable")


def claim_body(name: str, kind: str, config_bytes: int, entries: int = 1) -> bytes:
    """The manifest of one claim of ``kind`` (module docstring); a large one has
    ``entries`` configurations of ``config_bytes`` each."""
    body = json.loads(pipeline.claim(name))
    devices = body["spec"]["devices"]
    if kind != "small":
        filler = "x" * max(0, config_bytes - 64)
        parameters = {"apiVersion": "gpu.bench.dracap.io/v1", "kind": "Tuning", "notes": filler}
        entry = {"opaque": {"driver": pipeline.DRIVER, "parameters": parameters}}
        devices["config"] = [entry] * entries
    if kind == "unschedulable":  # a GPU of a model no node has: it waits
        selector = {"cel": {"expression": 'device.driver == "elsewhere.example.com"'}}
        devices["requests"][0]["exactly"]["selectors"] = [selector]
    return json.dumps(body).encode()


def resident_bytes(pid: int) -> int:
    """``VmRSS`` of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def up_resident_bytes(pid: int) -> tuple[int, int]:
    """``VmRSS`` of ``dracap up`` (``pid``) and of its audit and billing process (0 when
    it has none): the memory the machine holds for it is their sum."""
    ledger = pipeline.ledger_pid(pid)
    return resident_bytes(pid), 0 if ledger is None else resident_bytes(ledger)


class Decided:
    """Waits for claims until their watch update says they were decided."""

    def __init__(self) -> None:
        self.waiters: dict[str, asyncio.Future[None]] = {}

    def on_view(self, view: dict[str, Any]) -> None:
        waiter = self.waiters.get(view.get("name", ""))
        if view.get("phase") in DECIDED and waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def apply(self, api: ApiClient, name: str, body: bytes) -> None:
        waiter = self.waiters[name] = asyncio.get_running_loop().create_future()
        reply = await api.claims(pipeline.NAMESPACE, "apply", body)
        self.on_view(reply["claim"])
        try:
            await asyncio.wait_for(waiter, 120)
        except TimeoutError:
            view = (await api.claims(pipeline.NAMESPACE, "get", {"name": name}))["claim"]
            raise RuntimeError(f"{name} not decided in 120 s: {view['phase']}") from None
        finally:
            del self.waiters[name]


async def apply_all(
    api: ApiClient, kind: str, count: int, args: argparse.Namespace, label: str = ""
) -> None:
    """Apply ``count`` claims of ``kind`` (named ``{label or kind}-{i}``), each decided."""
    decided = Decided()
    subject = (await api.claims(pipeline.NAMESPACE, "watch", {"name": None}))["subject"]

    async def on_message(msg: Any) -> None:
        decided.on_view(json.loads(msg.data))

    sub = await api.nc.subscribe(subject, cb=on_message)
    await flushed(api.nc)
    names = iter(f"{label or kind}-{i}" for i in range(count))

    async def lane() -> None:
        for name in names:
            body = claim_body(name, kind, args.config_bytes, args.config_entries)
            await decided.apply(api, name, body)

    try:
        await asyncio.gather(*(lane() for _ in range(args.concurrency)))
    finally:
        await sub.unsubscribe()


async def measure_kind(kind: str, args: argparse.Namespace) -> tuple[float, float]:
    """MiB of resident memory per 1,000 live claims of ``kind``: over all of them, and
    over the second half (once the bounded caches are full: the cost of one more)."""
    async with pipeline.fresh_database(args) as settings:
        names = BusNames(prefix=f"mem{uuid.uuid4().hex[:8]}")
        annotations = {"dracap.io/opaque-config-classes": "*"}
        with tempfile.TemporaryDirectory(prefix="dracap-bench-") as work:
            up = pipeline.dracap_up(settings, args, names, Path(work), annotations=annotations)
            async with (
                up as reach,
                ApiClient.connect(reach.nats_url, names.prefix, reach.credential) as api,
            ):
                await apply_all(api, "small", 100, args, "warm")
                await asyncio.sleep(args.settle)
                before = up_resident_bytes(reach.pid)
                started = time.perf_counter()
                half = args.claims // 2
                await apply_all(api, kind, half, args, f"{kind}-a")
                await asyncio.sleep(args.settle)
                middle = up_resident_bytes(reach.pid)
                await apply_all(api, kind, args.claims - half, args, f"{kind}-b")
                seconds = time.perf_counter() - started
                await asyncio.sleep(args.settle)
                after = up_resident_bytes(reach.pid)
        with contextlib.suppress(Exception):
            await pipeline._delete_stream(settings.nats_url, names.stream)
    whole = (sum(after) - sum(before)) / args.claims * 1000 / 2**20
    marginal = (sum(after) - sum(middle)) / (args.claims - half) * 1000 / 2**20
    ledger = (after[1] - before[1]) / args.claims * 1000 / 2**20
    print(
        f"  {kind:<14} {args.claims:>6,} claims in {seconds:5.1f}s: resident "
        f"{sum(before) / 2**20:6.1f} -> {sum(middle) / 2**20:6.1f} -> "
        f"{sum(after) / 2**20:6.1f} MiB: {whole:6.2f} MiB per 1,000 live claims "
        f"({marginal:6.2f} in the second half; the ledger process's part {ledger:5.2f})",
        flush=True,
    )
    return whole, marginal


def snapshot_size(events: int, manifests: str, config_bytes: int) -> tuple[float, float]:
    """(JSON MiB, stored MiB) of the snapshot of ``events`` events of the history."""
    size = {"none": None, "small": 0, "large": config_bytes}[manifests]
    state = ClusterState()
    chunk: list[tuple[Any, ...]] = []
    with paused_gc():
        for row in history(events, size):
            chunk.append(row)
            if len(chunk) == 50_000:
                fold_rows(state, chunk)
                chunk = []
        fold_rows(state, chunk)
    body = snapshot_encode(state)
    return len(body) / 2**20, len(zlib.compress(body, 1)) / 2**20


async def main(args: argparse.Namespace) -> None:
    tune_for_long_lived_state()
    if not args.no_up:
        print(f"dracap up, resident memory per 1,000 live claims (--claims {args.claims}):")
        for kind in args.kinds:
            await measure_kind(kind, args)
    if args.snapshot_events:
        body, stored = snapshot_size(args.snapshot_events, args.manifests, args.config_bytes)
        print(
            f"snapshot at {args.snapshot_events:,} events (manifests: {args.manifests}): "
            f"{body:.1f} MiB of JSON, {stored:.1f} MiB stored (zlib 1)",
            flush=True,
        )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--claims", type=int, default=3000, help="live claims of each kind")
    parser.add_argument(
        "--kinds", type=lambda v: v.split(","), default=list(KINDS), help="small,large,..."
    )
    parser.add_argument("--config-bytes", type=int, default=10_000, help="per configuration")
    parser.add_argument(
        "--config-entries", type=int, default=1, help="configurations of a large claim"
    )
    parser.add_argument("--concurrency", type=int, default=64, help="applies in flight")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds before each read")
    parser.add_argument("--nodes", type=int, default=2, help="nodes (one agent each)")
    parser.add_argument("--workers", type=int, default=1, help="reservation workers")
    parser.add_argument("--pool", type=int, default=10, help="asyncpg pool size")
    parser.add_argument("--gpu-memory", default="100000Gi", help="each GPU's memory")
    parser.add_argument("--embedded", action="store_true", help="start embedded servers")
    parser.add_argument("--insecure", action="store_true", help="dracap up --insecure on --nats")
    parser.add_argument("--keep", action="store_true", help="keep the benchmark databases")
    parser.add_argument("--up-log", metavar="FILE", help="append dracap up's output to FILE")
    parser.add_argument("--no-up", action="store_true", help="skip the dracap up part")
    parser.add_argument("--snapshot-events", type=int, default=0)
    parser.add_argument("--manifests", choices=("none", "small", "large"), default="small")
    pipeline.add_server_arguments(parser)
    args = parser.parse_args(argv)
    for kind in args.kinds:
        if kind not in KINDS:
            parser.error(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
    return args


if __name__ == "__main__":
    stopping.run("memory", main(parse()))
