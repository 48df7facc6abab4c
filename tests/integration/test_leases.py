"""Node leases in the database: epochs, renewal, stale appends, expiry once, the fence hook.

Real PostgreSQL; node leases as the enforcement service keeps them for the agents
(:mod:`services.enforcement.leases`) and the reclamation service
(:class:`~services.reclamation.service.ReclamationService`), without a bus or an agent
process: what must hold at the store itself.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from events import catalog as c
from events.actors import Actor
from events.envelopes import Envelope, lease_stream, node_stream
from services.enforcement import leases
from services.reclamation.service import ReclamationService
from services.replay.verify import summary, verify
from services.runtime.ground.errors import ConflictError, StaleEpoch
from services.runtime.ground.settings import Settings
from services.runtime.store.appends import Batch, Metadata, Processed
from services.runtime.store.eventstore import EventStore
from services.runtime.store.livestate import LiveState
from tests.fixtures.clock import FakeClock
from tests.fixtures.contexts import folded
from tests.fixtures.dbtime import age_leases
from tests.fixtures.polling import until
from tests.integration import sample as s
from tests.integration.scenario import put

NODE = "node-a"


class NodeLease:
    """One node's lease, taken and renewed as the enforcement service does for its agent."""

    def __init__(self, store: EventStore, node: str, *, boot_id: str, ttl_s: float = 10.0):
        self.store, self.node, self.boot_id, self.ttl_ms = store, node, boot_id, round(ttl_s * 1000)
        self.epoch: int | None = None

    @property
    def actor(self) -> str:
        return str(Actor.agent(self.node, self.epoch))

    async def acquire(self) -> int:
        self.epoch, _ = await leases.acquire(
            self.store, self.node, boot_id=self.boot_id, ttl_ms=self.ttl_ms
        )
        return self.epoch

    async def renew(self) -> bool:
        assert self.epoch is not None
        return self.node in await self.store.renew_leases({self.node: self.epoch})


@pytest.fixture
async def store(settings: Settings) -> AsyncIterator[EventStore]:
    async with await EventStore.open(settings) as store:
        yield store


async def _with_share(store: EventStore, ttl_s: float = 60.0) -> tuple[NodeLease, str]:
    """A slice of ``NODE``, a lease of its agent and one share on it."""
    await put(store, s.slice_published(name="node-a-gpus", pool=NODE))
    lease = NodeLease(store, NODE, boot_id="boot-1", ttl_s=ttl_s)
    await lease.acquire()
    reserved = s.reserved(name="c1", pool=NODE)
    await put(store, reserved)
    return lease, reserved.share_id


async def _events(store: EventStore, kind: type[c.Event]) -> list[Envelope]:
    return [e async for e in store.read_all() if isinstance(e.event, kind)]


async def test_each_new_lease_gets_the_next_epoch_and_one_of_two_racers_wins(
    store: EventStore,
) -> None:
    first = NodeLease(store, NODE, boot_id="boot-1")
    assert await first.acquire() == 1
    assert first.actor == f"agent:{NODE}#1"
    racing = c.NodeLeaseAcquired(node=NODE, epoch=2, boot_id="b", ttl_ms=1000)
    results = await asyncio.gather(
        *(
            store.append(lease_stream(NODE), None, [racing], actor=f"agent:{NODE}#2")
            for _ in range(2)
        ),
        return_exceptions=True,
    )
    assert sum(isinstance(r, ConflictError) for r in results) == 1, results
    too_far = c.NodeLeaseAcquired(node=NODE, epoch=5, boot_id="b", ttl_ms=1000)
    with pytest.raises(ConflictError, match="next lease is epoch 3, not 5"):
        await store.append(lease_stream(NODE), None, [too_far], actor=f"agent:{NODE}#5")
    assert not await first.renew(), "a newer lease exists: the first one is lost"


async def test_a_lease_renews_until_it_expires_and_then_never_again(store: EventStore) -> None:
    lease = NodeLease(store, NODE, boot_id="boot-1", ttl_s=60)
    await lease.acquire()
    assert await lease.renew()
    # time passes past the expiry (set by hand: no test waits on the machine's speed)
    await store.pool.execute(
        "UPDATE node_leases SET expires_at = clock_timestamp() - interval '1 second'"
    )
    assert not await lease.renew(), "an expired lease cannot be revived"
    assert await lease.acquire() == 2  # the agent takes the next one instead
    assert await lease.renew()


async def test_many_leases_renew_in_one_statement_and_lost_ones_stay_lost(
    store: EventStore,
) -> None:
    nodes = [f"node-{i}" for i in range(50)]
    held = {n: await NodeLease(store, n, boot_id="b", ttl_s=60).acquire() for n in nodes}
    await store.pool.execute(  # node-0's lease ran out; node-1 was fenced at its epoch
        "UPDATE node_leases SET expires_at = clock_timestamp() - interval '1 second' "
        "WHERE node = 'node-0'"
    )
    await put(store, c.NodeFenced(node="node-1", epoch=1, reason="test"), actor="operator:t")
    renewed = await store.renew_leases({**held, "node-2": 7, "node-never": 1})
    assert renewed == set(nodes) - {"node-0", "node-1", "node-2"}  # one statement for all
    assert await store.renew_leases({"node-0": 1}) == set(), "an expired lease is not revived"


async def test_a_stale_append_is_refused_once_and_the_refusal_logged_instead(
    store: EventStore,
) -> None:
    lease, share = await _with_share(store)
    old = lease.actor
    await lease.acquire()  # epoch 2: epoch 1 is stale now
    head = await store.head()
    applied = c.LimitApplied(share_id=share, node=NODE, level="hard", actual={})
    report = c.EnforcementReconciled(node=NODE)
    batches = [Batch(node_stream(NODE), None, [applied, report])]
    processed = Processed("agent-node-a", ["6b7f6f4e-0000-4000-8000-000000000001"])
    async with store.pool.acquire() as connection:
        with pytest.raises(StaleEpoch) as refused:
            await store.append_many(
                batches, Metadata(actor=old), connection=connection, processed=processed
            )
        marked = await connection.fetchval("SELECT count(*) FROM processed_messages")
    assert (refused.value.epoch, refused.value.current) == (1, 2)
    assert marked == 0, "a refused append marks no message handled: it is redelivered"
    assert await store.head() == head + 1  # the refusal, not the batch
    [record] = await _events(store, c.AppendRefused)
    assert record.actor == old and record.position == head + 1
    assert record.event.types == ["enforcement.limit_applied", "enforcement.reconciled"]
    assert not await _events(store, c.LimitApplied)
    await put(store, applied, actor=lease.actor)  # the current epoch writes as usual
    assert len(await _events(store, c.LimitApplied)) == 1


async def test_an_epoch_never_granted_is_refused_too(store: EventStore) -> None:
    await NodeLease(store, NODE, boot_id="b").acquire()
    report = c.EnforcementReconciled(node=NODE)
    with pytest.raises(StaleEpoch):
        await put(store, report, actor=f"agent:{NODE}#9")
    with pytest.raises(StaleEpoch):
        await put(store, report, actor="agent:node-never-leased#1")


async def test_an_idle_tick_reads_nothing_of_the_log_while_the_live_view_keeps_up(
    store: EventStore,
) -> None:
    """No class sets a not-started timeout (the usual case): a tick asks the live view for
    what this process heard of the log, which its tailer already folded, and reads no
    more. (It read the log's head on every tick, 4 times a second, each read holding the
    tailer's fold of the process's own commits for a round trip; issue 25.)"""
    live = LiveState(store)
    await put(store, c.NamespaceAccessSet(namespace="team-a", classes=["*"]))
    stop = asyncio.Event()
    tailing = asyncio.create_task(live.run(stop))
    try:
        await until(  # the tailer has read what is there and listens for the rest
            lambda: (
                store.committed_head() is not None
                and live._reads_done >= 1
                and live.state.position == store.known_head
            )
        )
        reads = live._reads_done
        service = ReclamationService(folded(store, live=live))
        for _ in range(5):
            assert await service.tick() == 0
        assert live._reads_done == reads and service.ticks == 5
    finally:
        stop.set()
        await tailing


async def test_two_replicas_record_an_expiry_once(store: EventStore, settings: Settings) -> None:
    lease, share = await _with_share(store, ttl_s=10)
    await age_leases(store.pool, NODE, 20)  # twice the ttl without a renewal
    async with (
        await EventStore.open(settings) as one,
        await EventStore.open(settings) as two,
    ):
        replicas = [
            ReclamationService(folded(one), name="reclamation-0"),
            ReclamationService(folded(two), name="reclamation-1"),
        ]
        done = await asyncio.gather(*(r.tick() for r in replicas))
        assert sorted(done) == [0, 1]
        assert sum(r.lost_races for r in replicas) <= 1
        assert await asyncio.gather(*(r.tick() for r in replicas)) == [0, 0]
    [expired] = await _events(store, c.NodeLeaseExpired)
    assert expired.event == c.NodeLeaseExpired(node=NODE, epoch=1)
    assert expired.actor.startswith("system:reclamation-")
    [unknown] = await _events(store, c.ShareMarkedUnknown)
    assert unknown.event.share_id == share and unknown.correlation_id
    with pytest.raises(StaleEpoch):  # the agent of the expired epoch may not write
        await put(store, c.EnforcementReconciled(node=NODE), actor=lease.actor)
    report = await verify(settings, from_start=True)
    assert report.ok, summary(report)


@pytest.mark.parametrize("exit_status", [0, 3])
async def test_the_fence_hook_fences_a_node_it_reports_off(
    store: EventStore, settings: Settings, tmp_path: Path, exit_status: int
) -> None:
    _, share = await _with_share(store, ttl_s=10)
    calls = tmp_path / "calls"
    hook = [
        sys.executable,
        "-c",
        "import os, sys; open(sys.argv[1], 'a').write(os.environ['DRACAP_NODE'] + ' '"
        " + os.environ['DRACAP_EPOCH'] + '\\n'); sys.exit(int(sys.argv[2]))",
        str(calls),
        str(exit_status),
    ]
    clock = FakeClock()
    service = ReclamationService(
        folded(store, clock=clock),
        fence_hook=hook,
        fence_after_s=30,
        fence_hook_timeout_s=20,
    )
    assert await service.tick() == 0  # held: nothing to do
    await age_leases(store.pool, NODE, 10)
    assert await service.tick() == 1  # the expiry; the hook is not due yet
    assert await service.tick() == 0 and not calls.exists()
    await age_leases(store.pool, NODE, 30)  # expired for longer than fence-after
    await service.tick()
    assert calls.read_text() == f"{NODE} 1\n"
    fences = await _events(store, c.NodeFenced)
    held = await store.pool.fetchval("SELECT count(*) FROM held_shares WHERE node = $1", NODE)
    if exit_status == 0:
        [fence] = fences
        assert fence.actor == "system:fence-hook" and fence.event.epoch == 1
        assert "fence hook reported the node off" in fence.event.reason
        assert held == 0
        assert await service.tick() == 0, "fenced once"
    else:
        assert fences == [] and held == 1, f"{share} keeps its capacity: the node is not off"
        await clock.advance(29)
        assert await service.tick() == 0  # not tried again before another fence-after
        assert calls.read_text().count("\n") == 1
        await clock.advance(1)
        assert await service.tick() == 0  # tried again: the node is still not off
        assert calls.read_text() == f"{NODE} 1\n" * 2
    report = await verify(settings, from_start=True)
    assert report.ok, summary(report)


async def test_dracap_reclaim_runs_on_its_own_and_refuses_bad_flags(
    store: EventStore, settings: Settings, tmp_path: Path
) -> None:
    lease, _ = await _with_share(store, ttl_s=0.2)
    env = {**os.environ, "DRACAP_APP_ROLE": settings.app_role}
    argv = [sys.executable, "-m", "services.cli", "reclaim", "--database-url",
            settings.database_url, "--poll", "0.05", "--name", "reclamation-7"]  # fmt: skip
    log = (tmp_path / "reclaim.log").open("wb")
    process = await asyncio.create_subprocess_exec(*argv, env=env, stdout=log, stderr=log)
    log.close()
    try:
        async with asyncio.timeout(30):
            while not await _events(store, c.NodeLeaseExpired):
                await store.wait_for_new(await store.head(), 0.2)
    finally:
        process.send_signal(signal.SIGTERM)
        code = await process.wait()
    [expired] = await _events(store, c.NodeLeaseExpired)
    assert expired.actor == "system:reclamation-7" and expired.event.epoch == lease.epoch
    assert code == 0, (tmp_path / "reclaim.log").read_text()

    for bad, says in (
        (["--poll", "0"], "--poll must be a positive number"),
        (["--fence-hook", '"unclosed'], "--fence-hook"),
    ):
        done = await asyncio.create_subprocess_exec(
            *argv[:6], *bad, env=env, stderr=asyncio.subprocess.PIPE
        )
        _, err = await done.communicate()
        assert done.returncode == 2 and says in err.decode() and err.decode().count("\n") == 1
