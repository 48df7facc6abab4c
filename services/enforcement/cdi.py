"""CDI spec files: how a container of a GPU share reaches its own MPS control daemon.

The Container Device Interface (CDI, ``tags.cncf.io/container-device-interface``) lets
the kubelet plugin answer a prepared claim with a fully qualified device name
(``dracap.io/gpu-share=<share id>``); the container runtime finds that device in a JSON
spec file under its CDI directory (``/var/run/cdi`` for transient specs) and applies the
device's ``containerEdits`` to the container.

dracap writes one spec file per share, ``dracap.io-gpu-share_<share id>.json``, with one
device named after the share. Its edits give the container:

* the share's MPS **pipe directory**, bind-mounted read-write (the MPS clients connect
  to the daemon's sockets there), and its **log directory**, read-only;
* ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY`` pointing at those mounts, so
  every CUDA process in the container becomes a client of *this share's* daemon;
* ``NVIDIA_VISIBLE_DEVICES=<GPU UUID>`` so the NVIDIA container stack exposes that GPU;
* ``DRACAP_SHARE_ID`` so a workload (and an operator inside it) can tell its share.

A share that needs no device in the container (a bandwidth share: its limit is tc on the
node's interface) still gets a spec, kind ``dracap.io/share``, whose only edit is
``DRACAP_SHARE_ID``: the kubelet plugin answers every prepared share with a CDI name.

The memory limit itself is *not* an environment variable: a client-side
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` could be changed by the tenant. It is set in the
daemon (see :mod:`services.enforcement.mps`).

Mounts appear at the same paths inside the container as on the host, which keeps the
env values and the daemon's own view identical. Spec files are written atomically
(:func:`~services.enforcement.checkpointing.write_file_atomically`), so a runtime never
reads half a spec. ``cdiVersion`` is ``0.6.0``, the first version with annotations; the
tests validate every spec against the upstream JSON schema.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, Final

import msgspec

from services.enforcement.checkpointing import fsync_directory, write_file_atomically

__all__ = [
    "CDI_VERSION",
    "DEFAULT_SPEC_DIR",
    "KIND",
    "SHARE_KIND",
    "CdiShare",
    "CdiSpecs",
    "build_share_spec",
    "build_spec",
    "check_share_id",
]

CDI_VERSION: Final = "0.6.0"
KIND: Final = "dracap.io/gpu-share"
#: the kind of the specs of shares other than MPS GPU shares (see :func:`build_share_spec`)
SHARE_KIND: Final = "dracap.io/share"
DEFAULT_SPEC_DIR: Final = Path("/var/run/cdi")
ANNOTATION_SHARE: Final = "dracap.io/share-id"
ANNOTATION_UUID: Final = "dracap.io/gpu-uuid"
ANNOTATION_DEVICE: Final = "dracap.io/device"

# A share id becomes a CDI device name and a path component: CDI allows letters, digits,
# "_", "-", ".", ":" after a leading letter or digit; dracap drops ":" (not in paths).
_SHARE_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_share_id(share_id: str) -> str:
    """``share_id`` if it is safe as a CDI device name and a file name; else ValueError."""
    if not _SHARE_ID.fullmatch(share_id):
        raise ValueError(f"share id {share_id!r} is not a valid CDI device name")
    return share_id


class CdiShare(msgspec.Struct, frozen=True, kw_only=True):
    """What the container of one share is given."""

    share_id: str
    device: str
    gpu_uuid: str
    pipe_dir: Path
    log_dir: Path


def build_spec(share: CdiShare, *, kind: str = KIND) -> dict[str, Any]:
    """The CDI spec (a JSON object) for one share."""
    check_share_id(share.share_id)
    edits = {
        "env": [
            f"CUDA_MPS_PIPE_DIRECTORY={share.pipe_dir}",
            f"CUDA_MPS_LOG_DIRECTORY={share.log_dir}",
            f"DRACAP_SHARE_ID={share.share_id}",
            f"NVIDIA_VISIBLE_DEVICES={share.gpu_uuid}",
        ],
        "mounts": [
            _mount(share.pipe_dir, "rw"),
            _mount(share.log_dir, "ro"),
        ],
    }
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind,
        "devices": [
            {
                "name": share.share_id,
                "annotations": {
                    ANNOTATION_SHARE: share.share_id,
                    ANNOTATION_DEVICE: share.device,
                    ANNOTATION_UUID: share.gpu_uuid,
                },
                "containerEdits": edits,
            }
        ],
    }


def build_share_spec(share_id: str, device: str, *, kind: str = SHARE_KIND) -> dict[str, Any]:
    """The CDI spec of a share that needs no device node (a bandwidth share, a ``none`` one):
    the container learns its ShareID; the limit itself is the node's (tc on its interface)."""
    check_share_id(share_id)
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind,
        "devices": [
            {
                "name": share_id,
                "annotations": {ANNOTATION_SHARE: share_id, ANNOTATION_DEVICE: device},
                "containerEdits": {"env": [f"DRACAP_SHARE_ID={share_id}"]},
            }
        ],
    }


def _mount(path: Path, access: str) -> dict[str, Any]:
    return {
        "hostPath": str(path),
        "containerPath": str(path),
        "type": "bind",
        "options": ["rbind", access, "nosuid", "nodev", "noexec"],
    }


class CdiSpecs:
    """The CDI spec files of one kind in one directory, one per share."""

    def __init__(self, spec_dir: Path = DEFAULT_SPEC_DIR, *, kind: str = KIND) -> None:
        self.spec_dir = spec_dir
        self.kind = kind
        self._prefix = kind.replace("/", "-") + "_"

    def path_of(self, share_id: str) -> Path:
        """The spec file of ``share_id``."""
        return self.spec_dir / f"{self._prefix}{check_share_id(share_id)}.json"

    def qualified_name(self, share_id: str) -> str:
        """The fully qualified CDI device name a kubelet plugin hands the runtime."""
        return f"{self.kind}={check_share_id(share_id)}"

    def write(self, share: CdiShare) -> Path:
        """Write (or rewrite, if it differs) the spec of ``share``; returns its path."""
        return self.write_spec(share.share_id, build_spec(share, kind=self.kind))

    def write_spec(self, share_id: str, spec: dict[str, Any]) -> Path:
        """Write (or rewrite, if it differs) ``spec`` as the file of ``share_id``."""
        path = self.path_of(share_id)
        data = json.dumps(spec, indent=2, sort_keys=True) + "\n"
        encoded = data.encode("utf-8")
        with contextlib.suppress(OSError):
            if path.read_bytes() == encoded:
                return path
        write_file_atomically(path, encoded, mode=0o644)
        return path

    def read(self, share_id: str) -> dict[str, Any] | None:
        """The spec of ``share_id`` as stored, or ``None`` (missing or unreadable)."""
        try:
            spec = json.loads(self.path_of(share_id).read_bytes())
        except (OSError, ValueError):
            return None
        return spec if isinstance(spec, dict) else None

    def remove(self, share_id: str) -> None:
        """Delete the spec of ``share_id`` (a no-op if there is none)."""
        path = self.path_of(share_id)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        fsync_directory(path.parent)

    def share_ids(self) -> list[str]:
        """Shares that have a spec file here, sorted."""
        if not self.spec_dir.is_dir():
            return []
        out = []
        for path in self.spec_dir.glob(f"{self._prefix}*.json"):
            share_id = path.name[len(self._prefix) : -len(".json")]
            if _SHARE_ID.fullmatch(share_id):
                out.append(share_id)
        return sorted(out)


def gpu_uuid_of(spec: dict[str, Any]) -> str | None:
    """The GPU UUID recorded in a spec written by :func:`build_spec`."""
    devices = spec.get("devices")
    if not isinstance(devices, list) or len(devices) != 1 or not isinstance(devices[0], dict):
        return None
    annotations = devices[0].get("annotations")
    if not isinstance(annotations, dict):
        return None
    value = annotations.get(ANNOTATION_UUID)
    return value if isinstance(value, str) else None
