"""Sharing and request policies changing under live shares, through the real stack.

The whole stack runs in-process (:class:`services.stack.Stack`) on the test's own database
and a unique subject prefix, with a one-GPU inventory (40Gi, min 5Gi, step 5Gi) loaded
through the admin API; claims go through the claims API and are watched until their
phase says what the test waits for (a condition, never a delay).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from services import cli
from services.commands.claim import follow
from services.exitcodes import ExitCode
from services.runtime.bus.apiclient import ApiClient, ApiError
from services.runtime.ground.settings import Settings
from tests.integration.cluster import Cluster, namespace_and_class, running_cluster

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
    *namespace_and_class(NAMESPACE, GPU_CLASS),
    _slice(),
]


@pytest.fixture
async def cluster(
    settings: Settings, nats_url: str, tmp_path: Path, postgres_admin_url: str
) -> AsyncIterator[Cluster]:
    """Every service on its own database login, as under ``dracap up`` (migration 0011)."""
    async with running_cluster(
        settings, nats_url, tmp_path, INVENTORY, admin_url=postgres_admin_url
    ) as running:
        yield running


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


# --- (b) a request policy changed as an operation ---------------------------------------------


async def dracap(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``dracap ARGV`` (in a thread: the CLI runs its own event loop)."""
    capsys.readouterr()
    code = await asyncio.to_thread(cli.main, list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def test_a_policy_change_keeps_old_shares_and_rounds_new_claims_up_to_the_new_min(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    api = cluster.api
    await api.claims(NAMESPACE, "apply", claim_doc("before", "5Gi"))
    [old] = (await view_when(api, "before", _ready))["shares"]
    assert old["consumed"] == {"memory": "5Gi"}

    where = ["--driver", GPU_CLASS, "--pool", "node-a-gpus", "--device", "gpu-0"]
    setting = ["policy", "set", *where, "--capacity", "memory", "--min", "10Gi", "--step", "5Gi"]
    code, out, err = await dracap(capsys, *setting, "--max", "40Gi", *cluster.flags)
    assert code == 0, err
    assert "set (v2)" in out

    await api.claims(NAMESPACE, "apply", claim_doc("after", "5Gi"))
    [new] = (await view_when(api, "after", _ready))["shares"]
    assert new["consumed"] == {"memory": "10Gi"}  # rounded up to the new min, as upstream
    [still] = (await api.claims(NAMESPACE, "get", {"name": "before"}))["claim"]["shares"]
    assert still["consumed"] == {"memory": "5Gi"}

    code, out, err = await dracap(capsys, "devices", "--policies", "-o", "json", *cluster.flags)
    assert code == 0, err
    [device] = json.loads(out)
    assert device["policy_version"] == 2
    assert device["policies"] == [
        {"capacity": "memory", "version": 2, "policy": "default 10Gi, min 10Gi, step 5Gi, max 40Gi"}
    ]
    shares = {s["claim"]: s for s in device["shares"]}
    assert shares[f"{NAMESPACE}/before"]["policy_version"] == 1
    assert shares[f"{NAMESPACE}/before"]["consumed"] == {"memory": "5Gi"}
    assert shares[f"{NAMESPACE}/before"]["policies"] == {
        "memory": "default 5Gi, min 5Gi, step 5Gi, max 40Gi"
    }
    assert shares[f"{NAMESPACE}/after"]["policy_version"] == 2
    assert shares[f"{NAMESPACE}/after"]["consumed"] == {"memory": "10Gi"}
    code, out, _ = await dracap(capsys, "devices", "--policies", *cluster.flags)
    assert code == 0 and "v2 now" in out and old["share_id"] in out and "v1" in out


async def test_policy_set_changes_only_the_fields_given_and_prints_the_result(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    # in force: default 5Gi, validRange min 5Gi, step 5Gi, max 40Gi (deploy/examples)
    where = ["--driver", GPU_CLASS, "--device", "node-a-gpus/gpu-0", "--capacity", "memory"]
    code, out, err = await dracap(capsys, "policy", "set", *where, "--min", "10Gi", *cluster.flags)
    assert code == 0, err
    assert out.strip().endswith("set (v2): default 10Gi, min 10Gi, step 5Gi, max 40Gi"), out
    code, out, err = await dracap(
        capsys, "policy", "set", *where, "--max", "20Gi", "-o", "json", *cluster.flags
    )
    assert code == 0, err
    reply = json.loads(out)
    assert reply["policy_version"] == 3
    assert reply["request_policy"] == {
        "default": "10Gi",
        "validRange": {"min": "10Gi", "max": "20Gi", "step": "5Gi"},
    }
    code, out, err = await dracap(
        capsys, "policy", "set", *where, "--replace", "--min", "10Gi", *cluster.flags
    )
    assert code == 0, err
    assert out.strip().endswith("set (v4): default 10Gi, min 10Gi"), out


async def test_a_policy_set_for_an_unknown_capacity_or_breaking_a_rule_is_refused(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    change = {"driver": GPU_CLASS, "pool": "node-a-gpus", "device": "gpu-0", "capacity": "cores"}
    with pytest.raises(ApiError) as unknown:
        await cluster.api.admin("policies.set", {**change, "policy": None})
    assert (unknown.value.code, unknown.value.field) == ("not_found", "capacity")
    bad = {"default": "5Gi", "validRange": {"min": "50Gi"}}
    with pytest.raises(ApiError) as invalid:
        await cluster.api.admin("policies.set", {**change, "capacity": "memory", "policy": bad})
    assert (invalid.value.code, invalid.value.field) == ("invalid", "policy.validRange.min")
    where = ["--driver", GPU_CLASS, "--pool", "node-a-gpus", "--device", "gpu-9"]
    code, _, err = await dracap(
        capsys, "policy", "set", *where, "--capacity", "memory", "--min", "10Gi", *cluster.flags
    )
    assert code == ExitCode.NOT_FOUND and "device" in err
