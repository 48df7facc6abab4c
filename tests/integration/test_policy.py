"""Sharing and request policies changing under live shares, through the real stack.

The whole stack runs in-process (:class:`services.up.Stack`) on the test's own database
and a unique subject prefix, with a one-GPU inventory (40Gi, min 5Gi, step 5Gi) loaded
through the admin API; claims go through the claims API and are watched until their
phase says what the test waits for (a condition, never a delay).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from events.subjects import BusNames
from services.claims.command import follow
from services.runtime.apiclient import ApiClient
from services.runtime.bus import connect_bus
from services.runtime.settings import Settings
from services.up import Stack, load_inventory, read_inventory

GPU_CLASS = "gpu.dracap.io"
NAMESPACE = "tenant-a"
POLICY = {"default": "5Gi", "validRange": {"min": "5Gi", "step": "5Gi", "max": "40Gi"}}


def _slice(*, shared: bool = True) -> dict[str, Any]:
    device: dict[str, Any] = {"name": "gpu-0", "capacity": {"memory": {"value": "40Gi"}}}
    if shared:
        device["allowMultipleAllocations"] = True
        device["capacity"]["memory"]["requestPolicy"] = POLICY
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpus"},
        "spec": {
            "driver": GPU_CLASS,
            "nodeName": "node-a",
            "pool": {"name": "node-a-gpus", "generation": 1, "resourceSliceCount": 1},
            "devices": [device],
        },
    }


INVENTORY = [
    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
    {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": GPU_CLASS},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{GPU_CLASS}"'}}]},
    },
    _slice(),
]


class Cluster(msgspec.Struct, kw_only=True):
    api: ApiClient
    flags: list[str]


@pytest.fixture
async def cluster(settings: Settings, nats_url: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:10]}")
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump_all(INVENTORY))
    inventory = read_inventory([str(path)])
    settings = msgspec.structs.replace(settings, nats_url=nats_url)
    async with (
        Stack.running(settings, names, nodes=inventory.nodes, workers=1),
        ApiClient.connect(nats_url, names.prefix) as api,
    ):
        await load_inventory(api, inventory)
        yield Cluster(api=api, flags=["--nats", nats_url, "--prefix", names.prefix])
    nc, js = await connect_bus(nats_url)
    try:
        await js.delete_stream(names.stream)
    finally:
        await nc.close()


def claim_doc(name: str, memory: str | None) -> bytes:
    exactly: dict[str, Any] = {"deviceClassName": GPU_CLASS}
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    doc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }
    return yaml.safe_dump(doc).encode()


async def view_when(
    api: ApiClient, name: str, check: Callable[[dict[str, Any]], bool], within: float = 30
) -> dict[str, Any]:
    """The claim's view once ``check`` holds for it; AssertionError with the last view."""
    last: dict[str, Any] = {}
    async with contextlib.aclosing(follow(api, NAMESPACE, name, within)) as views:
        async for view in views:
            last = view
            if check(view):
                return view
    raise AssertionError(f"claim {name} never got there: {json.dumps(last)}")


def _ready(view: dict[str, Any]) -> bool:
    return bool(view.get("ready"))


# --- (a) a device republished as dedicated while a share lives ----------------------------------


async def test_a_device_flipped_to_dedicated_is_given_exclusively_only_after_its_last_share(
    cluster: Cluster,
) -> None:
    api = cluster.api
    await api.claims(NAMESPACE, "apply", claim_doc("sharer", "10Gi"))
    sharer = await view_when(api, "sharer", _ready)
    [share] = sharer["shares"]
    assert share["share_id"] and share["device"] == "gpu-0"

    await api.admin("slices.apply", json.dumps(_slice(shared=False)).encode())
    await api.claims(NAMESPACE, "apply", claim_doc("whole", None))
    waiting = await view_when(api, "whole", lambda v: v["phase"] == "unschedulable")
    assert "still shared" in waiting["reason"], waiting
    await api.claims(NAMESPACE, "apply", claim_doc("beside", "10Gi"))  # would fit beside it
    waiting = await view_when(api, "beside", lambda v: v["phase"] == "unschedulable")
    assert "still shared" in waiting["reason"], waiting

    await api.claims(NAMESPACE, "delete", {"name": "sharer"})
    whole = await view_when(api, "whole", _ready)
    [result] = whole["allocation"]["devices"]["results"]
    assert result["device"] == "gpu-0" and "shareID" not in result
    # the round that gave "whole" the device planned "beside" too (first come, first served)
    beside = (await api.claims(NAMESPACE, "get", {"name": "beside"}))["claim"]
    assert beside["phase"] == "unschedulable" and not beside["shares"]
    assert (await view_when(api, "sharer", lambda v: v["phase"] == "released"))["shares"]
