"""Claims that are Ready but never used: released once, or marked stalled (issue 13, item 7).

The in-process stack (its agents enforce nothing, so only a reservation counts as use)
on one 40Gi GPU, with two DeviceClasses selecting it: ``release.dracap.io`` releases a
claim unused for 1 s, ``stall.dracap.io`` marks it stalled. A second reclamation
replica runs beside the stack's own, so "exactly once" is checked against a race.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from events import catalog as c
from events.envelopes import claim_stream
from services.exitcodes import ExitCode
from services.reclamation.service import ReclamationService
from services.replay.verify import summary, verify
from services.runtime.ground.settings import ServiceKind, Settings
from tests.fixtures.contexts import folded
from tests.integration.cluster import Cluster, running_cluster
from tests.integration.test_policy import NAMESPACE, dracap, view_when

DRIVER = "gpu.dracap.io"


def _class(name: str, action: str) -> dict[str, Any]:
    annotations = {"dracap.io/not-started-timeout": "1s", "dracap.io/not-started-action": action}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }


INVENTORY = [
    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
    _class("release.dracap.io", "release"),
    _class("stall.dracap.io", "stall"),
    {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpus"},
        "spec": {
            "driver": DRIVER,
            "nodeName": "node-a",
            "pool": {"name": "node-a-gpus", "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "allowMultipleAllocations": True,
                    "capacity": {"memory": {"value": "40Gi"}},
                }
            ],
        },
    },
]


def _claim(name: str, device_class: str) -> bytes:
    exactly = {"deviceClassName": device_class, "capacity": {"requests": {"memory": "10Gi"}}}
    doc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }
    return yaml.safe_dump(doc).encode()


@pytest.fixture
async def cluster(
    settings: Settings, nats_url: str, tmp_path: Path, postgres_admin_url: str
) -> AsyncIterator[tuple[Cluster, ReclamationService]]:
    """The stack with every service on its own database login (as under ``dracap up``:
    each may append only its own job, migration 0011), and a second reclamation replica."""
    async with running_cluster(
        settings, nats_url, tmp_path, INVENTORY, admin_url=postgres_admin_url
    ) as running:
        store = running.stack.stores.of(ServiceKind.RECLAMATION)
        replica = ReclamationService(folded(store), name="reclamation-1", poll_s=0.05)
        stop = asyncio.Event()
        task = asyncio.create_task(replica.run(stop))
        try:
            yield running, replica
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await task


async def _consumed(cluster: Cluster) -> str:
    [device] = (await cluster.api.admin("devices.list"))["devices"]
    return str(device["capacity"]["memory"]["consumed"])


async def test_an_unused_claim_is_released_exactly_once_with_the_reason(
    cluster: tuple[Cluster, ReclamationService], settings: Settings
) -> None:
    running, _ = cluster
    api = running.api
    await api.claims(NAMESPACE, "apply", _claim("idle", "release.dracap.io"))
    released = await view_when(api, "idle", lambda v: v["phase"] == "released")
    assert "not started within 1s" in (released["reason"] or "")
    assert await _consumed(running) == "0"
    stream = claim_stream(NAMESPACE, "idle")
    log = await running.stack.store.read_stream(stream)
    requests = [e for e in log if isinstance(e.event, c.ReleaseRequested)]
    assert len(requests) == 1, "two replicas, one release"
    assert requests[0].actor.startswith("system:reclamation-")
    assert "no consumer reserved it" in requests[0].event.reason
    report = await verify(settings, from_start=True)
    assert report.ok, summary(report)


async def test_a_stalled_claim_keeps_its_capacity_until_a_consumer_reserves_it(
    cluster: tuple[Cluster, ReclamationService],
    settings: Settings,
    capsys: pytest.CaptureFixture[str],
) -> None:
    running, replica = cluster
    api, flags = running.api, running.flags
    await api.claims(NAMESPACE, "apply", _claim("parked", "stall.dracap.io"))
    stalled = await view_when(api, "parked", lambda v: v["phase"] == "stalled")
    assert stalled["ready"], "its limits are in force: stalled is not broken"
    assert "not started within 1s" in (stalled["reason"] or "")
    assert await _consumed(running) == "10Gi", "a stalled claim keeps its capacity"

    consumer = f"pod/{NAMESPACE}/trainer-0"
    argv = ["claim", "reserve", "parked", "--for", consumer, "-n", NAMESPACE, "-o", "json"]
    code, out, err = await dracap(capsys, *argv, *flags)
    assert code == ExitCode.OK, err
    assert json.loads(out)["reserved_for"] == [consumer]
    back = await view_when(api, "parked", lambda v: v["phase"] == "ready")
    assert back["reserved_for"] == [consumer] and back["reason"] is None
    assert await replica.tick() == 0, "a reserved claim has started: nothing to do"
    code, out, _ = await dracap(capsys, *argv, *flags)
    assert code == ExitCode.OK and json.loads(out)["unchanged"] == [consumer]

    # status.reservedFor[].uid: the consumer's own when given, else derived, never empty
    uid = str(uuid.uuid4())
    other = ["claim", "reserve", "parked", "--for", f"pod/{NAMESPACE}/trainer-1", "--uid", uid]
    code, _, err = await dracap(capsys, *other, "-n", NAMESPACE, *flags)
    assert code == ExitCode.OK, err
    again = ["claim", "reserve", "parked", "--for", f"pod/{NAMESPACE}/trainer-1"]
    code, _, err = await dracap(capsys, *again, "--uid", str(uuid.uuid4()), "-n", NAMESPACE, *flags)
    assert code == ExitCode.REJECTED and uid in err, "another pod of that name"
    get = ["claim", "get", "parked", "-n", NAMESPACE, "-o", "json"]
    code, out, _ = await dracap(capsys, *get, *flags)
    refs = {ref["name"]: ref["uid"] for ref in json.loads(out)["status"]["reservedFor"]}
    assert refs["trainer-1"] == uid and uuid.UUID(refs["trainer-0"])
    code, out, _ = await dracap(capsys, *get, *flags)
    assert {ref["name"]: ref["uid"] for ref in json.loads(out)["status"]["reservedFor"]} == refs
    code, _, err = await dracap(capsys, "claim", "unreserve", "parked", "--for",
                                f"pod/{NAMESPACE}/trainer-1", "-n", NAMESPACE, *flags)  # fmt: skip
    assert code == ExitCode.OK, err

    bad = ["claim", "reserve", "parked", "--for", "pod/other-ns/x", "-n", NAMESPACE]
    code, _, err = await dracap(capsys, *bad, *flags)
    assert code == ExitCode.BAD_INPUT and "for: must be pod/" in err
    code, _, err = await dracap(capsys, "claim", "reserve", "nope", "--for", consumer,
                                "-n", NAMESPACE, *flags)  # fmt: skip
    assert code == ExitCode.NOT_FOUND, err

    unreserve = ["claim", "unreserve", "parked", "--for", consumer, "-n", NAMESPACE]
    code, _, err = await dracap(capsys, *unreserve, *flags)
    assert code == ExitCode.OK, err
    again = await view_when(api, "parked", lambda v: v["phase"] == "stalled")
    assert again["reserved_for"] == []
    stream = claim_stream(NAMESPACE, "parked")
    log = await running.stack.store.read_stream(stream)
    assert len([e for e in log if isinstance(e.event, c.ClaimStalled)]) == 2
    assert not [e for e in log if isinstance(e.event, c.ReleaseRequested)]
    report = await verify(settings, from_start=True)
    assert report.ok, summary(report)
