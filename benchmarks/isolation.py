"""One tenant's expensive selectors against another tenant's apply -> Ready time.

Invariant 11 says no tenant can stall another. This benchmark measures it on ``dracap
up`` itself (started as its own process, as in :mod:`benchmarks.pipeline`, whose
inventory, tracker and helpers it reuses):

1. **unloaded**: tenant ``bench`` applies claims open-loop at ``--rate`` claims/s for
   ``--seconds``; apply -> Ready per claim, p50 / p99;
2. **loaded**: tenant ``noisy`` first applies ``--noisy`` claims whose selector costs
   just under the limit of 1,000,000 units (each a different expression, so nothing is
   memoised: tens of seconds of cel-python per device, evaluated in the selector
   pool), then ``bench`` runs the same open loop again while those are evaluated, and
   ``noisy`` meanwhile applies one claim per second whose selector's estimated cost is
   *above* the limit (``--over-limit``: refused at admission).

The noisy tenant's side is measured too: how long the API took to refuse each claim
above the limit (apply -> reply), and, after the loaded phase, how long each expensive
claim took to be cut off (apply -> ``unschedulable`` once the selector worker's CPU
deadline and job budget stopped its evaluation; waiting at most ``--settle`` seconds).

Goal: loaded p50 and p99 within 2x the unloaded ones.

Usage::

    .venv/bin/python -m benchmarks.isolation --rate 50 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks import pipeline, stopping
from events.subjects import BusNames
from services.runtime.bus.apiclient import ApiClient, ApiError
from services.runtime.bus.flushing import flushed
from services.runtime.ground.gctuning import tune_for_long_lived_state
from services.runtime.ground.settings import Settings

NOISY = "noisy"


def expensive_claim(i: int, *, items: int = 370, name: str = "expensive") -> bytes:
    """A claim of ``noisy`` whose selector costs just under the limit (distinct per ``i``).

    With ``items=380`` the estimate is above the limit (1,016,131 units): refused.
    """
    listed = "[" + ",".join(str(n) for n in range(1, items + 1)) + "]"
    expression = f"{listed}.all(x, {listed}.all(y, x*y >= -{i}))"
    request = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": pipeline.CLASS,
            "capacity": {"requests": {"memory": "1Gi"}},
            "selectors": [{"cel": {"expression": expression}}],
        },
    }
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": f"{name}-{i}", "namespace": NOISY},
        "spec": {"devices": {"requests": [request]}},
    }
    return json.dumps(body).encode()


async def run(settings: Settings, args: argparse.Namespace) -> dict[str, float]:
    names = BusNames(prefix=f"bench{uuid.uuid4().hex[:8]}")
    out: dict[str, float] = {}
    tenants = (pipeline.NAMESPACE, NOISY)
    try:
        with tempfile.TemporaryDirectory(prefix="dracap-bench-") as work:
            async with (
                pipeline.dracap_up(settings, args, names, Path(work), tenants) as reach,
                ApiClient.connect(reach.nats_url, names.prefix, reach.credential) as api,
            ):
                tracker = pipeline.ReadyTracker()
                verdicts = Verdicts()
                async with pipeline.watching(api, tracker), verdicts.watching(api):
                    await pipeline.throughput(api, tracker, 50, 8, "warm")
                    await _phase(api, tracker, args, "unloaded", out)
                    for i in range(args.noisy):
                        verdicts.sent[f"expensive-{i}"] = time.perf_counter()
                        reply = await api.claims(NOISY, "apply", expensive_claim(i))
                        assert reply["ok"], reply
                    await asyncio.sleep(3.0)  # the worker has started and taken the first job
                    refusals = asyncio.create_task(_over_limit(api, args, out))
                    await _phase(api, tracker, args, "loaded", out)
                    await refusals
                    await verdicts.settled(args.settle)
                    out["noisy_undecided"] = args.noisy - len(verdicts.decided)
                    _report_verdicts(verdicts, out)
    finally:
        if args.insecure:  # a secure run's nats-server went with its data directory
            with contextlib.suppress(Exception):
                await pipeline._delete_stream(settings.nats_url, names.stream)
    return out


class Verdicts:
    """Times each of ``noisy``'s expensive claims from apply to its first decision."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = {}
        self.decided: dict[str, tuple[float, str, str]] = {}  # name -> (seconds, phase, reason)
        self.all_in = asyncio.Event()

    def on_view(self, view: dict[str, Any]) -> None:
        name = view.get("name", "")
        pending = view.get("phase") in ("submitted", "admitted")
        if name in self.sent and name not in self.decided and not pending:
            took = time.perf_counter() - self.sent[name]
            self.decided[name] = (took, view["phase"], view.get("reason") or "")
            if len(self.decided) == len(self.sent):
                self.all_in.set()

    @contextlib.asynccontextmanager
    async def watching(self, api: ApiClient) -> Any:
        subject = (await api.claims(NOISY, "watch", {"name": None}))["subject"]

        async def on_message(msg: Any) -> None:
            self.on_view(json.loads(msg.data))

        sub = await api.nc.subscribe(subject, cb=on_message)
        await flushed(api.nc)
        try:
            yield
        finally:
            await sub.unsubscribe()

    async def settled(self, within_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.all_in.wait(), within_s)


async def _over_limit(api: ApiClient, args: argparse.Namespace, out: dict[str, float]) -> None:
    """One claim per second above the cost limit, during the loaded phase: reply latency."""
    took: list[float] = []
    rule = ""
    for i in range(args.over_limit):
        started = time.perf_counter()
        try:
            await api.claims(NOISY, "apply", expensive_claim(i, items=380, name="over"))
            rule = "admitted (unexpected)"
        except ApiError as exc:
            rule = f"{exc.code}: {exc.field}: {exc.rule}"
        took.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(max(0.0, started + 1.0 - time.perf_counter()))
    if took:
        out["over_limit_p50"] = statistics.median(took)
        out["over_limit_max"] = max(took)
        print(
            f"  noisy     {len(took)} claims above the cost limit, refused in: "
            f"median {out['over_limit_p50']:.0f} ms, max {out['over_limit_max']:.0f} ms "
            f"({rule[:120]})",
            flush=True,
        )


def _report_verdicts(verdicts: Verdicts, out: dict[str, float]) -> None:
    for name in sorted(verdicts.sent):
        if name not in verdicts.decided:
            print(f"  noisy     {name}: not decided yet", flush=True)
            continue
        took, phase, reason = verdicts.decided[name]
        why = reason.rsplit("': ", 1)[-1]  # the CEL error, without the long expression
        print(f"  noisy     {name}: {phase} after {took:.1f} s ({why})", flush=True)
    if verdicts.decided:
        times = [took for took, _, _ in verdicts.decided.values()]
        out["cut_off_max_s"] = max(times)
        out["cut_off_min_s"] = min(times)


async def _phase(
    api: ApiClient,
    tracker: pipeline.ReadyTracker,
    args: argparse.Namespace,
    label: str,
    out: dict[str, float],
) -> None:
    latencies = await pipeline.latency(api, tracker, args.rate, args.seconds, label)
    p50, p99 = pipeline.percentile(latencies, 50), pipeline.percentile(latencies, 99)
    out[f"{label}_p50"], out[f"{label}_p99"] = p50, p99
    print(
        f"  {label:<9} {len(latencies)} claims: p50 {p50:6.1f} ms   p99 {p99:6.1f} ms", flush=True
    )


async def main(args: argparse.Namespace) -> None:
    gc.freeze()
    tune_for_long_lived_state()
    async with pipeline.fresh_database(args) as settings:
        print(f"database {settings.database_url.rsplit('/', 1)[1]}:", flush=True)
        r = await run(settings, args)
    print("\nratios, loaded / unloaded (goal: <= 2):")
    p50, p99 = r["loaded_p50"] / r["unloaded_p50"], r["loaded_p99"] / r["unloaded_p99"]
    print(f"  p50 {p50:.2f}x   p99 {p99:.2f}x")
    print(f"  expensive claims not decided after --settle: {r['noisy_undecided']:.0f}")
    if "cut_off_min_s" in r:
        print(
            f"  expensive claims cut off after {r['cut_off_min_s']:.1f} - "
            f"{r['cut_off_max_s']:.1f} s (apply -> unschedulable)"
        )


def cli() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=50.0, help="bench's claims/s")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--noisy", type=int, default=4, help="expensive claims of the noisy tenant")
    parser.add_argument("--nodes", type=int, default=2, help="nodes (one agent each)")
    parser.add_argument(
        "--over-limit",
        type=int,
        default=5,
        help="claims above the cost limit the noisy tenant applies during the loaded phase",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=180.0,
        help="seconds to wait after the loaded phase for the expensive claims to be cut off",
    )
    parser.add_argument("--embedded", action="store_true", help="start embedded servers instead")
    own, rest = parser.parse_known_args()
    args = pipeline.parse([*rest, "--nodes", str(own.nodes), "--seconds", str(own.seconds)])
    args.rate, args.noisy, args.embedded = own.rate, own.noisy, own.embedded
    args.over_limit, args.settle = own.over_limit, own.settle
    return args


if __name__ == "__main__":
    stopping.run("isolation", main(cli()))
