"""NATS subject and stream names: where each event travels on the bus.

Pure names, no I/O: every service, the relay, the CLI and the broker's permission
file derive their subjects from one :class:`BusNames`, so a subject is spelled in
exactly one place.

Subject scheme
--------------
All names start with a *prefix* (``dracap`` in production; tests take a unique one
each, so several tests share one nats-server without seeing each other)::

    {prefix}.ev.{category}.{node}.{tag}      one event            (JetStream stream)
    {prefix}.api.{namespace}.claims.{op}     tenant requests      (core NATS, micro)
    {prefix}.admin.{op}                      operator requests    (core NATS, micro)
    {prefix}.node.{node}.{verb}              a node agent's requests to the enforcement
                                             service (core NATS request/reply)

* ``tag`` is the event's catalog tag with its dots kept
  (``reservation.capacity_reserved``), so a subject always has at least six tokens
  and filters may end in ``>``.
* ``category`` is the tag before its first dot (``reservation``): a service that
  cares about one part of the domain reads ``{prefix}.ev.{category}.>``.
* ``node`` is the node the event is *addressed to* — the node must act on it or learn
  it about itself: bindings, release requests, lease expiry, fencing, shares marked
  unknown or confirmed (:data:`NODE_EVENTS`; a ``None`` node there means "not bound
  to a node") —, else ``_``. A node agent reads only ``{prefix}.ev.*.{node}.>``; with
  per-node broker permissions on that filter, one node cannot read another's
  instructions. Events that merely *mention* a node — a reservation on one of its
  devices, what its agent reported (limits applied, failed or removed, reconcile
  reports) — travel under ``_``: no agent has to receive, and acknowledge, its own
  reports or the reservations that precede a binding, which would triple an agent's
  messages per claim.
* Kubernetes node names may contain dots, which would split the token. A node name
  is therefore written as its *token* (:func:`node_token`): ASCII letters, digits
  and ``-`` stay as they are, every other byte of its UTF-8 form becomes ``%XX``
  (``ip-10-0-0-1.ec2.internal`` -> ``ip-10-0-0-1%2Eec2%2Einternal``). Plain node
  names (the common case) read unchanged, and because ``_`` is always escaped, the
  bare ``_`` ("no node") can never be a node's token.

A node agent talks to the control plane only on ``{prefix}.node.{node}.{verb}`` (its
node's token, the same as in the event subjects): the broker lets only that node's
credential publish there, and the enforcement service answers
(:mod:`services.enforcement.protocol` names the verbs).

The JetStream stream is ``{PREFIX}_EVENTS`` (prefix upper-cased) over
``{prefix}.ev.>``. The prefix must be a single token usable in a stream name:
ASCII letters, digits, ``-`` and ``_``.
"""

from __future__ import annotations

import re
from typing import Final

import msgspec

from events.catalog import (
    EVENT_TYPES,
    AllocationBound,
    AppendRefused,
    CapacityReserved,
    DeviceHealthChanged,
    EnforcementCheckpointSetAside,
    EnforcementReconciled,
    Event,
    LimitApplied,
    LimitFailed,
    LimitRemoved,
    NodeFenced,
    NodeLeaseAcquired,
    NodeLeaseExpired,
    ReleaseRequested,
    ShareConfirmed,
    ShareMarkedUnknown,
    ShareUsed,
    tag_of,
)
from events.envelopes import Envelope
from events.errors import SubjectError

__all__ = [
    "EVERY_EVENT",
    "NODE_EVENTS",
    "NODE_REPORTS",
    "NODE_TAGS",
    "NO_NODE",
    "BusNames",
    "Carried",
    "SubjectError",
    "node_of",
    "node_of_token",
    "node_token",
    "subject_matches",
]

#: Events addressed to a node: their ``node`` field routes them to that node's subjects.
NODE_EVENTS: Final = (
    AllocationBound,
    ReleaseRequested,
    NodeLeaseExpired,
    NodeFenced,
    ShareMarkedUnknown,
    ShareConfirmed,
)
#: Events that carry a ``node`` field only to say where something happened: reported
#: by (or reserved on) a node, addressed to nobody; they travel under ``_``.
NODE_REPORTS: Final = (
    CapacityReserved,
    LimitApplied,
    LimitFailed,
    LimitRemoved,
    EnforcementReconciled,
    EnforcementCheckpointSetAside,
    NodeLeaseAcquired,
    AppendRefused,
    DeviceHealthChanged,
    ShareUsed,
)

#: Tags of :data:`NODE_EVENTS`.
NODE_TAGS: Final[frozenset[str]] = frozenset(
    tag for tag, cls in EVENT_TYPES.items() if issubclass(cls, NODE_EVENTS)
)

#: The node token of events that concern no node.
NO_NODE: Final = "_"

_PREFIX: Final = re.compile(r"[A-Za-z0-9_-]+")
_TOKEN_SAFE: Final = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")
_FORBIDDEN_IN_TOKEN: Final = re.compile(r"[\s.*>]")


def node_token(node: str) -> str:
    """``node`` as one subject token (see the module docstring)."""
    if not node:
        raise SubjectError("node name is empty")
    raw = node.encode()
    return "".join(chr(b) if b in _TOKEN_SAFE else f"%{b:02X}" for b in raw)


_ESCAPE: Final = re.compile(r"%([0-9A-F]{2})")


def node_of_token(token: str) -> str:
    """The node whose :func:`node_token` is ``token``; :class:`SubjectError` when no node's is."""
    try:
        node = _ESCAPE.sub(lambda m: chr(int(m[1], 16)), token).encode("latin-1").decode()
    except (UnicodeEncodeError, UnicodeDecodeError):
        node = ""
    if not node or node_token(node) != token:
        raise SubjectError(f"{token!r} is not a node's subject token")
    return node


def node_of(event: Event) -> str | None:
    """The node an event is addressed to, if it is one of :data:`NODE_EVENTS` with a node."""
    if isinstance(event, NODE_EVENTS):
        return event.node
    return None


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether NATS delivers ``subject`` to a subscription or filter on ``pattern``:
    ``*`` stands for one token, a final ``>`` for one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return i == len(want) - 1 and len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


class Carried(msgspec.Struct, frozen=True):
    """Which events the bus carries: every event addressed to a node (its agent's durable
    reads it), and the events of ``tags`` whatever their node; ``tags`` None: every
    event. ``services.durables.carried`` derives the tags from the durables' filters."""

    tags: frozenset[str] | None = None

    def __call__(self, tag: str, node: str | None) -> bool:
        """Whether an event of ``tag`` addressed to ``node`` (None: to no node) is carried."""
        return self.tags is None or node is not None or tag in self.tags


#: Every event on the bus (a relay for readers it does not know; the tests').
EVERY_EVENT: Final = Carried()


def _token(value: str, what: str, *, wildcard: bool = False) -> str:
    if wildcard and value == "*":
        return value
    if not value or _FORBIDDEN_IN_TOKEN.search(value):
        raise SubjectError(f"{what} {value!r} is not a single subject token")
    return value


def _dotted(value: str, what: str) -> str:
    """Dotted tokens; ``*`` may stand for a whole token and ``>`` for the last ones."""
    tokens = value.split(".")
    for i, token in enumerate(tokens):
        if token == "*" or (token == ">" and i == len(tokens) - 1):
            continue
        if not token or _FORBIDDEN_IN_TOKEN.search(token):
            raise SubjectError(f"{what} {value!r} is not a valid subject suffix")
    return value


class BusNames(msgspec.Struct, frozen=True):
    """Every subject and stream name of one dracap installation (see module docstring)."""

    prefix: str = "dracap"

    def __post_init__(self) -> None:
        if not _PREFIX.fullmatch(self.prefix):
            raise SubjectError(
                f"prefix {self.prefix!r}: use ASCII letters, digits, '-' and '_' only"
            )

    @property
    def stream(self) -> str:
        """The JetStream stream holding every event: ``{PREFIX}_EVENTS``."""
        return f"{self.prefix.upper()}_EVENTS"

    @property
    def events_subjects(self) -> str:
        """The stream's subject filter: every event, ``{prefix}.ev.>``."""
        return f"{self.prefix}.ev.>"

    def event_subject(self, env: Envelope) -> str:
        """``{prefix}.ev.{category}.{node or '_'}.{tag}`` of an envelope's event."""
        return self.subject_of(tag_of(env.event), node_of(env.event))

    def subject_of(self, tag: str, node: str | None) -> str:
        """The event subject for a tag and node (for callers holding stored rows)."""
        category = tag.split(".", 1)[0]
        token = node_token(node) if node else NO_NODE
        return f"{self.prefix}.ev.{category}.{token}.{tag}"

    def node_filter(self, node: str) -> str:
        """What a node agent reads: every event addressed to ``node``."""
        return f"{self.prefix}.ev.*.{node_token(node)}.>"

    def tag_filter(self, tag: str) -> str:
        """Every event of one tag, whatever its node: ``{prefix}.ev.{category}.*.{tag}``."""
        category = _token(tag.split(".", 1)[0], "category")
        return f"{self.prefix}.ev.{category}.*.{_dotted(tag, 'tag')}"

    def category_filter(self, category: str) -> str:
        """Every event whose tag starts with ``category.``."""
        return f"{self.prefix}.ev.{_token(category, 'category')}.>"

    def api(self, namespace: str, op: str) -> str:
        """Tenant request subject; ``namespace`` may be ``*`` (a service's listen filter)."""
        ns = _token(namespace, "namespace", wildcard=True)
        return f"{self.prefix}.api.{ns}.claims.{_dotted(op, 'operation')}"

    def node_request(self, node: str, verb: str) -> str:
        """A node agent's request subject: ``{prefix}.node.{node token}.{verb}``."""
        return f"{self.prefix}.node.{node_token(node)}.{_token(verb, 'verb')}"

    @property
    def node_requests(self) -> str:
        """Every node agent's requests (the enforcement service's listen filter)."""
        return f"{self.prefix}.node.*.>"

    def node_of_request(self, subject: str) -> tuple[str, str] | None:
        """``(node, verb)`` of a node agent's request subject (``None``: not one)."""
        parts = subject.split(".")
        if len(parts) != 4 or parts[0] != self.prefix or parts[1] != "node":
            return None
        try:
            return node_of_token(parts[2]), parts[3]
        except SubjectError:
            return None

    def admin(self, op: str) -> str:
        """Operator request subject (``op`` may be dotted: ``slices.apply``)."""
        return f"{self.prefix}.admin.{_dotted(op, 'operation')}"
