"""What one append to the event store is made of, validated before it is sent. Pure.

An append is a list of :class:`Batch` es (events for one stream, appended only if the
stream is at the expected version) with the :class:`Metadata` every event of it shares,
optionally :class:`Processed` bus messages recorded with it and one :class:`Cause` per
event when it carries the reactions to several messages (a consumer's group commit).

:func:`pending_of` validates the events before anything is sent: each is encoded and
decoded strictly into its own type (one decode for a run of one event type), which
catches wrongly typed fields and invalid quantities; a bad event raises
:class:`~services.runtime.ground.errors.InvalidEvent` and nothing is written. What passes is a
:class:`Pending` append in column form (payloads, fresh event ids, streams, versions
assuming ``None`` batches start at 0, namespaces, correlation and causation), the
shape ``dracap_append_guarded`` takes; :func:`stored_envelopes` makes the envelopes of
the events once the statement returned their positions and the database's time. The
store itself (:mod:`services.runtime.store.eventstore`) sends it and maps its errors.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import msgspec

from events.actors import ActorError, parse_actor
from events.catalog import _TAG_BY_CLASS, Event
from events.envelopes import Envelope, namespace_of
from events.errors import CatalogError
from events.eventcodec import encode_payload
from events.model import decode_hook
from events.uuids import time_ordered_uuids
from services.runtime.ground.errors import InvalidEvent

__all__ = [
    "AdmissionPremise",
    "Batch",
    "Cause",
    "Metadata",
    "Pending",
    "Processed",
    "agent_epoch",
    "moved_versions",
    "pending_of",
    "stored_envelopes",
]


class Cause(msgspec.Struct, frozen=True):
    """Why one event was written: the flow it belongs to and the event that caused it."""

    correlation_id: str | None
    causation_id: str | None

    @classmethod
    def of(cls, env: Envelope) -> Cause:
        """The cause of an event written in reaction to ``env``."""
        return cls(env.correlation_id, env.event_id)


class Processed(msgspec.Struct, frozen=True):
    """Bus messages an append records as handled by ``consumer`` (``processed_messages``).

    The append then also fails, with :class:`~services.runtime.ground.errors.AlreadyHandled`
    and nothing written, if any of ``event_ids`` had been recorded for ``consumer``.
    """

    consumer: str
    event_ids: list[str]


class AdmissionPremise(msgspec.Struct, frozen=True):
    """What an admission took for granted, checked by the database with its append.

    The claims API decided on its fold as of position ``seen`` that ``namespace`` may
    have the claim. The append then also fails, with a
    :class:`~services.runtime.ground.errors.ConflictError` on stream ``admissions:<namespace>``
    and nothing written (``dracap_expect_admissions``, migrations 0013 and 0014), when
    an event after ``seen`` changed what the decision read:

    * ``quota`` (the namespace has one): a claim of the namespace that ``counted`` (this
      instance's admissions in flight) does not name was admitted — somebody else
      (another replica, the Kubernetes bridge) took quota meanwhile;
    * the namespace's access record was set again (classes, adminAccess, opaque
      configuration, quota, requests per claim);
    * a DeviceClass in ``classes`` (the ones the claim names) changed mode or was removed.

    Decide again, on the whole log.
    """

    namespace: str
    seen: int
    counted: tuple[str, ...] = ()
    quota: bool = True
    classes: tuple[str, ...] = ()


class Batch(msgspec.Struct, frozen=True):
    """Events for one stream, appended only if the stream is at ``expected_version``.

    ``expected_version`` is the stream's current version (0: the stream must not exist
    yet); ``None`` appends whatever the version is.

    ``causes``: one :class:`Cause` per event, for an append that carries the reactions
    to several messages at once (a consumer's group commit); ``None`` takes the
    correlation and causation ids of the append's :class:`Metadata`.

    ``premise``: an admission's quota premise, checked with the append
    (:class:`AdmissionPremise`).
    """

    stream: str
    expected_version: int | None
    events: Sequence[Event]
    causes: Sequence[Cause] | None = None
    premise: AdmissionPremise | None = None


class Metadata(msgspec.Struct, frozen=True, kw_only=True):
    """Envelope fields shared by all events of one append."""

    actor: str
    namespace: str | None = None
    correlation_id: str | None = None
    causation_id: str | None = None


def agent_epoch(actor: str) -> tuple[str, int] | None:
    """``(node, epoch)`` of an agent's actor that names its lease epoch, else ``None``.

    ``dracap_append_guarded`` checks the epoch under the head lock (migration 0007) and
    records a refusal instead of the events when it is stale.
    """
    if not actor.startswith("agent:"):
        return None
    try:
        parsed = parse_actor(actor)
    except ActorError:
        return None
    return None if parsed.epoch is None else (parsed.name, parsed.epoch)


class _Kind(msgspec.Struct, frozen=True):
    """What the store needs of one event class, looked up once per class."""

    tag: str
    schema_version: int
    decoder: msgspec.json.Decoder[Any]
    many: msgspec.json.Decoder[Any]


_KINDS: dict[type, _Kind] = {}


def _kind(cls: type) -> _Kind:
    kind = _KINDS.get(cls)
    if kind is None:
        tag = _TAG_BY_CLASS[cls]  # KeyError: not an event of the catalog
        kind = _KINDS[cls] = _Kind(
            tag,
            cls.SCHEMA_VERSION,  # type: ignore[attr-defined]
            msgspec.json.Decoder(cls, dec_hook=decode_hook),
            msgspec.json.Decoder(list[cls], dec_hook=decode_hook),  # type: ignore[valid-type]
        )
    return kind


def _payload(event: Event) -> bytes:
    """The stored payload of ``event``; raises InvalidEvent if it is not a valid event.

    The check is a round trip: encode, then decode strictly into the event's own type,
    which catches wrongly typed fields and invalid quantities (a Struct built in Python
    is not validated on construction). Encoding a Struct cannot add unknown fields, so
    the catalog's extra unknown-field check of :func:`events.eventcodec.decode_event` is
    not needed here.
    """
    try:
        kind = _kind(type(event))
    except (KeyError, TypeError):
        raise InvalidEvent(f"not an event of the catalog: {type(event).__name__}") from None
    try:
        payload = encode_payload(event)
        kind.decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError, TypeError, msgspec.EncodeError) as exc:
        raise InvalidEvent(f"event {kind.tag!r}: {exc}") from exc
    except CatalogError as exc:
        raise InvalidEvent(str(exc)) from exc
    return payload


def _payloads(events: Sequence[Event]) -> list[bytes]:
    """:func:`_payload` of every event; one strict decode for a run of one event type.

    Encoding a list gives the same bytes per event as encoding each one; when all
    events share a class, the payloads are joined into one JSON array and checked
    with a single decode. Any failure falls back to checking event by event, which
    raises the same :class:`InvalidEvent` as :func:`_payload`.
    """
    cls = type(events[0])
    kind = _KINDS.get(cls)
    if kind is None or len(events) < 2 or any(type(e) is not cls for e in events):
        return [_payload(e) for e in events]
    try:
        payloads = [encode_payload(e) for e in events]
        kind.many.decode(b"[" + b",".join(payloads) + b"]")
    except Exception:  # the event-by-event check below says what is wrong
        return [_payload(e) for e in events]
    return payloads


class Pending(msgspec.Struct, frozen=True):
    """Validated events of one append, before positions are known (column form)."""

    meta: Metadata
    events: list[Event]
    payloads: list[bytes]
    event_ids: list[str]
    streams: list[str]
    versions: list[int]  # stream versions assuming the stream is at 0 for ``None`` batches
    types: list[str]
    schema_versions: list[int]
    namespaces: list[str | None]
    correlation_ids: list[str]
    causation_ids: list[str | None]
    processed: Processed | None = None

    def __len__(self) -> int:
        return len(self.events)


def pending_of(batches: Sequence[Batch], meta: Metadata) -> Pending:
    """Validate the events of ``batches``; raise InvalidEvent (nothing written) if bad."""
    events: list[Event] = []
    payloads: list[bytes] = []
    streams: list[str] = []
    versions: list[int] = []
    causes: list[Cause | None] = []
    for batch in batches:
        if not batch.stream:
            raise InvalidEvent("stream name is empty")
        if batch.expected_version is not None and batch.expected_version < 0:
            raise InvalidEvent(f"expected version {batch.expected_version} < 0")
        if not batch.events:
            continue
        if batch.causes is not None and len(batch.causes) != len(batch.events):
            raise InvalidEvent(
                f"stream {batch.stream!r}: {len(batch.causes)} causes for "
                f"{len(batch.events)} events"
            )
        # With expected_version None the offset from the current version is added
        # inside the append transaction, once the version is known.
        payloads += _payloads(batch.events)
        events += batch.events
        count = len(batch.events)
        base = batch.expected_version or 0
        streams += [batch.stream] * count
        versions += range(base + 1, base + count + 1)
        causes += batch.causes if batch.causes is not None else [None] * count
    kinds = [_KINDS[type(e)] for e in events]  # filled by _payloads
    ids = time_ordered_uuids(len(events))
    if meta.namespace is not None:
        namespaces: list[str | None] = [meta.namespace] * len(events)
    else:
        namespaces = [namespace_of(e) for e in events]
    correlation_ids = [
        (c.correlation_id if c is not None else meta.correlation_id) or eid
        for c, eid in zip(causes, ids, strict=True)
    ]
    causation_ids = [c.causation_id if c is not None else meta.causation_id for c in causes]
    return Pending(
        meta=meta,
        events=events,
        payloads=payloads,
        event_ids=ids,
        streams=streams,
        versions=versions,
        types=[k.tag for k in kinds],
        schema_versions=[k.schema_version for k in kinds],
        namespaces=namespaces,
        correlation_ids=correlation_ids,
        causation_ids=causation_ids,
    )


def moved_versions(pending: Pending, current: dict[str, int]) -> list[int]:
    """Stream versions with ``None`` batches moved past their stream's current version."""
    if not any(current.values()):
        return pending.versions
    return [v + current[s] for v, s in zip(pending.versions, pending.streams, strict=True)]


def stored_envelopes(
    pending: Pending, positions: list[int], versions: list[int], now: datetime.datetime
) -> list[Envelope]:
    """The envelopes of an append, with their positions, stream versions and time."""
    meta = pending.meta
    actor = meta.actor
    return [
        Envelope(
            event_id=eid,
            stream=stream,
            stream_version=version,
            position=position,
            namespace=namespace,
            actor=actor,
            correlation_id=correlation_id,
            causation_id=causation_id,
            recorded_at=now,
            schema_version=schema_version,
            event=event,
        )
        for (
            eid,
            stream,
            version,
            position,
            namespace,
            correlation_id,
            causation_id,
            schema_version,
            event,
        ) in zip(
            pending.event_ids,
            pending.streams,
            versions,
            positions,
            pending.namespaces,
            pending.correlation_ids,
            pending.causation_ids,
            pending.schema_versions,
            pending.events,
            strict=True,
        )
    ]
