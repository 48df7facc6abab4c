"""The pure parts of ``dracap claim`` / ``dracap devices``: input, endpoint, rendering."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from services import cli
from services.claims import command

CLAIM = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: c1}
spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu}}]}}
"""


def _args(tmp_path: Path, **kw: str | None) -> argparse.Namespace:
    return argparse.Namespace(**{"nats": None, "prefix": None, "data_dir": str(tmp_path), **kw})


def test_read_claims_fills_the_namespace(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(CLAIM)
    [(namespace, manifest)] = command.read_claims(str(path), "tenant-a")
    assert namespace == "tenant-a"
    assert json.loads(manifest)["metadata"] == {"name": "c1", "namespace": "tenant-a"}
    assert command.read_claims(str(path), None)[0][0] == "default"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kind: ResourceClaim\nmetadata: [", "c.yaml"),
        ("apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n", "only ResourceClaims"),
        ("", "no ResourceClaim"),
    ],
)
def test_bad_files_are_exit_2(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(command.CommandError, match=message) as caught:
        command.read_claims(str(path), None)
    assert caught.value.exit_code == cli.EXIT_BAD_INPUT


def test_missing_file_is_exit_2(tmp_path: Path) -> None:
    assert cli.main(["claim", "apply", "-f", str(tmp_path / "none.yaml"),
                     "--nats", "nats://127.0.0.1:1"]) == cli.EXIT_BAD_INPUT  # fmt: skip


def test_endpoint_from_flag_environment_and_connection_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DRACAP_NATS_URL", raising=False)
    with pytest.raises(command.CommandError, match="no NATS URL"):
        command.resolve_endpoint(_args(tmp_path))
    (tmp_path / "connection.json").write_text(
        json.dumps({"database_url": "postgresql://x", "nats_url": "nats://h:1", "prefix": "p"})
    )
    assert command.resolve_endpoint(_args(tmp_path)) == ("nats://h:1", "p")
    monkeypatch.setenv("DRACAP_NATS_URL", "nats://env:2")
    assert command.resolve_endpoint(_args(tmp_path)) == ("nats://env:2", "p")
    assert command.resolve_endpoint(_args(tmp_path, nats="nats://f:3", prefix="q")) == (
        "nats://f:3",
        "q",
    )


def test_no_server_is_exit_1(tmp_path: Path) -> None:
    argv = ["claim", "get", "x", "--nats", "nats://127.0.0.1:1", "--data-dir", str(tmp_path)]
    assert cli.main(argv) == 1


def test_api_errors_map_to_exit_codes() -> None:
    for code, exit_code in (("invalid", 2), ("not_found", 3), ("rejected", 4), ("odd", 1)):
        assert command.ApiError({"code": code, "message": "m"}).exit_code == exit_code


def test_claim_table_has_one_row_per_share() -> None:
    view = {
        "namespace": "tenant-a",
        "name": "two",
        "phase": "ready",
        "reason": None,
        "ready": True,
        "node": "node-a",
        "shares": [
            {"share_id": "s-1", "pool": "p", "device": "gpu-0", "consumed": {"memory": "10Gi"}},
            {"share_id": "s-2", "pool": "p", "device": "gpu-1", "consumed": {"memory": "5Gi"}},
        ],
    }
    lines = command.table(command.CLAIM_HEADER, command.claim_rows([view])).splitlines()
    assert lines[0].split() == command.CLAIM_HEADER
    assert lines[1].split() == [
        "tenant-a",
        "two",
        "ready",
        "node-a",
        "p/gpu-0",
        "memory=10Gi",
        "s-1",
    ]
    assert lines[2].split() == ["p/gpu-1", "memory=5Gi", "s-2"]


def test_device_table() -> None:
    device = {
        "driver": "gpu.dracap.io",
        "pool": "node-a-gpus",
        "device": "gpu-0",
        "node": "node-a",
        "capacity": {"memory": {"total": "40Gi", "consumed": "10Gi", "free": "30Gi"}},
        "shares": 1,
        "tenants": ["tenant-a"],
    }
    text = command.table(command.DEVICE_HEADER, command.device_rows([device]))
    assert text.splitlines()[1].split() == [
        "node-a", "gpu.dracap.io", "node-a-gpus/gpu-0", "memory", "40Gi", "10Gi", "30Gi", "1",
        "tenant-a",
    ]  # fmt: skip


def test_connection_file_is_written_into_a_new_data_directory(tmp_path: Path) -> None:
    # servers from the environment: nothing embedded created the directory before
    from services.claims.command import Connection, read_connection
    from services.up import write_connection

    data_dir = tmp_path / "not" / "yet"
    connection = Connection(database_url="postgresql://db/x", nats_url="nats://n:4222")
    path = write_connection(data_dir, connection)
    assert path == data_dir / "connection.json"
    assert read_connection(data_dir) == connection
