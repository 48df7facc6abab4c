"""The kubelet plugin as a node's kubelet drives it: many calls at once, bad input at once.

The kubelet calls ``NodePrepareResources`` outside its cache lock, so Pods starting
together on one node reach the plugin in parallel. Every call for a distinct claim must
succeed at the first try, and after each batch the kernel's HTB classes are exactly the
log's ``ready`` shares (the plugin's one writer per node: docs/kubelet-plugin.md).

The system is the one of ``test_kubernetes.py``: the API-server stand-in, the relay, the
enforcement service and the bridge in-process, ``dracap agent --enforcer tc
--kubelet-plugin`` as a subprocess on a veth, the kubelet side over real gRPC.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from events import model
from events.catalog import EnforcementReconciled, LimitApplied
from events.envelopes import node_stream
from events.state import ClusterState
from services.enforcement.decisions import limit_of
from services.enforcement.tc import TcEnforcer
from services.runtime.ground.settings import Settings
from services.runtime.kubeletplugin import ClaimRef
from services.runtime.store.livestate import HEAD
from tests.fixtures.k8s_standin import StandinApiServer
from tests.fixtures.kubeletclient import PluginConnection
from tests.fixtures.kubernetes import CLASS, DRIVER, NAMESPACE, Cluster, in_force, running, share_of

pytest_plugins = ["tests.fixtures.netns"]


@pytest.fixture
async def cluster(settings: Settings, nats_url: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    from tests.fixtures.netns import require_net_admin

    require_net_admin()
    settings = msgspec.structs.replace(settings, pool_max_size=4)
    async with StandinApiServer(history_limit=100_000) as standin:
        # room for 128 shares of the policy's step (a veth publishes at most 10G)
        stack = Cluster(settings, nats_url, tmp_path, standin, bandwidth="10G", step="50M")
        async with running(stack):
            yield stack


async def _allocated(cluster: Cluster, names: list[str]) -> tuple[list[ClaimRef], ClusterState]:
    """Allocate ``names`` (50M each) and wait until the bridge mirrored them all."""
    refs = []
    for name in names:
        rc = await cluster.allocate(name, "50M")
        refs.append(ClaimRef(namespace=NAMESPACE, name=name, uid=rc.metadata.uid or ""))

    def mirrored(state: ClusterState) -> bool:
        claims = [state.claim(NAMESPACE, n) for n in names]
        return all(c is not None and c.phase == "allocated" for c in claims)

    return refs, await cluster.until(mirrored, f"{len(names)} allocations mirrored")


def _ready(state: ClusterState, share_ids: list[str]) -> set[str]:
    return {sid for sid in share_ids if state.shares[sid].state == "ready"}


@pytest.mark.parametrize("parallel", [8, 32, 128])
async def test_parallel_prepares_then_unprepares_all_succeed_at_the_first_call(
    cluster: Cluster, parallel: int
) -> None:
    names = [f"pod-{i}" for i in range(parallel)]
    refs, state = await _allocated(cluster, names)
    shares = [share_of(state, n) for n in names]
    kubelet = await cluster.kubelet()
    try:
        prepared = await asyncio.gather(*(kubelet.prepare([ref]) for ref in refs))
        errors = {r.name: p[r.uid].error for r, p in zip(refs, prepared, strict=True)}
        assert all(e == "" for e in errors.values()), errors
        state = await cluster.view.fresh(HEAD)
        assert _ready(state, shares) == set(shares)
        assert await in_force(cluster.iface, shares) == set(shares)  # the kernel agrees

        unprepared = await asyncio.gather(*(kubelet.unprepare([ref]) for ref in refs))
        assert all(u == {r.uid: ""} for r, u in zip(refs, unprepared, strict=True)), unprepared
        state = await cluster.view.fresh(HEAD)
        assert _ready(state, shares) == set()
        assert await in_force(cluster.iface, shares) == set()
        assert {state.claims[(NAMESPACE, n)].phase for n in names} == {"allocated"}
    finally:
        await kubelet.close()


async def test_concurrent_calls_for_one_claim_are_one(cluster: Cluster) -> None:
    [ref], state = await _allocated(cluster, ["shared"])
    share = share_of(state, "shared")
    kubelet = await cluster.kubelet()
    try:
        answers = await asyncio.gather(*(kubelet.prepare([ref]) for _ in range(8)))
        assert all(a == answers[0] for a in answers), answers
        assert answers[0][ref.uid].error == ""
        applied = [
            e.event.share_id
            for e in await cluster.store.read_stream(node_stream(cluster.node))
            if isinstance(e.event, LimitApplied)
        ]
        assert applied == [share]  # applied and recorded once
        both = await asyncio.gather(kubelet.unprepare([ref]), kubelet.unprepare([ref]))
        assert both == [{ref.uid: ""}, {ref.uid: ""}]
        assert await in_force(cluster.iface, [share]) == set()
    finally:
        await kubelet.close()


async def _prepare_error(kubelet: PluginConnection, ref: ClaimRef) -> str:
    answer = await kubelet.prepare([ref])
    return answer[ref.uid].error


async def test_a_claim_not_allocated_or_on_another_driver_is_answered_from_the_api_server(
    cluster: Cluster,
) -> None:
    """Answered from the API server's copy: no wait for a mirror that will never come."""
    bare = model.convert(
        {
            "metadata": {"name": "bare", "namespace": NAMESPACE},
            "spec": {
                "devices": {"requests": [{"name": "net", "exactly": {"deviceClassName": CLASS}}]}
            },
        },
        model.ResourceClaim,
    )
    created = await cluster.api.create_claim(bare)
    kubelet = await cluster.kubelet()
    try:
        ref = ClaimRef(namespace=NAMESPACE, name="bare", uid=created.metadata.uid or "")
        error = await _prepare_error(kubelet, ref)
        assert "is not allocated (status.allocation is empty)" in error, error

        status = {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "net",
                            "driver": "gpu.other.example.com",
                            "pool": "p",
                            "device": "d",
                            "shareID": str(uuid.uuid4()),
                        }
                    ]
                }
            }
        }
        await cluster.api.patch_claim_status(
            NAMESPACE, "bare", status, resource_version=created.metadata.resource_version
        )
        error = await _prepare_error(kubelet, ref)
        assert "is allocated on gpu.other.example.com, none of them this plugin's" in error, error
        gone = ClaimRef(namespace=NAMESPACE, name="nobody", uid="u-1")
        assert "ResourceClaim default/nobody not found".replace("default", NAMESPACE) in (
            await _prepare_error(kubelet, gone)
        )
    finally:
        await kubelet.close()


async def test_a_restarted_agent_settles_what_a_crash_left_half_done(cluster: Cluster) -> None:
    """The two crashes a prepare or an unprepare can leave behind, made by hand while the
    agent is down: a limit applied whose report never landed (the log says bound), and a
    limit removed whose report never landed (the log says ready). The restarted agent's
    reconcile makes the kernel say what the log says: the first removed, the second put
    back; the kubelet's next calls then go through."""
    refs, state = await _allocated(cluster, ["applied", "removed"])
    applied, removed = (share_of(state, n) for n in ("applied", "removed"))
    kubelet = await cluster.kubelet()
    try:
        answer = await kubelet.prepare([refs[1]])
        assert answer[refs[1].uid].error == ""
    finally:
        await kubelet.close()
    cluster.kill_agent()
    pool, _ = await cluster.device()
    tc = TcEnforcer({(DRIVER, pool, cluster.iface): cluster.iface})
    state = await cluster.view.fresh(HEAD)
    await tc.apply(limit_of(state.shares[applied]))  # cut short before its LimitApplied
    await tc.remove(removed)  # cut short before its LimitRemoved
    assert await in_force(cluster.iface, [applied, removed]) == {applied}

    cluster.start_agent()

    async def reconciled() -> EnforcementReconciled | None:
        for env in await cluster.store.read_stream(node_stream(cluster.node)):
            if (
                isinstance(env.event, EnforcementReconciled)
                and applied in env.event.removed_orphans
            ):
                return env.event
        return None

    report = await cluster.until_api(reconciled, "the restarted agent's reconcile")
    assert report.reapplied == [removed]
    assert await in_force(cluster.iface, [applied, removed]) == {removed}  # as the log says
    state = await cluster.view.fresh(HEAD)
    assert _ready(state, [applied, removed]) == {removed}

    kubelet = await cluster.kubelet()
    try:  # the kubelet retries its calls: both go through now
        answer = await kubelet.prepare([refs[0]])
        assert answer[refs[0].uid].error == ""
        assert await kubelet.unprepare([refs[1]]) == {refs[1].uid: ""}
    finally:
        await kubelet.close()
    assert await in_force(cluster.iface, [applied, removed]) == {applied}
