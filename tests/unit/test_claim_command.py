"""The pure parts of ``dracap claim`` / ``dracap devices``: input, endpoint, rendering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services import cli
from services.commands import claim as command
from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.apiclient import ApiError

CLAIM = """
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: c1}
spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu}}]}}
"""


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
    with pytest.raises(CommandError, match=message) as caught:
        command.read_claims(str(path), None)
    assert caught.value.exit_code == ExitCode.BAD_INPUT


def test_a_claim_larger_than_the_api_takes_is_exit_2_before_sending(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a 5 MB claim: nats-py would refuse it with MaxPayloadError (exit 1, a traceback)
    big = tmp_path / "big.yaml"
    selector = "device.driver == '" + "x" * 5000 + "'"
    requests = [
        {
            "name": f"r{i}",
            "exactly": {"deviceClassName": "gpu", "selectors": [{"cel": {"expression": selector}}]},
        }
        for i in range(1000)
    ]
    big.write_text(
        CLAIM.replace(
            "{devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu}}]}}",
            json.dumps({"devices": {"requests": requests}}),
        )
    )
    assert big.stat().st_size > 5_000_000
    argv = ["claim", "apply", "-f", str(big), "--nats", "nats://127.0.0.1:1"]
    assert cli.main(argv) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "default/c1" in err and "at most 262144 bytes (256 KiB" in err


def test_missing_file_is_exit_2(tmp_path: Path) -> None:
    assert cli.main(["claim", "apply", "-f", str(tmp_path / "none.yaml"),
                     "--nats", "nats://127.0.0.1:1"]) == ExitCode.BAD_INPUT  # fmt: skip


def test_no_server_is_exit_1(tmp_path: Path) -> None:
    argv = ["claim", "get", "x", "--nats", "nats://127.0.0.1:1", "--data-dir", str(tmp_path)]
    assert cli.main(argv) == 1


def test_api_errors_map_to_exit_codes() -> None:
    for code, exit_code in (("invalid", 2), ("not_found", 3), ("rejected", 4), ("odd", 1)):
        assert ApiError({"code": code, "message": "m"}).exit_code == exit_code


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
    from services.commands.up import write_connection
    from services.runtime.bus.endpoints import Connection, read_connection

    data_dir = tmp_path / "not" / "yet"
    connection = Connection(database_url="postgresql://db/x", nats_url="nats://n:4222")
    path = write_connection(data_dir, connection)
    assert path == data_dir / "connection.json"
    assert read_connection(data_dir) == connection


def _policy_flags(*argv: str) -> object:
    where = ["--driver", "d", "--device", "p/x", "--capacity", "memory"]
    args = cli.build_parser(["policy"]).parse_args(["policy", "set", *where, *argv])
    return command.policy_of(args)


def test_policy_set_flags_change_only_the_fields_given() -> None:
    assert _policy_flags("--min", "10Gi") == ("patch", {"min": "10Gi"})
    assert _policy_flags("--step", "5Gi", "--max", "40Gi") == (
        "patch",
        {"step": "5Gi", "max": "40Gi"},
    )
    assert _policy_flags("--values", "1Gi,3Gi") == ("patch", {"values": ["1Gi", "3Gi"]})
    assert _policy_flags("--none") == ("policy", None)


def test_policy_set_replace_makes_a_whole_request_policy_with_min_as_the_default() -> None:
    assert _policy_flags("--replace", "--min", "10Gi", "--step", "5Gi") == (
        "policy",
        {"default": "10Gi", "validRange": {"min": "10Gi", "step": "5Gi"}},
    )
    assert _policy_flags("--replace", "--values", "1Gi,3Gi", "--default", "1Gi") == (
        "policy",
        {"default": "1Gi", "validValues": ["1Gi", "3Gi"]},
    )


@pytest.mark.parametrize(
    ("pool", "device", "expected"),
    [(None, "p/x", ("p", "x")), ("p", "x", ("p", "x")), ("p", "p/x", ("p", "x"))],
)
def test_a_device_is_pool_slash_device_or_pool_and_device(
    pool: str | None, device: str, expected: tuple[str, str]
) -> None:
    assert command.pool_and_device(pool, device) == expected


@pytest.mark.parametrize(("pool", "device"), [(None, "x"), ("q", "p/x"), (None, "/x")])
def test_a_device_without_its_pool_is_bad_input(pool: str | None, device: str) -> None:
    with pytest.raises(CommandError) as caught:
        command.pool_and_device(pool, device)
    assert caught.value.exit_code == ExitCode.BAD_INPUT and "POOL/DEVICE" in str(caught.value)


@pytest.mark.parametrize(
    "argv",
    [
        (),
        ("--replace", "--step", "5Gi"),
        ("--none", "--min", "1Gi"),
        ("--values", "1Gi", "--min", "1Gi"),
    ],
)
def test_policy_set_flags_that_say_no_policy_are_bad_input(argv: tuple[str, ...]) -> None:
    with pytest.raises(CommandError) as caught:
        _policy_flags(*argv)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
