"""The label sets of dracap's metrics that are known in advance, created at 0.

An unset label set is absent from a scrape, and a series that appears at 1 reads as no
increase to ``increase()`` and ``rate()``: the first forged message, the first dead
letter, the first recovery would raise no alert and draw no panel. So every service
process calls :func:`initialise_series` at start, which creates at 0 every claim
outcome, node transition, fence-hook outcome, selector outcome, node recovery outcome,
lease renewal outcome, node request verb and outcome and mirror outcome, and the
consumers given; a consumer (:mod:`services.runtime.delivery.consuming`,
:mod:`services.enforcement.consumer`) and a projector (:mod:`services.runtime.delivery.projecting`)
create their own series when they are made, the SLO tracker each DeviceClass's
(:mod:`services.runtime.ops.slos`), the health monitor each check's
(:mod:`services.runtime.ops.health`), and the claims API each rejection reason.

It imports no event store: the node agent calls it too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from services.runtime.ground.metrics import (
    CLAIMS,
    CONSUMER_REDELIVERIES,
    DEAD_LETTERS,
    FENCE_HOOK_RUNS,
    KUBERNETES_MIRROR,
    LEASE_RENEWALS,
    NODE_REQUESTS,
    NODE_TRANSITIONS,
    SELECTOR_JOBS,
    UNCONFIRMED_MESSAGES,
)
from services.runtime.ops.slos import NODE_RECOVERY, RECOVERY_OUTCOMES

__all__ = [
    "CLAIM_OUTCOMES",
    "FENCE_HOOK_OUTCOMES",
    "LEASE_RENEWAL_OUTCOMES",
    "MIRROR_OUTCOMES",
    "NODE_REQUEST_OUTCOMES",
    "NODE_REQUEST_VERBS",
    "NODE_TRANSITION_KINDS",
    "SELECTOR_OUTCOMES",
    "initialise_series",
]

#: The outcomes ``dracap_claims_total`` is counted under (see the services that count).
CLAIM_OUTCOMES: Final = (
    "admitted",
    "rejected",
    "allocated",
    "unschedulable",
    "ready",
    "released",
    "not_started_release",
    "not_started_stall",
)
NODE_TRANSITION_KINDS: Final = ("expired", "fenced_by_hook")
FENCE_HOOK_OUTCOMES: Final = ("off", "failed", "timeout")
SELECTOR_OUTCOMES: Final = ("evaluated", "deadline")
LEASE_RENEWAL_OUTCOMES: Final = ("held", "lost")
#: the verbs and outcomes of ``dracap_node_requests_total`` (services.enforcement.protocol)
NODE_REQUEST_VERBS: Final = ("lease", "heartbeat", "view", "report")
NODE_REQUEST_OUTCOMES: Final = (
    "ok", "conflict", "stale_epoch", "forbidden", "invalid", "unavailable", "internal"
)  # fmt: skip
MIRROR_OUTCOMES: Final = ("mirrored", "refused", "released", "reserved", "withdrawn", "unchanged")


def initialise_series(consumers: Iterable[str] = ()) -> None:
    """Create the known label sets at 0 (see the module docstring; an unset label set is
    absent from a scrape)."""
    for outcome in CLAIM_OUTCOMES:
        CLAIMS.labels(outcome=outcome)
    for transition in NODE_TRANSITION_KINDS:
        NODE_TRANSITIONS.labels(transition=transition)
    for run in FENCE_HOOK_OUTCOMES:
        FENCE_HOOK_RUNS.labels(outcome=run)
    for job in SELECTOR_OUTCOMES:
        SELECTOR_JOBS.labels(outcome=job)
    for renewal in LEASE_RENEWAL_OUTCOMES:
        LEASE_RENEWALS.labels(outcome=renewal)
    for verb in NODE_REQUEST_VERBS:
        for answer in NODE_REQUEST_OUTCOMES:
            NODE_REQUESTS.labels(verb=verb, outcome=answer)
    for mirrored in MIRROR_OUTCOMES:
        KUBERNETES_MIRROR.labels(outcome=mirrored)
    for recovery in RECOVERY_OUTCOMES:
        NODE_RECOVERY.labels(recovery)
    for name in consumers:
        for series in (CONSUMER_REDELIVERIES, DEAD_LETTERS, UNCONFIRMED_MESSAGES):
            series.labels(consumer=name)
