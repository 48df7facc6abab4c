"""``dracap plan --live`` against a running stack: the capacity math of the live inventory.

The stack runs in-process (:func:`tests.integration.cluster.running_cluster`) with two
nodes: node-a with two 40Gi GPUs, node-b with one 40Gi GPU and a device that publishes
no ``memory`` (left out of the plan). The CLI runs in a thread against the stack's
subjects (``--nats URL --prefix P``). The figures must follow the inventory and the
shares as they change: a claim allocated shows as in use, a slice applied on a third
node adds its device, its node and its capacity, and moves the failure headroom to the
node that now has the most.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.exitcodes import ExitCode
from services.runtime.ground.settings import Settings
from tests.integration.cluster import Cluster, namespace_and_class, node_slice, running_cluster
from tests.integration.test_policy import NAMESPACE, _ready, claim_doc, dracap, view_when

GPU_CLASS = "gpu.dracap.io"
GI = 1024**3


def _gpu(name: str, memory: str = "40Gi") -> dict[str, Any]:
    return {
        "name": name,
        "allowMultipleAllocations": True,
        "capacity": {"memory": {"value": memory}},
    }


def _slice(node: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
    return node_slice(node, GPU_CLASS, devices)


NIC = {"name": "nic-0", "capacity": {"bandwidth": {"value": "100G"}}}  # no memory
INVENTORY = [
    *namespace_and_class(NAMESPACE, GPU_CLASS),
    _slice("node-a", [_gpu("gpu-0"), _gpu("gpu-1")]),
    _slice("node-b", [_gpu("gpu-0"), NIC]),
]
PLAN = [
    "plan",
    "--live",
    "--target-utilization",
    "0.5",
    "--overhead",
    "1Gi",
    "--headroom-nodes",
    "1",
]


@pytest.fixture
async def cluster(settings: Settings, nats_url: str, tmp_path: Path) -> AsyncIterator[Cluster]:
    async with running_cluster(settings, nats_url, tmp_path, INVENTORY) as running:
        yield running


async def _plan(capsys: pytest.CaptureFixture[str], cluster: Cluster) -> dict[str, Any]:
    code, out, err = await dracap(capsys, *PLAN, "-o", "json", *cluster.flags)
    assert code == ExitCode.OK, err
    plan: dict[str, Any] = json.loads(out)
    return plan


def _steps(plan: dict[str, Any]) -> list[tuple[str, str, int, int]]:
    return [(s["step"], s["detail"], s["deduction"], s["remaining"]) for s in plan["steps"]]


async def test_plan_live_follows_the_inventory_and_the_shares(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    # three GPUs of 40Gi on two nodes (the NIC has no memory): 120Gi raw, 60Gi at 50 %,
    # 3Gi of overhead, and node-a (2 x 19Gi left) is the node whose loss costs the most
    plan = await _plan(capsys, cluster)
    assert (plan["devices"], plan["nodes"], plan["in_use"]) == (3, 2, 0)
    assert _steps(plan) == [
        ("raw", "3 devices", 0, 120 * GI),
        ("at the target utilization 50%", "raw x 0.5", 60 * GI, 60 * GI),
        ("driver overhead", "1Gi x 3 devices", 3 * GI, 57 * GI),
        ("failure headroom: 1 nodes", "2 devices of node-a", 38 * GI, 19 * GI),
    ]
    assert plan["schedulable"] == 19 * GI

    # a share of 10Gi is in use; the capacity figures do not move
    api = cluster.api
    await api.claims(NAMESPACE, "apply", claim_doc("trainer", "10Gi"))
    await view_when(api, "trainer", _ready)
    plan = await _plan(capsys, cluster)
    assert plan["in_use"] == 10 * GI
    assert plan["schedulable"] == 19 * GI

    # an 80Gi GPU on a third node: 200Gi raw, and node-c (39Gi left) is now the headroom
    slice_c = _slice("node-c", [_gpu("gpu-0", "80Gi")])
    await api.admin("slices.apply", json.dumps(slice_c).encode())
    plan = await _plan(capsys, cluster)
    assert (plan["devices"], plan["nodes"], plan["in_use"]) == (4, 3, 10 * GI)
    assert _steps(plan) == [
        ("raw", "4 devices", 0, 200 * GI),
        ("at the target utilization 50%", "raw x 0.5", 100 * GI, 100 * GI),
        ("driver overhead", "1Gi x 4 devices", 4 * GI, 96 * GI),
        ("failure headroom: 1 nodes", "1 devices of node-c", 39 * GI, 57 * GI),
    ]

    # the table says the same, with what is in use now
    code, out, err = await dracap(capsys, *PLAN, *cluster.flags)
    assert code == ExitCode.OK, err
    assert "schedulable: 57Gi (4 devices on 3 nodes)" in out
    assert "in use now: 10Gi" in out


async def test_plan_live_for_a_capacity_no_device_publishes_is_not_found(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await dracap(capsys, *PLAN, "--capacity-name", "cores", *cluster.flags)
    assert code == ExitCode.NOT_FOUND and not out
    assert "no device publishes the capacity 'cores'" in err
    code, _, err = await dracap(capsys, *PLAN, "--capacity-name", "bandwidth", *cluster.flags)
    assert code == ExitCode.OK, err  # the NIC alone
