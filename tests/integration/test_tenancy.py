"""What the operator lets each tenant do, through the real API (docs/tenancy.md).

The whole stack runs in-process (:class:`services.stack.Stack`) on the test's own database
and a unique subject prefix, with the example inventory loaded from
``deploy/examples`` exactly as ``dracap up`` loads it: ``tenant-a`` may not pass opaque
driver configuration, ``ops`` may (``dracap.io/opaque-config-classes: "*"``), and the
GPU class lets tenants read a GPU's ``model`` and ``driverVersion`` only.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from events import model
from events.subjects import BusNames
from services import cli
from services.commands.claim import wait_ready
from services.exitcodes import ExitCode
from services.replay.verify import summary, verify
from services.runtime.bus.apiclient import ApiClient, ApiError
from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground.settings import Settings
from services.stack import Stack, load_inventory, read_inventory

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"
GPU_CLASS = "gpu-memory.dracap.io"
CONFIG_FIELD = "spec.devices.config[0].opaque"


class Cluster(msgspec.Struct, kw_only=True):
    api: ApiClient
    flags: list[str]
    settings: Settings


@pytest.fixture
async def cluster(settings: Settings, nats_url: str) -> AsyncIterator[Cluster]:
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:10]}")
    inventory = read_inventory([str(EXAMPLES)])
    settings = msgspec.structs.replace(settings, nats_url=nats_url)
    flags = ["--nats", nats_url, "--prefix", names.prefix]
    async with (
        Stack.running(settings, names, nodes=inventory.nodes, workers=1),
        ApiClient.connect(nats_url, names.prefix) as api,
    ):
        await load_inventory(api, inventory)
        yield Cluster(api=api, flags=flags, settings=settings)
    nc, js = await connect_bus(nats_url)
    try:
        await js.delete_stream(names.stream)
    finally:
        await nc.close()


def claim_doc(name: str, namespace: str, memory: str = "10Gi", *, config: bool = False) -> bytes:
    devices: dict[str, Any] = {
        "requests": [
            {
                "name": "gpu",
                "exactly": {
                    "deviceClassName": GPU_CLASS,
                    "capacity": {"requests": {"memory": memory}},
                },
            }
        ]
    }
    if config:
        devices["config"] = [
            {"opaque": {"driver": "gpu.dracap.io", "parameters": {"computeMode": "exclusive"}}}
        ]
    doc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": devices},
    }
    return yaml.safe_dump(doc).encode()


async def dracap(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``dracap ARGV`` (in a thread: the CLI runs its own event loop)."""
    capsys.readouterr()
    code = await asyncio.to_thread(cli.main, list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- opaque driver configuration --------------------------------------------------------------


async def test_opaque_config_is_refused_for_a_namespace_without_the_permission(
    cluster: Cluster, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(ApiError) as refused:
        await cluster.api.claims("tenant-a", "apply", claim_doc("tuned", "tenant-a", config=True))
    assert (refused.value.code, refused.value.field) == ("rejected", CONFIG_FIELD)
    assert str(refused.value).startswith(
        f"rejected: {CONFIG_FIELD}: opaque driver configuration is not allowed for DeviceClass "
        f"'{GPU_CLASS}' in namespace 'tenant-a'"
    )
    view = (await cluster.api.claims("tenant-a", "get", {"name": "tuned"}))["claim"]
    assert view["phase"] == "rejected" and view["reason"].startswith(f"{CONFIG_FIELD}: ")

    # the same through the CLI: exit code 4, one line naming the field
    manifest = tmp_path / "tuned.yaml"
    manifest.write_bytes(claim_doc("tuned-cli", "tenant-a", config=True))
    code, _, err = await dracap(capsys, "claim", "apply", "-f", str(manifest), *cluster.flags)
    assert code == ExitCode.REJECTED, err
    assert err.count(CONFIG_FIELD) == 1 and "opaque driver configuration" in err

    # ops may configure every class: admitted, and the config reaches the allocation
    reply = await cluster.api.claims("ops", "apply", claim_doc("tuned", "ops", config=True))
    assert reply["claim"]["phase"] != "rejected"
    ready = await wait_ready(cluster.api, "ops", "tuned", 30)
    assert ready["ready"], ready
    [config] = ready["allocation"]["devices"]["config"]
    assert config["source"] == "FromClaim"
    assert config["opaque"]["parameters"] == {"computeMode": "exclusive"}


async def test_claim_get_shows_the_manifest_and_the_allocation_whole(
    cluster: Cluster, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The fold keeps neither the manifest nor the allocation's configuration (only what
    decisions read): ``claim get`` reads them from the log, so a user sees the claim as
    applied and its allocation as bound — in the object, the view, the list and a watch."""
    doc = yaml.safe_load(claim_doc("shown", "ops", config=True))
    doc["metadata"]["labels"] = {"team": "vision"}
    doc["metadata"]["annotations"] = {"note": "n" * 2048}
    doc["spec"]["devices"]["config"][0]["opaque"]["parameters"]["notes"] = "p" * 4096
    manifest = tmp_path / "shown.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    get = ("claim", "get", "shown", "-n", "ops", *cluster.flags)
    code, _, err = await dracap(capsys, "claim", "apply", "-f", str(manifest), *cluster.flags)
    assert code == 0, err
    ready = await wait_ready(cluster.api, "ops", "shown", 30)
    assert ready["ready"], ready
    code, out, err = await dracap(capsys, *get, "-o", "yaml")
    assert code == 0, err
    shown = yaml.safe_load(out)
    applied = model.to_builtins(model.convert(doc, model.ResourceClaim))
    assert shown["metadata"]["labels"] == {"team": "vision"}
    assert shown["metadata"]["annotations"] == doc["metadata"]["annotations"]
    assert shown["spec"] == applied["spec"]
    allocation = shown["status"]["allocation"]
    [config] = allocation["devices"]["config"]
    assert config["source"] == "FromClaim"
    assert config["opaque"] == doc["spec"]["devices"]["config"][0]["opaque"]
    assert shown["dracap"]["allocation"] == allocation == ready["allocation"]
    [listed] = [
        v for v in (await cluster.api.claims("ops", "list"))["claims"] if v["name"] == "shown"
    ]
    assert listed == shown["dracap"]


# --- the tenant's view of devices --------------------------------------------------------------


async def test_a_tenant_sees_the_devices_of_its_classes_and_only_allowed_attributes(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    await cluster.api.claims("tenant-b", "apply", claim_doc("train", "tenant-b"))
    assert (await wait_ready(cluster.api, "tenant-b", "train", 30))["ready"]

    code, out, _ = await dracap(capsys, "devices", "-n", "tenant-a", "-o", "json", *cluster.flags)
    assert code == 0, out
    devices = json.loads(out)
    gpus = [d for d in devices if d["driver"] == "gpu.dracap.io"]
    nics = [d for d in devices if d["driver"] == "vnic.dracap.io"]
    assert gpus and nics and len(gpus) + len(nics) == len(devices)
    for gpu in gpus:
        assert gpu["classes"] == [GPU_CLASS]
        assert set(gpu["attributes"]) == {"gpu.dracap.io/model", "gpu.dracap.io/driverVersion"}
        assert set(gpu) == {
            "driver", "pool", "device", "node", "classes", "capacity", "attributes"
        }  # fmt: skip
    assert all(nic["attributes"] == {} for nic in nics)  # the vNIC class allow-lists nothing
    used = [g for g in gpus if g["capacity"]["memory"]["free"] != "40Gi"]
    assert [g["capacity"]["memory"] for g in used] == [{"total": "40Gi", "free": "30Gi"}]
    assert "tenant-b" not in out  # who holds what is the operator's to see

    code, out, _ = await dracap(capsys, "devices", "-n", "tenant-a", *cluster.flags)
    assert code == 0 and "gpu.dracap.io/model=A100-SXM4-40GB" in out and "uuid" not in out
    assert out.splitlines()[0].split() == [
        "NODE", "DRIVER", "POOL/DEVICE", "CLASSES", "CAPACITY", "TOTAL", "FREE", "ATTRIBUTES"
    ]  # fmt: skip

    # a namespace limited to the vNIC class sees the vNICs only; one without access, nothing
    access = {"namespace": "tenant-c", "classes": ["vnic-bandwidth.dracap.io"]}
    await cluster.api.admin("namespaces.access", access)
    seen = (await cluster.api.claims("tenant-c", "devices"))["devices"]
    assert {d["driver"] for d in seen} == {"vnic.dracap.io"}
    assert (await cluster.api.claims("tenant-z", "devices"))["devices"] == []

    # the operator's view is as it was: consumption, shares and tenants of every device
    code, out, _ = await dracap(capsys, "devices", "-o", "json", *cluster.flags)
    listed = json.loads(out)
    assert len(listed) == len(devices)
    assert ["tenant-b"] in [d["tenants"] for d in listed]


# --- the quota -----------------------------------------------------------------------------------


async def test_the_quota_holds_when_claims_arrive_together(cluster: Cluster) -> None:
    access = {"namespace": "tenant-q", "classes": ["*"], "max_claims": 2}
    recorded = await cluster.api.admin("namespaces.access", access)
    assert recorded["max_claims"] == 2 and recorded["max_requests_per_claim"] is None

    async def apply(name: str) -> dict[str, Any]:
        try:
            return await cluster.api.claims("tenant-q", "apply", claim_doc(name, "tenant-q", "5Gi"))
        except ApiError as exc:
            return {"ok": False, "error": {"code": exc.code, "field": exc.field, "text": str(exc)}}

    names = [f"q{i}" for i in range(6)]
    replies = await asyncio.gather(*(apply(n) for n in names))
    admitted = [n for n, r in zip(names, replies, strict=True) if r["ok"]]
    refused = [r["error"] for r in replies if not r["ok"]]
    assert len(admitted) == 2, replies
    assert all(e["code"] == "rejected" and e["field"] == "metadata.namespace" for e in refused)
    assert all("at most 2 live claims (quota dracap.io/max-claims)" in e["text"] for e in refused)
    for name in set(names) - set(admitted):  # a refusal by quota records nothing
        with pytest.raises(ApiError) as missing:
            await cluster.api.claims("tenant-q", "get", {"name": name})
        assert missing.value.code == "not_found"

    deleted = await cluster.api.claims("tenant-q", "delete", {"name": admitted[0]})
    if deleted["phase"] == "releasing":  # it counts until its capacity is given back
        assert (await wait_ready(cluster.api, "tenant-q", admitted[0], 30))["phase"] == "released"
    later = await apply("after-delete")
    assert later["ok"], later


# --- shared-across-namespaces: deny ---------------------------------------------------------


async def test_a_class_that_denies_sharing_keeps_each_gpu_to_one_namespace(
    cluster: Cluster,
) -> None:
    [gpu_class] = [
        c for c in read_inventory([str(EXAMPLES)]).classes if c.metadata.name == GPU_CLASS
    ]
    annotations = {**(gpu_class.metadata.annotations or {})}
    annotations["dracap.io/shared-across-namespaces"] = "deny"
    meta = msgspec.structs.replace(gpu_class.metadata, annotations=annotations)
    denying = msgspec.structs.replace(gpu_class, metadata=meta)
    applied = await cluster.api.admin("deviceclasses.apply", model.encode_json(denying))
    assert applied["applied"] == [GPU_CLASS]

    placed: dict[str, tuple[str, str]] = {}
    for namespace, name in (("tenant-a", "a1"), ("tenant-b", "b1"), ("tenant-a", "a2")):
        await cluster.api.claims(namespace, "apply", claim_doc(name, namespace, "5Gi"))
        view = await wait_ready(cluster.api, namespace, name, 30)
        assert view["ready"], view
        [share] = view["shares"]
        placed[name] = (share["pool"], share["device"])
    assert placed["a2"] == placed["a1"]  # the same namespace shares its GPU
    assert placed["b1"] != placed["a1"]  # another namespace gets another one
    devices = (await cluster.api.admin("devices.list"))["devices"]
    assert all(len(d["tenants"]) <= 1 for d in devices)
    report = await verify(cluster.settings, from_start=True)
    assert report.ok, summary(report)
