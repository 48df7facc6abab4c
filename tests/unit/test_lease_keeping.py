"""A lease taken back is renewed while the agent reconciles, however long that takes."""

from __future__ import annotations

import asyncio

from services.enforcement.leasing import NodeLease
from services.enforcement.protocol import Leased
from services.runtime.ground.errors import RetryableError
from tests.fixtures.clock import FakeClock


class Plane:
    """The enforcement service's lease answers: epochs in turn, heartbeats counted."""

    def __init__(self) -> None:
        self.next_epoch = 1
        self.beats: list[int] = []

    async def lease(self, boot_id: str, ttl_s: float, enforcement: str) -> Leased:
        epoch, self.next_epoch = self.next_epoch, self.next_epoch + 1
        return Leased(epoch=epoch)

    async def heartbeat(self, epoch: int, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        self.beats.append(epoch)
        return True


def test_the_new_lease_is_renewed_while_the_reconcile_after_a_loss_runs() -> None:
    clock = FakeClock()
    plane = Plane()
    lease = NodeLease(plane, "node-a", boot_id="b", ttl_s=3.0, clock=clock)  # type: ignore[arg-type]
    reconciling = asyncio.Event()
    reconciled = asyncio.Event()

    async def take_back() -> None:
        await lease.acquire()  # epoch 2
        reconciling.set()
        await clock.sleep(12.0)  # a reconcile four ttls long (a report in flight, say)
        reconciled.set()

    async def run() -> None:
        await lease.acquire()  # epoch 1, then lost
        losing = asyncio.ensure_future(lease.lost(take_back))
        await reconciling.wait()
        assert plane.beats == [] and not lease.held.is_set()
        await clock.advance(12.0, steps=12)
        await losing

    asyncio.run(run())
    assert reconciled.is_set() and lease.held.is_set() and lease.epoch == 2
    # renewed at every third of the ttl meanwhile (the reconcile ends at the twelfth)
    assert plane.beats == [2] * 11, plane.beats


def test_a_failed_take_back_is_tried_again_and_the_loop_ends_held() -> None:
    plane = Plane()
    lease = NodeLease(plane, "node-a", boot_id="b", ttl_s=0.3)  # type: ignore[arg-type]
    tries: list[int] = []

    async def take_back() -> None:
        tries.append(await lease.acquire())
        if len(tries) == 1:
            raise RuntimeError("the service is away")

    asyncio.run(lease.lost(take_back))
    assert tries == [1, 2] and lease.held.is_set()


def test_a_whole_ttl_without_an_answer_loses_the_lease() -> None:
    clock = FakeClock()

    class Away(Plane):
        async def heartbeat(self, epoch: int, timeout: float | None = None) -> bool:  # noqa: ASYNC109
            self.beats.append(epoch)
            raise RetryableError("no answer from the enforcement service")

    plane = Away()
    lease = NodeLease(plane, "node-a", boot_id="b", ttl_s=3.0, clock=clock)  # type: ignore[arg-type]
    lost: list[int | None] = []
    stop = asyncio.Event()

    async def take_back() -> None:
        lost.append(lease.epoch)
        stop.set()

    async def run() -> None:
        await lease.acquire()
        keeping = asyncio.ensure_future(lease.keep(stop, take_back))
        await clock.advance(3.0, steps=3)  # three beats unanswered, a whole ttl: held still
        assert plane.beats == [1, 1, 1] and lost == []
        await clock.advance(1.0)  # the fourth, past the ttl: lost
        await keeping

    asyncio.run(run())
    assert lost == [1] and lease.held.is_set()
