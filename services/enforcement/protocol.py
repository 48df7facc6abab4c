"""The wire between a node agent and the enforcement service: verbs, payloads, refusals.

A node agent has no database login. It sends every request to the enforcement service
(:mod:`services.enforcement.service`) on ``{prefix}.node.<node token>.<verb>``
(:meth:`~events.subjects.BusNames.node_request`; only that node's credential may
publish there) and waits for the answer (NATS request/reply, JSON of the Structs
below; an answer larger than the server's ``max_payload`` comes in parts,
:mod:`services.runtime.bus.replies`):

========== =================== ================== ============================================
verb       request             answer             what the service does
========== =================== ================== ============================================
lease      :class:`LeaseAsk`   :class:`Leased`    appends ``NodeLeaseAcquired`` with the node's
                                                  next epoch, (re)creates the node's durable
                                                  consumer ``agent-<node>``
heartbeat  :class:`Heartbeat`  :class:`Beat`      renews the lease, with every other node's
                                                  heartbeat of the same tick, in one statement
view       :class:`ViewAsk`    :class:`Viewed`    confirms the agent's bus messages against
                                                  the log and answers a node-scoped view of
                                                  the fold (:mod:`services.enforcement.views`)
report     :class:`Report`     :class:`Reported`  checks and appends the agent's events, with
                                                  the ``processed_messages`` rows of its
                                                  consumer, as ``agent:<node>#<epoch>``
consumer   :class:`ConsumerAsk`:class:`Consumed`  creates the node's durable consumer again
                                                  if the broker lost it (the agent's pull
                                                  requests found nobody: ``503``)
========== =================== ================== ============================================

Every answer is a :class:`Reply`: ``{"answer": ...}`` or ``{"refusal": {"code",
"message"}}``. The codes say what the agent does, never the text:

* ``conflict``: the log moved under the decision (a stream version clash, a message
  handled meanwhile, the fold refusing a report decided on an old view): decide again
  on a fresh view;
* ``stale_epoch``: the lease named is not the node's any more (``current`` is the
  node's epoch): take the next lease and reconcile;
* ``forbidden``: the request is not this node's to make (another node's subject or
  share, no identity from the broker);
* ``invalid``: the payload breaks the protocol (does not decode, an event a node agent
  does not write, a stream that is not the event's): nothing was written;
* ``unavailable``: the database could not be reached: try again later;
* ``internal``: a bug of the service (logged there).

Requests are decoded strictly (unknown fields refused), reported events with the
catalog's strict decoder (:func:`~events.eventcodec.decode_event`). Pure: no I/O here.
"""

from __future__ import annotations

import datetime
import re
from typing import Final, Generic, Literal, TypeVar

import msgspec

from events.catalog import EnforcementLevel
from events.envelopes import Envelope
from events.model import decode_hook, encode_hook
from events.state import ClaimKey
from events.subjects import node_token

__all__ = [
    "VERBS",
    "Beat",
    "Cause",
    "Consumed",
    "ConsumerAsk",
    "Heartbeat",
    "LeaseAsk",
    "Leased",
    "Refusal",
    "RefusalCode",
    "Reply",
    "Report",
    "ReportBatch",
    "Reported",
    "ViewAsk",
    "Viewed",
    "consumer_name",
    "decode",
    "encode",
]

VERBS: Final = ("lease", "heartbeat", "view", "report", "consumer")

RefusalCode = Literal["conflict", "stale_epoch", "forbidden", "invalid", "unavailable", "internal"]

_DURABLE_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_-]")


def consumer_name(node: str) -> str:
    """The durable consumer of ``node``'s agent (a JetStream-safe name)."""
    return "agent-" + _DURABLE_UNSAFE.sub("_", node_token(node))


class _Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A request or answer: strict, every field named."""


class LeaseAsk(_Message, frozen=True, kw_only=True):
    """Take the node's next lease."""

    boot_id: str
    ttl_ms: int
    enforcement: EnforcementLevel = "none"


class Leased(_Message, frozen=True, kw_only=True):
    """The lease taken: its epoch, the boot id of the lease before, where it was logged."""

    epoch: int
    previous_boot_id: str = ""
    position: int = 0


class Heartbeat(_Message, frozen=True, kw_only=True):
    """Renew the lease of ``epoch``."""

    epoch: int


class Beat(_Message, frozen=True, kw_only=True):
    """Whether the lease is still held (False: expired, fenced or superseded: lost)."""

    held: bool


class ViewAsk(_Message, frozen=True, kw_only=True):
    """A view of the fold for a decision.

    ``at_least``: a position the view must include (the agent's latest append or lease);
    ``messages``: bus messages to confirm against the log and decide on (their claims
    and shares are in the view); ``redelivered``: the ids among them delivered before
    (only those can have been handled already); ``undecodable``: the ids
    (``Nats-Msg-Id``) of messages that did not decode, for the log to say whether each
    is an event the fold refuses; ``claims`` and ``shares``: more to put in the view;
    ``retries``: the node's shares waiting for a retry; ``node``: the whole node;
    ``streams``: stream versions wanted besides those of the node and the claims.
    """

    at_least: int = 0
    messages: list[Envelope] = []
    redelivered: list[str] = []
    undecodable: list[str] = []
    claims: list[ClaimKey] = []
    shares: list[str] = []
    retries: bool = False
    node: bool = False
    streams: list[str] = []


class Viewed(_Message, frozen=True, kw_only=True):
    """The view (raw JSON of a :class:`~services.enforcement.views.NodeView`) and what
    became of the messages: ``unconfirmed`` (the log does not hold them as sent: drop
    them), ``handled`` (recorded before: acknowledge them), ``refused`` (events the fold
    refuses, :mod:`events.folding`: acknowledge them unhandled, never act on them);
    ``next_retry_at``: the earliest retry due on the node (``None``: none)."""

    view: msgspec.Raw
    unconfirmed: list[str] = []
    handled: list[str] = []
    refused: list[str] = []
    next_retry_at: datetime.datetime | None = None


class ConsumerAsk(_Message, frozen=True, kw_only=True):
    """Create the node's durable consumer again if the broker lost it."""


class Consumed(_Message, frozen=True, kw_only=True):
    """Whether the durable had to be created again."""

    created: bool = False


class Cause(_Message, frozen=True, kw_only=True):
    """Why one reported event was written: the message's flow and id."""

    correlation_id: str | None = None
    causation_id: str | None = None


class ReportBatch(_Message, frozen=True, kw_only=True):
    """Events for one stream, at ``expected_version`` (``None``: any; no events: a
    version check only), each with its cause when ``causes`` is given."""

    stream: str
    expected_version: int | None = None
    events: list[msgspec.Raw] = []
    causes: list[Cause] | None = None


class Report(_Message, frozen=True, kw_only=True):
    """What the agent did, as events to append under its lease ``epoch``.

    ``processed``: the bus messages (event ids) this append records as handled by the
    node's consumer, atomically with the events (exactly once).
    """

    epoch: int
    at_least: int = 0
    batches: list[ReportBatch] = []
    processed: list[str] = []


class Reported(_Message, frozen=True, kw_only=True):
    """Appended: the position of the last event (0: nothing was written) and the earliest
    retry due on the node afterwards."""

    position: int = 0
    next_retry_at: datetime.datetime | None = None


class Refusal(_Message, frozen=True, kw_only=True):
    """Why a request was not done (see the module docstring for the codes)."""

    code: RefusalCode
    message: str
    current: int = 0  #: ``stale_epoch``: the node's epoch


_T = TypeVar("_T")


class Reply(msgspec.Struct, Generic[_T], frozen=True, kw_only=True):
    """Every answer: the answer, or the refusal."""

    answer: _T | None = None
    refusal: Refusal | None = None


_ENCODER: Final = msgspec.json.Encoder(enc_hook=encode_hook)


def encode(item: msgspec.Struct) -> bytes:
    """JSON of a request, an answer or a :class:`Reply`."""
    return _ENCODER.encode(item)


def decode(data: bytes, kind: type[_T]) -> _T:
    """``data`` as ``kind``, strictly (``msgspec.DecodeError`` / ``ValidationError``)."""
    return msgspec.json.decode(data, type=kind, dec_hook=decode_hook)
