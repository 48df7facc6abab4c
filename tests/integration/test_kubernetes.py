"""Kubernetes mode end to end: a kubelet-like client, the agent's kubelet plugin, the bridge.

No kube-apiserver can run on these machines, so the API server here is the **stand-in**
of :mod:`tests.fixtures.k8s_standin` (plainly not Kubernetes: it keeps the API server's
contract for ResourceClaims and ResourceSlices — resource versions, watches with
bookmarks, 410 Gone, 409 Conflict, the status subresource — and validates every object
written against the 1.34 OpenAPI schemas). The test plays kube-scheduler: it allocates
claims on the ResourceSlices the agent published there, by writing ``status.allocation``.

Real parts: PostgreSQL, nats-server, the relay and the bridge in-process, the node agent
as a subprocess (``dracap agent --enforcer tc --kubelet-plugin``) with a veth whose peer
lives in a fresh network namespace, and the kubelet side over real gRPC on Unix sockets
(:class:`~tests.fixtures.kubeletclient.KubeletClient`: registers through the
registration socket, then calls the advertised endpoint). Skipped, with the reason,
without CAP_NET_ADMIN.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from events import model
from events.catalog import CapacityReserved, ClaimReserved, LimitApplied
from events.envelopes import node_stream
from events.quantities import Quantity
from services.replay.verify import summary, verify
from services.runtime.ground.settings import Settings
from services.runtime.kubeletplugin import ClaimRef
from services.runtime.store.livestate import HEAD
from tests.fixtures.k8s_standin import StandinApiServer
from tests.fixtures.kubernetes import DRIVER, NAMESPACE, Cluster, running, share_of, tc_minor

pytest_plugins = ["tests.fixtures.netns"]


@pytest.fixture
async def cluster(settings: Settings, nats_url: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    from tests.fixtures.netns import require_net_admin

    require_net_admin()
    settings = msgspec.structs.replace(settings, pool_max_size=4)
    async with StandinApiServer() as standin:
        stack = Cluster(settings, nats_url, tmp_path, standin)
        async with running(stack):
            yield stack


async def test_kubelet_prepares_enforces_and_unprepares_a_scheduled_claim(
    cluster: Cluster,
) -> None:
    rc = await cluster.allocate("train", "400M")
    uid = rc.metadata.uid or ""
    ref = ClaimRef(namespace=NAMESPACE, name="train", uid=uid)
    state = await cluster.until(
        lambda st: (c := st.claim(NAMESPACE, "train")) is not None and c.phase == "allocated",
        "the allocation mirrored",
    )
    share_id = share_of(state, "train")
    assert tc_minor(cluster.iface, share_id) is None  # scheduled, not enforced: not Ready
    kubelet = await cluster.kubelet()
    try:
        first = await kubelet.prepare([ref])
        assert first[uid].error == "", first
        [device] = first[uid].devices
        assert device.cdi_device_ids == (f"dracap.io/share={share_id}",)
        assert (cluster.cdi / f"dracap.io-share_{share_id}.json").exists()
        state = await cluster.view.fresh(HEAD)
        assert state.claims[(NAMESPACE, "train")].phase == "ready"
        assert tc_minor(cluster.iface, share_id) is not None  # the limit is in force
        again = await kubelet.prepare([ref])  # idempotent: the same answer, nothing new
        assert again == first
        applied = [
            e
            for e in await cluster.store.read_stream(node_stream(cluster.node))
            if isinstance(e.event, LimitApplied)
        ]
        assert len(applied) == 1

        async def ready_condition() -> Any:
            cond = await cluster.condition("train")
            return cond if cond is not None and cond["status"] == "True" else None

        cond = await cluster.until_api(ready_condition, "status.devices Ready=True")
        assert cond["reason"] == "LimitApplied" and "hard" in cond["message"]
        wrong = await kubelet.prepare([ClaimRef(namespace=NAMESPACE, name="train", uid="x")])
        assert "uid" in wrong["x"].error
        health = kubelet.watch_health()
        [report] = await anext(health)  # the node's device, as the agent last found it
        assert (report.device_name, report.health) == (device.device_name, "healthy")
        await health.aclose()
    finally:
        await kubelet.close()

    [published] = (await cluster.api.list_slices(node=cluster.node)).items
    cluster.kill_agent()  # restarted between prepare and unprepare
    assert tc_minor(cluster.iface, share_id) is not None
    cluster.start_agent()
    kubelet = await cluster.kubelet()
    synced = f"ResourceSlices of {DRIVER} on {cluster.node} in sync at generation 1"
    await cluster.until_api(lambda: _logged(cluster, 2, synced), "the restart's slice sync")
    [again_published] = (await cluster.api.list_slices(node=cluster.node)).items
    # the restarted agent found its slices as they were: nothing written, same generation
    assert again_published.metadata.resource_version == published.metadata.resource_version
    assert again_published.spec.pool.generation == published.spec.pool.generation == 1
    try:
        again = await kubelet.prepare([ref])
        assert again == first  # the log and the checkpoint carried it
        done = await kubelet.unprepare([ref])
        assert done == {uid: ""}
        assert tc_minor(cluster.iface, share_id) is None
        state = await cluster.view.fresh(HEAD)
        # the limit is off; Kubernetes still allocates the claim: its capacity stays held
        assert state.claims[(NAMESPACE, "train")].phase == "allocated"
        assert state.shares[share_id].state == "bound"
        held = state.devices[state.shares[share_id].device_key].consumed_nanos["bandwidth"]
        assert held == Quantity.parse("400M").nanos
        unknown = await kubelet.unprepare([ClaimRef(namespace=NAMESPACE, name="nope", uid="u")])
        assert unknown == {"u": ""}
        assert (await kubelet.unprepare([ref])) == {uid: ""}  # again: nothing left to undo

        # another Pod of the same claim starts on the node: prepared again, limit and all
        back = await kubelet.prepare([ref])
        assert back == first, back
        assert tc_minor(cluster.iface, share_id) is not None
        state = await cluster.view.fresh(HEAD)
        assert state.claims[(NAMESPACE, "train")].phase == "ready"
        assert (await kubelet.unprepare([ref])) == {uid: ""}
        assert tc_minor(cluster.iface, share_id) is None
    finally:
        await kubelet.close()

    # Kubernetes deallocates: only now is the capacity given back
    await cluster.set_status(
        "train", lambda _: {"allocation": None, "reservedFor": None, "devices": None}
    )
    state = await cluster.until(
        lambda st: st.claims[(NAMESPACE, "train")].phase == "withdrawn", "released and withdrawn"
    )
    assert not any(state.devices[k].consumed_nanos.get("bandwidth") for k in state.devices)
    applied = [
        e
        for e in await cluster.store.read_stream(node_stream(cluster.node))
        if isinstance(e.event, LimitApplied)
    ]
    assert len(applied) == 2  # the first prepare and the one after the unprepare
    verified = await verify(cluster.settings, from_start=True)
    assert verified.ok, summary(verified)


async def _logged(cluster: Cluster, start: int, line: str) -> bool:
    """Whether the agent's ``start``-th run logged ``line``."""
    log = cluster.tmp / f"agent-{start}.log"
    return log.exists() and line in log.read_text(errors="replace")


async def test_an_oversubscribing_allocation_is_refused_at_prepare(cluster: Cluster) -> None:
    total = await cluster.total()
    big = Quantity(total.nanos - 200 * 10**6 * 10**9, total.format).canonical()
    await cluster.allocate("big", big)
    late = await cluster.allocate("late", "400M")  # 200M more than the device has: a defect
    await cluster.until(
        lambda st: (c := st.claim(NAMESPACE, "late")) is not None and c.phase == "rejected",
        "the second allocation refused",
    )
    uid = late.metadata.uid or ""
    kubelet = await cluster.kubelet()
    try:
        answer = await kubelet.prepare([ClaimRef(namespace=NAMESPACE, name="late", uid=uid)])
        assert f"{big} consumed + 400M > total {total.canonical()}" in answer[uid].error, answer
    finally:
        await kubelet.close()

    async def refused() -> Any:
        cond = await cluster.condition("late")
        return cond if cond is not None and cond["reason"] == "AllocationRefused" else None

    cond = await cluster.until_api(refused, "a condition saying why")
    assert cond["status"] == "False" and f"400M > total {total.canonical()}" in cond["message"]


async def test_mirrored_once_across_watch_restarts_and_410(cluster: Cluster) -> None:
    await cluster.allocate("once", "100M")
    await cluster.until(
        lambda st: (c := st.claim(NAMESPACE, "once")) is not None and c.phase == "allocated",
        "mirrored",
    )
    cluster.standin.drop_watches()
    await cluster.standin.wait_for_watches(1)
    cluster.standin.compact()
    cluster.standin.expire_watches()  # the bridge must list again
    pod_b = {"resource": "pods", "name": "pod-b", "uid": "uid-b"}

    def reserve_b(claim: model.ResourceClaim) -> dict[str, Any]:
        refs = [model.to_builtins(r) for r in (claim.status.reserved_for or [])]  # type: ignore[union-attr]
        return {"reservedFor": [*refs, pod_b]}

    await cluster.set_status("once", reserve_b)
    await cluster.until(
        lambda st: len(st.claims[(NAMESPACE, "once")].reserved_for) == 2, "pod-b reserved"
    )
    events = [e.event for e in await cluster.store.read_stream(f"claim:{NAMESPACE}/once")]
    reserved = [e for e in events if isinstance(e, ClaimReserved)]
    assert [e.consumer for e in reserved] == [f"pod/{NAMESPACE}/pod-a", f"pod/{NAMESPACE}/pod-b"]
    state = await cluster.view.fresh(HEAD)
    share = state.shares[share_of(state, "once")]
    device_events = await cluster.store.read_stream(
        f"device:{share.driver}/{share.pool}/{share.device}"
    )
    assert sum(isinstance(e.event, CapacityReserved) for e in device_events) == 1


async def test_deallocation_releases_the_capacity(cluster: Cluster) -> None:
    await cluster.allocate("gone", "800M")
    state = await cluster.until(
        lambda st: (c := st.claim(NAMESPACE, "gone")) is not None and c.phase == "allocated",
        "mirrored",
    )
    share = state.shares[share_of(state, "gone")]
    assert state.devices[share.device_key].consumed_nanos["bandwidth"] > 0
    await cluster.set_status(
        "gone", lambda _: {"allocation": None, "reservedFor": None, "devices": None}
    )
    # released by the agent, then withdrawn by the bridge: Kubernetes no longer allocates it
    state = await cluster.until(
        lambda st: st.claims[(NAMESPACE, "gone")].phase == "withdrawn", "released and withdrawn"
    )
    assert state.devices[share.device_key].consumed_nanos["bandwidth"] == 0
    assert state.shares[share.share_id].state == "released"
