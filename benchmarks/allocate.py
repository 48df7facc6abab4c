"""``dracap allocate`` end to end: claims per second over generated manifest files.

Input (written to a temporary directory, or ``--keep DIR``): one DeviceClass (a CEL
selector on the driver), ``--slices`` ResourceSlices of ``--devices`` shareable GPUs
each (40Gi, policy min 5Gi step 5Gi, the attributes of ``deploy/examples``), one node
per slice, and ``--claims`` ResourceClaims in ten namespaces asking for 5Gi, 10Gi or
20Gi (every tenth claim asks for two GPUs). The default is the size of issue 10:
100 slices x 100 devices, 3,000 claims.

What is measured:

* **end to end**: ``python -m services.cli allocate -f DIR`` as a subprocess (interpreter
  start, imports, parsing, validation, allocation, printing the table into a pipe);
  the best of ``--runs`` wall-clock times, and claims per second over it;
* **phases**, in this process: reading and decoding the files (``load_paths``), the
  allocation (``allocate_manifests``) and rendering the table, so a regression can be
  placed.

Run:  python -m benchmarks.allocate [--slices 100] [--devices 100] [--claims 3000]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.commands import allocate as command  # noqa: E402

DRIVER = "gpu.bench.io"
CLASS = "gpu-memory.bench.io"
SIZES = ("5Gi", "10Gi", "20Gi")


def device_class() -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": CLASS},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
    }


def resource_slice(index: int, devices: int) -> dict[str, Any]:
    node = f"node-{index}"
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-gpus"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": f"{node}-gpus", "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": f"gpu-{d}",
                    "allowMultipleAllocations": True,
                    "attributes": {
                        "model": {"string": "A100-SXM4-40GB"},
                        "uuid": {"string": f"GPU-{index:08x}-{d:04x}-4d0b-9c6e-0a1b2c3d4e50"},
                        "driverVersion": {"version": "550.54.15"},
                    },
                    "capacity": {
                        "memory": {
                            "value": "40Gi",
                            "requestPolicy": {
                                "default": "5Gi",
                                "validRange": {"min": "5Gi", "step": "5Gi", "max": "40Gi"},
                            },
                        }
                    },
                }
                for d in range(devices)
            ],
        },
    }


def resource_claim(index: int) -> dict[str, Any]:
    def request(name: str) -> dict[str, Any]:
        amount = SIZES[index % len(SIZES)]
        exactly = {"deviceClassName": CLASS, "capacity": {"requests": {"memory": amount}}}
        return {"name": name, "exactly": exactly}

    requests = [request("gpu-a"), request("gpu-b")] if index % 10 == 0 else [request("gpu")]
    spec: dict[str, Any] = {"devices": {"requests": requests}}
    if len(requests) == 2:
        spec["devices"]["constraints"] = [{"distinctAttribute": f"{DRIVER}/uuid"}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": f"claim-{index}", "namespace": f"tenant-{index % 10}"},
        "spec": spec,
    }


def write_input(directory: Path, slices: int, devices: int, claims: int) -> None:
    """The benchmark's manifest files, as multi-document YAML like an operator writes."""
    inventory = [device_class(), *(resource_slice(i, devices) for i in range(slices))]
    (directory / "inventory.yaml").write_text(yaml.safe_dump_all(inventory, sort_keys=False))
    documents = (resource_claim(i) for i in range(claims))
    (directory / "claims.yaml").write_text(yaml.safe_dump_all(documents, sort_keys=False))


def end_to_end(directory: Path, runs: int) -> tuple[float, str]:
    """The best wall-clock time of ``dracap allocate -f DIRECTORY``, and its last line."""
    best, last = float("inf"), ""
    for _ in range(runs):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", "allocate", "-f", str(directory)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        best = min(best, time.perf_counter() - started)
        last = done.stdout.rstrip().rsplit("\n", 1)[-1]
    return best, last


def phases(directory: Path) -> dict[str, float]:
    """Seconds spent reading, allocating and rendering, in this process."""
    started = time.perf_counter()
    objects = command.load_paths([directory], check=False)
    read = time.perf_counter()
    decisions = command.allocate_manifests(objects)
    decided = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        print(command.render_table(command.report_rows(decisions)))
    printed = time.perf_counter()
    return {"read": read - started, "allocate": decided - read, "print": printed - decided}


@contextlib.contextmanager
def input_directory(keep: str | None) -> Iterator[Path]:
    if keep:
        path = Path(keep)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="dracap-allocate-") as scratch:
        yield Path(scratch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slices", type=int, default=100)
    parser.add_argument("--devices", type=int, default=100, help="devices per slice")
    parser.add_argument("--claims", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=3, help="end-to-end runs (best is kept)")
    parser.add_argument("--keep", metavar="DIR", help="write the input here and keep it")
    args = parser.parse_args()
    with input_directory(args.keep) as directory:
        write_input(directory, args.slices, args.devices, args.claims)
        size = sum(f.stat().st_size for f in directory.iterdir()) / 2**20
        print(
            f"input: {args.slices} slices x {args.devices} devices, {args.claims} claims "
            f"({size:.1f} MiB of YAML)"
        )
        split = phases(directory)
        print("phases in-process: " + ", ".join(f"{k} {v:.2f}s" for k, v in split.items()))
        seconds, last = end_to_end(directory, args.runs)
        print(f"last row: {last}")
        print(
            f"dracap allocate end to end: {seconds:.2f}s (best of {args.runs}), "
            f"{args.claims / seconds:,.0f} claims/s"
        )


if __name__ == "__main__":
    main()
