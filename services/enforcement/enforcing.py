"""The limits a node agent has in force, and what they consume per device, kept current.

The agent's last line of defense (invariant 12, :func:`~services.enforcement.decisions.
overcommit`) asks one question per capacity of each new limit: how much do the limits in
force on that device consume already? Scanning every limit the agent enforces to answer
it made each decision cost O(limits on the node) — with thousands of live claims on a
node, most of a busy control plane's time. So the answer is *kept*:

* :class:`Enforcing` holds the limits in force by ShareID (the checkpoint's ``completed``
  set, in memory) and, per ``(device, capacity)``, the sum of the amounts of its
  non-admin limits and how many of them consume that capacity. :meth:`Enforcing.add`
  and :meth:`Enforcing.discard` change both as a limit is applied or removed; the
  question is one dictionary lookup (:meth:`Enforcing.held`). A limit applied again
  (an idempotent re-apply) replaces its earlier amounts, it is never counted twice.
* :class:`Draft` is what a decision over a group of messages counts: the limits in
  force plus the ones the group will apply, minus the ones it will remove, recorded on
  top of an :class:`Enforcing` without copying it (:meth:`Enforcing.draft`). Each change
  costs O(the capacities of that limit); the draft is thrown away after the decision,
  and the enforcers' real outcomes change the :class:`Enforcing` itself.

Both answer :meth:`get` and :meth:`held` (the :class:`Tally` protocol the pure decisions
read). Admin-access limits consume nothing and are never summed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol, TypeAlias

from events.state import DeviceKey
from services.enforcement.enforcers import ShareLimit

__all__ = ["Draft", "Enforcing", "Tally"]

#: ``(device, capacity)``
Place: TypeAlias = tuple[DeviceKey, str]


class Tally(Protocol):
    """What a decision reads of the limits in force (see the module docstring)."""

    def get(self, share_id: str) -> ShareLimit | None:
        """The limit of ``share_id`` in force (``None``: none)."""

    def held(self, device: DeviceKey, capacity: str) -> tuple[int, int]:
        """The nanos of ``capacity`` the non-admin limits on ``device`` consume, and how
        many limits consume it."""


def _places(limit: ShareLimit) -> Iterator[tuple[Place, int]]:
    """What ``limit`` counts towards: ``((device, capacity), nanos)`` (nothing if admin)."""
    if limit.admin_access:
        return
    key = (limit.driver, limit.pool, limit.device)
    for capacity, amount in limit.consumed.items():
        yield (key, capacity), amount.nanos


def _count(sums: dict[Place, list[int]], limit: ShareLimit, sign: int) -> None:
    for place, nanos in _places(limit):
        held = sums.get(place)
        if held is None:
            held = sums[place] = [0, 0]
        held[0] += sign * nanos
        held[1] += sign
        if held[1] == 0 and held[0] == 0:
            del sums[place]


class Enforcing(Mapping[str, ShareLimit]):
    """The limits in force on the node by ShareID, with their sums per device capacity."""

    def __init__(self, limits: Iterable[ShareLimit] | Mapping[str, ShareLimit] = ()) -> None:
        self._limits: dict[str, ShareLimit] = {}
        self._sums: dict[Place, list[int]] = {}
        items = limits.values() if isinstance(limits, Mapping) else limits
        for limit in items:
            self.add(limit)

    def __getitem__(self, share_id: str) -> ShareLimit:
        return self._limits[share_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._limits)

    def __len__(self) -> int:
        return len(self._limits)

    def __repr__(self) -> str:
        return f"Enforcing({sorted(self._limits)})"

    def add(self, limit: ShareLimit) -> None:
        """``limit`` is in force now (replacing what its share had in force before)."""
        self.discard(limit.share_id)
        self._limits[limit.share_id] = limit
        _count(self._sums, limit, +1)

    def discard(self, share_id: str) -> None:
        """The limit of ``share_id`` is no longer in force (none: nothing changes)."""
        limit = self._limits.pop(share_id, None)
        if limit is not None:
            _count(self._sums, limit, -1)

    def held(self, device: DeviceKey, capacity: str) -> tuple[int, int]:
        held = self._sums.get((device, capacity))
        return (held[0], held[1]) if held is not None else (0, 0)

    def draft(self) -> Draft:
        """A draft of what a decision over several messages will change (see above)."""
        return Draft(self)


class Draft:
    """The limits in force with a decision's changes on top (see the module docstring)."""

    def __init__(self, base: Tally) -> None:
        self._base = base
        self._changed: dict[str, ShareLimit | None] = {}  # None: removed
        self._sums: dict[Place, list[int]] = {}  # the changes' effect on the base's sums

    def get(self, share_id: str) -> ShareLimit | None:
        if share_id in self._changed:
            return self._changed[share_id]
        return self._base.get(share_id)

    def __contains__(self, share_id: object) -> bool:
        return isinstance(share_id, str) and self.get(share_id) is not None

    def held(self, device: DeviceKey, capacity: str) -> tuple[int, int]:
        nanos, count = self._base.held(device, capacity)
        delta = self._sums.get((device, capacity))
        if delta is None:
            return nanos, count
        return nanos + delta[0], count + delta[1]

    def add(self, limit: ShareLimit) -> None:
        """The decision applies ``limit`` (replacing what its share has in force)."""
        self.discard(limit.share_id)
        self._changed[limit.share_id] = limit
        _count(self._sums, limit, +1)

    def discard(self, share_id: str) -> None:
        """The decision removes the limit of ``share_id``."""
        limit = self.get(share_id)
        if limit is not None:
            _count(self._sums, limit, -1)
        self._changed[share_id] = None
