"""What the consumers make of one generated log: a digest per consumer, and their speed.

A change to how consumers read events (``events/transitions.py``: what each event
means) must leave their outputs unchanged. This builds one log without I/O (a slice of
64 GPUs, 400 claims through their lifecycle, a fifth left held; an unschedulable, a
rejected and a withdrawn claim, a device failing, a dead letter; then a node's lease
acquired, lost, its held shares marked unknown and some confirmed, a stale fence, a
second expiry and a fence), runs it through the audit's records, billing's usage, the
fold with the SLO fold and the claims views' touched claims, and prints a digest of
each output (event ids, random per run, left out) and the best of ``--runs`` timings
(the process's CPU time, which a machine busy with other work disturbs less).

Run it on two commits (``PYTHONPATH=<checkout of the other commit>``) and compare:
equal digests mean equal outputs.

Run:  python -m benchmarks.meaning [--runs 15]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import time
from typing import Any

import msgspec

from benchmarks.eventlog import DEVICES, _lifecycle
from events import catalog
from events.envelopes import Envelope, new_envelope
from events.fold import apply as fold_apply
from events.state import ClusterState
from services.audit.records import build
from services.billing.usage import apply as bill
from services.claims.views import ClaimsTouched, claims_touched
from services.runtime.ops.slos import SloFold
from tests.integration import sample as s

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def generated_log() -> list[Envelope]:
    """The log of the module docstring, one second between events."""
    gpus = {f"gpu-{d}": {"memory": "80Gi"} for d in range(DEVICES)}
    events: list[catalog.Event] = [s.slice_published("bench", gpus)]
    held: list[catalog.CapacityReserved] = []
    for i in range(400):
        lifecycle = _lifecycle(i, 0)
        if i % 5 == 0:  # no release request, no release: held
            lifecycle = lifecycle[:-2]
            reserved = lifecycle[2]
            assert isinstance(reserved, catalog.CapacityReserved)
            held.append(reserved)
        events += lifecycle
    node = s.POOL
    events += [
        catalog.ClaimUnschedulable(namespace="ns-1", name="claim-1", reason="full"),
        catalog.ClaimRejected(namespace="ns-2", name="claim-x", field="f", rule="r", reason=""),
        catalog.ClaimWithdrawn(namespace="ns-1", name="claim-1"),
        catalog.DeviceHealthChanged(
            node=node, driver=s.DRIVER, pool=s.POOL, device="gpu-0", healthy=False
        ),
        catalog.MessageDeadLettered(
            consumer="c", event_id="e", position=1, deliveries=3, reason="x"
        ),
        catalog.NodeLeaseAcquired(node=node, epoch=1, boot_id="b", ttl_ms=1000),
        catalog.NodeLeaseExpired(node=node, epoch=1),
        *(catalog.ShareMarkedUnknown(share_id=r.share_id, node=node) for r in held[:10]),
        catalog.NodeLeaseAcquired(node=node, epoch=2, boot_id="b", ttl_ms=1000),
        *(catalog.ShareConfirmed(share_id=r.share_id, node=node) for r in held[:5]),
        catalog.NodeFenced(node=node, epoch=1, reason="stale"),
        catalog.NodeLeaseExpired(node=node, epoch=2),
        catalog.NodeFenced(node=node, epoch=3, reason="gone"),
    ]
    return [
        new_envelope(
            e,
            stream_version=1,
            actor="system:test",
            position=p + 1,
            recorded_at=T0 + datetime.timedelta(seconds=p),
        )
        for p, e in enumerate(events)
    ]


def _digest(value: Any) -> str:
    return hashlib.sha256(msgspec.json.encode(value, order="deterministic")).hexdigest()[:16]


def outputs(envs: list[Envelope]) -> dict[str, Any]:
    """Each consumer's output for ``envs``."""
    audit = build(envs, {}, {}, {})
    usage = bill(envs, {}, {}, {})
    state, slos, seen, touched = ClusterState(), SloFold(), [], []
    index: ClaimsTouched | None = None
    for env in envs:
        fold_apply(state, env)
        seen += [tuple(o) for o in slos.observe(state, env.event, env.recorded_at)]
        index = index or ClaimsTouched(state)
        touched.append((claims_touched(state, env), index(state, env)))
    return {
        "audit": [msgspec.structs.replace(r, event_id="") for r in audit.records],
        "billing": [usage.segments, usage.shares, usage.nodes, sorted(usage.claims.items())],
        "slo": seen,
        "touched": touched,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    runs = parser.parse_args().runs
    envs = generated_log()
    for name, value in outputs(envs).items():
        print(f"  {name:<8} {len(value):>6} items  {_digest(value)}")
    best = float("inf")
    for _ in range(runs):
        started = time.process_time()
        outputs(envs)
        best = min(best, time.process_time() - started)
    print(f"  {len(envs)} events through every consumer: best {best * 1000:.1f} ms of CPU")


if __name__ == "__main__":
    main()
