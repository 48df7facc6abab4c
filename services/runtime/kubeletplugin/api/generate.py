"""Regenerate the Python stubs of the kubelet's gRPC protocols from ``protos/``.

``python -m services.runtime.kubeletplugin.api.generate`` rewrites the committed
``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` beside this file; ``--check`` only
compares and exits 1 when they differ from a fresh generation (a unit test does the
same, so the stubs cannot drift from the ``.proto`` files).

The ``.proto`` files are compiled under the virtual directory
``services/runtime/kubeletplugin/api`` (protoc's ``-IVIRTUAL=DIR``), so the generated
``*_pb2_grpc.py`` import their messages as ``services.runtime.kubeletplugin.api.X_pb2`` and no
import needs rewriting. The output depends on the exact ``grpcio-tools`` version (it
names itself and the protobuf version in the files): that version is pinned in
``pyproject.toml``, and changing it means regenerating.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Final

PACKAGE_DIR: Final = Path(__file__).resolve().parent
PROTO_DIR: Final = PACKAGE_DIR / "protos"
#: Where the package sits below the repository root, as protoc should see it.
VIRTUAL_DIR: Final = "services/runtime/kubeletplugin/api"
PROTOS: Final = ("pluginregistration.proto", "dra_v1.proto", "dra_health_v1alpha1.proto")
SUFFIXES: Final = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

__all__ = ["GenerationError", "generate", "generated_names", "main"]


class GenerationError(RuntimeError):
    """protoc refused the ``.proto`` files (its message went to stderr)."""


def generated_names() -> list[str]:
    """File names of every generated stub, in a stable order."""
    return [Path(proto).stem + suffix for proto in PROTOS for suffix in SUFFIXES]


def generate(into: Path) -> dict[str, bytes]:
    """Compile the protos with the output rooted at ``into``; the stubs by file name."""
    from grpc_tools import protoc  # a dev/test dependency: only the generator needs it

    args = [
        "grpc_tools.protoc",
        f"-I{VIRTUAL_DIR}={PROTO_DIR}",
        f"--python_out={into}",
        f"--pyi_out={into}",
        f"--grpc_python_out={into}",
        *(str(PROTO_DIR / proto) for proto in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise GenerationError(f"protoc failed on {PROTO_DIR}")
    out = into / VIRTUAL_DIR
    return {name: (out / name).read_bytes() for name in generated_names()}


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) the stubs; 1 when ``--check`` finds drift."""
    parser = argparse.ArgumentParser(prog="python -m services.runtime.kubeletplugin.api.generate")
    parser.add_argument("--check", action="store_true", help="compare only, write nothing")
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        fresh = generate(Path(scratch))
    stale = [n for n, data in fresh.items() if _read(PACKAGE_DIR / n) != data]
    if options.check:
        for name in stale:
            print(f"{PACKAGE_DIR / name}: differs from a fresh generation", file=sys.stderr)
        return 1 if stale else 0
    for name in stale:
        (PACKAGE_DIR / name).write_bytes(fresh[name])
        print(f"wrote {PACKAGE_DIR / name}")
    return 0


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None


if __name__ == "__main__":
    sys.exit(main())
