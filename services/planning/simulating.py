"""The discrete-event simulation of ``dracap simulate``, on the real allocator. Pure: no I/O.

Events are claim arrivals (from the trace) and departures (a served claim's duration
later). A departure happens before an arrival at the same instant.

* **Arrival.** A claim larger than a device (:meth:`Fleet.need` = 0) is *rejected* at
  once. Otherwise the allocator decides it (:meth:`Allocator.allocate`, committed when
  allocated); a claim that does not fit is *refused on arrival* -- the first such
  refusal is "the first rejection" of the reports -- and waits. A claim of a size that
  is already waiting joins the queue without a decision: the claims ahead of it were
  refused on the same state.
* **Departure.** The claim's grants are released; then the waiting claims that could
  now fit -- a size whose need is at most what the freed device has -- are decided
  again, the oldest first, each size until one is refused (what dracap's reservation
  service does: every pending claim that fits gets in, a small one may pass a large one).
* **Waiting.** A waiting claim is served later (its queueing delay is the wait) or,
  with ``max_wait``, rejected when it has waited that long. At the end a claim is
  served, rejected or still waiting (only when claims that never leave fill the fleet).

Accounting, as fractions of the fleet's total capacity: *allocated* is what the
served claims asked for; *consumed* what they took (a whole device, whole slices);
*stranded* (measured at arrivals) is free capacity on devices that cannot take the
arriving claim -- free but unusable by the next request. Means are time-weighted
(allocated) or per arrival (stranded) over the trace (first to last arrival), and over
the *saturated* part, from the first refusal to the last arrival, where free capacity
is only left for a reason: churn at full demand. Decision times are wall-clock
(reported, never asserted: ``benchmarks/simulate.py``).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from services.planning.fleets import CAPACITY, CONSUMABLE, FIXED_SLICES, Fleet
from services.planning.traces import TraceClaim
from services.reservation.allocating import Allocator, Prepared
from services.reservation.outcomes import Allocated, Unschedulable

__all__ = ["Options", "Sample", "SimResult", "compare", "devices_needed", "simulate"]

_NANO = 10**9
#: at most this many arrivals have their stranded capacity measured (an O(distinct free
#: amounts) sum each), evenly spread over the trace
STRANDED_SAMPLES = 4096


class Sample(msgspec.Struct, frozen=True, array_like=True):
    """The state at time ``t``: allocated and consumed fractions, claims waiting."""

    t: float
    allocated: float
    consumed: float
    waiting: int


class SimResult(msgspec.Struct, kw_only=True):
    """What one simulation found (fractions are of the fleet's total capacity)."""

    label: str
    mode: str
    placement: str
    devices: int
    capacity: int  # bytes per device
    claims: int
    served: int
    rejected: int  # never served: larger than a device, or waited past max_wait
    waiting: int  # still waiting at the end
    too_large: int
    refused_on_arrival: int
    refusal_rate: float  # refused_on_arrival / claims
    rejection_rate: float  # rejected / claims
    first_refusal_at: float | None
    allocated_at_first_refusal: float | None
    consumed_at_first_refusal: float | None
    stranded_at_first_refusal: float | None
    allocated_mean: float
    allocated_saturated: float | None
    stranded_mean: float
    stranded_saturated: float | None
    peak_allocated: float
    peak_consumed: float
    waited: int  # served after waiting
    queue_p50_s: float | None
    queue_p99_s: float | None
    decisions: int
    decision_us_mean: float
    decision_us_p99: float
    claims_per_s: float
    devices_needed: int | None = None
    series: list[Sample] = []


@dataclass(frozen=True, slots=True)
class Options:
    """``max_wait``: seconds a refused claim waits before it is rejected (``None``: forever).

    ``samples``: points of the allocated-over-time series. ``stop_at_first_refusal``:
    end at the first refusal (the search for the devices a trace needs).
    ``progress(done, total)`` is called every few thousand arrivals.
    """

    max_wait: float | None = None
    samples: int = 200
    stop_at_first_refusal: bool = False
    progress: Callable[[int, int], None] | None = None


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _Engine:
    """One run: the allocator, the free capacity per device and the accounting."""

    def __init__(self, trace: Sequence[TraceClaim], fleet: Fleet, options: Options) -> None:
        self.trace = trace
        self.fleet = fleet
        self.options = options
        inventory = fleet.inventory()
        share_ids = map("s{}".format, itertools.count()).__next__  # s0, s1, ...
        self.allocator = Allocator(inventory, new_share_id=share_ids)
        device_of = fleet.device_of()
        self.device_of_key = {entry.key: device_of(entry.key[2]) for entry in inventory.devices}
        self.free = [fleet.capacity] * fleet.devices
        self.free_count: dict[int, int] = {fleet.capacity: fleet.devices}
        self.max_free = fleet.capacity  # the largest key of free_count
        self.templates: dict[int, Prepared] = {}  # size -> its claim, prepared once
        self.needs: dict[int, int] = {}  # size -> Fleet.need(size)
        #: what one grant takes: a whole slice, or (0) the capacity it consumed
        self.slice_size = fleet.mode.slice_size if fleet.mode.kind == FIXED_SLICES else 0
        #: a served claim's allocation and its moves: (device, bytes) per grant
        self.held: dict[int, tuple[Allocated, list[tuple[int, int]]]] = {}
        self.asked = 0
        self.consumed = 0
        self.decision_ns: list[int] = []

    def need(self, size: int) -> int:
        """:meth:`Fleet.need`, remembered per size."""
        need = self.needs.get(size)
        if need is None:
            need = self.needs[size] = self.fleet.need(size)
        return need

    def usable_free(self, free: int) -> int:
        """:meth:`Fleet.usable_free`, inlined."""
        return free - free % self.slice_size if self.slice_size else free

    # -- taking and giving back capacity

    def _move(self, moves: list[tuple[int, int]], sign: int) -> int:
        """Take (sign 1) or give back (-1) ``moves``; the most free after, of those devices."""
        free, counts = self.free, self.free_count
        capacity = self.fleet.capacity
        most = 0
        for device, amount in moves:
            before = free[device]
            after = before - sign * amount
            if not 0 <= after <= capacity:  # the one invariant, checked on every move
                raise AssertionError(
                    f"device {device}: {after} bytes free of {capacity} after a "
                    f"{'grant' if sign > 0 else 'release'}"
                )
            free[device] = after
            counts[after] = counts.get(after, 0) + 1
            left = counts[before] - 1
            if left:
                counts[before] = left
            else:
                del counts[before]
                if before == self.max_free:
                    self.max_free = max(counts)
            if after > self.max_free:
                self.max_free = after
            if after > most:
                most = after
        return most

    def decide(self, index: int, size: int, need: int) -> bool:
        """Ask the allocator for claim ``index`` (``size`` bytes, ``need`` of one device).

        Commits and accounts when allocated. When no device has the claim's need free the
        allocator is not asked: it could only answer unschedulable (a necessary
        condition, so outcomes are the same).
        """
        most = self.max_free
        if self.slice_size:
            most -= most % self.slice_size
        if most < need:
            return False
        prepared = self.templates.get(size)
        if prepared is None:
            prepared = self.templates[size] = self.allocator.prepare(self.fleet.claim(size))
        allocator = self.allocator
        start = time.perf_counter_ns()
        out = allocator.allocate(prepared.claim, explain=False, prepared=prepared)
        self.decision_ns.append(time.perf_counter_ns() - start)
        if isinstance(out, Allocated):
            allocator.commit(out)
            device_of, slice_size = self.device_of_key, self.slice_size
            moves = [
                (
                    device_of[grant.device],
                    slice_size or grant.consumed[CAPACITY].nanos // _NANO,
                )
                for grant in out.grants
            ]
            self._move(moves, 1)
            self.held[index] = (out, moves)
            self.asked += size
            self.consumed += need
            return True
        if isinstance(out, Unschedulable):
            return False
        raise AssertionError(f"the simulated claim of {size} bytes was not decided: {out}")

    def release(self, index: int) -> int:
        """Give claim ``index``'s capacity back; the most any one of its devices now has free."""
        out, moves = self.held.pop(index)
        self.allocator.release(out)
        most = self._move(moves, -1)
        size = self.trace[index].size
        self.asked -= size
        self.consumed -= self.needs[size]
        return most - most % self.slice_size if self.slice_size else most

    def stranded(self, need: int) -> int:
        """Free bytes on devices that cannot take a claim needing ``need`` bytes of one."""
        usable = self.fleet.usable_free
        return sum(free * n for free, n in self.free_count.items() if usable(free) < need)


def simulate(
    trace: Sequence[TraceClaim], fleet: Fleet, options: Options | None = None
) -> SimResult:
    """Run ``trace`` (sorted by arrival) on ``fleet``; see the module doc for the rules.

    The cyclic garbage collector is paused during the run (a run makes millions of
    short-lived acyclic objects; collecting them cost a tenth of the time) and restored.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _simulate(trace, fleet, options or Options())
    finally:
        if collecting:
            gc.enable()


def _simulate(trace: Sequence[TraceClaim], fleet: Fleet, options: Options) -> SimResult:
    wall = time.perf_counter()
    engine = _Engine(trace, fleet, options)
    n = len(trace)
    total = fleet.total
    need_of = engine.need
    needs = engine.needs

    max_wait = options.max_wait
    first_t = trace[0].arrival if n else 0.0
    last_t = trace[-1].arrival if n else 0.0
    horizon = max(last_t - first_t, 1e-12)
    step = horizon / max(1, options.samples)
    stride = max(1, n // STRANDED_SAMPLES)

    departures: list[tuple[float, int]] = []
    queues: dict[int, deque[int]] = {}  # size -> waiting claims, oldest first
    served = 0  # claims served (each at most once)
    outcome_rejected = 0
    too_large = 0
    refused = 0
    waiting_count = 0
    delays: list[float] = []
    series: list[Sample] = []
    next_sample = first_t
    area = 0.0  # integral of asked over [first_t, now]
    area_at_refusal = 0.0
    peak = 0
    peak_consumed = 0
    now = first_t
    first_refusal: float | None = None
    at_refusal: tuple[float, float, float] | None = None
    stranded_sum = 0.0
    stranded_n = 0
    stranded_sat_sum = 0.0
    stranded_sat_n = 0

    def sample() -> None:
        """Append the samples due by ``now`` (called when ``next_sample <= now``)."""
        nonlocal next_sample
        while next_sample <= min(now, last_t) and len(series) <= options.samples:
            series.append(
                Sample(next_sample, engine.asked / total, engine.consumed / total, waiting_count)
            )
            next_sample = first_t + step * len(series)

    def advance(to: float) -> None:
        nonlocal now, area
        if to > now:
            if now < last_t:
                area += engine.asked * (min(to, last_t) - now)
            now = to
        if next_sample <= now:
            sample()

    def serve(index: int, at: float) -> None:
        nonlocal peak, peak_consumed, served
        served += 1
        if engine.asked > peak:
            peak = engine.asked
        if engine.consumed > peak_consumed:
            peak_consumed = engine.consumed
        duration = trace[index].duration
        if duration is not None:
            heappush(departures, (at + duration, index))

    def retry(freed: int) -> None:
        """Decide the waiting claims that might fit a device with ``freed`` bytes free."""
        nonlocal waiting_count, outcome_rejected
        heads = [
            (queue[0], size, need)
            for size, queue in queues.items()
            if queue and 0 < (need := needs[size]) <= freed
        ]
        heads.sort()
        decide = engine.decide
        for _, size, need in heads:
            queue = queues[size]
            while queue:
                index = queue[0]
                if max_wait is not None and now - trace[index].arrival > max_wait:
                    queue.popleft()
                    waiting_count -= 1
                    outcome_rejected += 1
                    continue
                # engine.max_free < need: decide would refuse without asking (cheaper here)
                if engine.max_free < need or not decide(index, size, need):
                    break
                queue.popleft()
                waiting_count -= 1
                delays.append(now - trace[index].arrival)
                serve(index, now)
            if not queue:
                del queues[size]

    progress = options.progress
    heappush, heappop = heapq.heappush, heapq.heappop
    decide, release, stranded_of = engine.decide, engine.release, engine.stranded
    arrival = 0
    while arrival < n or departures:
        if departures and (arrival >= n or departures[0][0] <= trace[arrival].arrival):
            at, index = heappop(departures)
            if at > now or next_sample <= now:
                advance(at)
            freed = release(index)
            if queues:
                retry(freed)
            continue
        claim = trace[arrival]
        index = arrival
        arrival += 1
        if claim.arrival > now or next_sample <= now:
            advance(claim.arrival)
        if progress is not None and arrival % 4096 == 0:
            progress(arrival, n)
        size = claim.size
        need = needs.get(size)
        if need is None:
            need = need_of(size)
        if need == 0:
            too_large += 1
            outcome_rejected += 1
            continue
        if index % stride == 0:
            stranded = stranded_of(need) / total
            stranded_sum += stranded
            stranded_n += 1
            if first_refusal is not None:
                stranded_sat_sum += stranded
                stranded_sat_n += 1
        queue = queues.get(size)
        if not queue and decide(index, size, need):
            serve(index, now)
            continue
        refused += 1
        if first_refusal is None:
            first_refusal = now
            area_at_refusal = area
            at_refusal = (
                engine.asked / total,
                engine.consumed / total,
                stranded_of(need) / total,
            )
            if options.stop_at_first_refusal:
                break
        if max_wait == 0:
            outcome_rejected += 1
            continue
        if queue is None:
            queue = queues[size] = deque()
        queue.append(index)
        waiting_count += 1
    advance(max(now, last_t))
    if progress is not None:
        progress(min(arrival, n), n)

    for queue in queues.values():  # at the end: rejected when waited too long, else waiting
        for index in queue:
            if max_wait is not None and now - trace[index].arrival >= max_wait:
                waiting_count -= 1
                outcome_rejected += 1
    if options.stop_at_first_refusal:
        waiting_count = n - served - outcome_rejected
    elapsed = time.perf_counter() - wall
    decisions = engine.decision_ns
    saturated = last_t - first_refusal if first_refusal is not None else 0.0
    return SimResult(
        label=fleet.label,
        mode=str(fleet.mode),
        placement=fleet.placement if fleet.mode.kind == CONSUMABLE else "first-fit",
        devices=fleet.devices,
        capacity=fleet.capacity,
        claims=n,
        served=served,
        rejected=outcome_rejected,
        waiting=waiting_count,
        too_large=too_large,
        refused_on_arrival=refused,
        refusal_rate=refused / n if n else 0.0,
        rejection_rate=outcome_rejected / n if n else 0.0,
        first_refusal_at=None if first_refusal is None else first_refusal - first_t,
        allocated_at_first_refusal=at_refusal[0] if at_refusal else None,
        consumed_at_first_refusal=at_refusal[1] if at_refusal else None,
        stranded_at_first_refusal=at_refusal[2] if at_refusal else None,
        allocated_mean=area / total / horizon if last_t > first_t else engine.asked / total,
        allocated_saturated=(
            (area - area_at_refusal) / total / saturated if saturated > 0 else None
        ),
        stranded_mean=stranded_sum / stranded_n if stranded_n else 0.0,
        stranded_saturated=stranded_sat_sum / stranded_sat_n if stranded_sat_n else None,
        peak_allocated=peak / total,
        peak_consumed=peak_consumed / total,
        waited=len(delays),
        queue_p50_s=_percentile(delays, 0.5) if delays else None,
        queue_p99_s=_percentile(delays, 0.99) if delays else None,
        decisions=len(decisions),
        decision_us_mean=sum(decisions) / len(decisions) / 1e3 if decisions else 0.0,
        decision_us_p99=_percentile(decisions, 0.99) / 1e3 if decisions else 0.0,
        claims_per_s=n / elapsed if elapsed > 0 else 0.0,
        series=series,
    )


def devices_needed(
    trace: Sequence[TraceClaim], fleet: Fleet, *, limit: int | None = None
) -> int | None:
    """The fewest devices (of ``fleet``'s size and mode) that serve ``trace`` with no refusal.

    A binary search over the device count, each probe a simulation that stops at its
    first refusal. ``None`` when some claim fits no device, or past ``limit`` devices
    (default: one device per claim, which always suffices otherwise).
    """
    if any(fleet.need(c.size) == 0 for c in trace):
        return None
    ceiling = limit if limit is not None else max(1, len(trace))
    probe = Options(samples=0, stop_at_first_refusal=True)

    def enough(count: int) -> bool:
        sized = Fleet(count, fleet.capacity, fleet.mode, fleet.placement)
        return simulate(trace, sized, probe).refused_on_arrival == 0

    high = min(fleet.devices, ceiling)
    while not enough(high):
        if high >= ceiling:
            return None
        high = min(ceiling, high * 2)
    low = 0  # not enough (zero devices serve nothing)
    while high - low > 1:
        middle = (low + high) // 2
        if enough(middle):
            high = middle
        else:
            low = middle
    return high


def compare(
    trace: Sequence[TraceClaim],
    fleets: Sequence[Fleet],
    options: Options | None = None,
    *,
    needed: bool = True,
    on_run: Callable[[int, Fleet], None] | None = None,
) -> list[SimResult]:
    """:func:`simulate` ``trace`` on each fleet (and, with ``needed``, :func:`devices_needed`).

    ``on_run(i, fleet)`` is called before each fleet's run (for a progress display).
    """
    results = []
    for i, fleet in enumerate(fleets):
        if on_run is not None:
            on_run(i, fleet)
        result = simulate(trace, fleet, options)
        if needed:
            result.devices_needed = devices_needed(trace, fleet)
        results.append(result)
    return results
