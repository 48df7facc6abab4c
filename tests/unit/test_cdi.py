"""CDI spec files: the shape the runtime reads, validated against the upstream schema."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft7Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from services.enforcement.cdi import (
    CDI_VERSION,
    KIND,
    CdiShare,
    CdiSpecs,
    build_spec,
    check_share_id,
    gpu_uuid_of,
)

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "cdi"
UUID = "GPU-2f6a3c1e-8a34-4d0b-9c6e-0a1b2c3d4e50"
SHARE = "0b6a3f4e-1c2d-4e5f-8a9b-0c1d2e3f4a5b"

# Field names the CDI loader accepts (specs-go; it rejects unknown fields, the schema
# does not). Only the ones dracap may emit are listed.
SPEC_FIELDS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
DEVICE_FIELDS = {"name", "annotations", "containerEdits"}
EDIT_FIELDS = {"env", "deviceNodes", "mounts", "hooks", "additionalGids"}
MOUNT_FIELDS = {"hostPath", "containerPath", "options", "type"}


def cdi_validator() -> Draft7Validator:
    """The upstream CDI schema, with ``defs.json`` resolvable by its relative name."""
    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    registry: Registry[Any] = Registry().with_resource(
        "defs.json", Resource.from_contents(defs, default_specification=DRAFT7)
    )
    return Draft7Validator(schema, registry=registry)


def check_spec(spec: dict[str, Any]) -> None:
    """Schema-valid, and within what the CDI loader accepts (see the fixture README)."""
    cdi_validator().validate(spec)
    assert set(spec) <= SPEC_FIELDS
    for device in spec["devices"]:
        assert set(device) <= DEVICE_FIELDS
        edits = device["containerEdits"]
        assert set(edits) <= EDIT_FIELDS
        for entry in edits.get("env", []):
            assert isinstance(entry, str)
            assert "=" in entry
            assert entry.partition("=")[0]
        for mount in edits.get("mounts", []):
            assert set(mount) <= MOUNT_FIELDS
            assert Path(mount["containerPath"]).is_absolute()


def share(tmp_path: Path, share_id: str = SHARE) -> CdiShare:
    base = tmp_path / "mps" / share_id
    return CdiShare(
        share_id=share_id,
        device="gpu-0",
        gpu_uuid=UUID,
        pipe_dir=base / "pipe",
        log_dir=base / "log",
    )


def test_spec_is_valid_against_the_upstream_schema(tmp_path: Path) -> None:
    check_spec(build_spec(share(tmp_path)))


def test_schema_check_is_not_vacuous(tmp_path: Path) -> None:
    spec = build_spec(share(tmp_path))
    del spec["devices"][0]["containerEdits"]
    assert not cdi_validator().is_valid(spec)
    bad_mount = build_spec(share(tmp_path))
    del bad_mount["devices"][0]["containerEdits"]["mounts"][0]["containerPath"]
    assert not cdi_validator().is_valid(bad_mount)
    assert not cdi_validator().is_valid({"cdiVersion": CDI_VERSION, "kind": KIND})


def test_spec_hands_the_container_its_pipe_dir_and_environment(tmp_path: Path) -> None:
    s = share(tmp_path)
    spec = build_spec(s)
    assert spec["cdiVersion"] == CDI_VERSION
    assert spec["kind"] == "dracap.io/gpu-share"
    (device,) = spec["devices"]
    assert device["name"] == SHARE
    edits = device["containerEdits"]
    env = dict(e.split("=", 1) for e in edits["env"])
    assert env == {
        "CUDA_MPS_PIPE_DIRECTORY": str(s.pipe_dir),
        "CUDA_MPS_LOG_DIRECTORY": str(s.log_dir),
        "DRACAP_SHARE_ID": SHARE,
        "NVIDIA_VISIBLE_DEVICES": UUID,
    }
    mounts = {m["hostPath"]: m for m in edits["mounts"]}
    assert mounts[str(s.pipe_dir)]["containerPath"] == str(s.pipe_dir)
    assert "rw" in mounts[str(s.pipe_dir)]["options"]
    assert "ro" in mounts[str(s.log_dir)]["options"]
    # The limit is never a client-side variable the tenant could change.
    assert not any(e.startswith("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") for e in edits["env"])
    assert gpu_uuid_of(spec) == UUID


def test_write_read_remove(tmp_path: Path) -> None:
    specs = CdiSpecs(tmp_path / "cdi")
    path = specs.write(share(tmp_path))
    assert path == tmp_path / "cdi" / f"dracap.io-gpu-share_{SHARE}.json"
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    stored = specs.read(SHARE)
    assert stored is not None
    check_spec(stored)
    assert specs.share_ids() == [SHARE]
    assert specs.qualified_name(SHARE) == f"dracap.io/gpu-share={SHARE}"
    specs.remove(SHARE)
    specs.remove(SHARE)  # idempotent
    assert specs.read(SHARE) is None
    assert specs.share_ids() == []


def test_rewriting_the_same_spec_leaves_the_file_alone(tmp_path: Path) -> None:
    specs = CdiSpecs(tmp_path / "cdi")
    path = specs.write(share(tmp_path))
    inode = path.stat().st_ino
    specs.write(share(tmp_path))
    assert path.stat().st_ino == inode
    changed = share(tmp_path)
    specs.write(CdiShare(**{**_fields(changed), "gpu_uuid": "GPU-other"}))
    assert path.stat().st_ino != inode  # replaced by rename, never edited in place
    assert gpu_uuid_of(specs.read(SHARE) or {}) == "GPU-other"


def test_write_leaves_no_temporary_files(tmp_path: Path) -> None:
    specs = CdiSpecs(tmp_path / "cdi")
    for i in range(3):
        specs.write(share(tmp_path, f"share-{i}"))
    assert sorted(os.listdir(tmp_path / "cdi")) == [
        f"dracap.io-gpu-share_share-{i}.json" for i in range(3)
    ]


@pytest.mark.parametrize("bad", ["", "../etc", "a/b", ".hidden", "a b", "x:y", "a\nb", "é"])
def test_unsafe_share_ids_are_refused(bad: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a valid CDI device name"):
        check_share_id(bad)
    with pytest.raises(ValueError, match="not a valid CDI device name"):
        CdiSpecs(tmp_path).path_of(bad)


def _fields(s: CdiShare) -> dict[str, Any]:
    return {f: getattr(s, f) for f in s.__struct_fields__}
