"""Envelopes and streams: the bookkeeping an event travels with, and where it is appended.

An :class:`Envelope` wraps one event of the catalog (:data:`events.catalog.Event`)
with what the fold and the store need but the decision logic does not: its stream and
version in that stream, the global position, the namespace, the actor and the
correlation. :class:`EnvelopeHead` is the one definition of those fields; the
envelope's subclasses carry the event decoded (:class:`Envelope`) or as the JSON it was
stored as (:class:`RawEnvelope`, the relay's form).

Every event has one natural stream (:func:`stream_of`), named by the functions here
(``claim:``, ``device:``, ``class:``, ``slice:``, ``namespace:``, ``node:``,
``lease:``): the store orders and guards appends per stream, so the names are part of
the log's format. Pure.
"""

from __future__ import annotations

import datetime

import msgspec

from events.catalog import (
    AllocationBound,
    AppendRefused,
    CapacityReleased,
    CapacityReserved,
    ClaimAdmitted,
    ClaimRejected,
    ClaimReserved,
    ClaimStalled,
    ClaimSubmitted,
    ClaimUnreserved,
    ClaimUnschedulable,
    ClaimWithdrawn,
    ClassModeSet,
    DeviceClassApplied,
    DeviceClassRemoved,
    DeviceHealthChanged,
    EnforcementCheckpointSetAside,
    EnforcementReconciled,
    Event,
    LimitApplied,
    LimitFailed,
    LimitRemoved,
    MessageDeadLettered,
    NamespaceAccessSet,
    NodeFenced,
    NodeLeaseAcquired,
    NodeLeaseExpired,
    ReleaseRequested,
    RequestPolicyChanged,
    ResourceSlicePublished,
    ResourceSliceWithdrawn,
    ShareConfirmed,
    ShareMarkedUnknown,
    ShareUsed,
    schema_version_of,
)
from events.errors import CatalogError
from events.uuids import time_ordered_uuid

__all__ = [
    "Envelope",
    "EnvelopeHead",
    "RawEnvelope",
    "claim_stream",
    "class_stream",
    "device_stream",
    "lease_stream",
    "namespace_of",
    "namespace_stream",
    "new_envelope",
    "node_stream",
    "slice_stream",
    "stream_of",
]


# --- envelope -----------------------------------------------------------------------------


class EnvelopeHead(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """An envelope's bookkeeping, the one definition of its fields.

    ``position`` is the global log position (0 until the store assigns it);
    ``stream_version`` is 1-based within ``stream``; ``schema_version`` is the
    version of the event's payload as it was written. Subclasses add ``event``
    in the form they carry it: decoded (:class:`Envelope`), raw JSON
    (:class:`RawEnvelope`), or not at all (a shell while decoding).
    """

    event_id: str
    stream: str
    stream_version: int
    position: int = 0
    namespace: str | None = None
    actor: str
    correlation_id: str
    causation_id: str | None = None
    recorded_at: datetime.datetime
    schema_version: int


class Envelope(EnvelopeHead, frozen=True, kw_only=True, gc=False):
    """One event with its bookkeeping."""

    event: Event


class RawEnvelope(EnvelopeHead, frozen=True, kw_only=True, gc=False):
    """An envelope whose event is kept as the JSON it was stored as (the relay's form)."""

    event: msgspec.Raw


def new_envelope(
    event: Event,
    *,
    stream: str | None = None,
    stream_version: int,
    actor: str,
    correlation_id: str | None = None,
    causation_id: str | None = None,
    namespace: str | None = None,
    event_id: str | None = None,
    recorded_at: datetime.datetime | None = None,
    position: int = 0,
) -> Envelope:
    """Wrap a new ``event``; stream, ids, time and schema version default sensibly."""
    eid = event_id or time_ordered_uuid()
    return Envelope(
        event_id=eid,
        stream=stream if stream is not None else stream_of(event),
        stream_version=stream_version,
        position=position,
        namespace=namespace if namespace is not None else namespace_of(event),
        actor=actor,
        correlation_id=correlation_id or eid,
        causation_id=causation_id,
        recorded_at=recorded_at or datetime.datetime.now(datetime.UTC),
        schema_version=schema_version_of(event),
        event=event,
    )


# --- stream names -------------------------------------------------------------------------


def claim_stream(namespace: str, name: str) -> str:
    """``claim:<namespace>/<name>``."""
    return f"claim:{namespace}/{name}"


def device_stream(driver: str, pool: str, device: str) -> str:
    """``device:<driver>/<pool>/<device>``."""
    return f"device:{driver}/{pool}/{device}"


def class_stream(name: str) -> str:
    """``class:<name>``."""
    return f"class:{name}"


def slice_stream(name: str) -> str:
    """``slice:<name>``."""
    return f"slice:{name}"


def namespace_stream(name: str) -> str:
    """``namespace:<name>``."""
    return f"namespace:{name}"


def node_stream(name: str) -> str:
    """``node:<name>``."""
    return f"node:{name}"


def lease_stream(node: str) -> str:
    """``lease:<node>``: the node's lease transitions (acquired, expired, fenced) only,
    so that appending one at the version read orders them exactly."""
    return f"lease:{node}"


def stream_of(event: Event) -> str:
    """The stream an event is naturally appended to."""
    match event:
        case CapacityReserved() | CapacityReleased() | RequestPolicyChanged():
            return device_stream(event.driver, event.pool, event.device)
        case DeviceClassApplied():
            return class_stream(event.device_class.metadata.name)
        case DeviceClassRemoved() | ClassModeSet():
            return class_stream(event.name)
        case ResourceSlicePublished():
            return slice_stream(event.slice.metadata.name)
        case ResourceSliceWithdrawn():
            return slice_stream(event.name)
        case ClaimSubmitted():
            meta = event.claim.metadata
            return claim_stream(meta.namespace or "", meta.name)
        case (
            ClaimAdmitted()
            | ClaimRejected()
            | ClaimUnschedulable()
            | AllocationBound()
            | ReleaseRequested()
            | ClaimWithdrawn()
            | ClaimReserved()
            | ClaimUnreserved()
            | ClaimStalled()
        ):
            return claim_stream(event.namespace, event.name)
        case NamespaceAccessSet():
            return namespace_stream(event.namespace)
        case MessageDeadLettered():
            return f"consumer:{event.consumer}"
        case (
            LimitApplied()
            | LimitFailed()
            | LimitRemoved()
            | EnforcementReconciled()
            | EnforcementCheckpointSetAside()
            | DeviceHealthChanged()
            | ShareUsed()
            | ShareMarkedUnknown()
            | ShareConfirmed()
            | AppendRefused()
        ):
            return node_stream(event.node)
        case NodeLeaseAcquired() | NodeLeaseExpired() | NodeFenced():
            return lease_stream(event.node)
    raise CatalogError(f"not an event of the catalog: {type(event).__name__}")


def namespace_of(event: Event) -> str | None:
    """The tenant namespace an event belongs to, if any."""
    if isinstance(event, ClaimSubmitted):
        return event.claim.metadata.namespace
    namespace = getattr(event, "namespace", None)
    return namespace if isinstance(namespace, str) else None
