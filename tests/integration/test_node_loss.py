"""Node loss end to end: a stopped agent, its lease, Unknown shares, fencing, return.

The stack of ``test_agent_restart`` (relay, claims API and a reservation worker
in-process; the node agent a **subprocess** with the tc enforcer on a veth) plus two
reclamation replicas in-process. The agent runs with a 2 s lease. Stopping it with
SIGSTOP makes its lease run out: both replicas see the expiry, exactly one records
it, the node's shares become ``unknown`` and keep their capacity, and its devices are
tainted. Then either an operator fences the node (the capacity comes back at once, a
new agent process of another boot takes the node over and serves the claims that
waited), or the stopped agent resumes (same boot: it confirms the limit the kernel
still holds, releases the share whose claim was deleted meanwhile and the one whose
limit vanished), or an agent of a new boot starts (every unknown share is released).
A forged append under the old epoch is refused, and the refusal is in the log.

Skipped, with the reason, without CAP_NET_ADMIN (or veth/HTB/cls_bpf).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest

from events import catalog as c
from events.envelopes import Envelope, lease_stream, node_stream
from events.state import ClusterState
from services import cli
from services.exitcodes import ExitCode
from services.reclamation.service import ReclamationService
from services.replay.verify import summary, verify
from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground.errors import StaleEpoch
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import EventStore
from tests.fixtures.contexts import folded
from tests.fixtures.polling import until
from tests.integration.test_agent_restart import NAMESPACE, Node, ready

pytest_plugins = ["tests.fixtures.netns"]

TTL = "2"


class Lossy(Node):
    """The agent restart stack with a short lease and two reclamation replicas."""

    replicas: list[ReclamationService]

    async def start_reclamation(self) -> None:
        self.replicas = []
        for i in range(2):
            store = await self._store()
            replica = ReclamationService(
                folded(store, self.names), name=f"reclamation-{i}", poll_s=0.1
            )
            self.replicas.append(replica)
            self._run(replica.run)

    def signal_agent(self, sig: signal.Signals) -> None:
        assert self.agent is not None
        os.kill(self.agent.pid, sig)

    async def delete(self, name: str) -> None:
        subject = self.names.api(NAMESPACE, "delete")
        body = json.dumps({"name": name}).encode()
        reply = json.loads((await self.nc.request(subject, body, timeout=10)).data)
        assert reply["ok"], reply

    async def events_of(self, stream: str, kind: type[c.Event]) -> list[Envelope]:
        return [e for e in await self.store.read_stream(stream) if isinstance(e.event, kind)]

    async def dracap(self, *argv: str) -> tuple[int, str]:
        flags = ["--nats", self.nats_url, "--prefix", self.names.prefix]
        code = await asyncio.to_thread(cli.main, [*argv, *flags])
        return code, ""

    async def verify_clean(self) -> None:
        report = await verify(self.settings, from_start=True)
        assert report.ok, summary(report)


def lease(node: str, want: str) -> Callable[[ClusterState], bool]:
    def check(state: ClusterState) -> bool:
        held = state.nodes.get(node)
        return held is not None and held.lease == want

    return check


def phases(**want: str) -> Callable[[ClusterState], bool]:
    def check(state: ClusterState) -> bool:
        for name, phase in want.items():
            claim = state.claim(NAMESPACE, name)
            if claim is None or claim.phase != phase:
                return False
        return True

    return check


@pytest.fixture
async def lossy(settings: Settings, nats_url: str, tmp_path: Path) -> AsyncIterator[Lossy]:
    from tests.fixtures.netns import require_net_admin

    require_net_admin()
    settings = msgspec.structs.replace(settings, pool_max_size=4)
    nc, js = await connect_bus(nats_url)
    stack = Lossy(settings, nats_url, nc, js, tmp_path)
    stack.speed = "10G"  # a veth's own speed where the kernel reports one
    stack.policy = {"default": "1G", "validValues": ["1G", "4G", "5G"]}
    stack.agent_args = ["--lease-ttl", TTL, "--boot-id", "boot-1"]
    try:
        stack.make_link()
        stack.write_config()
        await stack.start()
        await stack.start_reclamation()
        stack.start_agent()
        await stack.until(
            lambda st: any(s.spec.node_name == stack.node for s in st.slices.values())
        )
        yield stack
    finally:
        await stack.close()
        stack.remove_link()
        await nc.close()


async def _forge_stale_append(stack: Lossy, share_id: str, epoch: int) -> None:
    """What a resumed agent of ``epoch`` would write: refused, and the refusal logged."""
    applied = c.LimitApplied(share_id=share_id, node=stack.node, level="hard", actual={})
    async with await EventStore.open(stack.settings) as store:
        with pytest.raises(StaleEpoch) as refused:
            await store.append(
                node_stream(stack.node), None, [applied], actor=f"agent:{stack.node}#{epoch}"
            )
    assert refused.value.epoch == epoch
    [record] = await stack.events_of(node_stream(stack.node), c.AppendRefused)
    assert record.actor == f"agent:{stack.node}#{epoch}"
    assert record.event == c.AppendRefused(
        node=stack.node,
        epoch=epoch,
        current_epoch=refused.value.current,
        types=["enforcement.limit_applied"],
    )


async def test_a_lost_node_holds_its_capacity_until_fenced_then_a_new_boot_serves_the_waiters(
    lossy: Lossy, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = lossy
    await stack.apply("a", "5G")
    await stack.apply("b", "4G")
    await stack.until(ready("a", "b"))
    held = stack.share_ids(stack.view.state, "a", "b")
    await stack.apply("c", "5G")  # 1G free: waits
    await stack.until(phases(c="unschedulable"))

    stack.signal_agent(signal.SIGSTOP)
    await stack.until(lease(stack.node, "expired"), within=60)
    state = await stack.view.fresh(stack.view.state.position)
    assert {state.shares[s].state for s in held} == {"unknown"}
    key = state.shares[held[0]].device_key
    assert state.devices[key].consumed()["bandwidth"].canonical() == "9G", "capacity held"

    # two replicas ran; the expiry and its unknown shares were recorded once
    leases = lease_stream(stack.node)
    assert len(await stack.events_of(leases, c.NodeLeaseExpired)) == 1
    marked = await stack.events_of(node_stream(stack.node), c.ShareMarkedUnknown)
    assert sorted(e.event.share_id for e in marked) == held
    ticked = [r.ticks for r in stack.replicas]
    await until(  # more ticks of both replicas change nothing
        lambda: all(r.ticks >= t + 3 for r, t in zip(stack.replicas, ticked, strict=True)),
        what="three more ticks of each replica",
    )
    assert sum(r.expired for r in stack.replicas) == 1
    assert len(await stack.events_of(leases, c.NodeLeaseExpired)) == 1

    # a claim that fits the free capacity is still not placed there, and says why
    await stack.apply("d", "1G")
    await stack.until(phases(d="unschedulable"))
    reason = stack.view.state.claim(NAMESPACE, "d").reason  # type: ignore[union-attr]
    assert reason is not None and "dracap.io/node-lost" in reason and "unknown shares" in reason

    code, _ = await stack.dracap("node", "list", "-o", "json")
    listed = {n["node"]: n for n in json.loads(capsys.readouterr().out)}
    assert code == ExitCode.OK and listed[stack.node]["lease"] == "expired"
    assert len(listed[stack.node]["unknown_shares"]) == 2
    code, _ = await stack.dracap("node", "get", stack.node, "-o", "json")
    shown = json.loads(capsys.readouterr().out)
    assert code == ExitCode.OK and shown["lease"] == "expired" and shown["epoch"] == 1
    assert shown["boot_id"] == "boot-1" and shown["expires_in_s"] < 0
    assert sorted(u["share_id"] for u in shown["unknown_shares"]) == held
    assert shown["taints"] and "NoSchedule" in shown["taints"][0]

    await _forge_stale_append(stack, held[0], epoch=1)

    code, _ = await stack.dracap("node", "fence", stack.node, "--reason", "powered off by test")
    out = capsys.readouterr().out
    assert code == ExitCode.OK and "fenced at epoch 1" in out
    await stack.until(phases(a="failed", b="failed"))
    state = stack.view.state
    assert state.devices[key].consumed()["bandwidth"].canonical() == "0"
    assert "powered off by test" in (state.claim(NAMESPACE, "a").reason or "")  # type: ignore[union-attr]
    held_rows = await stack.store.pool.fetchval(
        "SELECT count(*) FROM held_shares WHERE node = $1", stack.node
    )
    assert held_rows == 0, "the fence gave the capacity back in the ledger too"
    [fence] = await stack.events_of(leases, c.NodeFenced)
    assert fence.actor.startswith(("operator:", "anonymous:"))

    # the node comes back after a power cycle: another boot, a new process
    stack.kill_agent()
    stack.agent_args = ["--lease-ttl", TTL, "--boot-id", "boot-2"]
    stack.start_agent()
    await stack.until(ready("c", "d"), within=60)
    acquired = await stack.events_of(leases, c.NodeLeaseAcquired)
    assert [(e.event.epoch, e.event.boot_id) for e in acquired] == [(1, "boot-1"), (2, "boot-2")]
    in_force = await stack.tc.observe()
    assert not set(held) & set(in_force), "the fenced shares' limits were removed as orphans"
    assert set(stack.share_ids(stack.view.state, "c", "d")) <= set(in_force)
    await stack.verify_clean()


async def test_a_resumed_agent_confirms_what_it_enforces_and_releases_the_rest(
    lossy: Lossy,
) -> None:
    stack = lossy
    for name, rate in (("a", "1G"), ("b", "4G"), ("c", "5G")):
        await stack.apply(name, rate)
    await stack.until(ready("a", "b", "c"))
    [a], [b], [cc] = (stack.share_ids(stack.view.state, n) for n in ("a", "b", "c"))

    stack.signal_agent(signal.SIGSTOP)
    await stack.until(lease(stack.node, "expired"), within=60)
    await stack.delete("b")  # deleted while unknown: releasing, its capacity still held
    await stack.until(phases(b="releasing"))
    assert stack.view.state.shares[b].state == "unknown"
    await stack.tc.remove(cc)  # the kernel lost c's limit while nobody watched
    await _forge_stale_append(stack, a, epoch=1)

    resumed = time.monotonic()
    stack.signal_agent(signal.SIGCONT)
    await stack.until(phases(a="ready", b="released", c="failed"), within=60)
    took = time.monotonic() - resumed
    state = stack.view.state
    assert state.shares[a].state == "ready"
    assert state.shares[b].state == state.shares[cc].state == "released"
    assert "no longer in force" in (state.claim(NAMESPACE, "c").reason or "")  # type: ignore[union-attr]
    node = node_stream(stack.node)
    assert [e.event.share_id for e in await stack.events_of(node, c.ShareConfirmed)] == [a]
    acquired = await stack.events_of(lease_stream(stack.node), c.NodeLeaseAcquired)
    assert [(e.event.epoch, e.event.boot_id) for e in acquired] == [(1, "boot-1"), (2, "boot-1")]
    in_force = await stack.tc.observe()
    assert a in in_force and b not in in_force and cc not in in_force
    print(f"confirmed {took:.2f}s after the agent resumed", file=sys.stderr)
    await stack.verify_clean()


async def test_an_agent_of_a_new_boot_releases_every_unknown_share(lossy: Lossy) -> None:
    stack = lossy
    await stack.apply("a", "4G")
    await stack.until(ready("a"))
    [a] = stack.share_ids(stack.view.state, "a")
    stack.kill_agent()
    await stack.until(lease(stack.node, "expired"), within=60)
    assert stack.view.state.shares[a].state == "unknown"
    stack.agent_args = ["--lease-ttl", TTL, "--boot-id", "boot-2"]
    stack.start_agent()
    await stack.until(phases(a="failed"), within=60)
    await stack.until(lambda st: st.shares[a].state == "released")
    assert "rebooted" in (stack.view.state.claim(NAMESPACE, "a").reason or "")  # type: ignore[union-attr]
    await stack.verify_clean()
