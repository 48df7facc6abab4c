"""A lease taken back is renewed while the agent reconciles, however long that takes."""

from __future__ import annotations

import asyncio

from services.enforcement.leasing import NodeLease
from services.enforcement.protocol import Leased


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
    plane = Plane()
    lease = NodeLease(plane, "node-a", boot_id="b", ttl_s=0.3)  # type: ignore[arg-type]
    reconciled = asyncio.Event()

    async def take_back() -> None:
        await lease.acquire()  # epoch 2
        await asyncio.sleep(1.2)  # a reconcile four ttls long (a report in flight, say)
        reconciled.set()

    async def run() -> None:
        await lease.acquire()  # epoch 1, then lost
        await lease.lost(take_back)

    asyncio.run(run())
    assert reconciled.is_set() and lease.held.is_set() and lease.epoch == 2
    # renewed at every third of the ttl meanwhile: never a whole ttl without one
    assert plane.beats.count(2) >= 3, plane.beats


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
