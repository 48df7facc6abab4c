"""What the fault harness checks, read from the log itself.

:class:`Book` is what the tenants were told: each apply and each delete the claims API
acknowledged. :class:`LogView` reads the log as the superuser (the multi-host URL, so
it follows a failover) and keeps, from position 0 on:

* the fold of the log (:class:`~events.state.ClusterState`, through the fold's driver:
  an event it refuses is a finding), for each claim's phase;
* the claims the log holds a ``ClaimAdmitted`` of, and a ``ReleaseRequested`` or
  ``ClaimWithdrawn`` of;
* its own replay of the capacity each device holds — every ``CapacityReserved`` that is
  not admin access adds its amounts, the ``CapacityReleased`` of its share takes them
  back, a ``NodeFenced`` releases its node's shares — against the device's total, after
  every event: independent of the fold's and the database's checks it is meant to
  confirm.

Each time the view connects again (its connection lost: a failover, a server paused
past a timeout) it starts again from position 0. A commit can be visible on the old
primary before its standby has it: a backend waiting for the standby's confirmation
that sees its postmaster die stops waiting, and its transaction becomes visible to the
sessions not yet killed. The view may have read such an event; the promoted server
never got it (its client was never told it succeeded) and hands its positions to the
next appends. A view that went on from where it was would skip those appends: a claim
applied right after the failover would never look Ready to it.

:func:`findings` says what is wrong: an acknowledged apply or delete missing from the
log, a device over its total, a refused event. :func:`unconverged` says which claims
have not reached their end state: Ready, or released/withdrawn once the log holds their
delete.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

import asyncpg

from events.catalog import (
    CapacityReleased,
    CapacityReserved,
    ClaimAdmitted,
    ClaimWithdrawn,
    Event,
    NodeFenced,
    ReleaseRequested,
)
from events.eventcodec import decode_stored
from events.folding import Refusal, fold_stored
from events.quantities import Quantity
from events.state import ClusterState
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import connect, iter_rows
from services.runtime.store.rows import PAYLOAD, POSITION, SCHEMA_VERSION, TYPE

DeviceKey = tuple[str, str, str]  #: driver, pool, device
DELETED: Final = frozenset({"released", "withdrawn"})


@dataclass
class Book:
    """What the claims API acknowledged: claim name -> when (``time.monotonic()``)."""

    applied: dict[str, float] = field(default_factory=dict)
    deleted: dict[str, float] = field(default_factory=dict)
    #: claim name -> what the acknowledgement of its apply said (its phase then)
    replies: dict[str, str] = field(default_factory=dict)


@dataclass
class _Share:
    device: DeviceKey
    node: str | None
    consumed: dict[str, Quantity]


class LogView:
    """The log folded and scanned as it grows (see the module docstring)."""

    def __init__(self, settings: Settings, namespace: str, totals: dict[DeviceKey, Quantity]):
        self._settings = settings
        self._namespace = namespace
        self._totals = totals
        self._connection: asyncpg.Connection | None = None
        self._connected = False  #: whether it had a connection before
        self.reset()

    def reset(self) -> None:
        """Start again from position 0 (after a failover: see the module docstring)."""
        self.state = ClusterState()
        self.submitted: set[str] = set()
        self.deletes: set[str] = set()
        self.shares: dict[str, _Share] = {}
        self.held: dict[DeviceKey, Quantity] = {}
        self.over: list[str] = []
        self.refused: list[str] = []
        self.peak: dict[DeviceKey, Quantity] = {}
        #: claim name -> the tags of its stream's events, with their positions
        self.history: dict[str, list[str]] = {}

    async def close(self) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            try:
                await connection.close(timeout=2)
            except Exception:  # (a session already broken: drop it)
                connection.terminate()

    async def refresh(self) -> None:
        """Read what was appended since the last call; from position 0 on a new
        connection after a lost one (see the module docstring)."""
        if self._connection is None or self._connection.is_closed():
            if self._connected:
                self.reset()
            self._connection = await connect(self._settings, through_failover=True)
            self._connected = True
        try:
            async for rows in iter_rows(self._connection, self.state.position):
                for row in rows:
                    self._take(row)
        except Exception:  # (asyncpg's InternalClientError too: a session ended under it)
            await self.close()
            raise

    def _take(self, row: asyncpg.Record) -> None:
        position = row[POSITION]
        folded = fold_stored(self.state, row[PAYLOAD], row[TYPE], row[SCHEMA_VERSION], position)
        if type(folded) is Refusal:
            self.refused.append(f"position {position} ({row[TYPE]}): {folded}")
        self._scan(decode_stored(row[PAYLOAD], row[TYPE], row[SCHEMA_VERSION]), position)

    def _scan(self, event: Event, position: int) -> None:
        name = getattr(event, "name", None)
        if isinstance(name, str) and getattr(event, "namespace", None) == self._namespace:
            self.history.setdefault(name, []).append(f"{position} {type(event).__name__}")
        match event:
            case ClaimAdmitted(namespace=ns, name=name) if ns == self._namespace:
                self.submitted.add(name)
            case (
                ReleaseRequested(namespace=ns, name=name) | ClaimWithdrawn(namespace=ns, name=name)
            ) if ns == self._namespace:
                self.deletes.add(name)
            case CapacityReserved() if not event.admin_access:
                key = (event.driver, event.pool, event.device)
                self.shares[event.share_id] = _Share(key, event.node, dict(event.consumed))
                self._add(key, event.consumed, position)
            case CapacityReleased(share_id=share_id):
                self._release(share_id)
            case NodeFenced(node=node):
                for share_id in [s for s, share in self.shares.items() if share.node == node]:
                    self._release(share_id)

    def _add(self, key: DeviceKey, consumed: dict[str, Quantity], position: int) -> None:
        held = self.held.get(key, Quantity(0)) + consumed.get("memory", Quantity(0))
        self.held[key] = held
        self.peak[key] = max(self.peak.get(key, held), held)
        total = self._totals.get(key)
        if total is None or held > total:
            self.over.append(f"position {position}: {'/'.join(key)} holds {held}, total {total}")

    def _release(self, share_id: str) -> None:
        share = self.shares.pop(share_id, None)
        if share is not None:
            amount = share.consumed.get("memory", Quantity(0))
            self.held[share.device] = self.held[share.device] - amount

    def phase(self, name: str) -> str | None:
        claim = self.state.claims.get((self._namespace, name))
        return None if claim is None else claim.phase


def findings(book: Book, view: LogView, read_at: float) -> list[str]:
    """What the log says is wrong (see the module docstring); [] when nothing is.
    ``read_at``: a moment before the view last read the log (``time.monotonic()``): what
    was acknowledged later may be committed after that read."""
    lost = [n for n, at in book.applied.items() if at < read_at and n not in view.submitted]
    found = [f"acknowledged apply not in the log: {told(book, view, n)}" for n in lost]
    lost = [n for n, at in book.deleted.items() if at < read_at and n not in view.deletes]
    found += [f"acknowledged delete not in the log: {told(book, view, n)}" for n in lost]
    found += [f"over capacity at {o}" for o in view.over]
    found += [f"refused by the fold: {r}" for r in view.refused]
    return found


def told(book: Book, view: LogView, name: str) -> str:
    """A claim's acknowledgements and what the log holds of it."""
    tags = ", ".join(view.history.get(name, [])) or "nothing"
    reply = book.replies.get(name, "?")
    return f"{name} (apply acknowledged as {reply!r}; the log holds: {tags})"


def converged(view: LogView, name: str) -> bool:
    """Whether the claim reached its end state: released or withdrawn once the log holds
    its delete, else Ready."""
    phase = view.phase(name)
    return phase in DELETED if name in view.deletes else phase == "ready"


def unconverged(book: Book, view: LogView, names: list[str] | None = None) -> list[str]:
    """The acknowledged claims (of ``names``, default all) not in their end state."""
    wanted = book.applied if names is None else names
    return [n for n in wanted if not converged(view, n)]
