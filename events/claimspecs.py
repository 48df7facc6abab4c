"""What the fold keeps of a submitted ResourceClaim: exactly what decisions read. Pure.

Every service folds the whole log, so whatever :class:`~events.state.ClaimState` holds
is held once per claim in every process, for as long as the claim is known. A
ResourceClaim manifest is mostly what no decision reads: metadata (labels, annotations,
managed fields a client sent along) and opaque driver configuration
(``spec.devices.config``, up to 32 entries of 10 KiB each) that only the driver on the
node interprets. :class:`ClaimSpec` is the compact form the fold keeps instead; the
manifest itself stays in the log (its ``ClaimSubmitted``), from where the few readers
that show or copy it fetch it (``services.runtime.store.recorded``).

What each decision reads of a claim, and where it is here:

=========================================== =============================================
reader                                      reads
=========================================== =============================================
the allocator (``reservation/allocating``,  ``requests`` (class, selectors, mode, count,
``rounds``, ``candidates``)                 adminAccess, tolerations, capacity requests,
                                            ``firstAvailable``) and ``constraints``;
                                            namespace and name (the claim's key). The
                                            claim's configuration is *copied* into the
                                            allocation (``FromClaim``): the reservation
                                            service reads it from the log for the claims
                                            it binds that have one (``configs``)
admission (``claims/admission``)            whether a re-applied spec is the one recorded:
                                            :meth:`ClaimSpec.same_spec`
reclamation's not-started timeouts,         the DeviceClass of each request
the SLO tracker's class label, the agent's  (:meth:`ClaimSpec.class_of`,
retry window (``enforcement/decisions``),   :meth:`ClaimSpec.classes`)
replay's class scope
Kubernetes mirroring and ``status.devices`` ``results``: the device results of
of a refused claim                          ``status.allocation`` as submitted (a claim
                                            mirrored from Kubernetes)
views, audit, billing, report panels        nothing of the manifest (they read the fold's
                                            claim record or the events themselves)
``dracap claim get`` (the ResourceClaim)    the whole manifest: read from the log
=========================================== =============================================

The requests and constraints are the decoded event's own objects (in tuples, which
cost less than lists and are shared when empty): a claim's selectors and capacity
requests are what decisions are made of, so they stay whole.
The configuration is kept as its number of entries and a SHA-256 of its sorted JSON,
which is all admission's "same spec?" needs; two configurations that differ only in
how a number is written (``1`` and ``1.0``) count as different.

Of an allocation the fold keeps everything but its ``devices.config``
(:func:`allocation_without_config`), which it counts; the snapshot codec upcasts older
snapshots with the same function, so both keep the same.
"""

from __future__ import annotations

import hashlib
from typing import Final

import msgspec

from events.model import (
    AllocationResult,
    DeviceClaim,
    DeviceClaimConfiguration,
    DeviceConstraint,
    DeviceRequest,
    DeviceRequestAllocationResult,
    ObjectMeta,
    ResourceClaim,
    ResourceClaimSpec,
    encode_hook,
)

__all__ = ["ClaimSpec", "allocation_without_config", "claim_spec", "config_digest"]

_DIGEST_ENCODER: Final = msgspec.json.Encoder(enc_hook=encode_hook, order="sorted")


class ClaimSpec(msgspec.Struct, kw_only=True, frozen=True, gc=False, omit_defaults=True):
    """The parts of a submitted ResourceClaim that decisions read (module docstring)."""

    requests: tuple[DeviceRequest, ...] = ()
    constraints: tuple[DeviceConstraint, ...] = ()
    #: entries of ``spec.devices.config``: their contents stay in the log
    configs: int = 0
    #: :func:`config_digest` of them ("" when there are none)
    config_digest: str = ""
    #: ``status.allocation.devices.results`` as submitted (a claim mirrored from Kubernetes)
    results: tuple[DeviceRequestAllocationResult, ...] = ()

    def same_spec(self, other: ClaimSpec) -> bool:
        """Whether both were submitted with the same ``spec`` (``status`` aside)."""
        return (
            self.requests == other.requests
            and self.constraints == other.constraints
            and self.config_digest == other.config_digest
        )

    def class_of(self, request: str) -> str | None:
        """The DeviceClass named by result request ``request`` (``req`` or ``req/sub``)."""
        name, _, sub = request.partition("/")
        for candidate in self.requests:
            if candidate.name != name:
                continue
            if candidate.exactly is not None:
                return candidate.exactly.device_class_name
            for option in candidate.first_available or ():
                if option.name == sub:
                    return option.device_class_name
        return None

    def classes(self) -> list[str]:
        """Every DeviceClass the requests name, in request order (alternatives in theirs)."""
        names: list[str] = []
        for request in self.requests:
            if request.exactly is not None:
                names.append(request.exactly.device_class_name)
            names += [option.device_class_name for option in request.first_available or ()]
        return names

    def as_claim(self, namespace: str, name: str) -> ResourceClaim:
        """A ResourceClaim of these requests and constraints, without configuration: what
        the allocator decides on (the configuration is copied in from the log after)."""
        devices = DeviceClaim(
            requests=list(self.requests), constraints=list(self.constraints) or None
        )
        return ResourceClaim(
            metadata=ObjectMeta(name=name, namespace=namespace),
            spec=ResourceClaimSpec(devices=devices),
        )


def config_digest(config: list[DeviceClaimConfiguration] | None) -> str:
    """A SHA-256 of a claim's configuration as sorted JSON ("" for none)."""
    if not config:
        return ""
    return hashlib.sha256(_DIGEST_ENCODER.encode(config)).hexdigest()


def claim_spec(claim: ResourceClaim) -> ClaimSpec:
    """The :class:`ClaimSpec` of ``claim``."""
    devices = claim.spec.devices
    status = claim.status
    allocation = status.allocation if status is not None else None
    allocated = allocation.devices if allocation is not None else None
    found = allocated.results if allocated is not None else None
    results = tuple(found) if found else ()
    if devices is None:
        return ClaimSpec(results=results)
    config = devices.config
    return ClaimSpec(
        requests=tuple(devices.requests) if devices.requests else (),
        constraints=tuple(devices.constraints) if devices.constraints else (),
        configs=len(config) if config else 0,
        config_digest=config_digest(config),
        results=results,
    )


def allocation_without_config(allocation: AllocationResult) -> tuple[AllocationResult, int]:
    """``allocation`` without ``devices.config``, and how many entries that took away."""
    devices = allocation.devices
    config = devices.config if devices is not None else None
    if not config:
        return allocation, 0
    assert devices is not None
    stripped = msgspec.structs.replace(devices, config=None)
    return msgspec.structs.replace(allocation, devices=stripped), len(config)
