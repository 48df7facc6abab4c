"""Who may write each event: the writers of the catalog, and which login holds which job.

The catalog (:mod:`events.catalog`) says what can happen; this module says who records
it. Every event type has the *writers* that produce it today, and every writer is known
by its actor (:mod:`events.actors`), so the database can refuse an append that no
producer of dracap would make (migration 0011, ``docs/database-roles.md``):

================ ======================================== ===================================
writer           actor                                    what it records
================ ======================================== ===================================
``tenant``       ``tenant:<user>@<ns>``, ``anonymous:<ns>`` a tenant's claim requests, in its
                                                          own namespace only
``operator``     ``operator:<user>``, ``anonymous:-``     the admin API's writes, and claim
                                                          requests in any namespace
``bridge``       ``system:kubernetes-bridge``             claims mirrored from Kubernetes
``reservation``  ``system:reservation…``                  allocations, and its consumers'
                                                          dead letters
``reclamation``  ``system:reclamation…``,                 lease expiries, unknown shares,
                 ``system:fence-hook``                    fences, not-started timeouts
``agent``        ``agent:<node>#<epoch>``                 a node's reports, under its lease
================ ======================================== ===================================

:data:`JOBS` says which writers each service kind's database login may act as: the
claims API (and the Kubernetes bridge, which connects with its role) as tenants,
operators and the bridge; the reservation and reclamation services as themselves; the
enforcement service as node agents (node agents have no database login since migration
0012). ``AppendRefused`` has no writer: the database writes it itself.

:mod:`services.runtime.store.payloadchecks` turns both tables into the database's functions,
so the database and this module cannot disagree (a test compares the generated file with
this module). A new event type must be listed here: the test of the catalog's coverage
fails until it is, and the database refuses it from every service login meanwhile.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final, Literal, TypeAlias

from events import catalog as c

__all__ = ["ACTOR_PATTERNS", "JOBS", "WRITERS", "Writer", "writer_of"]

Writer: TypeAlias = Literal["tenant", "operator", "bridge", "reservation", "reclamation", "agent"]

_NAME: Final = r"[^:@#[:space:]]+"  # a name of the actor grammar (POSIX class: SQL too)

#: The actors of each writer, as anchored POSIX regular expressions (Python and SQL).
ACTOR_PATTERNS: Final[Mapping[Writer, str]] = {
    "tenant": rf"^(tenant:{_NAME}@{_NAME}|anonymous:([^-:@#[:space:]]|[^:@#[:space:]]{{2,}}))$",
    "operator": rf"^(operator:{_NAME}|anonymous:-)$",
    "bridge": r"^system:kubernetes-bridge$",
    "reservation": r"^system:reservation[^:@#[:space:]]*$",
    "reclamation": r"^system:(reclamation[^:@#[:space:]]*|fence-hook)$",
    "agent": rf"^agent:{_NAME}#[1-9][0-9]{{0,17}}$",
}

_TENANT: Final = frozenset[Writer]({"tenant", "operator", "bridge"})
_OPERATOR: Final = frozenset[Writer]({"operator"})
_AGENT: Final = frozenset[Writer]({"agent"})

#: The writers of each event type (by class; :data:`WRITERS` is by tag).
_BY_CLASS: Final[Mapping[type[c.Event], frozenset[Writer]]] = {
    # inventory: the admin API; a node's agent publishes and withdraws its own slices
    c.DeviceClassApplied: _OPERATOR,
    c.DeviceClassRemoved: _OPERATOR,
    c.ClassModeSet: _OPERATOR,
    c.ResourceSlicePublished: frozenset({"operator", "agent"}),
    c.ResourceSliceWithdrawn: _AGENT,
    c.RequestPolicyChanged: _OPERATOR,
    # claims: a tenant's request (or an operator's for it), or the Kubernetes bridge
    c.ClaimSubmitted: _TENANT,
    c.ClaimAdmitted: _TENANT,
    c.ClaimRejected: _TENANT,
    c.ClaimWithdrawn: _TENANT,
    c.ClaimReserved: _TENANT,
    c.ClaimUnreserved: _TENANT,
    c.ReleaseRequested: frozenset({"tenant", "operator", "bridge", "reclamation"}),
    # reservation: the allocator; the bridge mirrors kube-scheduler's allocations
    c.CapacityReserved: frozenset({"reservation", "bridge"}),
    c.AllocationBound: frozenset({"reservation", "bridge"}),
    c.ClaimUnschedulable: frozenset({"reservation"}),
    # enforcement: node reports
    c.LimitApplied: _AGENT,
    c.LimitFailed: _AGENT,
    c.LimitRemoved: _AGENT,
    c.EnforcementReconciled: _AGENT,
    c.EnforcementCheckpointSetAside: _AGENT,
    c.ShareUsed: _AGENT,
    c.DeviceHealthChanged: _AGENT,
    c.ShareConfirmed: _AGENT,
    c.CapacityReleased: _AGENT,
    c.NodeLeaseAcquired: _AGENT,
    # reclamation
    c.NodeLeaseExpired: frozenset({"reclamation"}),
    c.ShareMarkedUnknown: frozenset({"reclamation"}),
    c.ClaimStalled: frozenset({"reclamation"}),
    c.NodeFenced: frozenset({"operator", "reclamation"}),
    c.AppendRefused: frozenset(),  # the database's own record of a refusal
    c.NamespaceAccessSet: _OPERATOR,
    # a consumer that gave up on a message: the consumers that can append
    c.MessageDeadLettered: frozenset({"reservation", "agent"}),
}

#: The writers of each event type, by tag; every tag of the catalog is here.
WRITERS: Final[Mapping[str, frozenset[Writer]]] = {
    str(cls.__struct_config__.tag): writers for cls, writers in _BY_CLASS.items()
}

#: Which writers each service kind's database login may act as (by service kind).
JOBS: Final[Mapping[str, frozenset[Writer]]] = {
    "claims": _TENANT,
    "reservation": frozenset({"reservation"}),
    "reclamation": frozenset({"reclamation"}),
    "enforcement": _AGENT,
}

_COMPILED: Final = {
    writer: re.compile(pattern.replace("[:space:]", r"\s"))
    for writer, pattern in ACTOR_PATTERNS.items()
}


def writer_of(actor: str) -> Writer | None:
    """The writer an actor speaks as; None when it is none of them."""
    for writer, pattern in _COMPILED.items():
        if pattern.fullmatch(actor):
            return writer
    return None
