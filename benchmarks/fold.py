"""Fold throughput: replay 200k already-decoded reserve/release envelopes.

Run ``python -m benchmarks.fold [events]`` from the repository root. It publishes
one slice of 64 shareable devices (80Gi memory, policy min 1Gi step 1Gi; 100G
bandwidth without policy), then builds reservations and their releases,
interleaved so that up to 512 shares are live at a time, and times
:func:`events.fold.fold` over them. Decoding is not timed: this measures the
fold alone.
"""

from __future__ import annotations

import datetime
import sys
import time
from collections import deque

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


def main() -> None:
    """Build, fold (best of three) and print events/s."""
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    head, events = build(count)
    best = float("inf")
    for _ in range(3):
        state = apply(ClusterState(), head)
        start = time.perf_counter()
        fold(events, state)
        best = min(best, time.perf_counter() - start)
    print(f"{count} events in {best:.3f}s: {count / best:,.0f} events/s")


if __name__ == "__main__":
    main()
