"""The node agent's checkpoint: versioned, checksummed, atomic, with a boot id."""

from __future__ import annotations

import datetime
import json
import os
import threading
from pathlib import Path

import pytest

from events.quantities import Quantity
from services.enforcement.checkpointing import (
    CHECKPOINT_VERSION,
    Checkpoint,
    checksum_of,
    load,
    write_file_atomically,
)
from services.enforcement.enforcers import AppliedLimit, ShareLimit

NOW = datetime.datetime(2025, 6, 1, 12, 0, 0, 123456, tzinfo=datetime.UTC)
BOOT_A = "3f0c1e2d-aaaa-4bbb-8ccc-000000000001"
BOOT_B = "3f0c1e2d-aaaa-4bbb-8ccc-000000000002"


def clock() -> datetime.datetime:
    return NOW


def limit(share_id: str = "s-1", memory: str = "10Gi") -> ShareLimit:
    return ShareLimit(
        share_id=share_id,
        driver="gpu.dracap.io",
        pool="node-a-gpus",
        device="gpu-0",
        consumed={"memory": Quantity.parse(memory)},
    )


def applied(memory: str = "10Gi") -> AppliedLimit:
    return AppliedLimit(level="hard", actual={"memory": Quantity.parse(memory)})


@pytest.fixture
def boot(tmp_path: Path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text(BOOT_A + "\n")
    return path


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "checkpoint.json"


def fresh(path: Path, boot: Path) -> Checkpoint:
    return load(path, boot_id_path=boot, clock=clock)


def test_missing_file_is_an_empty_checkpoint(path: Path, boot: Path) -> None:
    cp = fresh(path, boot)
    assert cp.entries == {}
    assert cp.warning is None
    assert not cp.rebooted
    assert cp.boot_id == BOOT_A


def test_round_trip(path: Path, boot: Path) -> None:
    cp = fresh(path, boot)
    cp.mark_started("s-1", limit("s-1"))
    cp.mark_completed("s-1", applied())
    cp.mark_started("s-2", limit("s-2", "1536Mi"))
    again = fresh(path, boot)
    assert again.warning is None
    assert not again.rebooted
    assert again.entries == cp.entries
    assert again.entries["s-1"].applied == applied()
    assert again.entries["s-1"].limit.consumed["memory"] == Quantity.parse("10Gi")
    assert again.entries["s-2"].updated_at == NOW


def test_file_format_is_versioned_and_checksummed(path: Path, boot: Path) -> None:
    cp = fresh(path, boot)
    cp.mark_started("s-1", limit())
    document = json.loads(path.read_bytes())
    assert set(document) == {"version", "checksum", "body"}
    assert document["version"] == CHECKPOINT_VERSION
    assert document["checksum"] == checksum_of(document["body"])
    assert document["checksum"].startswith("sha256:")
    assert document["body"]["boot_id"] == BOOT_A
    assert document["body"]["entries"]["s-1"]["limit"]["consumed"] == {"memory": "10Gi"}
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)


def test_two_phase_states(path: Path, boot: Path) -> None:
    cp = fresh(path, boot)
    cp.mark_started("s-1", limit())
    # Durable before the daemon or the kernel is touched: a crash now leaves "started".
    after_crash = fresh(path, boot)
    assert after_crash.entries["s-1"].phase == "started"
    assert after_crash.entries["s-1"].applied is None
    assert set(after_crash.pending()) == {"s-1"}

    cp.mark_completed("s-1", applied())
    done = fresh(path, boot)
    assert done.entries["s-1"].phase == "completed"
    assert done.entries["s-1"].applied == applied()
    assert done.pending() == {}

    cp.mark_removing("s-1")
    removing = fresh(path, boot)
    assert removing.entries["s-1"].phase == "removing"
    assert set(removing.pending()) == {"s-1"}

    cp.mark_removed("s-1")
    assert fresh(path, boot).entries == {}
    cp.mark_removed("s-1")  # idempotent
    cp.mark_removing("never-seen")  # nothing to mark


def test_completed_needs_started(path: Path, boot: Path) -> None:
    cp = fresh(path, boot)
    with pytest.raises(KeyError, match="never marked started"):
        cp.mark_completed("s-1", applied())
    with pytest.raises(ValueError, match="carries the limit of"):
        cp.mark_started("s-1", limit("s-2"))
    assert not path.exists()


def test_boot_id_change_is_reported(path: Path, boot: Path) -> None:
    cp = fresh(path, boot)
    cp.mark_started("s-1", limit())
    cp.mark_completed("s-1", applied())
    boot.write_text(BOOT_B + "\n")
    after_reboot = fresh(path, boot)
    assert after_reboot.rebooted
    assert after_reboot.previous_boot_id == BOOT_A
    assert after_reboot.boot_id == BOOT_B
    # Entries survive: they say what must be applied again.
    assert after_reboot.entries["s-1"].phase == "completed"
    after_reboot.save()
    assert not fresh(path, boot).rebooted


def test_checksum_mismatch_is_set_aside(path: Path, boot: Path) -> None:
    fresh(path, boot).mark_started("s-1", limit())
    document = json.loads(path.read_bytes())
    document["body"]["entries"]["s-1"]["limit"]["consumed"]["memory"] = "40Gi"  # edited
    path.write_text(json.dumps(document))
    cp = fresh(path, boot)
    assert cp.entries == {}
    assert cp.warning is not None
    assert cp.warning.reason == "checksum-mismatch"
    assert cp.warning.set_aside == f"{path}.corrupt-20250601T120000.123456Z"
    assert not path.exists()
    assert json.loads(Path(cp.warning.set_aside).read_text()) == document
    # The next save writes a clean file; loading again warns no more.
    cp.mark_started("s-2", limit("s-2"))
    assert fresh(path, boot).warning is None


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "corrupt"),
        (b'{"version": 1, "checksum": "sha256:', "corrupt"),  # torn write
        (b"\xff\xfe", "corrupt"),
        (b"[]", "corrupt"),
        (b'{"version": 2, "checksum": "x", "body": {}}', "foreign-version"),
        (b'{"version": "1", "checksum": "x", "body": {}}', "foreign-version"),
        (b'{"checksum": "x", "body": {}}', "foreign-version"),
        (b'{"version": 1, "checksum": "x", "body": {}}', "checksum-mismatch"),
    ],
)
def test_unusable_files_are_set_aside(path: Path, boot: Path, content: bytes, reason: str) -> None:
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    cp = fresh(path, boot)
    assert cp.entries == {}
    assert cp.warning is not None
    assert cp.warning.reason == reason
    assert cp.warning.set_aside is not None
    assert Path(cp.warning.set_aside).read_bytes() == content
    assert not path.exists()


def test_valid_checksum_over_wrong_shape_is_corrupt(path: Path, boot: Path) -> None:
    body = {"boot_id": BOOT_A, "entries": {"s-1": {"share_id": "s-1", "phase": "done"}}}
    document = {"version": CHECKPOINT_VERSION, "checksum": checksum_of(body), "body": body}
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(document))
    cp = fresh(path, boot)
    assert cp.warning is not None
    assert cp.warning.reason == "corrupt"


def test_entry_under_another_key_is_corrupt(path: Path, boot: Path) -> None:
    cp = fresh(path, boot)
    cp.mark_started("s-1", limit())
    document = json.loads(path.read_bytes())
    body = document["body"]
    body["entries"]["s-9"] = body["entries"].pop("s-1")
    document["checksum"] = checksum_of(body)
    path.write_text(json.dumps(document))
    warning = fresh(path, boot).warning
    assert warning is not None
    assert warning.reason == "corrupt"


def test_a_file_that_cannot_be_set_aside_still_loads_empty(
    path: Path, boot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path.parent.mkdir(parents=True)
    path.write_bytes(b"garbage")

    def refuse(src: object, dst: object) -> None:
        raise PermissionError("read-only")

    monkeypatch.setattr(os, "replace", refuse)
    cp = fresh(path, boot)
    assert cp.entries == {}
    assert cp.warning is not None
    assert cp.warning.set_aside is None
    assert "could not set it aside" in cp.warning.detail


def test_missing_boot_id_reads_as_empty(path: Path, tmp_path: Path) -> None:
    cp = load(path, boot_id_path=tmp_path / "no-such-file", clock=clock)
    assert cp.boot_id == ""


def test_atomic_write_never_shows_a_partial_file(tmp_path: Path) -> None:
    target = tmp_path / "file.json"
    big = [b"A" * 1_000_000, b"B" * 1_000_000]
    write_file_atomically(target, big[0])
    seen: set[bytes] = set()
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            data = target.read_bytes()
            seen.add(data[:1] + str(len(data)).encode())

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(30):
            write_file_atomically(target, big[i % 2])
    finally:
        stop.set()
        thread.join()
    assert seen <= {b"A1000000", b"B1000000"}
    assert os.listdir(tmp_path) == ["file.json"]  # no temporary file left behind


def test_failed_write_keeps_the_old_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "file.json"
    write_file_atomically(target, b"old")

    def fail_fsync(fd: int) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", fail_fsync)
    with pytest.raises(OSError, match="disk gone"):
        write_file_atomically(target, b"new")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["file.json"]


def test_save_failure_raises_so_the_agent_does_not_go_on(
    path: Path, boot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cp = fresh(path, boot)

    def fail_fsync(fd: int) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", fail_fsync)
    with pytest.raises(OSError, match="disk gone"):
        cp.mark_started("s-1", limit())
