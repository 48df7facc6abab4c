"""Per-DeviceClass modes, minimum enforcement and class removal through the real stack.

A class switched to ``whole-device`` and back: the existing share is untouched, new
claims follow the mode in force (a capacity request refused while whole-device, a claim
without one given a device of its own, a share again once consumable). ``disabled`` and
a removed class refuse new claims; allocated claims keep running. Two 40Gi GPUs (min 5Gi,
step 5Gi, max 40Gi), loaded through the admin API; the mode is set with ``dracap class``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.exitcodes import ExitCode
from services.runtime.bus.apiclient import ApiClient, ApiError
from services.runtime.ground.settings import Settings
from tests.integration.cluster import Cluster, namespace_and_class, running_cluster
from tests.integration.test_policy import NAMESPACE, POLICY, _ready, claim_doc, dracap, view_when

GPU_CLASS = "gpu.dracap.io"
FIELD = "spec.devices.requests[0].exactly"


def _gpu(name: str) -> dict[str, Any]:
    memory = {"value": "40Gi", "requestPolicy": POLICY}
    return {"name": name, "allowMultipleAllocations": True, "capacity": {"memory": memory}}


INVENTORY = [
    *namespace_and_class(NAMESPACE, GPU_CLASS),
    {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpus"},
        "spec": {
            "driver": GPU_CLASS,
            "nodeName": "node-a",
            "pool": {"name": "node-a-gpus", "generation": 1, "resourceSliceCount": 1},
            "devices": [_gpu("gpu-0"), _gpu("gpu-1")],
        },
    },
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


async def _refused(api: ApiClient, name: str, memory: str | None) -> ApiError:
    with pytest.raises(ApiError) as refused:
        await api.claims(NAMESPACE, "apply", claim_doc(name, memory))
    claim = (await api.claims(NAMESPACE, "get", {"name": name}))["claim"]
    assert claim["phase"] == "rejected", claim  # recorded: the tenant can read why
    return refused.value


async def test_a_class_switched_to_whole_device_and_back_leaves_shares_and_decides_new_claims(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    api, flags = cluster.api, cluster.flags
    await api.claims(NAMESPACE, "apply", claim_doc("sharer", "10Gi"))
    [share] = (await view_when(api, "sharer", _ready))["shares"]
    assert share["consumed"] == {"memory": "10Gi"}

    code, out, err = await dracap(capsys, "class", "set-mode", GPU_CLASS, "whole-device", *flags)
    assert code == ExitCode.OK and "whole-device" in out, err
    refused = await _refused(api, "asks-capacity", "10Gi")
    assert (refused.code, refused.field) == ("rejected", f"{FIELD}.capacity.requests")
    assert "DRAConsumableCapacity" in str(refused)
    await api.claims(NAMESPACE, "apply", claim_doc("whole", None))
    [whole] = (await view_when(api, "whole", _ready))["shares"]
    assert whole["device"] != share["device"]  # the sharer's device is not free whole
    assert whole["consumed"] == {"memory": "40Gi"}  # nothing fits beside it
    [still] = (await api.claims(NAMESPACE, "get", {"name": "sharer"}))["claim"]["shares"]
    assert still == share  # the existing share is untouched

    code, out, err = await dracap(capsys, "class", "set-mode", GPU_CLASS, "consumable", *flags)
    assert code == ExitCode.OK, err
    await api.claims(NAMESPACE, "apply", claim_doc("after", "10Gi"))
    [after] = (await view_when(api, "after", _ready))["shares"]
    assert after["device"] == share["device"] and after["consumed"] == {"memory": "10Gi"}
    assert after["share_id"] != share["share_id"]
    code, out, _ = await dracap(capsys, "class", "set-mode", GPU_CLASS, "consumable", *flags)
    assert code == ExitCode.OK and "unchanged" in out


async def test_a_disabled_or_removed_class_refuses_new_claims_and_keeps_allocated_ones(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    api, flags = cluster.api, cluster.flags
    await api.claims(NAMESPACE, "apply", claim_doc("running", "10Gi"))
    [share] = (await view_when(api, "running", _ready))["shares"]

    code, _, err = await dracap(capsys, "class", "set-mode", GPU_CLASS, "disabled", *flags)
    assert code == ExitCode.OK, err
    refused = await _refused(api, "while-disabled", "5Gi")
    assert (refused.code, refused.field) == ("rejected", f"{FIELD}.deviceClassName")
    assert "disabled" in str(refused)

    code, _, err = await dracap(capsys, "class", "set-mode", GPU_CLASS, "shared", *flags)
    assert code == ExitCode.BAD_INPUT and "MODE" in err
    code, _, err = await dracap(capsys, "class", "set-mode", "nope.dracap.io", "disabled", *flags)
    assert code == ExitCode.NOT_FOUND and "does not exist" in err

    code, out, err = await dracap(capsys, "class", "remove", GPU_CLASS, "-o", "json", *flags)
    assert code == ExitCode.OK and json.loads(out) == {"applied": [GPU_CLASS]}, err
    refused = await _refused(api, "after-removal", "5Gi")
    assert (refused.code, refused.field) == ("rejected", f"{FIELD}.deviceClassName")
    assert "does not exist" in str(refused)
    running = (await api.claims(NAMESPACE, "get", {"name": "running"}))["claim"]
    assert running["ready"] and running["shares"] == [share]
    code, _, err = await dracap(capsys, "class", "remove", GPU_CLASS, *flags)
    assert code == ExitCode.NOT_FOUND, err


def _unschedulable(view: dict[str, Any]) -> bool:
    return view.get("phase") == "unschedulable"


async def test_a_class_that_requires_hard_enforcement_places_nothing_on_a_none_node(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """The stack's agents enforce nothing (level none): a class that requires ``hard``
    places no new share, existing ones stay, and lowering the minimum serves the claim."""
    api, flags = cluster.api, cluster.flags
    await api.claims(NAMESPACE, "apply", claim_doc("before", "10Gi"))
    [share] = (await view_when(api, "before", _ready))["shares"]

    argv = ["class", "set-mode", GPU_CLASS, "consumable", "--min-enforcement", "hard"]
    code, out, err = await dracap(capsys, *argv, "-o", "json", *flags)
    assert code == ExitCode.OK, err
    assert json.loads(out)["min_enforcement"] == "hard"
    code, out, err = await dracap(capsys, "class", "list", "-o", "json", *flags)
    assert code == ExitCode.OK, err
    [listed] = json.loads(out)
    assert (listed["name"], listed["mode"], listed["min_enforcement"]) == (
        GPU_CLASS,
        "consumable",
        "hard",
    )

    await api.claims(NAMESPACE, "apply", claim_doc("strict", "5Gi"))
    waiting = await view_when(api, "strict", _unschedulable)
    assert "node node-a enforces none, class gpu.dracap.io needs hard" in waiting["reason"]
    still = (await api.claims(NAMESPACE, "get", {"name": "before"}))["claim"]
    assert still["ready"] and still["shares"] == [share]

    # the mode is kept when only the minimum changes back; the waiting claim is served
    code, _, err = await dracap(capsys, "class", "set-mode", GPU_CLASS, "consumable",
                                "--min-enforcement", "none", *flags)  # fmt: skip
    assert code == ExitCode.OK, err
    await view_when(api, "strict", _ready)  # the change woke the reservation service
    await api.claims(NAMESPACE, "apply", claim_doc("relaxed", "5Gi"))
    await view_when(api, "relaxed", _ready)
    code, _, err = await dracap(capsys, "class", "set-mode", GPU_CLASS, "consumable",
                                "--min-enforcement", "firm", *flags)  # fmt: skip
    assert code == ExitCode.BAD_INPUT and "--min-enforcement" in err
