"""What the node agent does, and what it records of it, as pure decisions. No I/O.

The agent (:mod:`services.enforcement.agent`) is a loop: it asks for a fresh state,
calls :func:`decide_work`, runs the enforcers for the tasks, and hands their outcomes
to :func:`record`, which says what to append. Neither function awaits or touches the
kernel, so both are tested as tables. The rules:

Work (:func:`decide_work`, on the folded state; a message only says where to look)

* ``AllocationBound`` -> :class:`Enforce`: the limit of each share of the allocation
  that is this node's (or has no node), ``bound`` in the fold and of that allocation
  version. Shares already ready, released or releasing are left alone, so a
  redelivered or forged message changes nothing. A claim mirrored from Kubernetes
  (``source == "kubernetes"``) gives no task here: its limits are applied when the
  kubelet prepares it (:func:`enforce_claim`, :mod:`services.enforcement.kubelet`).
* ``ReleaseRequested`` -> :class:`Release`: only when the fold has the claim
  ``releasing`` at that allocation version; each of its shares on this node that is
  ``releasing`` at that version (not ``unknown``: the reclamation service owns those)
  has its limit removed and its capacity released.

A message that asks nothing of this node gives no task.

Retries (:func:`decide_retries`): no message drives them. The agent sweeps its node's
claims in phase ``retrying`` and makes an :class:`Enforce` of each share whose
``retry_at`` has come, exactly as for its ``AllocationBound``; so a restarted agent
carries on where the log says.

Record (:func:`record`, from the enforcers' outcomes)

* an applied limit -> ``LimitApplied(level, actual)``; a failed one -> ``LimitFailed``:
  a retryable failure is recorded at once with the next try's time (back-off from
  :data:`RETRY_BASE_S`, doubling, at most :data:`RETRY_MAX_S`), the share's first
  failure time and the try's number, unless the next try would fall outside the class's
  retry window (``dracap.io/enforcement-retry-window``, default 10 min), when it is
  recorded as permanent ("gave up after N tries"); a refused one ->
  ``LimitFailed(retryable=False)`` with the refusal's reason; all on the node stream at
  the version read with the state;
* every :class:`Enforce` with an outcome also checks its claim stream's version (a
  batch without events): a ``ReleaseRequested`` that got in first makes the append
  conflict, and the redelivery finds the share releasing — ``LimitApplied`` never
  follows it (invariant 7);
* each removal -> ``LimitRemoved`` (node stream) + ``CapacityReleased`` (device stream,
  any version: the fold and the ledger make a release idempotent, invariant 5).

Reconcile (at start): :func:`services.enforcement.reconciling.plan_reconcile` says
what to do per share; :func:`reconciled` turns what was done into the report
``EnforcementReconciled`` (``None`` when there is nothing to report),
:func:`set_aside` reports a checkpoint the loader could not use, and
:func:`rebuilt_entries` is the checkpoint written afterwards.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Mapping, Sequence
from typing import Final, TypeAlias

import msgspec

from events.catalog import (
    AllocationBound,
    CapacityReleased,
    DeviceHealthChanged,
    EnforcementCheckpointSetAside,
    EnforcementReconciled,
    Event,
    LimitApplied,
    LimitFailed,
    LimitRemoved,
    ReleaseRequested,
    ShareUsed,
)
from events.envelopes import Envelope, claim_stream, device_stream, node_stream
from events.model import DeviceClass
from events.quantities import Quantity
from events.state import ClaimState, ClusterState, DeviceKey, ShareState
from events.tenancy import DEFAULT_RETRY_WINDOW_S, retry_window
from services.enforcement.checkpointing import CheckpointEntry, CheckpointWarning
from services.enforcement.enforcers import AppliedLimit, ShareLimit
from services.enforcement.enforcing import Draft, Tally
from services.enforcement.reconciling import ReconcilePlan

__all__ = [
    "Enforce",
    "Failed",
    "Refused",
    "Release",
    "Task",
    "Unprepare",
    "Written",
    "decide_bound",
    "decide_retries",
    "decide_taken_up",
    "decide_work",
    "enforce_claim",
    "health_changes",
    "kubelet_round",
    "limit_of",
    "overcommit",
    "rebuilt_entries",
    "reconciled",
    "record",
    "released",
    "retry_state",
    "set_aside",
    "streams_to_check",
    "unprepare_claim",
    "uses",
    "vanished",
]

#: Share states in which the folded log demands an action (not the message alone).
_APPLICABLE: Final = frozenset({"bound"})
#: share states whose limit a kubelet unprepare removes when the agent has it in force
_UNPREPARABLE: Final = frozenset({"reserved", "bound", "ready", "releasing"})
_RELEASABLE: Final = frozenset({"releasing"})
#: Characters of a checkpoint problem kept in the report.
_DETAIL_KEPT: Final = 2000


class Refused(msgspec.Struct, frozen=True, kw_only=True):
    """A share whose limit would take its device past its total (:func:`overcommit`)."""

    share_id: str
    reason: str


class RetryState(msgspec.Struct, frozen=True, kw_only=True):
    """A share's retryable failures so far and how long its class lets them go on."""

    attempts: int = 0
    failing_since: datetime.datetime | None = None
    window_s: float = DEFAULT_RETRY_WINDOW_S


class Enforce(msgspec.Struct, frozen=True, kw_only=True):
    """Put limits in force for one ``AllocationBound`` (event id ``message``), or for a
    retry the agent's sweep decided (``message``: ``retry:<claim>``)."""

    message: str
    guard: str  #: the claim stream, whose version the append checks
    limits: tuple[ShareLimit, ...]
    shares: int  #: shares in the allocation: the claim is ready when all are applied
    refused: tuple[Refused, ...] = ()  #: never handed to an enforcer: a terminal failure
    retries: dict[str, RetryState] = {}  #: by share id


class Release(msgspec.Struct, frozen=True, kw_only=True):
    """Remove limits and release capacity for one ``ReleaseRequested`` (``message``)."""

    message: str
    released: tuple[CapacityReleased, ...]  #: one per share, as the device stream records it


class Unprepare(msgspec.Struct, frozen=True, kw_only=True):
    """Remove limits for a kubelet unprepare (``message``: ``unprepare:<claim>``): the
    shares stay allocated (``bound`` again in the fold), their capacity held until
    Kubernetes deallocates the claim, so a later prepare applies them anew."""

    message: str
    share_ids: tuple[str, ...]


Task: TypeAlias = Enforce | Release | Unprepare


class Failed(msgspec.Struct, frozen=True, kw_only=True):
    """An enforcer could not apply a limit (a retryable one is tried again by the sweep)."""

    retryable: bool
    reason: str


class Written(msgspec.Struct, kw_only=True):
    """What :func:`record` wants appended, and what it means for the metrics."""

    #: per stream: expected version, events, and the message (event id) of each event
    streams: dict[str, tuple[int | None, list[Event], list[str]]] = {}
    ready: dict[str, bool] = {}  #: messages that applied a limit -> whether all were applied
    released: list[str] = []  #: messages that released capacity

    def add(self, stream: str, version: int | None, event: Event | None, message: str) -> None:
        """Add ``event`` (``None``: only check the stream's version) to ``stream``."""
        _, events, messages = self.streams.setdefault(stream, (version, [], []))
        if event is not None:
            events.append(event)
            messages.append(message)


def decide_work(
    state: ClusterState,
    node: str,
    messages: Sequence[Envelope],
    enforcing: Tally,
) -> list[Task]:
    """What ``messages`` ask of ``node``, as the folded ``state`` demands it.

    ``enforcing``: the limits the agent has in force now (what it applied and has not
    removed, :class:`~services.enforcement.enforcing.Enforcing`); a new limit must fit its
    device's total together with them.
    """
    tasks: list[Task] = []
    counted = Draft(enforcing)  # grows with every limit this group applies: no copy
    for env in messages:
        event = env.event
        task: Task | None = None
        if isinstance(event, AllocationBound) and event.node == node:
            if _prepared_by_kubelet(state, event):
                continue  # its limits are applied when the kubelet prepares it
            task = _enforce(state, node, env.event_id, event, counted)
        elif isinstance(event, ReleaseRequested) and event.node == node:
            task = _release(state, node, env.event_id, event)
            for released in task.released if isinstance(task, Release) else ():
                counted.discard(released.share_id)  # removed before later tasks run
        if task is not None:
            tasks.append(task)
    return tasks


def decide_bound(state: ClusterState, node: str, enforcing: Tally) -> list[Task]:
    """The :class:`Enforce` of every claim with a share of ``node`` ``bound`` (the agent's
    reconcile; ``apply`` is idempotent, so one already in force is recorded; a claim
    mirrored from Kubernetes waits for its prepare).

    A share's ``AllocationBound`` may have been taken while the share was ``unknown``
    (the node's lease expired before the agent noticed): no task then, and the message
    acknowledged. Confirmed on the node's return, the share is ``bound`` again with no
    message left to apply it, so the reconcile after a return applies it as its
    message would have (``test_a_bound_share_whose_message_was_taken_is_applied_at_reconcile``).
    """
    return _bound(state, node, Draft(enforcing))


def decide_taken_up(state: ClusterState, node: str, enforcing: Tally) -> list[Task]:
    """What ``node``'s messages ask, from the log alone, when they may be lost with the
    broker's store (the agent's durable made again): the :class:`Release` of every claim
    being released with a share still on ``node``, as its ``ReleaseRequested`` would
    have it, then :func:`decide_bound`'s :class:`Enforce` tasks, counted without the
    released shares. Claims mirrored from Kubernetes are the kubelet's, as there."""
    counted = Draft(enforcing)
    tasks: list[Task] = []
    for key in _claims_on(state, node, _RELEASABLE):
        claim = state.claims.get(key)
        if claim is None or claim.source == "kubernetes" or claim.phase != "releasing":
            continue
        task = _releases(state, node, f"reconcile:{key[0]}/{key[1]}", claim, _RELEASABLE)
        if isinstance(task, Release):
            for gone in task.released:
                counted.discard(gone.share_id)
            tasks.append(task)
    return tasks + _bound(state, node, counted)


def _bound(state: ClusterState, node: str, counted: Draft) -> list[Task]:
    """:func:`decide_bound` on a draft shared with other decisions."""
    tasks: list[Task] = []
    for key in _claims_on(state, node, _APPLICABLE):
        claim = state.claims.get(key)
        if claim is None or claim.source == "kubernetes":
            continue
        task = _enforce_current(state, node, key, f"reconcile:{key[0]}/{key[1]}", counted)
        if task is not None:
            tasks.append(task)
    return tasks


def _claims_on(state: ClusterState, node: str, states: frozenset[str]) -> list[tuple[str, str]]:
    """The claims with a live share of ``node`` in one of ``states``, in key order."""
    return sorted(
        {
            share.claim
            for share_id in _live_on(state, node)
            if (share := state.shares.get(share_id)) is not None and share.state in states
        }
    )


def _prepared_by_kubelet(state: ClusterState, event: AllocationBound) -> bool:
    """Whether the claim was mirrored from Kubernetes: the kubelet's prepare applies it."""
    claim = state.claims.get((event.namespace, event.name))
    return claim is not None and claim.source == "kubernetes"


def enforce_claim(
    state: ClusterState, node: str, key: tuple[str, str], enforcing: Tally
) -> Task | None:
    """The :class:`Enforce` of a claim's current allocation on ``node`` (a kubelet prepare).

    The same rules as for its ``AllocationBound``: only this node's ``bound`` shares of
    that allocation, each fitting its device with the limits in force.
    """
    return _enforce_current(state, node, key, "", Draft(enforcing))


def _enforce_current(
    state: ClusterState, node: str, key: tuple[str, str], message: str, counted: Draft
) -> Task | None:
    """:func:`enforce_claim` on a draft shared with other decisions (``message``: the
    task's name)."""
    claim = state.claims.get(key)
    if claim is None or claim.allocation is None:
        return None
    bound = AllocationBound(
        namespace=claim.namespace,
        name=claim.name,
        allocation_version=claim.allocation_version,
        node=claim.node,
        allocation=claim.allocation,
        share_ids=list(claim.share_ids),
    )
    return _enforce(state, node, message, bound, counted)


def unprepare_claim(
    state: ClusterState, node: str, key: tuple[str, str], enforcing: Tally | None = None
) -> Unprepare | None:
    """The :class:`Unprepare` of a kubelet unprepare: every share of the claim's current
    allocation on ``node`` that is ``ready``, or whose limit the agent has in force
    (``enforcing``, by share id), has its limit removed; nothing is released (Kubernetes
    still allocates the claim, and may prepare it again)."""
    claim = state.claims.get(key)
    if claim is None:
        return None
    gone = tuple(
        sid
        for sid in claim.share_ids
        if (share := state.shares.get(sid)) is not None
        and _mine(share, node)
        and share.allocation_version == claim.allocation_version
        and (
            share.state == "ready"
            or (
                enforcing is not None
                and enforcing.get(sid) is not None
                and share.state in _UNPREPARABLE
            )
        )
    )
    return Unprepare(message=f"unprepare:{key[0]}/{key[1]}", share_ids=gone) if gone else None


def kubelet_round(
    state: ClusterState,
    node: str,
    prepares: Sequence[tuple[str, str]],
    unprepares: Sequence[tuple[str, str]],
    enforcing: Tally,
) -> list[Task]:
    """What one round of the kubelet plugin's writer does: the unprepares first (their
    limits come off), then the prepares, each fitting its device together with the
    limits in force and those of the round's earlier prepares (one draft for all)."""
    tasks: list[Task] = []
    counted = Draft(enforcing)
    for key in unprepares:
        task = unprepare_claim(state, node, key, enforcing)
        if task is not None:
            for sid in task.share_ids:
                counted.discard(sid)
            tasks.append(task)
    for key in prepares:
        enforce = _enforce_current(state, node, key, f"prepare:{key[0]}/{key[1]}", counted)
        if enforce is not None:
            tasks.append(enforce)
    return tasks


def _releases(
    state: ClusterState, node: str, message: str, claim: ClaimState, states: frozenset[str]
) -> Task | None:
    """The :class:`Release` of ``claim``'s current allocation's shares on ``node`` that are
    in one of ``states``; ``None`` when there is none."""
    gone = []
    for share_id in claim.share_ids:
        share = state.shares.get(share_id)
        if share is None or not _mine(share, node) or share.state not in states:
            continue
        if share.allocation_version == claim.allocation_version:
            gone.append(released(share))
    return Release(message=message, released=tuple(gone)) if gone else None


def _mine(share: ShareState | None, node: str) -> bool:
    return share is not None and share.node in (None, node)


def _enforce(
    state: ClusterState,
    node: str,
    message: str,
    event: AllocationBound,
    counted: Draft,
) -> Task | None:
    limits: list[ShareLimit] = []
    refused: list[Refused] = []
    for share_id in event.share_ids:
        share = state.shares.get(share_id)
        if share is None or not _mine(share, node) or share.state not in _APPLICABLE:
            continue
        if share.allocation_version != event.allocation_version:
            continue
        limit = limit_of(share)
        reason = overcommit(state, counted, limit)
        if reason is not None:
            refused.append(Refused(share_id=share_id, reason=reason))
            continue
        limits.append(limit)
        counted.add(limit)
    if not limits and not refused:
        return None
    return Enforce(
        message=message,
        guard=claim_stream(event.namespace, event.name),
        limits=tuple(limits),
        shares=len(event.share_ids),
        refused=tuple(refused),
        retries={
            limit.share_id: retry_state(state, state.shares[limit.share_id]) for limit in limits
        },
    )


def retry_state(state: ClusterState, share: ShareState) -> RetryState:
    """The share's failures so far and its class's retry window."""
    return RetryState(
        attempts=share.attempts,
        failing_since=share.failing_since,
        window_s=retry_window(_class_of(state, share)),
    )


def _class_of(state: ClusterState, share: ShareState) -> DeviceClass | None:
    """The DeviceClass of the request the share was granted for (``None``: unknown)."""
    claim = state.claims.get(share.claim)
    name = claim.class_of(share.request) if claim is not None else None
    cls = state.classes.get(name) if name is not None else None
    return cls.device_class if cls is not None else None


def decide_retries(
    state: ClusterState,
    node: str,
    now: datetime.datetime,
    enforcing: Tally,
) -> list[Enforce]:
    """The retries due on ``node`` at ``now``: one :class:`Enforce` per ``retrying`` claim
    with a share whose ``retry_at`` has come (see the module docstring).

    Its cost is the claims of ``state``: the agent decides on a view that holds only its
    node's retrying claims (:mod:`services.enforcement.views`).
    """
    tasks: list[Enforce] = []
    counted = Draft(enforcing)
    for key, claim in state.claims.items():
        if claim.phase != "retrying":
            continue
        limits: list[ShareLimit] = []
        refused: list[Refused] = []
        for share_id in claim.share_ids:
            share = state.shares.get(share_id)
            if share is None or not _mine(share, node) or share.state not in _APPLICABLE:
                continue
            if share.retry_at is None or share.retry_at > now:
                continue
            limit = limit_of(share)
            reason = overcommit(state, counted, limit)
            if reason is not None:
                refused.append(Refused(share_id=share_id, reason=reason))
                continue
            limits.append(limit)
            counted.add(limit)
        if limits or refused:
            tasks.append(
                Enforce(
                    message=f"retry:{key[0]}/{key[1]}",
                    guard=claim_stream(*key),
                    limits=tuple(limits),
                    shares=len(claim.share_ids),
                    refused=tuple(refused),
                    retries={
                        limit.share_id: retry_state(state, state.shares[limit.share_id])
                        for limit in limits
                    },
                )
            )
    return tasks


#: The first retry comes this long after a retryable failure; each next one twice as late.
RETRY_BASE_S: Final = 0.5
#: Retries are never further apart than this.
RETRY_MAX_S: Final = 30.0


def _failed(
    node: str, share_id: str, outcome: Failed, retry: RetryState | None, now: datetime.datetime
) -> LimitFailed:
    """``LimitFailed`` of a failed apply: with its next try, or final (see the module)."""
    if not outcome.retryable:
        return LimitFailed(share_id=share_id, node=node, retryable=False, reason=outcome.reason)
    retry = retry or RetryState()
    attempt = retry.attempts + 1
    since = retry.failing_since or now
    delay = min(RETRY_BASE_S * 2 ** (attempt - 1), RETRY_MAX_S)
    if (now - since).total_seconds() + delay > retry.window_s:
        reason = (
            f"{outcome.reason} (gave up after {attempt} tries over "
            f"{(now - since).total_seconds():.0f}s; the class allows {retry.window_s:g}s)"
        )
        return LimitFailed(share_id=share_id, node=node, retryable=False, reason=reason)
    return LimitFailed(
        share_id=share_id,
        node=node,
        retryable=True,
        reason=outcome.reason,
        retry_at=now + datetime.timedelta(seconds=delay),
        failing_since=since,
        attempt=attempt,
    )


def overcommit(state: ClusterState, enforcing: Tally, limit: ShareLimit) -> str | None:
    """Why ``limit`` may not be applied next to ``enforcing``; ``None`` when it fits.

    Per capacity ``limit`` consumes, the amounts of the non-admin limits in
    ``enforcing`` on the same device (``limit``'s own share not counted twice) plus
    ``limit``'s must be at most the device's total in the folded ``state``. A device
    or capacity the log does not publish has no total to fit in: refused too. The sums
    are kept by ``enforcing`` (:mod:`services.enforcement.enforcing`): the check costs
    O(the capacities of ``limit``), whatever the node enforces.
    """
    if limit.admin_access or not limit.consumed:
        return None
    key: DeviceKey = (limit.driver, limit.pool, limit.device)
    where = "/".join(key)
    device = state.devices.get(key)
    if device is None:
        return f"refused: device {where} is not published"
    own = enforcing.get(limit.share_id)
    if own is not None and (own.admin_access or (own.driver, own.pool, own.device) != key):
        own = None  # counted elsewhere, or not at all
    for capacity, asked in sorted(limit.consumed.items()):
        total = device.total.get(capacity)
        if total is None:
            return f"refused: device {where} publishes no capacity {capacity!r}"
        nanos, count = enforcing.held(key, capacity)
        if own is not None and capacity in own.consumed:
            nanos, count = nanos - own.consumed[capacity].nanos, count - 1
        enforced = Quantity(nanos, total.format)
        if enforced.nanos + asked.nanos > total.nanos:
            wanted = Quantity(enforced.nanos + asked.nanos, total.format)
            return (
                f"refused: device {where} {capacity}: enforcing {enforced.canonical()} "
                f"({count} share(s)) + asked {asked.canonical()} = {wanted.canonical()} "
                f"> total {total.canonical()}"
            )
    return None


def _release(state: ClusterState, node: str, message: str, event: ReleaseRequested) -> Task | None:
    claim = state.claim(event.namespace, event.name)
    if (
        claim is None
        or claim.phase != "releasing"
        or claim.allocation_version != event.allocation_version
    ):
        return None
    return _releases(state, node, message, claim, _RELEASABLE)


def streams_to_check(node: str, tasks: Sequence[Task]) -> list[str]:
    """The streams whose expected versions :func:`record` needs (read with the state)."""
    if not tasks:
        return []
    return [node_stream(node), *(t.guard for t in tasks if isinstance(t, Enforce))]


def record(
    node: str,
    tasks: Sequence[Task],
    outcomes: Mapping[str, AppliedLimit | Failed],
    versions: Mapping[str, int],
    now: datetime.datetime | None = None,
) -> Written:
    """The events of ``tasks`` done, given each applied share's outcome (by share id);
    ``now`` dates a retryable failure's next try (default: the clock)."""
    out = Written()
    when = now or datetime.datetime.now(datetime.UTC)
    stream = node_stream(node)
    for task in tasks:
        if isinstance(task, Enforce):
            applied = 0
            for limit in task.limits:
                outcome = outcomes[limit.share_id]
                event: Event = (
                    _failed(node, limit.share_id, outcome, task.retries.get(limit.share_id), when)
                    if isinstance(outcome, Failed)
                    else LimitApplied(
                        share_id=limit.share_id,
                        node=node,
                        level=outcome.level,
                        actual=outcome.actual,
                    )
                )
                applied += isinstance(event, LimitApplied)
                out.add(stream, versions[stream], event, task.message)
            for refusal in task.refused:
                failed = LimitFailed(
                    share_id=refusal.share_id, node=node, retryable=False, reason=refusal.reason
                )
                out.add(stream, versions[stream], failed, task.message)
            out.add(task.guard, versions[task.guard], None, task.message)
            if applied:
                out.ready[task.message] = applied == task.shares
        elif isinstance(task, Unprepare):
            for sid in task.share_ids:
                out.add(
                    stream, versions[stream], LimitRemoved(share_id=sid, node=node), task.message
                )
        else:
            for released in task.released:
                removed = LimitRemoved(share_id=released.share_id, node=node)
                out.add(stream, versions[stream], removed, task.message)
                device = device_stream(released.driver, released.pool, released.device)
                out.add(device, None, released, task.message)
            out.released.append(task.message)
    return out


# -- reconcile ------------------------------------------------------------------------


def set_aside(node: str, warning: CheckpointWarning) -> EnforcementCheckpointSetAside:
    """The report of a checkpoint the loader could not use."""
    return EnforcementCheckpointSetAside(
        node=node,
        path=warning.path,
        reason=warning.reason,
        detail=warning.detail[:_DETAIL_KEPT],
        moved_to=warning.set_aside,
    )


def reconciled(
    node: str,
    plan: ReconcilePlan,
    observed: Collection[str],
    removed: Collection[str],
    reapplied: Sequence[str],
    failed: Sequence[str],
) -> EnforcementReconciled | None:
    """The report of a reconcile; ``None`` when nothing was found to report.

    ``removed``: the orphaned and stale shares whose removal succeeded; only those the
    kernel showed (``observed``) are reported as orphans removed.
    """
    orphans = [s for s in plan.orphans + plan.stale if s in removed and s in observed]
    if not (reapplied or orphans or plan.kept or failed):
        return None
    return EnforcementReconciled(
        node=node,
        reapplied=list(reapplied),
        removed_orphans=orphans,
        kept=plan.kept,
        failed=list(failed),
    )


def rebuilt_entries(
    shares: Mapping[str, ShareState],
    in_force: Mapping[str, AppliedLimit],
    failed: Sequence[str],
    now: datetime.datetime,
) -> dict[str, CheckpointEntry]:
    """The checkpoint after a reconcile: what is in force now, and what failed (started)."""
    entries: dict[str, CheckpointEntry] = {}
    for share_id, applied in in_force.items():
        limit = limit_of(shares[share_id])
        entries[share_id] = CheckpointEntry(
            share_id=share_id, phase="completed", limit=limit, applied=applied, updated_at=now
        )
    for share_id in failed:
        limit = limit_of(shares[share_id])
        entries[share_id] = CheckpointEntry(
            share_id=share_id, phase="started", limit=limit, updated_at=now
        )
    return entries


# -- shapes -----------------------------------------------------------------------------


def limit_of(share: ShareState) -> ShareLimit:
    """The limit an enforcer puts in force for ``share``."""
    return ShareLimit(
        share_id=share.share_id,
        driver=share.driver,
        pool=share.pool,
        device=share.device,
        consumed=dict(share.consumed),
        admin_access=share.admin_access,
    )


def released(share: ShareState) -> CapacityReleased:
    """The event that gives ``share``'s capacity back."""
    return CapacityReleased(
        share_id=share.share_id,
        driver=share.driver,
        pool=share.pool,
        device=share.device,
        allocation_version=share.allocation_version,
        consumed=dict(share.consumed),
        admin_access=share.admin_access,
    )


# -- device health ----------------------------------------------------------------------


def health_changes(
    state: ClusterState, node: str, findings: Mapping[DeviceKey, str | None]
) -> list[DeviceHealthChanged]:
    """What the agent records of ``findings`` (device -> problem, ``None``: healthy).

    Transitions only, against what the log says: a device the log does not hold, or
    holds for another node, is left out; one whose state and reason are already
    recorded gives nothing.
    """
    out: list[DeviceHealthChanged] = []
    for key, problem in sorted(findings.items()):
        dev = state.devices.get(key)
        if dev is None or (dev.node is not None and dev.node != node):
            continue
        if dev.unhealthy == problem:
            continue
        out.append(
            DeviceHealthChanged(
                node=node,
                driver=key[0],
                pool=key[1],
                device=key[2],
                healthy=problem is None,
                reason=problem or "",
            )
        )
    return out


def vanished(
    state: ClusterState, node: str, drivers: Collection[str], found: Collection[DeviceKey]
) -> dict[DeviceKey, str | None]:
    """Findings of a scan: each device of ``node`` the log has from ``drivers``, healthy
    when the scan found it, "vanished from discovery" when not (a withdrawn device
    without live shares is left out: nothing depends on it)."""
    held = {state.shares[s].device_key for s in _live_on(state, node)}
    out: dict[DeviceKey, str | None] = {}
    for key, dev in state.devices.items():
        if dev.node != node or key[0] not in drivers:
            continue
        if key in found:
            out[key] = None
        elif dev.present or key in held:
            out[key] = "vanished from discovery"
    return out


def _live_on(state: ClusterState, node: str) -> list[str]:
    held = state.nodes.get(node)
    return sorted(held.live_shares) if held is not None else []


def uses(state: ClusterState, node: str, usage: Mapping[str, int]) -> list[ShareUsed]:
    """``ShareUsed`` for each live share of ``node`` not yet known used whose limit has
    seen traffic (``usage``: bytes per share), in ShareID order."""
    out: list[ShareUsed] = []
    for share_id in _live_on(state, node):
        share = state.shares[share_id]
        sent = usage.get(share_id, 0)
        if sent > 0 and not share.used and share.state in ("ready", "bound"):
            evidence = f"{sent} bytes through its limit"
            out.append(ShareUsed(share_id=share_id, node=node, evidence=evidence))
    return out
