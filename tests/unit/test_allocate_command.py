"""``dracap allocate`` end to end through the CLI entry point (no services needed)."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from events.model import CapacityRequestPolicy, convert
from events.quantities import Quantity
from services.cli import main
from services.reservation.policy import consumed_amount, violates_policy

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["allocate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def gpu_claim_file(tmp_path: Path, name: str, memory: str) -> Path:
    """A file with one tenant-a claim for ``memory`` of the example GPU class."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"""
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {{name: {name}, namespace: tenant-a}}
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpu-memory.dracap.io
        capacity: {{requests: {{memory: {memory}}}}}
"""
    )
    return path


def test_json_report_has_exactly_the_documented_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "-f", str(EXAMPLES), "-o", "json")
    assert code == 0
    report = json.loads(out)
    assert list(report) == ["results"]
    for row in report["results"]:
        assert set(row) <= {"claim", "outcome", "reason", "allocation"}
        assert row["outcome"] in ("allocated", "unschedulable", "invalid")
        assert ("allocation" in row) == (row["outcome"] == "allocated")
    first = report["results"][0]
    assert first["claim"] == "tenant-a/train-small"
    result = first["allocation"]["devices"]["results"][0]
    assert result["consumedCapacity"] == {"memory": "10Gi"}
    assert len(result["shareID"]) == 36


def test_yaml_output_validates_against_the_official_schema(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "-f", str(EXAMPLES), "-o", "yaml")
    assert code == 0
    docs = list(yaml.safe_load_all(out))
    assert docs
    for doc in docs:
        assert doc["status"]["allocation"]["devices"]["results"]
        kubernetes_validate.validate(doc, "1.34.0", strict=True)


def test_claims_see_earlier_claims_and_allocated_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "-f", str(EXAMPLES), "-o", "yaml")
    assert code == 0
    allocated = tmp_path / "allocated.yaml"
    allocated.write_text(out)
    big = gpu_claim_file(tmp_path, "big", "40Gi")
    inventory = [str(EXAMPLES / n) for n in ("gpu-memory.yaml", "vnic-bandwidth.yaml")]
    args = [a for path in inventory for a in ("-f", path)]
    code, out, _ = run(capsys, *args, "-f", str(allocated), "-f", str(big), "--node", "node-a")
    report = json.loads(run(capsys, *args, "-f", str(allocated), "-f", str(big), "-o", "json")[1])
    assert code == 0
    # node-a's GPUs are partly taken by the earlier claims, node-b's are free
    row = report["results"][0]
    assert row["outcome"] == "allocated"
    assert row["allocation"]["devices"]["results"][0]["pool"] == "node-b-gpus"
    assert "unschedulable" in out
    assert "largest free" in out


def test_above_max_is_unschedulable_with_the_max_in_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    claim = gpu_claim_file(tmp_path, "huge", "45Gi")
    code, out, _ = run(
        capsys, "-f", str(EXAMPLES / "gpu-memory.yaml"), "-f", str(claim), "-o", "json"
    )
    row = json.loads(out)["results"][0]
    assert code == 0
    assert row["outcome"] == "unschedulable"
    assert "max 40Gi" in row["reason"]


def test_gate_off_makes_capacity_claims_invalid(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "-f", str(EXAMPLES), "-o", "json", "--feature-gates", "DRAConsumableCapacity=false"
    )
    assert code == 0
    rows = json.loads(out)["results"]
    assert rows
    assert all(r["outcome"] == "invalid" and "DRAConsumableCapacity" in r["reason"] for r in rows)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (
            "kind: ResourceSlice\napiVersion: resource.k8s.io/v1\nmetadata: {name: s}\nspec: [",
            "bad.yaml",
        ),
        (
            "kind: ResourceSlice\napiVersion: resource.k8s.io/v1\nmetadata: {name: s}\n"
            "spec: {driver: d.io, nodeName: n,"
            " pool: {name: p, generation: x, resourceSliceCount: 1}}",
            "spec.pool.generation",
        ),
        (
            "kind: ResourceSlice\napiVersion: resource.k8s.io/v1\nmetadata: {name: s}\n"
            "spec: {driver: d.io, nodeName: n,"
            " pool: {name: p, generation: 1, resourceSliceCount: 1},"
            " devices: [{name: g, capacity: {memory: {value: 12XB}}}]}",
            "12XB",
        ),
        ("kind: Gadget\napiVersion: v1\nmetadata: {name: s}\n", "Gadget"),
    ],
    ids=["yaml-syntax", "wrong-type", "bad-quantity", "unknown-kind"],
)
def test_undecodable_input_exits_2_naming_file_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, fragment: str
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(content)
    code, out, err = run(capsys, "-f", str(bad))
    assert code == 2
    assert out == ""
    assert "bad.yaml" in err
    assert fragment in err


def test_missing_file_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "-f", str(tmp_path / "nope.yaml"))
    assert code == 2
    assert "nope.yaml" in err


def test_unknown_feature_gate_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "-f", str(EXAMPLES), "--feature-gates", "DRANoSuchGate=true")
    assert code == 2
    assert "DRANoSuchGate" in err


POLICY = {"default": "2Gi", "validRange": {"min": "2Gi", "step": "2Gi", "max": "8Gi"}}


@pytest.mark.parametrize(
    ("amount", "violates"),
    [("2Gi", False), ("4Gi", False), ("3Gi", True), ("8Gi", False), ("10Gi", True), ("1Gi", True)],
)
def test_policy_violation_checks_grid_and_max(amount: str, violates: bool) -> None:
    policy = convert(POLICY, CapacityRequestPolicy)
    assert violates_policy(Quantity.parse(amount), policy) is violates


def test_validvalues_above_all_values_keeps_the_request() -> None:
    policy = convert({"default": "1Gi", "validValues": ["1Gi", "3Gi"]}, CapacityRequestPolicy)
    amount = consumed_amount(Quantity.parse("4Gi"), policy, Quantity.parse("5Gi"))
    assert amount == Quantity.parse("5Gi")
    assert violates_policy(amount, policy)


FLIPPED = """
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: gpu-memory.dracap.io}
spec:
  selectors:
    - cel: {expression: device.driver == "gpu.dracap.io"}
---
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {name: node-a-gpu.dracap.io}
spec:
  driver: gpu.dracap.io
  nodeName: node-a
  pool: {name: node-a-gpus, generation: 2, resourceSliceCount: 1}
  devices:
    - {name: gpu-0, capacity: {memory: {value: 40Gi}}}
"""

SHARE_ON_GPU0 = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: earlier, namespace: tenant-a}
spec:
  devices:
    requests:
    - name: gpu
      exactly: {deviceClassName: gpu-memory.dracap.io, capacity: {requests: {memory: 5Gi}}}
status:
  allocation:
    devices:
      results:
      - request: gpu
        driver: gpu.dracap.io
        pool: node-a-gpus
        device: gpu-0
        shareID: 6d1f7a52-4d0b-4d6e-9a51-2c3b8e0f7d14
        consumedCapacity: {memory: 5Gi}
"""


def test_a_device_republished_as_dedicated_is_in_use_while_a_share_lives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inventory = tmp_path / "flipped.yaml"
    inventory.write_text(FLIPPED)
    share = tmp_path / "share.yaml"
    share.write_text(SHARE_ON_GPU0)
    whole = gpu_claim_file(tmp_path, "exclusive", "5Gi")  # fits beside the share
    code, out, _ = run(
        capsys, "-f", str(inventory), "-f", str(share), "-f", str(whole), "-o", "json"
    )
    [row] = json.loads(out)["results"]
    assert code == 0
    assert row["outcome"] == "unschedulable" and "still shared" in row["reason"]
    code, out, _ = run(capsys, "-f", str(inventory), "-f", str(whole), "-o", "json")
    [row] = json.loads(out)["results"]
    assert row["outcome"] == "allocated"
    assert "shareID" not in row["allocation"]["devices"]["results"][0]
