"""A realistic sequence of appends that touches every projection path."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from events import catalog
from events.catalog import Event
from events.envelopes import Envelope, stream_of
from services.runtime.store.eventstore import EventStore
from tests.integration import sample as s

Step = Callable[[], Awaitable[list[Envelope]]]


async def put(store: EventStore, *events: Event, actor: str = "test") -> list[Envelope]:
    """Append each event to its natural stream, whatever the stream's version."""
    out: list[Envelope] = []
    for event in events:
        out += await store.append(stream_of(event), None, [event], actor=actor)
    return out


async def lease(store: EventStore, node: str, *, ttl_ms: int = 600_000) -> str:
    """Take the next lease of ``node`` through ``store``; the agent's actor under it."""
    current = await store.pool.fetchval(
        "SELECT greatest(coalesce((SELECT epoch FROM node_leases WHERE node = $1), 0),"
        " coalesce((SELECT epoch FROM node_epochs WHERE node = $1), 0))",
        node,
    )
    epoch = int(current or 0) + 1
    actor = f"agent:{node}#{epoch}"
    event = catalog.NodeLeaseAcquired(node=node, epoch=epoch, boot_id="test-boot", ttl_ms=ttl_ms)
    await store.append(stream_of(event), None, [event], actor=actor)
    return actor


def _lifecycle(
    ns: str,
    name: str,
    device: str,
    amount: str,
    *,
    node: str = "node-a",
    shared: bool = True,
    admin: bool = False,
) -> tuple[Event, ...]:
    r = s.reserved(ns, name, device, amount, shared=shared, admin=admin, pool=node)
    return (
        s.claim_submitted(ns, name),
        catalog.ClaimAdmitted(namespace=ns, name=name),
        r,
        s.bound(r),
        catalog.LimitApplied(share_id=r.share_id, node=node, level="hard", actual=dict(r.consumed)),
    )


async def run(
    store: EventStore, on_step: Callable[[list[Envelope]], Awaitable[None]], unit: str = "Gi"
) -> None:
    """Append the scenario; ``on_step`` sees the envelopes of every append.

    ``unit`` scales every amount (``"Mi"`` keeps nanos below 2**64).
    """

    async def step(*events: Event) -> list[Envelope]:
        envs = await put(store, *events)
        await on_step(envs)
        return envs

    await step(
        s.slice_published("a-gpus", {"gpu-0": {"memory": f"80{unit}"}}, shared=True),
        s.slice_published(
            "a-dedicated", {"gpu-1": {"memory": f"40{unit}"}}, shared=False, pool="node-a-ded"
        ),
        s.slice_published("b-gpus", {"gpu-0": {"memory": f"80{unit}"}}, pool="node-b"),
    )
    c1 = _lifecycle("team-a", "c1", "gpu-0", f"10{unit}")
    await step(*c1)
    c2 = _lifecycle("team-b", "c2", "gpu-0", f"30{unit}")
    await step(*c2[:4])  # bound, not yet ready
    await step(*_lifecycle("team-a", "admin", "gpu-0", f"80{unit}", admin=True))
    r3 = s.reserved("team-c", "c3", "gpu-1", f"40{unit}", shared=False, pool="node-a-ded")
    await step(s.claim_submitted("team-c", "c3"), r3, s.bound(r3))
    await step(
        catalog.ClaimRejected(
            namespace="team-d", name="bad", field="spec", rule="required", reason="empty"
        ),
        catalog.ClaimUnschedulable(namespace="team-e", name="wait", reason="full"),
    )
    r1 = c1[2]
    assert isinstance(r1, catalog.CapacityReserved)
    await step(
        catalog.ReleaseRequested(namespace="team-a", name="c1", allocation_version=1),
        s.released(r1),
        s.released(r1),
    )  # the duplicate release subtracts nothing
    await step(
        catalog.ReleaseRequested(namespace="team-c", name="c3", allocation_version=1),
        s.released(r3),
    )
    b = _lifecycle("team-f", "on-b", "gpu-0", f"20{unit}", node="node-b")
    await step(*b)
    await step(catalog.NodeLeaseExpired(node="node-b", epoch=1))
    await step(catalog.NodeFenced(node="node-b", epoch=1))
    rb = s.reserved("team-g", "c7", "gpu-0", f"5{unit}")
    await step(
        *_lifecycle("team-g", "c7", "gpu-0", f"5{unit}")[:2],
        rb,
        s.bound(rb),
        catalog.ShareMarkedUnknown(share_id=rb.share_id, node="node-a"),
        catalog.ShareConfirmed(share_id=rb.share_id, node="node-a"),
        catalog.LimitFailed(
            share_id=rb.share_id, node="node-a", retryable=False, reason="mps daemon down"
        ),
    )
    await step(  # a fence older than the lease it follows is stale: nothing is released
        catalog.NodeLeaseExpired(node="node-a", epoch=3),
        catalog.NodeFenced(node="node-a", epoch=2),
    )
