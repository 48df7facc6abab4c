"""``dracap apply`` / ``get`` / ``delete`` against the real services.

The stack runs in-process on the test's own database and subject prefix with *no*
inventory: ``dracap apply -f deploy/examples`` loads it — DeviceClasses, Namespaces
(their ``dracap.io/`` annotations), ResourceSlices and the example claims, each where
its kind belongs — as an operator of an installation without ``dracap up`` does.
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import yaml

from events.subjects import BusNames
from services import cli
from services.exitcodes import ExitCode
from services.runtime.bus.jetstream import connect_bus
from services.runtime.ground.settings import Settings
from services.stack import Stack, read_inventory

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "deploy" / "examples"


@pytest.fixture
async def bare(settings: Settings, nats_url: str) -> AsyncIterator[list[str]]:
    """The stack with the example nodes' agents and nothing loaded; the CLI flags."""
    names = BusNames(prefix=f"t{uuid.uuid4().hex[:10]}")
    nodes = read_inventory([str(EXAMPLES)]).nodes
    settings = msgspec.structs.replace(settings, nats_url=nats_url)
    async with Stack.running(settings, names, nodes=nodes, workers=1):
        yield ["--nats", nats_url, "--prefix", names.prefix]
    nc, js = await connect_bus(nats_url)
    try:
        await js.delete_stream(names.stream)
    finally:
        await nc.close()


async def run(
    capsys: pytest.CaptureFixture[str], *argv: str, stdin: str | None = None
) -> tuple[int, str, str]:
    """``dracap ARGV`` in a thread (the CLI runs its own loop): code, stdout, stderr."""
    capsys.readouterr()
    if stdin is None:
        code = await asyncio.to_thread(cli.main, list(argv))
    else:

        def with_stdin() -> int:
            saved, sys.stdin = sys.stdin, io.StringIO(stdin)
            try:
                return cli.main(list(argv))
            finally:
                sys.stdin = saved

        code = await asyncio.to_thread(with_stdin)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def test_apply_loads_every_kind_and_again_changes_nothing(
    bare: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await run(capsys, "apply", "-f", str(EXAMPLES), *bare)
    assert code == 0, err
    lines = out.splitlines()
    # the order a claim needs: classes, namespaces, slices, then the claims
    kinds = [line.split("/", 1)[0] for line in lines]
    assert kinds == sorted(
        kinds, key=["deviceclass", "namespace", "resourceslice", "resourceclaim"].index
    )
    assert "deviceclass/gpu-memory.dracap.io applied" in lines
    assert "namespace/tenant-b applied" in lines
    assert "resourceslice/node-a-gpus applied" in lines or any(
        line.startswith("resourceslice/") and line.endswith(" applied") for line in lines
    )
    claims = [line for line in lines if line.startswith("resourceclaim/")]
    assert "resourceclaim/tenant-a/train-small admitted" in claims, claims

    code, out, err = await run(capsys, "apply", "-f", str(EXAMPLES), "-o", "json", *bare)
    assert code == 0, err
    again = json.loads(out)
    inventory = [a for a in again if a["kind"] != "ResourceClaim"]
    assert inventory and {a["result"] for a in inventory} == {"unchanged"}

    code, out, _ = await run(capsys, "get", "deviceclasses", *bare)
    assert code == 0
    assert out.splitlines()[0].split() == ["NAME", "MODE", "MIN-ENFORCEMENT", "SELECTORS"]
    assert "gpu-memory.dracap.io" in out and "consumable" in out
    code, out, _ = await run(capsys, "get", "ns", "tenant-b", *bare)
    assert code == 0 and "tenant-b" in out and "100" in out  # dracap.io/max-claims
    code, out, _ = await run(capsys, "get", "slices", *bare)
    assert code == 0 and "node-a" in out
    code, out, _ = await run(capsys, "get", "claims", "-n", "tenant-a", *bare)
    assert code == 0 and "train-small" in out


async def test_what_get_prints_applies_again_as_unchanged(
    bare: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = await run(capsys, "apply", "-f", str(EXAMPLES), *bare)
    assert code == 0, err
    for kind in ("deviceclasses", "namespaces", "resourceslices"):
        code, out, err = await run(capsys, "get", kind, "-o", "yaml", *bare)
        assert code == 0, err
        listed = yaml.safe_load(out)
        assert listed["kind"] == "List" and listed["items"], kind
        code, out, err = await run(capsys, "apply", "-f", "-", *bare, stdin=out)
        assert code == 0, err
        assert out and all(line.endswith(" unchanged") for line in out.splitlines()), out
    code, out, _ = await run(capsys, "get", "namespace", "ops", "-o", "json", *bare)
    ops = json.loads(out)
    assert ops["kind"] == "Namespace" and ops["metadata"]["name"] == "ops"
    assert ops["metadata"]["labels"] == {"resource.kubernetes.io/admin-access": "true"}
    assert ops["metadata"]["annotations"]["dracap.io/opaque-config-classes"] == "*"
    code, out, _ = await run(
        capsys, "get", "claim", "train-small", "-n", "tenant-a", "-o", "yaml", *bare
    )
    assert code == 0 and yaml.safe_load(out)["kind"] == "ResourceClaim"


async def test_a_bad_object_anywhere_applies_nothing(
    bare: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for example in EXAMPLES.iterdir():
        (tmp_path / example.name).write_text(example.read_text())
    (tmp_path / "zz-typo.yaml").write_text(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: tenant-z\n"
        "  annotations: {dracap.io/max-claim: '3'}\n"
    )
    code, out, err = await run(capsys, "apply", "-f", str(tmp_path), *bare)
    assert code == ExitCode.BAD_INPUT and out == ""
    assert "zz-typo.yaml" in err and "dracap.io/max-claim" in err and len(err.splitlines()) == 1
    code, out, _ = await run(capsys, "get", "deviceclasses", "-o", "json", *bare)
    assert code == 0 and json.loads(out)["items"] == []

    code, _, err = await run(capsys, "apply", "-f", str(tmp_path / "missing.yaml"), *bare)
    assert code == ExitCode.BAD_INPUT and len(err.splitlines()) == 1 and "cannot read" in err


async def test_delete_withdraws_classes_and_namespaces_and_releases_claims(
    bare: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = await run(capsys, "apply", "-f", str(EXAMPLES), *bare)
    assert code == 0, err
    code, out, err = await run(capsys, "delete", "claim", "train-small", "-n", "tenant-a", *bare)
    assert code == 0, err
    assert out.startswith("resourceclaim/tenant-a/train-small deleted")

    code, out, err = await run(capsys, "delete", "ns", "tenant-b", *bare)
    assert code == 0 and "namespace/tenant-b deleted" in out, err
    code, out, _ = await run(capsys, "get", "ns", "tenant-b", "-o", "json", *bare)
    assert json.loads(out)["metadata"]["annotations"]["dracap.io/device-classes"] == ""
    late = tmp_path / "late.yaml"
    late.write_text(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\n"
        "metadata: {name: late, namespace: tenant-b}\n"
        "spec: {devices: {requests: [{name: nic, exactly: "
        "{deviceClassName: vnic-bandwidth.dracap.io}}]}}\n"
    )
    code, out, _ = await run(capsys, "apply", "-f", str(late), *bare)
    assert code == ExitCode.REJECTED and "resourceclaim/tenant-b/late rejected: " in out

    code, out, err = await run(capsys, "delete", "deviceclass", "gpu-memory.dracap.io", *bare)
    assert code == 0 and "deviceclass/gpu-memory.dracap.io deleted" in out, err
    code, out, _ = await run(capsys, "get", "dc", "gpu-memory.dracap.io", *bare)
    assert code == ExitCode.NOT_FOUND

    code, _, err = await run(capsys, "delete", "resourceslice", "anything", *bare)
    assert code == ExitCode.BAD_INPUT and "node's agent" in err
    code, _, err = await run(capsys, "get", "pods", *bare)
    assert code == ExitCode.BAD_INPUT and "KIND: must be one of" in err
    code, _, _ = await run(capsys, "delete", "ns", "never-was", *bare)
    assert code == ExitCode.NOT_FOUND
    code, _, _ = await run(capsys, "delete", "claim", "never-was", "-n", "tenant-a", *bare)
    assert code == ExitCode.NOT_FOUND
