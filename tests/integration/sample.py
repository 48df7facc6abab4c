"""Small builders of catalog events for the integration tests."""

from __future__ import annotations

import uuid

from events import catalog, model
from events.quantities import Quantity

DRIVER = "gpu.example.com"
POOL = "node-a"


def q(text: str) -> Quantity:
    return Quantity.parse(text)


def slice_published(
    name: str = "node-a-gpus",
    devices: dict[str, dict[str, str]] | None = None,
    shared: bool = True,
    pool: str = POOL,
) -> catalog.ResourceSlicePublished:
    devices = devices if devices is not None else {"gpu-0": {"memory": "80Gi"}}
    spec = {
        "driver": DRIVER,
        "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
        "nodeName": pool,
        "devices": [
            {
                "name": dev,
                "allowMultipleAllocations": shared,
                "capacity": {cap: {"value": value} for cap, value in caps.items()},
            }
            for dev, caps in devices.items()
        ],
    }
    rs = model.convert({"metadata": {"name": name}, "spec": spec}, model.ResourceSlice)
    return catalog.ResourceSlicePublished(slice=rs)


def claim_submitted(namespace: str = "team-a", name: str = "c1") -> catalog.ClaimSubmitted:
    claim = model.convert(
        {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": "gpu.example.com",
                                "capacity": {"requests": {"memory": "10Gi"}},
                            },
                        }
                    ]
                }
            },
        },
        model.ResourceClaim,
    )
    return catalog.ClaimSubmitted(claim=claim)


def reserved(
    namespace: str = "team-a",
    name: str = "c1",
    device: str = "gpu-0",
    consumed: str = "10Gi",
    *,
    shared: bool = True,
    admin: bool = False,
    share_id: str | None = None,
    allocation_version: int = 1,
    pool: str = POOL,
) -> catalog.CapacityReserved:
    return catalog.CapacityReserved(
        namespace=namespace,
        name=name,
        allocation_version=allocation_version,
        request="gpu",
        driver=DRIVER,
        pool=pool,
        device=device,
        node=pool,
        share_id=share_id or str(uuid.uuid4()),
        shared=shared,
        admin_access=admin,
        consumed={"memory": q(consumed)},
        policy_version=1,
    )


def released(r: catalog.CapacityReserved) -> catalog.CapacityReleased:
    return catalog.CapacityReleased(
        share_id=r.share_id,
        driver=r.driver,
        pool=r.pool,
        device=r.device,
        allocation_version=r.allocation_version,
        consumed=dict(r.consumed),
        admin_access=r.admin_access,
    )


def bound(r: catalog.CapacityReserved) -> catalog.AllocationBound:
    result = model.DeviceRequestAllocationResult(
        request=r.request,
        driver=r.driver,
        pool=r.pool,
        device=r.device,
        share_id=r.share_id if r.shared else None,
        consumed_capacity=dict(r.consumed),
    )
    allocation = model.AllocationResult(devices=model.DeviceAllocationResult(results=[result]))
    return catalog.AllocationBound(
        namespace=r.namespace,
        name=r.name,
        allocation_version=r.allocation_version,
        node=r.node,
        allocation=allocation,
        share_ids=[r.share_id],
    )
