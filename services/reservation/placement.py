"""Placement policies: in which order the allocator tries the devices a request may take. Pure.

Eligibility is decided elsewhere (:mod:`services.reservation.allocating` checks every
candidate exactly as before); a policy only orders the candidates, and the first one
that passes the checks is taken. A DeviceClass names its policy with the annotation
``dracap.io/placement`` (:func:`events.tenancy.placement`; ``docs/placement.md``):

``first-fit`` (default)
    upstream's order: pools sorted, slices in input order, devices in spec order.
``binpack``
    the device where the share leaves the least free capacity.
``spread``
    the emptiest device (the most free capacity).
``fragmentation-aware``
    the device whose free capacity after the share stays the most usable for the
    request sizes seen recently (the sizes of the live shares of that capacity, plus the
    request itself). ``frag(L) = L * P(size > L)`` is the free capacity ``L`` a device
    would strand if the next request were drawn from those sizes; the policy takes the
    device where the share increases it least (``frag(free - a) - frag(free)``), in the
    spirit of fragmentation-gradient-descent GPU schedulers.

What is compared: the free amount of the request's *primary* capacity (the first one
it names, in name order) as committed before this claim, measured against the amount
asked (before a device's request policy rounds it, so devices of one class compare by
their free amount). A request naming no capacity, an adminAccess request and a class
in mode ``whole-device`` use first-fit.

Ties, always: the smaller free amount after the share (binpack's rule), then
upstream's first-fit position. So every policy is a total order and a decision is the
same whenever the committed state is the same.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Mapping
from typing import Final

from events.tenancy import PLACEMENTS
from services.reservation.candidates import FreeIndex

__all__ = [
    "BINPACK",
    "FIRST_FIT",
    "FRAGMENTATION_AWARE",
    "PLACEMENTS",
    "SPREAD",
    "fragmentation",
    "placement_order",
    "value_order",
]

FIRST_FIT: Final = "first-fit"
BINPACK: Final = "binpack"
SPREAD: Final = "spread"
FRAGMENTATION_AWARE: Final = "fragmentation-aware"
assert (FIRST_FIT, BINPACK, SPREAD, FRAGMENTATION_AWARE) == PLACEMENTS


class _Sizes:
    """A size distribution: sorted distinct sizes and how many are larger than each."""

    __slots__ = ("above", "keys", "total")

    def __init__(self, sizes: Mapping[int, int] | None, extra: int) -> None:
        counts = dict(sizes or {})
        counts[extra] = counts.get(extra, 0) + 1
        self.keys = sorted(k for k, n in counts.items() if n > 0)
        above = [0] * (len(self.keys) + 1)
        for i in range(len(self.keys) - 1, -1, -1):
            above[i] = above[i + 1] + counts[self.keys[i]]
        self.above = above  # above[i]: how many sizes are >= keys[i]
        self.total = above[0]

    def larger_than(self, amount: int) -> int:
        return self.above[bisect_right(self.keys, amount)]


def fragmentation(free: int, sizes: Mapping[int, int] | None, request: int) -> float:
    """``frag(free)``: the free capacity expected to be stranded for the next request.

    ``free * P(size > free)`` over ``sizes`` (amount -> count) plus ``request`` once.
    """
    dist = _Sizes(sizes, request)
    return free * dist.larger_than(free) / dist.total


def value_order(
    policy: str, values: list[int], amount: int, sizes: Mapping[int, int] | None = None
) -> list[int]:
    """The free amounts (sorted ``values``, each shared by some devices) to try, in order.

    Only amounts ``>= amount`` can fit; ``first-fit`` is not ranked by value (the caller
    keeps upstream's order) and gives ascending values like ``binpack``.
    """
    start = bisect_left(values, amount)
    if policy == SPREAD:
        return values[start:][::-1]
    if policy != FRAGMENTATION_AWARE:
        return values[start:]
    dist = _Sizes(sizes, amount)
    larger_than = dist.larger_than

    def increase(free: int) -> tuple[int, int]:
        left = free - amount
        return (left * larger_than(left) - free * larger_than(free), left)

    return sorted(values[start:], key=increase)


def placement_order(
    policy: str, index: FreeIndex, amount: int, sizes: Mapping[int, int] | None = None
) -> Iterator[int]:
    """Candidate-list positions in the order ``policy`` tries them (see the module doc)."""
    groups = index.groups
    for value in value_order(policy, index.values, amount, sizes):
        yield from groups[value]
