"""The node agent's rules, one named table row each (services.enforcement.decisions).

A row tells a story in the log (claims reserved, limits applied, releases requested),
hands the agent some of its events as messages, and says how the enforcers fare; it
expects the enforcer calls :func:`decide_work` asks for and the append :func:`record`
makes of their outcomes (per stream: expected version and events; a guard is a
version check without events).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import pytest

from events import catalog as c
from events.envelopes import Envelope, new_envelope
from events.quantities import Quantity
from services.enforcement.checkpointing import CheckpointWarning
from services.enforcement.decisions import (
    RETRY_BASE_S,
    RETRY_MAX_S,
    Enforce,
    Failed,
    Release,
    RetryState,
    decide_bound,
    decide_retries,
    decide_taken_up,
    decide_work,
    limit_of,
    rebuilt_entries,
    reconciled,
    record,
    set_aside,
    streams_to_check,
)
from services.enforcement.enforcers import AppliedLimit, ShareLimit
from services.enforcement.enforcing import Enforcing
from services.enforcement.reconciling import ReconcilePlan
from tests.unit.allocator_fixtures import DRIVER, claim, request
from tests.unit.decision_fixtures import (
    NAMESPACE,
    NODE,
    POOL,
    Log,
    Unscannable,
    describe,
    gpu,
    inventory,
)

BROKEN = Failed(retryable=False, reason="tc: no such device")
GPU0 = f"{DRIVER}/{POOL}/gpu-0"
ONE_BYTE_OVER_30GI = str(30 * 2**30 + 1)
T1 = datetime.datetime(2025, 1, 2, tzinfo=datetime.UTC)


@dataclass
class Case:
    id: str
    story: list[str]  # "reserve c1", "reserve-two c1", "ready c1", "release c1", "lost node-a"
    messages: list[str]  # "bound c1", "release c1", "forged-release c1 v2"
    calls: list[str]  # "apply <share>" / "remove <share>", in order
    writes: list[str]  # "<stream>@<version>: <event>" in append order
    failing: dict[str, Failed] = field(default_factory=dict)  # share -> outcome
    node: str = NODE
    ready: dict[str, bool] = field(default_factory=dict)  # claim -> all its shares applied
    released: list[str] = field(default_factory=list)  # claims released
    #: what the agent enforces before the messages: "held-1" (a share of the story) or
    #: "<share> <device> <memory> [admin]" (a limit the log no longer counts, e.g. fenced)
    enforcing: list[str] = field(default_factory=list)


CASES = [
    Case(
        "a-bound-share-gets-its-limit",
        ["reserve c1"],
        ["bound c1"],
        ["apply held-1"],
        ["node node-a@0: LimitApplied held-1 hard memory=10Gi", "claim c1@3: (version check)"],
        ready={"c1": True},
    ),
    Case(
        "another-nodes-binding-is-not-this-agents",
        ["reserve c1"],
        ["bound c1"],
        [],
        [],
        node="node-b",
    ),
    Case(
        "a-share-already-ready-is-left-alone",
        ["reserve c1", "ready c1"],
        ["bound c1"],
        [],
        [],
    ),
    Case(
        "a-share-whose-release-was-requested-gets-no-limit",
        ["reserve c1", "release c1"],
        ["bound c1"],
        [],
        [],
    ),
    Case(
        "a-limit-that-fails-for-good-is-recorded",
        ["reserve c1"],
        ["bound c1"],
        ["apply held-1"],
        [
            "node node-a@0: LimitFailed held-1 permanent: tc: no such device",
            "claim c1@3: (version check)",
        ],
        failing={"held-1": BROKEN},
    ),
    Case(
        "the-claim-is-ready-only-when-every-share-has-its-limit",
        ["reserve-two c1"],
        ["bound c1"],
        ["apply held-1", "apply held-2"],
        [
            "node node-a@0: LimitApplied held-1 hard memory=10Gi",
            "node node-a@0: LimitFailed held-2 permanent: tc: no such device",
            "claim c1@3: (version check)",
        ],
        failing={"held-2": BROKEN},
        ready={"c1": False},
    ),
    Case(
        "a-requested-release-removes-the-limit-and-releases-the-capacity",
        ["reserve c1", "ready c1", "release c1"],
        ["release c1"],
        ["remove held-1"],
        ["node node-a@1: LimitRemoved held-1", "device gpu-0@None: CapacityReleased held-1 v1"],
        released=["c1"],
    ),
    Case(
        "a-release-the-log-does-not-ask-for-changes-nothing",
        ["reserve c1", "ready c1"],
        ["forged-release c1 v1"],
        [],
        [],
    ),
    Case(
        "a-release-of-another-allocation-version-changes-nothing",
        ["reserve c1", "ready c1", "release c1"],
        ["forged-release c1 v2"],
        [],
        [],
    ),
    Case(
        "a-share-whose-node-was-lost-is-left-to-reclamation",
        ["reserve c1", "ready c1", "release c1", "lost node-a"],
        ["release c1"],
        [],
        [],
    ),
    Case(
        "a-group-keeps-its-messages-order-and-appends-once-per-stream",
        ["reserve c1", "reserve c2", "ready c1", "release c1"],
        ["release c1", "bound c2"],
        ["remove held-1", "apply held-2"],
        [
            "node node-a@1: LimitRemoved held-1",
            "node node-a@1: LimitApplied held-2 hard memory=10Gi",
            "device gpu-0@None: CapacityReleased held-1 v1",
            "claim c2@3: (version check)",
        ],
        ready={"c2": True},
        released=["c1"],
    ),
    # -- last line of defense: never past a device's total, counting what is enforced
    Case(
        "a-share-that-fills-the-device-exactly-to-its-total-is-applied",
        ["reserve c1"],
        ["bound c1"],
        ["apply held-1"],
        ["node node-a@0: LimitApplied held-1 hard memory=10Gi", "claim c1@3: (version check)"],
        ready={"c1": True},
        enforcing=["ghost-1 gpu-0 30Gi"],
    ),
    Case(
        "one-unit-past-the-total-is-refused-naming-the-amounts",
        ["reserve c1"],
        ["bound c1"],
        [],
        [
            f"node node-a@0: LimitFailed held-1 permanent: refused: device {GPU0} memory: "
            f"enforcing {ONE_BYTE_OVER_30GI} (1 share(s)) + asked 10Gi = "
            f"{40 * 2**30 + 1} > total 40Gi",
            "claim c1@3: (version check)",
        ],
        enforcing=[f"ghost-1 gpu-0 {ONE_BYTE_OVER_30GI}"],
    ),
    Case(
        "a-share-already-enforced-is-not-counted-twice-when-applied-again",
        ["reserve c1"],
        ["bound c1"],
        ["apply held-1"],
        ["node node-a@0: LimitApplied held-1 hard memory=10Gi", "claim c1@3: (version check)"],
        ready={"c1": True},
        enforcing=["held-1", "ghost-1 gpu-0 30Gi"],
    ),
    Case(
        "what-another-device-enforces-does-not-count",
        ["reserve c1"],
        ["bound c1"],
        ["apply held-1"],
        ["node node-a@0: LimitApplied held-1 hard memory=10Gi", "claim c1@3: (version check)"],
        ready={"c1": True},
        enforcing=["ghost-1 gpu-1 40Gi"],
    ),
    Case(
        "an-admin-access-share-consumes-nothing-and-does-not-count",
        ["reserve c1"],
        ["bound c1"],
        ["apply held-1"],
        ["node node-a@0: LimitApplied held-1 hard memory=10Gi", "claim c1@3: (version check)"],
        ready={"c1": True},
        enforcing=["ghost-1 gpu-0 40Gi admin"],
    ),
    Case(
        "a-share-released-earlier-in-the-group-no-longer-counts",
        ["reserve c1", "ready c1", "release c1", "reserve c2"],
        ["release c1", "bound c2"],
        ["remove held-1", "apply held-2"],
        [
            "node node-a@1: LimitRemoved held-1",
            "node node-a@1: LimitApplied held-2 hard memory=10Gi",
            "device gpu-0@None: CapacityReleased held-1 v1",
            "claim c2@3: (version check)",
        ],
        ready={"c2": True},
        released=["c1"],
        enforcing=["held-1", "ghost-1 gpu-0 30Gi"],
    ),
    Case(
        "a-share-applied-earlier-in-the-group-counts-for-the-next",
        ["reserve c1", "reserve c2"],
        ["bound c1", "bound c2"],
        ["apply held-1"],
        [
            "node node-a@0: LimitApplied held-1 hard memory=10Gi",
            f"node node-a@0: LimitFailed held-2 permanent: refused: device {GPU0} memory: "
            "enforcing 35Gi (2 share(s)) + asked 10Gi = 45Gi > total 40Gi",
            "claim c1@3: (version check)",
            "claim c2@3: (version check)",
        ],
        ready={"c1": True},
        enforcing=["ghost-1 gpu-0 25Gi"],
    ),
]


def _enforcing(log: Log, lines: list[str]) -> Enforcing:
    shares = log.state().shares
    out: dict[str, ShareLimit] = {}
    for line in lines:
        share_id, *rest = line.split()
        if not rest:
            out[share_id] = limit_of(shares[share_id])
            continue
        device, memory, *admin = rest
        out[share_id] = ShareLimit(
            share_id=share_id,
            driver=DRIVER,
            pool=POOL,
            device=device,
            consumed={"memory": Quantity.parse(memory)},
            admin_access=bool(admin),
        )
    return Unscannable(out)  # every row: the check never lists the limits in force


def _tell(story: list[str]) -> Log:
    log = Log(*inventory(gpu("gpu-0"), gpu("gpu-1")))
    for line in story:
        verb, name = line.split()
        if verb == "reserve":
            log.reserve(claim(request("gpu", {"memory": "10Gi"}), name=name, namespace=NAMESPACE))
        elif verb == "reserve-two":
            two = [request(r, {"memory": "10Gi"}) for r in ("a", "b")]
            log.reserve(claim(*two, name=name, namespace=NAMESPACE))
        elif verb == "ready":
            state = log.state()
            for share_id in state.claims[(NAMESPACE, name)].share_ids:
                consumed = state.shares[share_id].consumed
                log.add(c.LimitApplied(share_id=share_id, node=NODE, level="hard", actual=consumed))
        elif verb == "release":
            version = log.state().claims[(NAMESPACE, name)].allocation_version
            log.add(
                c.ReleaseRequested(
                    namespace=NAMESPACE, name=name, allocation_version=version, node=NODE
                )
            )
        elif verb == "lost":
            log.add(c.NodeLeaseExpired(node=name, epoch=1))
    return log


def _message(log: Log, line: str) -> Envelope:
    verb, name, *rest = line.split()
    if verb == "forged-release":
        event = c.ReleaseRequested(
            namespace=NAMESPACE, name=name, allocation_version=int(rest[0][1:]), node=NODE
        )
        return new_envelope(event, stream_version=99, actor="intruder", event_id="forged")
    kind = c.AllocationBound if verb == "bound" else c.ReleaseRequested
    return next(
        env
        for env in reversed(log.envelopes)
        if isinstance(env.event, kind) and env.event.name == name
    )


def _short(stream: str) -> str:
    kind, _, rest = stream.partition(":")
    return f"{kind} {rest.rsplit('/', 1)[-1]}"


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_agent_work(case: Case) -> None:
    log = _tell(case.story)
    messages = [_message(log, line) for line in case.messages]
    names = {env.event_id: env.event.name for env in messages}  # type: ignore[union-attr]
    tasks = decide_work(log.state(), case.node, messages, _enforcing(log, case.enforcing))
    calls: list[str] = []
    outcomes: dict[str, AppliedLimit | Failed] = {}
    for task in tasks:  # what the loop does with a fake enforcer
        if isinstance(task, Enforce):
            for limit in task.limits:
                calls.append(f"apply {limit.share_id}")
                outcomes[limit.share_id] = case.failing.get(limit.share_id) or AppliedLimit(
                    level="hard", actual=limit.consumed
                )
        else:
            calls += [f"remove {released.share_id}" for released in task.released]
    versions = log.versions(streams_to_check(case.node, tasks))
    written = record(case.node, tasks, outcomes, versions)
    writes: list[str] = []
    for stream, (version, events, _) in written.streams.items():
        writes += [f"{_short(stream)}@{version}: {describe(e)}" for e in events]
        if not events:
            writes.append(f"{_short(stream)}@{version}: (version check)")
    assert calls == case.calls
    assert writes == case.writes
    assert {names[m]: ready for m, ready in written.ready.items()} == case.ready
    assert [names[m] for m in written.released] == case.released
    for _, events, caused_by in written.streams.values():
        assert len(caused_by) == len(events)  # every event names the message behind it


_T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
_LIMIT = ShareLimit(share_id="s-1", driver=DRIVER, pool=POOL, device="gpu-0", consumed={})


def _recorded(outcome: Failed, retry: RetryState, now: datetime.datetime) -> c.LimitFailed:
    task = Enforce(
        message="m", guard="claim:x/y", limits=(_LIMIT,), shares=1, retries={"s-1": retry}
    )
    written = record(NODE, [task], {"s-1": outcome}, {"node:" + NODE: 3, "claim:x/y": 1}, now)
    [failed] = written.streams["node:" + NODE][1]
    assert isinstance(failed, c.LimitFailed)
    return failed


def test_a_retryable_failure_is_recorded_at_once_with_its_next_try_and_back_off() -> None:
    busy = Failed(retryable=True, reason="daemon still starting")
    first = _recorded(busy, RetryState(window_s=600), _T0)
    assert first.retryable and first.attempt == 1 and first.failing_since == _T0
    assert first.retry_at == _T0 + datetime.timedelta(seconds=RETRY_BASE_S)
    later = _T0 + datetime.timedelta(seconds=5)
    fourth = _recorded(busy, RetryState(attempts=3, failing_since=_T0, window_s=600), later)
    assert fourth.attempt == 4 and fourth.failing_since == _T0
    assert fourth.retry_at == later + datetime.timedelta(seconds=RETRY_BASE_S * 8)
    many = _recorded(busy, RetryState(attempts=20, failing_since=_T0, window_s=600), later)
    assert many.retry_at == later + datetime.timedelta(seconds=RETRY_MAX_S)


def test_a_retry_past_the_class_window_is_a_final_failure() -> None:
    busy = Failed(retryable=True, reason="daemon still starting")
    late = _T0 + datetime.timedelta(seconds=59.9)
    final = _recorded(busy, RetryState(attempts=6, failing_since=_T0, window_s=60), late)
    assert not final.retryable and final.retry_at is None
    assert final.reason.startswith("daemon still starting (gave up after 7 tries")
    permanent = _recorded(Failed(retryable=False, reason="no such GPU"), RetryState(), _T0)
    assert not permanent.retryable and permanent.reason == "no such GPU"


def test_the_sweep_retries_a_retrying_claims_due_shares_only() -> None:
    log = Log(*inventory(gpu()))
    log.add(c.NodeLeaseAcquired(node=NODE, epoch=1, boot_id="b", ttl_ms=10_000))
    rc = claim(request("gpu", {"memory": "10Gi"}), name="job", namespace=NAMESPACE)
    log.reserve(rc)
    state = log.state()
    [share_id] = state.claim(NAMESPACE, "job").share_ids  # type: ignore[union-attr]
    due = _T0 + datetime.timedelta(seconds=1)
    log.add(
        c.LimitFailed(
            share_id=share_id, node=NODE, retryable=True, reason="busy",
            retry_at=due, failing_since=_T0, attempt=1,
        )
    )  # fmt: skip
    state = log.state()
    job = state.claim(NAMESPACE, "job")
    assert job is not None and job.phase == "retrying" and "next try at" in (job.reason or "")
    assert decide_retries(state, NODE, _T0, Enforcing()) == []  # not yet
    [task] = decide_retries(state, NODE, due, Enforcing())
    assert [limit.share_id for limit in task.limits] == [share_id]
    assert task.retries[share_id].attempts == 1 and task.retries[share_id].window_s == 600
    assert decide_retries(state, "node-b", due, Enforcing()) == []
    log.add(c.LimitApplied(share_id=share_id, node=NODE, level="hard", actual={}))
    job = log.state().claim(NAMESPACE, "job")
    assert job is not None and job.phase == "ready"


def test_the_reconcile_applies_each_bound_share_of_the_node_and_nothing_else() -> None:
    log = _tell(["reserve c1", "reserve c2", "ready c2", "reserve c3", "release c3"])
    state = log.state()
    bound = state.claims[(NAMESPACE, "c1")].share_ids
    tasks = decide_bound(state, NODE, Enforcing())
    assert [[limit.share_id for limit in t.limits] for t in tasks if isinstance(t, Enforce)] == [
        bound
    ]
    assert [t.message for t in tasks] == [f"reconcile:{NAMESPACE}/c1"]  # one name each
    assert decide_bound(state, "node-b", Enforcing()) == []
    # in force already (its record lost with its message): applied again, so recorded
    [again] = decide_bound(state, NODE, _enforcing(log, bound))
    assert isinstance(again, Enforce) and [lim.share_id for lim in again.limits] == bound
    assert again.refused == ()  # its own limit is not counted twice
    # while the node's shares are unknown nothing is applied: the return decides first
    lost = _tell(["reserve c1", "lost node-a"])
    assert {s.state for s in lost.state().shares.values()} == {"unknown"}
    assert decide_bound(lost.state(), NODE, Enforcing()) == []


def test_taking_up_a_node_releases_its_releasing_claims_then_applies_its_bound_ones() -> None:
    """What a lost stream's messages asked (the durable made again): c3's release, as its
    ``ReleaseRequested`` would have it, and c1's apply, as ``decide_bound``'s; the ready
    c2 and the other node's nothing."""
    log = _tell(["reserve c1", "reserve c2", "ready c2", "reserve c3", "ready c3", "release c3"])
    state = log.state()
    held = [s for k in ("c2", "c3") for s in state.claims[(NAMESPACE, k)].share_ids]
    tasks = decide_taken_up(state, NODE, _enforcing(log, held))
    assert [type(t).__name__ for t in tasks] == ["Release", "Enforce"]
    release, enforce = tasks
    assert isinstance(release, Release) and isinstance(enforce, Enforce)
    assert [r.share_id for r in release.released] == state.claims[(NAMESPACE, "c3")].share_ids
    assert [lim.share_id for lim in enforce.limits] == state.claims[(NAMESPACE, "c1")].share_ids
    assert [t.message for t in tasks] == [f"reconcile:{NAMESPACE}/c3", f"reconcile:{NAMESPACE}/c1"]
    # the same apply as the reconcile's
    assert tasks[1:] == decide_bound(state, NODE, _enforcing(log, held))
    assert decide_taken_up(state, "node-b", Enforcing()) == []
    # a release carried out (LimitRemoved, CapacityReleased) leaves nothing to take up
    for share in release.released:
        log.add(c.LimitRemoved(share_id=share.share_id, node=NODE))
        log.add(share)
    assert [type(t).__name__ for t in decide_taken_up(log.state(), NODE, Enforcing())] == [
        "Enforce"
    ]


# --- reconcile ------------------------------------------------------------------------


@dataclass
class Reconcile:
    id: str
    plan: ReconcilePlan
    observed: list[str]  # shares with a limit in the kernel
    removed: list[str]  # orphans and stale shares whose removal succeeded
    reapplied: list[str]
    failed: list[str]
    expect: c.EnforcementReconciled | None


RECONCILES = [
    Reconcile("nothing-found-reports-nothing", ReconcilePlan(), [], [], [], [], None),
    Reconcile(
        "limits-in-force-are-reported-kept",
        ReconcilePlan(kept=["s1"]),
        ["s1"],
        [],
        [],
        [],
        c.EnforcementReconciled(node=NODE, kept=["s1"]),
    ),
    Reconcile(
        "only-orphans-the-kernel-showed-and-that-went-away-are-reported",
        ReconcilePlan(orphans=["o1", "o2"], stale=["s9"]),
        ["o1", "o2"],
        ["o1", "s9"],
        [],
        [],
        c.EnforcementReconciled(node=NODE, removed_orphans=["o1"]),
    ),
    Reconcile(
        "a-stale-entry-removed-again-is-not-news",
        ReconcilePlan(stale=["s9"]),
        [],
        ["s9"],
        [],
        [],
        None,
    ),
    Reconcile(
        "put-back-and-failed-limits-are-reported",
        ReconcilePlan(),
        [],
        [],
        ["r1"],
        ["f1"],
        c.EnforcementReconciled(node=NODE, reapplied=["r1"], failed=["f1"]),
    ),
]


@pytest.mark.parametrize("case", RECONCILES, ids=[case.id for case in RECONCILES])
def test_reconcile_report(case: Reconcile) -> None:
    report = reconciled(NODE, case.plan, case.observed, case.removed, case.reapplied, case.failed)
    assert report == case.expect


def test_a_checkpoint_set_aside_is_reported_with_its_detail_cut() -> None:
    warning = CheckpointWarning(reason="corrupt", detail="x" * 5000, path="/c", set_aside="/c.bad")
    event = set_aside(NODE, warning)
    assert (event.path, event.reason, event.moved_to) == ("/c", "corrupt", "/c.bad")
    assert event.detail == "x" * 2000


def test_the_rebuilt_checkpoint_holds_what_is_in_force_and_what_failed() -> None:
    log = _tell(["reserve-two c1"])
    shares = log.state().shares
    applied = AppliedLimit(level="hard", actual={"memory": Quantity.parse("10Gi")})
    entries = rebuilt_entries(shares, {"held-1": applied}, ["held-2"], T1)
    assert {s: (e.phase, e.applied) for s, e in entries.items()} == {
        "held-1": ("completed", applied),
        "held-2": ("started", None),
    }
    assert entries["held-2"].limit == limit_of(shares["held-2"])
    assert all(e.updated_at == T1 for e in entries.values())
