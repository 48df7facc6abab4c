"""Garbage-collector settings for processes that hold the fold in memory.

A service process keeps :class:`events.state.ClusterState` — every claim, share and
device of the log — as long-lived Python objects, and creates many short-lived ones
per message (envelopes, events, futures). With CPython's default thresholds (a young
collection every 700 net allocations, the oldest generation every ~100 young ones),
the collector runs hundreds of times per second under load, and each full collection
walks the whole fold: pauses that grow with the cluster and land on whichever request
is in flight. Measured with ``benchmarks/pipeline.py`` (3,000 claims, 2-core machine):
throughput ~300 -> ~320-336 claims/s and p99 at half that rate ~370-420 -> ~250-310 ms.

:func:`tune_for_long_lived_state` raises the young-generation threshold (fewer
young collections: short-lived objects are mostly gone by then) but keeps the middle
generation small, and keeps full collections rare. A young collection's pause grows
with the objects that survived since the last one, and a middle one's with the
survivors of all young ones since: with (50,000, 20) the middle collections walked up
to a million objects and paused the event loop for 190-360 ms, a stall that alone
broke the p99 of a latency run; with (10,000, 2) the pauses measured 2-3 ms (young)
and 5-8 ms (middle) at 650 claims/s. Reference cycles are still collected.

The other half is not creating work for the collector at all: the Structs that make
up the fold and the events (Kubernetes objects, events, envelopes, claim and share
states, grants, limits) are declared ``gc=False`` — pure data trees that never form a
reference cycle, so the collector need not track them; that took the tracked objects
per claim from ~39 to ~15.
"""

from __future__ import annotations

import gc
from typing import Final

__all__ = ["THRESHOLDS", "tune_for_long_lived_state"]

#: (young, middle, old) generation thresholds.
THRESHOLDS: Final = (10_000, 2, 100)


def tune_for_long_lived_state() -> tuple[int, int, int]:
    """Apply :data:`THRESHOLDS`; returns the previous thresholds."""
    previous = gc.get_threshold()
    gc.set_threshold(*THRESHOLDS)
    return previous
