"""Fold throughput: replay 200k already-decoded reserve/release envelopes.

Run ``python -m benchmarks.fold [events]`` from the repository root. It publishes
one slice of 64 shareable devices (80Gi memory, policy min 1Gi step 1Gi; 100G
bandwidth without policy), then builds reservations and their releases,
interleaved so that up to 512 shares are live at a time, and times
:func:`events.fold.fold` over them. Decoding is not timed: this measures the
fold alone.

``--history N`` folds N events of the same workload first, untimed, and times the
``events`` that follow them: the same work per event on a state that holds more.
The fold keeps every share it has seen, released ones too (idempotent releases and
late confirmations are judged against them), so N events of history leave about N/2
shares in the state however few are live; the difference between the two rates is
what a bigger state costs each event (dicts beyond the processor's caches), not work
that grows with it — docs/services.md, "What a bigger state costs the fold".
"""

from __future__ import annotations

import argparse
import datetime
import time
from collections import deque

from benchmarks.stopping import INTERRUPTED, say_interrupted
from events.catalog import (
    CapacityReleased,
    CapacityReserved,
    Event,
    ResourceSlicePublished,
    schema_version_of,
)
from events.envelopes import Envelope, stream_of
from events.fold import apply, fold
from events.model import (
    CapacityRequestPolicy,
    CapacityRequestPolicyRange,
    Device,
    DeviceCapacity,
    ObjectMeta,
    ResourcePool,
    ResourceSlice,
    ResourceSliceSpec,
)
from events.quantities import Quantity
from events.state import ClusterState

DRIVER = "gpu.example.com"
POOL = "node-a"
DEVICES = 64
WINDOW = 512
T0 = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)


def _envelope(event: Event, position: int) -> Envelope:
    return Envelope(
        event_id=f"e{position}",
        stream=stream_of(event),
        stream_version=position,
        position=position,
        actor="bench",
        correlation_id=f"c{position}",
        recorded_at=T0,
        schema_version=schema_version_of(event),
        event=event,
    )


def _slice() -> ResourceSlice:
    q = Quantity.parse
    policy = CapacityRequestPolicy(
        default=q("1Gi"), valid_range=CapacityRequestPolicyRange(min=q("1Gi"), step=q("1Gi"))
    )
    devices = [
        Device(
            name=f"gpu-{i}",
            allow_multiple_allocations=True,
            capacity={
                "memory": DeviceCapacity(value=q("80Gi"), request_policy=policy),
                "bandwidth": DeviceCapacity(value=q("100G")),
            },
        )
        for i in range(DEVICES)
    ]
    return ResourceSlice(
        metadata=ObjectMeta(name="node-a-gpus"),
        spec=ResourceSliceSpec(
            driver=DRIVER,
            pool=ResourcePool(name=POOL, generation=1, resource_slice_count=1),
            node_name="node-a",
            devices=devices,
        ),
    )


def build(count: int) -> tuple[Envelope, list[Envelope]]:
    """The slice envelope and ``count`` reserve/release envelopes."""
    consumed = {"memory": Quantity.parse("4Gi"), "bandwidth": Quantity.parse("1G")}
    events: list[Envelope] = []
    live: deque[CapacityReserved] = deque()
    position = 2
    n = 0
    while len(events) < count:
        if len(live) < WINDOW and (n % 3 != 2 or not live):
            dev = f"gpu-{n % DEVICES}"
            reserved = CapacityReserved(
                namespace="bench",
                name=f"claim-{n}",
                allocation_version=1,
                request="gpu",
                driver=DRIVER,
                pool=POOL,
                device=dev,
                node="node-a",
                share_id=f"share-{n}",
                shared=True,
                admin_access=False,
                consumed=consumed,
                policy_version=1,
            )
            live.append(reserved)
            ev: Event = reserved
        else:
            r = live.popleft()
            ev = CapacityReleased(
                share_id=r.share_id,
                driver=r.driver,
                pool=r.pool,
                device=r.device,
                allocation_version=1,
                consumed=r.consumed,
                admin_access=False,
            )
        n += 1
        events.append(_envelope(ev, position))
        position += 1
    return _envelope(ResourceSlicePublished(slice=_slice()), 1), events


def measure(count: int, history: int = 0, rounds: int = 3) -> tuple[float, int]:
    """The best of ``rounds`` timed folds of ``count`` events that follow ``history``
    untimed ones (seconds), and the shares the state holds at the end."""
    head, events = build(history + count)
    before, timed = events[:history], events[history:]
    best, shares = float("inf"), 0
    for _ in range(rounds):
        state = apply(ClusterState(), head)
        fold(before, state)
        start = time.perf_counter()
        fold(timed, state)
        best = min(best, time.perf_counter() - start)
        shares = len(state.shares)
    return best, shares


def main() -> None:
    """Build, fold (best of three) and print events/s."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fold", description=__doc__)
    parser.add_argument("events", type=int, nargs="?", default=200_000, help="events timed")
    parser.add_argument(
        "--history", type=int, default=0, help="events folded first, untimed (default 0)"
    )
    args = parser.parse_args()
    if args.events < 1 or args.history < 0:
        parser.error("events must be at least 1 and --history at least 0")
    try:
        best, shares = measure(args.events, args.history)
    except KeyboardInterrupt:
        say_interrupted("benchmarks.fold")
        raise SystemExit(INTERRUPTED) from None
    after = f" after {args.history:,} events of history" if args.history else ""
    print(
        f"{args.events} events in {best:.3f}s: {args.events / best:,.0f} events/s{after} "
        f"({shares:,} shares held at the end)"
    )


if __name__ == "__main__":
    main()
