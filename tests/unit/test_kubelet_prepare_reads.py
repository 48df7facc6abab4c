"""A prepare reads the API server's claim and the log's view at the same time.

The driver is the real :class:`~services.enforcement.kubelet.KubeletDriver` on a real
:class:`~services.enforcement.agent.Agent`; the two ends it reads are stand-ins that
record when they are asked: the API server's claim (:class:`Claims`) and the
enforcement service's view (:class:`Plane`). Each read waits until the other one has
been asked, so a prepare that reads them one after the other never gets an answer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from events.model import ResourceClaim, convert
from events.subjects import BusNames
from services.enforcement.agent import Agent
from services.enforcement.cdi import CdiSpecs
from services.enforcement.enforcers import NoneEnforcer
from services.enforcement.kubelet import KubeletDriver
from services.enforcement.protocol import Report, Reported, ViewAsk, Viewed
from services.enforcement.views import NodeView
from services.runtime.ground.clock import SYSTEM, Clock
from services.runtime.kube.errors import NotFound
from services.runtime.kubeletplugin import ClaimRef
from tests.fixtures.clock import FakeClock
from tests.fixtures.contexts import NO_NATS, handed

NODE = "node-a"
DRIVER = "net.dracap.io"
REF = ClaimRef(namespace="team-a", name="web", uid="uid-1")
#: how long one read waits for the other before it gives up (fails the test)
MEETING_S = 2.0


def _claim(uid: str = "uid-1") -> ResourceClaim:
    return convert(
        {
            "metadata": {"name": "web", "namespace": "team-a", "uid": uid},
            "spec": {"devices": {"requests": []}},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {"request": "r", "driver": DRIVER, "pool": "p", "device": "nic"}
                        ]
                    }
                }
            },
        },
        ResourceClaim,
    )


class Plane:
    """The enforcement service: an empty log, views counted."""

    def __init__(self) -> None:
        self.viewing = asyncio.Event()
        self.meet: asyncio.Event | None = None  #: set: the view waits for it
        self.views = 0

    async def view(self, ask: ViewAsk) -> tuple[NodeView, Viewed]:
        self.views += 1
        self.viewing.set()
        if self.meet is not None:
            await asyncio.wait_for(self.meet.wait(), MEETING_S)
        view = NodeView(node=NODE, position=0)
        return view, Viewed(view=msgspec.Raw(b"{}"))

    async def report(self, report: Report) -> Reported:
        raise AssertionError("nothing is reported in these tests")

    async def consumer(self) -> bool:
        return True


class Claims:
    """The API server: answers after the view was asked (or with ``error``)."""

    def __init__(self, plane: Plane, *, error: Exception | None = None) -> None:
        self.plane = plane
        self.asked = asyncio.Event()
        self.error = error

    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        self.asked.set()
        if self.error is not None:
            raise self.error
        await asyncio.wait_for(self.plane.viewing.wait(), MEETING_S)
        return _claim()


def _driver(
    plane: Plane, claims: Claims, tmp_path: Path, mirror_wait_s: float, clock: Clock = SYSTEM
) -> KubeletDriver:
    context = handed(None, BusNames("t"), NO_NATS)
    agent = Agent(context, node=NODE, enforcer=NoneEnforcer(), plane=plane)  # type: ignore[arg-type]
    agent.lease.epoch = 1
    agent.lease.held.set()
    return KubeletDriver(
        agent,
        claims,
        drivers=[DRIVER],
        cdi_dir=CdiSpecs(tmp_path),
        mirror_wait_s=mirror_wait_s,
        clock=clock,
    )


async def test_the_claim_and_the_view_are_read_concurrently(tmp_path: Path) -> None:
    plane = Plane()
    claims = Claims(plane)
    plane.meet = claims.asked  # the view answers only once the claim was asked for
    driver = _driver(plane, claims, tmp_path, mirror_wait_s=0.0)
    answer = await driver.prepare([REF])
    # both reads met (each waited for the other; one after the other, the first read
    # would have given up and the answer would be its TimeoutError)
    assert plane.views == 1
    error = answer[REF.uid].error
    assert error is not None and "not mirrored yet" in error  # the empty log's verdict


async def test_a_refusal_of_the_api_server_drops_the_wait_for_the_mirror(
    tmp_path: Path,
) -> None:
    plane = Plane()
    claims = Claims(plane, error=NotFound("resourceclaims team-a/web not found", status=404))
    clock = FakeClock()  # moved by nobody: the 20 s wait for the mirror never runs out
    driver = _driver(plane, claims, tmp_path, mirror_wait_s=20.0, clock=clock)
    answer = await asyncio.wait_for(driver.prepare([REF]), 60)  # a hang fails, not a hold-up
    assert answer[REF.uid].error == "ResourceClaim team-a/web not found"
    assert clock.waiting == 0
    # the view's wait was cancelled with the call: no task of it is left behind
    leftover = [
        t
        for t in asyncio.all_tasks()
        if t is not asyncio.current_task() and "_verdict" in repr(t.get_coro())
    ]
    assert leftover == []
