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
the allocator; if it fails, the search resumes after it. A capacity tree holds
:data:`UNUSABLE` where the usable tree holds 0, so a request naming a capacity is
pruned by its capacity trees alone (the usable tree serves requests naming none).
On a half full or 90 % full inventory the cost of finding the first fitting device
is O(log n) instead of O(n), which is what keeps the decision cost flat as the cluster fills.
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
        while i > 1:  # the parent is the larger of this node (now ``value``) and its sibling
            sibling = data[i ^ 1]
            best = value if value >= sibling else sibling
            i >>= 1
            if data[i] == best:
                break
            data[i] = best
            value = best


def first_fit(trees: Sequence[tuple[MaxTree, int]], start: int, count: int) -> int:
    """The leftmost position in ``[start, count)`` where every tree holds at least its threshold.

    Returns -1 when there is none. Iterative: the subtrees right of ``start`` are
    visited left to right (climbing from the leaf ``start``; from 0, the root), a subtree
    is skipped when any tree's maximum in it is below its threshold, and the first one
    that passes is descended; leaves are exact. With one tree a passing subtree always
    holds a passing leaf, so the search is O(log n); with several, a subtree whose
    maxima pass tree by tree may hold no leaf that passes them all, and the search moves
    on to the next subtree (the leftmost passing position is the same either way).
    """
    if start >= count:
        return -1
    if len(trees) == 1:
        tree, threshold = trees[0]
        return _first_at_least(tree.data, tree.size, threshold, start, count)
    datas = [(tree.data, threshold) for tree, threshold in trees]
    size = trees[0][0].size
    node = start + size if start else 1  # from 0: the whole tree, the root
    while True:
        if _passes(datas, node):
            # every maximum passes: descend, leftmost child first
            while node < size:
                node *= 2
                if not _passes(datas, node):
                    node += 1
                    if not _passes(datas, node):
                        break  # neither child passes every tree: no leaf here does
            else:
                pos = node - size
                return pos if pos < count else -1
        # the next subtree to the right: up while a right child, then the right sibling
        while node & 1:
            node >>= 1
        if not node:
            return -1
        node += 1


def _passes(datas: list[tuple[list[int], int]], node: int) -> bool:
    return all(data[node] >= threshold for data, threshold in datas)


def _first_at_least(data: list[int], size: int, threshold: int, start: int, count: int) -> int:
    """:func:`first_fit` over one tree (its ``data`` and ``size``)."""
    node = start + size if start else 1  # from 0: the whole tree, the root
    while data[node] < threshold:
        while node & 1:
            node >>= 1
        if not node:
            return -1
        node += 1
    while node < size:
        node *= 2
        if data[node] < threshold:
            node += 1
    pos = node - size
    return pos if pos < count else -1


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
