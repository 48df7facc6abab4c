"""Candidate lists with max-trees, so that a decision never scans full devices.

A *candidate list* is the ordered set of devices that one kind of request can pick
on one node: visible from the node and matching the class and request selectors.
It is built once per (node, class, request selectors) and kept up to date as
capacity is reserved and released.

For every capacity name a request asks for, the list keeps a max segment tree over
"free amount" (total minus committed consumption, in nanos), and one tree over
"usable" (1 unless the device is held exclusively, or is dedicated and live shares
still hold it). Because a request never
consumes less than it asks for (rounding only goes up), ``free >= requested`` is a
necessary condition for a device to fit, so whole subtrees of full devices are
skipped. The first position that passes the trees still gets the exact check by
the allocator; if it fails, the search resumes after it. On a half full or 90 %
full inventory the cost of finding the first fitting device is O(log n) instead
of O(n), which is what keeps the decision cost flat as the cluster fills.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

from events.errors import SelectorError

UNUSABLE = -1


class MaxTree:
    """A max segment tree over a fixed number of integer slots."""

    __slots__ = ("data", "size")

    def __init__(self, values: Sequence[int]) -> None:
        size = 1
        while size < max(1, len(values)):
            size *= 2
        self.size = size
        data = [UNUSABLE] * (2 * size)
        data[size : size + len(values)] = values
        for i in range(size - 1, 0, -1):
            left, right = data[2 * i], data[2 * i + 1]
            data[i] = left if left >= right else right
        self.data = data

    def set(self, pos: int, value: int) -> None:
        data = self.data
        i = pos + self.size
        data[i] = value
        i //= 2
        while i:
            left, right = data[2 * i], data[2 * i + 1]
            best = left if left >= right else right
            if data[i] == best:
                break
            data[i] = best
            i //= 2


def first_fit(trees: Sequence[tuple[MaxTree, int]], start: int, count: int) -> int:
    """The leftmost position >= ``start`` where every tree holds at least its threshold.

    Subtrees are pruned when any tree's maximum is below its threshold; leaves are
    exact. Returns -1 when there is none.
    """
    size = trees[0][0].size

    def descend(node: int, lo: int, hi: int) -> int:
        if hi <= start or lo >= count:
            return -1
        for tree, threshold in trees:
            if tree.data[node] < threshold:
                return -1
        if node >= size:
            return lo
        mid = (lo + hi) // 2
        found = descend(2 * node, lo, mid)
        if found >= 0:
            return found
        return descend(2 * node + 1, mid, hi)

    return descend(1, 0, size)


class CandidateList:
    """The devices one request shape can pick on one node, in allocation order."""

    __slots__ = ("devices", "errors", "indexes", "position", "trees", "usable", "whole")

    def __init__(self, devices: list[int], errors: list[tuple[int, SelectorError]]) -> None:
        self.devices = devices
        self.position = {device: pos for pos, device in enumerate(devices)}
        self.errors = errors  # (device index, error), in device order
        self.usable: MaxTree | None = None
        self.trees: dict[str, MaxTree] = {}
        self.indexes: dict[str, FreeIndex] = {}  # only for placement policies
        #: capacities every device has with a total > 0 (whole-device takes prune on them)
        self.whole: tuple[str, ...] | None = None


class FreeIndex:
    """The positions of a candidate list grouped by the free amount of one capacity.

    For placement policies other than first-fit (:mod:`services.reservation.placement`):
    ``values`` holds every free amount that some usable device has, sorted; ``groups``
    maps each to its positions, ascending (upstream's order). Devices that are unusable
    or lack the capacity (:data:`UNUSABLE`) are left out. A class of identical devices
    has few distinct amounts, so ranking amounts costs far less than ranking devices.
    """

    __slots__ = ("groups", "values")

    def __init__(self, values: Sequence[int]) -> None:
        groups: dict[int, list[int]] = {}
        for pos, value in enumerate(values):
            if value != UNUSABLE:
                groups.setdefault(value, []).append(pos)
        self.groups = groups
        self.values = sorted(groups)

    def move(self, pos: int, old: int, new: int) -> None:
        """Position ``pos`` changed from free amount ``old`` to ``new``."""
        if old == new:
            return
        if old != UNUSABLE:
            group = self.groups[old]
            del group[bisect_left(group, pos)]
            if not group:
                del self.groups[old]
                del self.values[bisect_left(self.values, old)]
        if new != UNUSABLE:
            target = self.groups.get(new)
            if target is None:
                self.groups[new] = [pos]
                insort(self.values, new)
            else:
                insort(target, pos)
