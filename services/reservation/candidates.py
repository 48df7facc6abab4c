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

    __slots__ = ("devices", "errors", "position", "trees", "usable")

    def __init__(self, devices: list[int], errors: list[tuple[int, SelectorError]]) -> None:
        self.devices = devices
        self.position = {device: pos for pos, device in enumerate(devices)}
        self.errors = errors  # (device index, error), in device order
        self.usable: MaxTree | None = None
        self.trees: dict[str, MaxTree] = {}
