"""Events as JSON and back: the catalog's wire format, its two decoders and its upcasters.

Wire format
-----------
JSON. Event fields are snake_case; nested Kubernetes objects
(:mod:`events.model`) keep their camelCase API shape. Quantities are written in
canonical form (``"1536Mi"``) through :func:`events.model.encode_hook` and read
back into :class:`~events.quantities.Quantity` through
:func:`events.model.decode_hook`; in Python, every ``dict[str, Quantity]`` field
holds real ``Quantity`` objects, never strings.

Two decoders, two contracts
---------------------------
* **Strict** (:func:`decode_event`, :func:`decode_command_envelope`): for events
  that are being *created* now (commands, tests, tools). Unknown tags, unknown
  top-level fields, missing fields and wrongly typed values are all rejected with
  a :class:`~events.errors.CatalogError` that names the tag and the field.
* **Tolerant** (:func:`decode_stored`, :func:`decode_envelope`): for data already
  in the log or on the bus. Unknown fields are ignored (a newer writer may have
  added an optional one), and payloads written under an older schema version are
  brought up to date by the upcasters before they are typed.

The one breaking change so far: ``reservation.capacity_reserved`` version 1 had
no ``policy_version`` and no ``shared``, and its ``share_id`` was ``null`` for
dedicated devices. :func:`_upcast_capacity_reserved_v1` derives ``shared`` from
the presence of a share id, gives dedicated results a deterministic share id
(UUIDv5 of the result's identity) and sets ``policy_version`` to
:data:`~events.catalog.POLICY_VERSION_UNRECORDED`, which the fold resolves to the policy in
force when it replays the reservation.

The evolution rules these decoders keep are the catalog's (:mod:`events.catalog`). Pure.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeAlias

import msgspec

from events.catalog import (
    EVENT_TYPES,
    POLICY_VERSION_UNRECORDED,
    SCHEMA_VERSIONS,
    SHARE_ID_NAMESPACE,
    Event,
    tag_of,
)
from events.envelopes import Envelope, EnvelopeHead
from events.errors import CatalogError
from events.model import decode_hook, encode_hook
from events.nesting import MAX_STORED_DEPTH, bounded

__all__ = [
    "UPCASTERS",
    "Upcaster",
    "current_decoders",
    "decode_command_envelope",
    "decode_envelope",
    "decode_event",
    "decode_stored",
    "encode_event",
    "encode_payload",
]

_ENCODER: Final = msgspec.json.Encoder(enc_hook=encode_hook)


def encode_event(item: Envelope | Event) -> bytes:
    """JSON of an envelope (what the bus carries) or of a bare event.

    The store keeps the bare event (:func:`encode_payload`) next to its ``type``
    and ``schema_version`` columns and reads it back with :func:`decode_stored`.
    """
    return _ENCODER.encode(item)


def encode_payload(event: Event) -> bytes:
    """JSON of the bare event, ``type`` included: the store's payload column."""
    return _ENCODER.encode(event)


# --- decoding -----------------------------------------------------------------------------

_RAW_DECODER: Final = msgspec.json.Decoder()
_EVENT_DECODERS: Final[Mapping[str, msgspec.json.Decoder[Any]]] = {
    tag: msgspec.json.Decoder(cls, dec_hook=decode_hook) for tag, cls in EVENT_TYPES.items()
}
_ENVELOPE_DECODER: Final = msgspec.json.Decoder(Envelope, dec_hook=decode_hook)
_FIELDS_BY_TAG: Final[Mapping[str, frozenset[str]]] = {
    tag: frozenset(cls.__struct_encode_fields__) | {"type"} for tag, cls in EVENT_TYPES.items()
}
_ENVELOPE_FIELDS: Final = frozenset(Envelope.__struct_encode_fields__)

Upcaster: TypeAlias = Callable[[dict[str, Any]], dict[str, Any]]


def _upcast_capacity_reserved_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """v1 -> v2: add ``shared`` and ``policy_version``; give dedicated results a share id."""
    out = dict(payload)
    share_id = out.get("share_id")
    out["shared"] = share_id is not None
    if share_id is None:
        identity = "/".join(
            str(out.get(k, ""))
            for k in ("namespace", "name", "allocation_version", "request", "driver", "pool")
        )
        out["share_id"] = str(uuid.uuid5(SHARE_ID_NAMESPACE, f"{identity}/{out.get('device')}"))
    out.setdefault("policy_version", POLICY_VERSION_UNRECORDED)
    return out


#: ``(tag, version) -> function`` turning a payload of ``version`` into ``version + 1``.
UPCASTERS: Final[Mapping[tuple[str, int], Upcaster]] = {
    ("reservation.capacity_reserved", 1): _upcast_capacity_reserved_v1,
}


def _validation_error(tag: str, exc: Exception) -> CatalogError:
    return CatalogError(f"event {tag!r}: {exc}")


def _class_for(tag: str) -> type[Event]:
    try:
        return EVENT_TYPES[tag]
    except KeyError:
        raise CatalogError(f"unknown event type {tag!r}") from None


def _raw_object(data: bytes | str, what: str) -> dict[str, Any]:
    try:
        raw = _RAW_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise CatalogError(f"{what}: not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CatalogError(f"{what}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _upcast(raw: dict[str, Any], tag: str, version: int) -> dict[str, Any]:
    """Apply the upcaster chain from ``version`` to the current version of ``tag``."""
    current = SCHEMA_VERSIONS[tag]
    if version > current:
        raise CatalogError(
            f"event {tag!r}: schema version {version} is newer than this code ({current})"
        )
    if version < 1:
        raise CatalogError(f"event {tag!r}: invalid schema version {version}")
    while version < current:
        upcaster = UPCASTERS.get((tag, version))
        if upcaster is None:
            raise CatalogError(f"event {tag!r}: no upcaster from schema version {version}")
        raw = upcaster(raw)
        version += 1
    raw["type"] = tag
    return raw


def _convert(raw: Any, cls: type[Any], tag: str, *, strict: bool = True) -> Any:
    try:
        return msgspec.convert(raw, type=cls, dec_hook=decode_hook, strict=strict)
    except msgspec.ValidationError as exc:
        raise _validation_error(tag, exc) from None


def _bounded(data: bytes | str, limit: int) -> bytes:
    """``data`` with nothing nested deeper than ``limit`` (:func:`events.nesting.bounded`)."""
    return bounded(data.encode() if isinstance(data, str) else bytes(data), limit)


def decode_stored(payload: bytes | str, type_tag: str, schema_version: int) -> Event:
    """Tolerantly decode a stored event payload, upcasting old schema versions.

    Unknown fields are ignored; an unknown tag, a tag that contradicts
    ``type_tag`` or a payload that fails validation raises :class:`CatalogError`.
    A value nested deeper than :data:`~events.nesting.MAX_STORED_DEPTH` is kept as its
    JSON text (:mod:`events.nesting`).
    """
    cls = _class_for(type_tag)
    payload = _bounded(payload, MAX_STORED_DEPTH)
    if schema_version == cls.SCHEMA_VERSION:
        try:
            event: Event = _EVENT_DECODERS[type_tag].decode(payload)
        except msgspec.ValidationError as exc:
            raise _validation_error(type_tag, exc) from None
        except msgspec.DecodeError as exc:
            raise CatalogError(f"event {type_tag!r}: not JSON: {exc}") from None
        return event
    raw = _raw_object(payload, f"event {type_tag!r}")
    if raw.get("type", type_tag) != type_tag:
        raise CatalogError(f"event {type_tag!r}: payload is tagged {raw.get('type')!r}")
    result: Event = _convert(_upcast(raw, type_tag, schema_version), cls, type_tag)
    return result


def current_decoders() -> dict[str, tuple[int, Callable[[bytes | str], Event]]]:
    """``tag -> (current schema version, decode)``, for hot replay loops.

    ``decode`` is the tolerant decoder :func:`decode_stored` uses for a payload stored
    at the current schema version. It raises msgspec's own errors; a caller that gets
    one should call :func:`decode_stored` for the :class:`CatalogError` it raises.
    """
    return {tag: (SCHEMA_VERSIONS[tag], decoder.decode) for tag, decoder in _EVENT_DECODERS.items()}


def decode_envelope(data: bytes | str) -> Envelope:
    """Tolerantly decode an envelope from the bus, upcasting its event if it is old.

    Its event is bounded in depth as :func:`decode_stored` bounds a stored payload (one
    level more: the envelope holds it), so a message and the log's row decode alike.
    """
    data = _bounded(data, MAX_STORED_DEPTH + 1)
    try:
        env = _ENVELOPE_DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        env = None
    if env is not None and env.schema_version == type(env.event).SCHEMA_VERSION:
        return env
    raw = _raw_object(data, "envelope")
    event_raw = raw.get("event")
    version = raw.get("schema_version")
    if not isinstance(event_raw, dict) or not isinstance(version, int):
        raise CatalogError("envelope: missing or invalid field `event` or `schema_version`")
    tag = event_raw.get("type")
    if not isinstance(tag, str):
        raise CatalogError("envelope: event has no `type` tag")
    cls = _class_for(tag)
    event = _convert(_upcast(dict(event_raw), tag, version), cls, tag)
    try:
        shell = msgspec.convert(
            {**raw, "event": None, "schema_version": cls.SCHEMA_VERSION},
            type=_EnvelopeShell,
            dec_hook=decode_hook,
        )
    except msgspec.ValidationError as exc:
        raise CatalogError(f"envelope: {exc}") from None
    return Envelope(**{f: getattr(shell, f) for f in _SHELL_FIELDS}, event=event)


class _EnvelopeShell(EnvelopeHead, frozen=True, kw_only=True):
    """An envelope without its event, for decoding upcast envelopes."""

    event: None = None


_SHELL_FIELDS: Final = EnvelopeHead.__struct_fields__


def _strict_event(raw: Any, where: str) -> Event:
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: expected a JSON object")
    tag = raw.get("type")
    if not isinstance(tag, str):
        raise CatalogError(f"{where}: missing or invalid field `type`")
    cls = _class_for(tag)
    unknown = sorted(set(raw) - _FIELDS_BY_TAG[tag])
    if unknown:
        raise CatalogError(f"event {tag!r}: unknown field(s) {', '.join(unknown)}")
    event: Event = _convert(raw, cls, tag)
    return event


def decode_event(data: bytes | str) -> Event:
    """Strictly decode a bare event of the current schema (commands, new events)."""
    return _strict_event(_raw_object(data, "event"), "event")


def decode_command_envelope(data: bytes | str) -> Envelope:
    """Strictly decode an envelope whose event is of the current schema."""
    raw = _raw_object(data, "envelope")
    unknown = sorted(set(raw) - _ENVELOPE_FIELDS)
    if unknown:
        raise CatalogError(f"envelope: unknown field(s) {', '.join(unknown)}")
    event = _strict_event(raw.get("event"), "envelope event")
    if raw.get("schema_version") != type(event).SCHEMA_VERSION:
        raise CatalogError(
            f"event {tag_of(event)!r}: schema_version must be {type(event).SCHEMA_VERSION}"
        )
    try:
        shell = msgspec.convert({**raw, "event": None}, type=_EnvelopeShell, strict=True)
    except msgspec.ValidationError as exc:
        raise CatalogError(f"envelope: {exc}") from None
    return Envelope(**{f: getattr(shell, f) for f in _SHELL_FIELDS}, event=event)
