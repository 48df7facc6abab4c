"""A small log written before the fold kept claims compact, and how to remake its files.

``tests/fixtures/oldlog/`` holds what dracap at ``bb28756`` (snapshot format 2: every
claim's whole manifest and allocation in the fold) made of :func:`rows`:

* ``format2.dracap-log``: the log as ``replay export`` writes it, a checkpoint line
  every :data:`EVERY` events (each a format-2 snapshot);
* ``snapshot.json``: the snapshot body of the fold at the head;
* ``view.json``: ``replay state``'s view of the fold at the head;
* ``timelines.json``: ``replay timeline`` of each claim (:data:`CLAIMS`).

The events use only what that version has too (the catalog, the model, the sample
builders), so the same module made the files there::

    git worktree add /tmp/base bb28756
    cp tests/unit/oldlog.py /tmp/base/tests/unit/
    (cd /tmp/base && .venv/bin/python -m tests.unit.oldlog OUT_DIR)

The claims: ``tuned`` with labels, annotations and opaque configuration (two entries),
allocated with its configuration copied in, ready; ``plain`` allocated, ready,
released; ``alt`` of two alternatives (``firstAvailable``), unschedulable;
``mirrored`` from Kubernetes with its ``status.allocation``, refused.
"""

from __future__ import annotations

import datetime
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec

from events import catalog as c
from events import model
from events.envelopes import stream_of
from tests.integration import sample as s
from tests.unit.test_logfile import _row

EVERY = 4
CLAIMS = ("tuned", "plain", "alt", "mirrored")
T0 = datetime.datetime(2026, 1, 5, 8, 0, tzinfo=datetime.UTC)
NAMESPACE = "team-a"
CONFIG = [
    {
        "requests": ["gpu"],
        "opaque": {
            "driver": s.DRIVER,
            "parameters": {"kind": "Tuning", "mps": {"threads": 40}, "notes": "x" * 2048},
        },
    },
    {"opaque": {"driver": s.DRIVER, "parameters": {"sharing": {"strategy": "TimeSlicing"}}}},
]


def _manifest(name: str, devices: dict[str, Any], **extra: Any) -> model.ResourceClaim:
    meta = {"name": name, "namespace": NAMESPACE, **extra.pop("metadata", {})}
    doc = {"metadata": meta, "spec": {"devices": devices}, **extra}
    return model.convert(doc, model.ResourceClaim)


def _request(name: str = "gpu", memory: str = "10Gi") -> dict[str, Any]:
    exactly = {"deviceClassName": s.DRIVER, "capacity": {"requests": {"memory": memory}}}
    return {"name": name, "exactly": exactly}


def _bound(r: c.CapacityReserved, config: list[dict[str, Any]] | None) -> c.AllocationBound:
    plain = s.bound(r)
    if config is None:
        return plain
    assert plain.allocation.devices is not None
    entries = [{"source": "FromClaim", **entry} for entry in config]
    devices = model.DeviceAllocationResult(
        results=plain.allocation.devices.results,
        config=[model.convert(e, model.DeviceAllocationConfiguration) for e in entries],
    )
    return c.AllocationBound(
        namespace=r.namespace,
        name=r.name,
        allocation_version=r.allocation_version,
        node=r.node,
        allocation=model.AllocationResult(devices=devices),
        share_ids=list(plain.share_ids),
    )


def events() -> list[c.Event]:
    """The log's events, in order (module docstring)."""
    cls = model.convert(
        {"metadata": {"name": s.DRIVER}, "spec": {"selectors": []}}, model.DeviceClass
    )
    out: list[c.Event] = [
        c.DeviceClassApplied(device_class=cls, rollout="immediate"),
        s.slice_published(devices={"gpu-0": {"memory": "80Gi"}, "gpu-1": {"memory": "80Gi"}}),
    ]
    tuned = _manifest(
        "tuned",
        {"requests": [_request()], "config": CONFIG},
        metadata={"labels": {"team": "vision"}, "annotations": {"note": "y" * 512}},
    )
    r = s.reserved(NAMESPACE, "tuned", "gpu-0", "10Gi", share_id=str(uuid.UUID(int=1)))
    out += [
        c.ClaimSubmitted(claim=tuned),
        c.ClaimAdmitted(namespace=NAMESPACE, name="tuned"),
        r,
        _bound(r, CONFIG),
        c.LimitApplied(share_id=r.share_id, node=s.POOL, level="hard", actual=dict(r.consumed)),
    ]
    p = s.reserved(NAMESPACE, "plain", "gpu-1", "20Gi", share_id=str(uuid.UUID(int=2)))
    out += [
        c.ClaimSubmitted(claim=_manifest("plain", {"requests": [_request(memory="20Gi")]})),
        c.ClaimAdmitted(namespace=NAMESPACE, name="plain"),
        p,
        _bound(p, None),
        c.LimitApplied(share_id=p.share_id, node=s.POOL, level="hard", actual=dict(p.consumed)),
        c.ReleaseRequested(namespace=NAMESPACE, name="plain", allocation_version=1),
        s.released(p),
    ]
    options = [
        {"name": "big", "deviceClassName": s.DRIVER, "capacity": {"requests": {"memory": "90Gi"}}},
        {"name": "huge", "deviceClassName": s.DRIVER, "capacity": {"requests": {"memory": "99Gi"}}},
    ]
    alt = _manifest("alt", {"requests": [{"name": "gpu", "firstAvailable": options}]})
    out += [
        c.ClaimSubmitted(claim=alt),
        c.ClaimAdmitted(namespace=NAMESPACE, name="alt"),
        c.ClaimUnschedulable(namespace=NAMESPACE, name="alt", reason="no device has 90Gi free"),
    ]
    result = {
        "request": "gpu",
        "driver": s.DRIVER,
        "pool": s.POOL,
        "device": "gpu-0",
        "shareID": str(uuid.UUID(int=3)),
        "consumedCapacity": {"memory": "75Gi"},
    }
    mirrored = _manifest(
        "mirrored",
        {"requests": [_request(memory="75Gi")]},
        metadata={"uid": str(uuid.UUID(int=4))},
        status={"allocation": {"devices": {"results": [result]}}},
    )
    out += [
        c.ClaimSubmitted(claim=mirrored, source="kubernetes"),
        c.ClaimRejected(
            namespace=NAMESPACE,
            name="mirrored",
            field="status.allocation.devices.results[0]",
            rule="dracap's ledger refuses the allocation (capacity)",
            reason="75Gi consumed + 10Gi > total 80Gi",
        ),
    ]
    return out


def rows() -> list[list[Any]]:
    """The stored rows of :func:`events` (ids and times fixed, stream versions counted)."""
    versions: dict[str, int] = {}
    out: list[list[Any]] = []
    for position, event in enumerate(events(), start=1):
        stream = stream_of(event)
        versions[stream] = versions.get(stream, 0) + 1
        event_id = str(uuid.UUID(int=1000 + position))
        at = T0 + datetime.timedelta(seconds=position)
        out.append(_row(position, event, _1=event_id, _3=versions[stream], _10=at))
    return out


def timelines(path: Path) -> dict[str, Any]:
    """``replay timeline`` of each claim of :data:`CLAIMS` in the file at ``path``, as
    plain data."""
    import asyncio

    from services.replay.history import find_entity, timeline
    from services.replay.sources import FileSource

    out: dict[str, Any] = {}
    for name in CLAIMS:
        state = asyncio.run(_head_state(path))
        entity = find_entity(state, f"{NAMESPACE}/{name}")
        assert entity is not None
        steps = asyncio.run(timeline(FileSource(path), entity))
        out[name] = json.loads(json.dumps([msgspec.to_builtins(s) for s in steps]))
    return out


async def _head_state(path: Path) -> Any:
    from services.replay.history import state_at
    from services.replay.sources import FileSource

    return await state_at(FileSource(path), len(rows()))


def main(out: Path) -> None:
    """Write the files of the module docstring into ``out``."""
    from events.state import ClusterState
    from events.statecodec import snapshot_encode
    from services.replay.checkpoints import CheckpointWriter
    from services.replay.history import view
    from services.replay.verify import fold_rows

    out.mkdir(parents=True, exist_ok=True)
    log = out / "format2.dracap-log"
    writer = CheckpointWriter(log, source="tests.unit.oldlog", every=EVERY)
    writer.write(rows())
    writer.close()
    state = ClusterState()
    fold_rows(state, rows())
    (out / "snapshot.json").write_bytes(snapshot_encode(state))
    (out / "view.json").write_text(json.dumps(view(state), indent=1, sort_keys=True) + "\n")
    text = json.dumps(timelines(log), indent=1, sort_keys=True)
    (out / "timelines.json").write_text(text + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
