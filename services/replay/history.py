"""Forensic questions over the log: state at a point, an object's timeline, a diff, usage.

All of them fold stored rows through the fold's driver (:mod:`events.folding`, with the
replay loop of ``replay verify``: :func:`services.replay.verify.fold_rows`) from a
:mod:`services.replay.sources` source, so the answers are the fold's — the same meaning
the services decided on — and an event the fold refuses is skipped by each of them (the
timeline still lists it when it names the object, with why it was refused).

* :func:`state_at`: the fold up to a position (from the newest verified snapshot at or
  before it, on a database); :func:`view` turns it into the devices, shares, claims and
  nodes a person reads (:func:`events.statecodec.to_builtins` form).
* :func:`timeline`: every event that touched one object, in log order. *Touched* means
  the event names the object (its id appears as a JSON string in the payload) **or**
  folding it changed the object's record in the state — so a node fence appears in the
  timeline of every share it released although it names only the node. Each step
  carries the fields of the record that changed (``old -> new``) and the envelope's
  actor (:mod:`events.actors`). A claim's record is shown with its manifest
  (``claim``) and its allocation whole, taken from the events the timeline reads (the
  fold keeps neither whole).
* :func:`diff`: what differs between two views, per section and key, field by field.
* :func:`usage_series`: for the plot, consumed capacity per tenant (namespace) on a
  device, a node's devices or a DeviceClass's shares after every event that changed it,
  the total, and the periods when some of it was Unknown.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, Final

import msgspec

from events.actors import ActorError, parse_actor
from events.catalog import AllocationBound, ClaimSubmitted, Event
from events.errors import InvariantViolation
from events.folding import Refusal, fold_stored
from events.model import AllocationResult, ResourceClaim, encode_hook
from events.state import ClusterState, ShareState
from events.statecodec import to_builtins
from services.replay.sources import LogSource
from services.replay.verify import fold_rows, note_refused, paused_gc
from services.runtime.ops.gauges import class_members
from services.runtime.ops.slos import share_class
from services.runtime.store.livestate import INVENTORY_EVENTS
from services.runtime.store.rows import PAYLOAD, POSITION, SCHEMA_VERSION, TYPE

__all__ = [
    "AmbiguousNameError",
    "Change",
    "Entity",
    "ReplayBrokenError",
    "Step",
    "diff",
    "find_entity",
    "state_at",
    "timeline",
    "usage_series",
    "view",
]

ACTOR = 7
RECORDED_AT = 10
SECTIONS: Final = ("devices", "shares", "claims", "nodes")


class ReplayBrokenError(Exception):
    """The log cannot be folded: a position out of order (names it). An event the fold
    refuses is no such error: it is skipped (:mod:`events.folding`)."""

    def __init__(self, position: int, detail: str) -> None:
        super().__init__(f"the log does not fold at position {position}: {detail}")
        self.position = position


async def state_at(source: LogSource, position: int) -> ClusterState:
    """The fold of the log up to and including ``position``."""
    state = await source.start(position)
    with paused_gc():
        async for rows in source.rows(state.position, to_position=position, to_fold=True):
            try:
                fold_rows(state, rows)
            except InvariantViolation as exc:
                raise ReplayBrokenError(exc.position, str(exc)) from None
    return state


def view(state: ClusterState) -> dict[str, Any]:
    """Devices, shares, claims and nodes of ``state`` as plain data."""
    plain = to_builtins(state)
    out: dict[str, Any] = {"position": state.position}
    for section in SECTIONS:
        out[section] = plain[section]
    for claim in out["claims"].values():
        claim.pop("spec", None)  # what the fold keeps of the manifest: in the timeline
        claim.pop("allocation_configs", None)
    for key, dev in state.devices.items():  # consumed as quantities, beside the nanos
        consumed = msgspec.to_builtins(dev.consumed(), enc_hook=encode_hook)
        out["devices"]["/".join(key)]["consumed"] = consumed
    return out


# --- diff --------------------------------------------------------------------------------


class Change(msgspec.Struct, kw_only=True):
    """One key of a section that differs between two views."""

    section: str
    key: str
    kind: str  # added | removed | changed
    fields: dict[str, tuple[Any, Any]] = {}


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaf values by dotted name; an empty mapping has no leaves (``{}`` gaining a key
    is that key added, not the mapping replaced)."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def field_changes(old: Any, new: Any) -> dict[str, tuple[Any, Any]]:
    """The leaf fields that differ between two plain records (dotted names)."""
    a = _flatten(old) if old is not None else {}
    b = _flatten(new) if new is not None else {}
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[Change]:
    """What changed from view ``a`` to view ``b``."""
    out: list[Change] = []
    for section in SECTIONS:
        left, right = a.get(section, {}), b.get(section, {})
        for key in sorted(set(left) | set(right)):
            if key not in left:
                out.append(Change(section=section, key=key, kind="added"))
            elif key not in right:
                out.append(Change(section=section, key=key, kind="removed"))
            elif left[key] != right[key]:
                fields = field_changes(left[key], right[key])
                out.append(Change(section=section, key=key, kind="changed", fields=fields))
    return out


# --- timeline ----------------------------------------------------------------------------


class Entity(msgspec.Struct, frozen=True, kw_only=True):
    """An object of the state a timeline follows."""

    kind: str  # claim | share | device | node
    key: str  # as in to_builtins: joined with "/"
    needles: tuple[bytes, ...]  # JSON strings whose presence in a payload names it

    def record(self, state: ClusterState) -> Any:
        """The object's record in ``state`` (``None``: not there)."""
        if self.kind == "share":
            return state.shares.get(self.key)
        if self.kind == "node":
            return state.nodes.get(self.key)
        parts = tuple(self.key.split("/"))
        if self.kind == "claim":
            return state.claims.get((parts[0], parts[1]))
        return state.devices.get((parts[0], parts[1], parts[2]))

    def named_in(self, payload: bytes) -> bool:
        """Whether a stored payload names the object."""
        return all(n in payload for n in self.needles)


def _quoted(text: str) -> bytes:
    return msgspec.json.encode(text)


class AmbiguousNameError(Exception):
    """A name that more than one object of the log answers to."""

    def __init__(self, text: str, candidates: list[Entity]) -> None:
        named = ", ".join(f"{c.kind}:{c.key}" for c in candidates)
        super().__init__(f"{text!r} is ambiguous: it names {named}; give one of these")
        self.candidates = candidates


def find_entity(state: ClusterState, text: str) -> Entity | None:
    """The object ``text`` names in ``state``: ``[claim:|share:|device:|node:]ID``.

    Without a prefix: a ShareID, a claim ``namespace/name``, a node, a device
    ``driver/pool/device`` or ``pool/device`` (as ``dracap devices`` prints it), or a
    device name or claim name that is unique. A text that names several objects at the
    same level (a claim ``a/b`` and a device of pool ``a``; a device name in two pools)
    raises :class:`AmbiguousNameError` listing them, never picks one.
    """
    kind, _, ident = text.partition(":") if ":" in text else ("", "", text)
    if kind and kind not in ("claim", "share", "device", "node"):
        kind, ident = "", text
    for found in (_exact(state, kind, ident), _short(state, kind, ident)):
        if len(found) > 1:
            raise AmbiguousNameError(text, found)
        if found:
            return found[0]
    return None


def _device(key: tuple[str, str, str], needle: str) -> Entity:
    return Entity(kind="device", key="/".join(key), needles=(_quoted(needle),))


def _claim(namespace: str, name: str) -> Entity:
    needles = (_quoted(namespace), _quoted(name))
    return Entity(kind="claim", key=f"{namespace}/{name}", needles=needles)


def _exact(state: ClusterState, kind: str, ident: str) -> list[Entity]:
    """The objects ``ident`` names in full (an id, ``namespace/name``, ``pool/device``...)."""
    parts = ident.split("/")
    found: list[Entity] = []
    if kind in ("", "share") and ident in state.shares:
        found.append(Entity(kind="share", key=ident, needles=(_quoted(ident),)))
    if kind in ("", "claim") and len(parts) == 2 and (parts[0], parts[1]) in state.claims:
        found.append(_claim(parts[0], parts[1]))
    if kind in ("", "node") and ident in state.nodes:
        found.append(Entity(kind="node", key=ident, needles=(_quoted(ident),)))
    if kind in ("", "device") and len(parts) == 3 and tuple(parts) in state.devices:
        found.append(_device((parts[0], parts[1], parts[2]), parts[2]))
    if kind in ("", "device") and len(parts) == 2:
        found += [_device(k, k[2]) for k in state.devices if (k[1], k[2]) == (parts[0], parts[1])]
    return found


def _short(state: ClusterState, kind: str, ident: str) -> list[Entity]:
    """The objects whose short name is ``ident`` (a device's, a claim's)."""
    if "/" in ident:
        return []
    found: list[Entity] = []
    if kind in ("", "device"):
        found += [_device(k, ident) for k in state.devices if k[2] == ident]
    if kind in ("", "claim"):
        found += [_claim(ns, name) for ns, name in state.claims if name == ident]
    return found


class Step(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One event in an object's timeline (``refused``: why the fold skipped it; left out
    of the JSON of a step it did not skip)."""

    position: int
    recorded_at: str
    type: str
    actor: str
    actor_kind: str
    changes: dict[str, tuple[Any, Any]]
    refused: str | None = None


def _plain(record: Any) -> Any:
    if record is None:
        return None
    return msgspec.to_builtins(record, enc_hook=encode_hook, order="sorted")


class _WholeClaim:
    """A claim's record as its timeline shows it: with its manifest (``claim``) and its
    allocation whole. The fold keeps neither whole (:mod:`events.claimspecs`); the
    timeline reads every event anyway, so it takes them from the events that set them."""

    def __init__(self, entity: Entity) -> None:
        namespace, _, name = entity.key.partition("/")
        self.key = (namespace, name)
        self.manifest: ResourceClaim | None = None
        self.allocation: AllocationResult | None = None

    def __call__(self, state: ClusterState, event: Event | None) -> Any:
        if isinstance(event, ClaimSubmitted):
            meta = event.claim.metadata
            if (meta.namespace or "", meta.name) == self.key:
                self.manifest = event.claim
        elif isinstance(event, AllocationBound) and (event.namespace, event.name) == self.key:
            self.allocation = event.allocation
        record = state.claims.get(self.key)
        if record is None:
            return None
        plain = _plain(record)
        del plain["spec"], plain["allocation_configs"]
        plain["claim"] = _plain(self.manifest)
        if record.allocation is not None and self.allocation is not None:
            plain["allocation"] = _plain(self.allocation)
        return plain


def _recorder(entity: Entity) -> Callable[[ClusterState, Event | None], Any]:
    """What a timeline compares after each event: the entity's record, as plain data."""
    if entity.kind == "claim":
        return _WholeClaim(entity)
    return lambda state, _: _plain(entity.record(state))


def _actor_kind(actor: str) -> str:
    try:
        return parse_actor(actor).kind
    except ActorError:
        return "unknown"


def _iso(value: Any) -> str:
    return value.isoformat() if isinstance(value, datetime.datetime) else str(value)


async def timeline(source: LogSource, entity: Entity) -> list[Step]:
    """Every event that touched ``entity``, from position 1 (see the module docstring)."""
    state = ClusterState()
    before: Any = None
    steps: list[Step] = []
    record = _recorder(entity)
    with paused_gc():
        async for rows in source.rows(0):
            for row in rows:
                payload = bytes(row[PAYLOAD])
                folded = _fold(state, row, payload)
                refused = None
                if isinstance(folded, Refusal):
                    note_refused(folded, row)
                    refused = f"{folded.reason}: {folded.detail}"
                after = record(state, None if isinstance(folded, Refusal) else folded)
                if after != before or entity.named_in(payload):
                    actor = row[ACTOR]
                    steps.append(
                        Step(
                            position=row[POSITION],
                            recorded_at=_iso(row[RECORDED_AT]),
                            type=row[TYPE],
                            actor=actor,
                            actor_kind=_actor_kind(actor),
                            changes=field_changes(before, after),
                            refused=refused,
                        )
                    )
                before = after
    return steps


def _fold(state: ClusterState, row: Any, payload: bytes) -> Event | Refusal:
    """Fold one row through the fold's driver (a position out of order: ReplayBrokenError)."""
    try:
        return fold_stored(state, payload, row[TYPE], row[SCHEMA_VERSION], row[POSITION])
    except InvariantViolation as exc:
        raise ReplayBrokenError(exc.position, str(exc)) from None


# --- usage over time (the plot) ------------------------------------------------------------


class Sample(msgspec.Struct, kw_only=True):
    """Consumed capacity of the scope after one event."""

    position: int
    time: datetime.datetime
    by_tenant: dict[str, float]
    total: float
    unknown: bool


def _scope_test(state: ClusterState, kind: str, key: str) -> Callable[[ShareState], bool]:
    if kind == "device":
        parts = tuple(key.split("/"))
        return lambda s: s.device_key == parts
    if kind == "node":
        return lambda s: s.node == key
    return lambda s: share_class(state, s) == key


def _unit_scale(capacity: str, state: ClusterState) -> tuple[float, str]:
    for dev in state.devices.values():
        total = dev.total.get(capacity)
        if total is not None and total.format == "BinarySI":
            return 2**30 * 1e9, "GiB"
    return 1e9, ""


async def usage_series(
    source: LogSource, kind: str, key: str, capacity: str
) -> tuple[list[Sample], str]:
    """Samples of consumed ``capacity`` per tenant for a device, node or class scope.

    Folds the whole log; a sample is taken after every event that changed what the
    scope holds, its total or whether some of it is Unknown. A class's total is every
    device its selectors select (as the allocator and the capacity gauges select them:
    :func:`services.runtime.ops.gauges.class_members`, taken again after each run of
    inventory events), and every device that held one of its shares. Returns the samples
    and the unit (``GiB`` for binary quantities).
    """
    state = ClusterState()
    in_scope: dict[str, str] = {}  # live share id -> namespace, shares placed in scope
    seen: set[str] = set()
    scoped_devices: set[tuple[str, str, str]] = set()
    members: set[tuple[str, str, str]] = set()  # a class's selected devices
    members_stale = False
    samples: list[Sample] = []
    last: tuple[Any, ...] | None = None
    scale = 1.0  # nanos until the end, then the unit of the final state
    async for page in source.rows(0):
        for row in page:
            event = _fold(state, row, bytes(row[PAYLOAD]))
            if isinstance(event, Refusal):
                note_refused(event, row)
                continue  # skipped: nothing changed
            share_id = getattr(event, "share_id", None)
            if isinstance(share_id, str) and share_id not in seen:
                seen.add(share_id)
                share = state.shares.get(share_id)
                if share is not None and _scope_test(state, kind, key)(share):
                    in_scope[share_id] = share.claim[0]
                    scoped_devices.add(share.device_key)
            if kind == "device":
                scoped_devices.add(tuple(key.split("/")))  # type: ignore[arg-type]
            elif kind == "node":
                scoped_devices.update(k for k, d in state.devices.items() if d.node == key)
            elif type(event) in INVENTORY_EVENTS:
                members_stale = True
            elif members_stale:  # the run of inventory events is over: select anew
                members, members_stale = set(class_members(state).get(key, ())), False
            by_tenant: dict[str, float] = {}
            unknown = False
            for sid, namespace in list(in_scope.items()):
                share = state.shares[sid]
                if not share.live:
                    del in_scope[sid]
                    continue
                if share.admin_access:
                    continue
                quantity = share.consumed.get(capacity)
                if quantity is not None:
                    by_tenant[namespace] = by_tenant.get(namespace, 0.0) + quantity.nanos / scale
                unknown = unknown or share.state == "unknown"
            total = sum(
                dev.total[capacity].nanos / scale
                for k in scoped_devices | members
                if (dev := state.devices.get(k)) is not None and capacity in dev.total
            )
            mark = (tuple(sorted(by_tenant.items())), total, unknown)
            if mark != last:
                when = row[RECORDED_AT]
                if not isinstance(when, datetime.datetime):
                    when = datetime.datetime.fromisoformat(when)
                samples.append(
                    Sample(
                        position=row[POSITION],
                        time=when,
                        by_tenant=by_tenant,
                        total=total,
                        unknown=unknown,
                    )
                )
                last = mark
    divide, unit = _unit_scale(capacity, state)
    for sample in samples:
        sample.total /= divide
        sample.by_tenant = {k: v / divide for k, v in sample.by_tenant.items()}
    return samples, unit
