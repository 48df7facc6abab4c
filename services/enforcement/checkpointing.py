"""The node agent's durable checkpoint: what it set out to enforce, and what it finished.

The agent touches things that outlive it (MPS control daemons, CDI spec files, tc
classes). After a crash it must know which of them it started, which it completed and
which it was taking away, so it can reconcile them with the kernel and the event log.
This module keeps that record, following the habits of the NVIDIA DRA driver and
dra-example-driver:

* **Versioned.** The file names its format version (:data:`CHECKPOINT_VERSION`). A file
  of another version — older or newer — is never guessed at: it is set aside.
* **Checksummed.** ``checksum`` is ``sha256:`` + the hex SHA-256 of the *canonical* body
  (``json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``,
  UTF-8). A torn or edited file fails the check and is set aside.
* **Atomic.** :func:`write_file_atomically` writes a temporary file in the same
  directory, fsyncs it, renames it over the target and fsyncs the directory: a reader
  sees the old file or the new one, never a partial one, even across a power loss.
* **Boot id.** The body records ``/proc/sys/kernel/random/boot_id``. A checkpoint from
  another boot is loaded (its entries still say what was intended) but flagged
  :attr:`Checkpoint.rebooted`: daemons and kernel state did not survive the reboot, so
  every entry must be applied again.
* **Two-phase records.** :meth:`Checkpoint.mark_started` is written (and fsynced)
  *before* the agent touches a daemon or the kernel, :meth:`Checkpoint.mark_completed`
  after; :meth:`Checkpoint.mark_removing` before a removal and
  :meth:`Checkpoint.mark_removed` (the entry disappears) after. An entry left in
  ``started`` or ``removing`` after a crash is an operation whose outcome is unknown:
  the agent asks the enforcer (``observe()``) what is really in force.

File layout (JSON)::

    {"version": 1,
     "checksum": "sha256:<hex of the canonical body>",
     "body": {"boot_id": "...",
              "entries": {"<share id>": {"share_id": "...", "phase": "completed",
                                          "limit": {...ShareLimit...},
                                          "applied": {"level": "hard", "actual": {...}},
                                          "updated_at": "2025-...Z"}}}}

:func:`load` never raises for bad content: a corrupted file, a checksum mismatch or a
foreign version is renamed to ``<path>.corrupt-<UTC timestamp>`` and an empty checkpoint
is returned with a :class:`CheckpointWarning` the caller turns into an event (an agent
that crashed on its own checkpoint would crash again on every restart). Only a failure
to *write* raises (:class:`OSError`): then the agent must not go on to touch the kernel.

The API is synchronous (small files, a few fsyncs); an asyncio caller that minds the
latency can wrap the calls in :func:`asyncio.to_thread`. Saves are serialised by a lock.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal, TypeAlias

import msgspec

from events.model import decode_hook, encode_hook
from services.enforcement.enforcers import AppliedLimit, ShareLimit

__all__ = [
    "BOOT_ID_PATH",
    "CHECKPOINT_VERSION",
    "Checkpoint",
    "CheckpointEntry",
    "CheckpointWarning",
    "Phase",
    "load",
    "write_file_atomically",
]

CHECKPOINT_VERSION: Final = 1
BOOT_ID_PATH: Final = Path("/proc/sys/kernel/random/boot_id")
_CHECKSUM_PREFIX: Final = "sha256:"

Phase: TypeAlias = Literal["started", "completed", "removing"]
WarningReason: TypeAlias = Literal["unreadable", "corrupt", "checksum-mismatch", "foreign-version"]
Clock: TypeAlias = Callable[[], datetime.datetime]


class CheckpointEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One share's record: what was asked (``limit``) and, once done, what is in force."""

    share_id: str
    phase: Phase
    limit: ShareLimit
    applied: AppliedLimit | None = None
    updated_at: datetime.datetime


class _Body(msgspec.Struct, frozen=True, kw_only=True):
    boot_id: str
    entries: dict[str, CheckpointEntry]


class CheckpointWarning(msgspec.Struct, frozen=True, kw_only=True):
    """Why a checkpoint file was not used; the caller reports it (an event, a log line)."""

    reason: WarningReason
    detail: str
    path: str
    set_aside: str | None = None  # where the bad file went (None: it could not be moved)


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def read_boot_id(path: Path = BOOT_ID_PATH) -> str:
    """This boot's id (``""`` where the kernel does not offer one)."""
    try:
        return path.read_text(encoding="ascii").strip()
    except OSError:
        return ""


def canonical_json(data: Any) -> bytes:
    """The canonical encoding of a JSON value, the input of the checksum."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8")


def checksum_of(body: Any) -> str:
    """``sha256:<hex>`` of the canonical body."""
    return _CHECKSUM_PREFIX + hashlib.sha256(canonical_json(body)).hexdigest()


def write_file_atomically(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data``: temp file, fsync, rename, fsync of the directory."""
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fchmod(out.fileno(), mode)
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_directory(directory)


def fsync_directory(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class Checkpoint:
    """The agent's checkpoint, in memory; every ``mark_*`` is saved before it returns."""

    def __init__(
        self,
        path: Path,
        *,
        boot_id: str,
        entries: dict[str, CheckpointEntry] | None = None,
        previous_boot_id: str | None = None,
        warning: CheckpointWarning | None = None,
        clock: Clock = _utcnow,
    ) -> None:
        self.path = path
        self.boot_id = boot_id
        self.entries: dict[str, CheckpointEntry] = dict(entries or {})
        self.previous_boot_id = previous_boot_id
        self.warning = warning
        self._clock = clock
        self._lock = threading.Lock()

    @property
    def rebooted(self) -> bool:
        """Whether the loaded file was written during another boot of this node."""
        return self.previous_boot_id is not None and self.previous_boot_id != self.boot_id

    def pending(self) -> dict[str, CheckpointEntry]:
        """Entries whose operation may have been cut short (``started`` or ``removing``)."""
        return {k: e for k, e in self.entries.items() if e.phase != "completed"}

    def encode(self) -> bytes:
        """The file content for the current entries (and this boot's id)."""
        body = msgspec.to_builtins(
            _Body(boot_id=self.boot_id, entries=self.entries), enc_hook=encode_hook
        )
        document = {"version": CHECKPOINT_VERSION, "checksum": checksum_of(body), "body": body}
        return canonical_json(document) + b"\n"

    def save(self) -> None:
        """Write the checkpoint atomically (raises :class:`OSError` if it cannot)."""
        with self._lock:
            write_file_atomically(self.path, self.encode())

    def mark_started(self, share_id: str, limit: ShareLimit) -> None:
        """Record, durably, that ``limit`` is about to be applied."""
        self._put(
            CheckpointEntry(
                share_id=share_id, phase="started", limit=limit, updated_at=self._clock()
            )
        )

    def mark_completed(self, share_id: str, applied: AppliedLimit) -> None:
        """Record that the limit of ``share_id`` is in force as ``applied``."""
        entry = self._entry(share_id)
        self._put(
            msgspec.structs.replace(
                entry, phase="completed", applied=applied, updated_at=self._clock()
            )
        )

    def mark_started_all(self, limits: Sequence[ShareLimit]) -> None:
        """:meth:`mark_started` of every limit of a round, in one durable write."""
        now = self._clock()
        for limit in limits:
            entry = CheckpointEntry(
                share_id=limit.share_id, phase="started", limit=limit, updated_at=now
            )
            self.entries[limit.share_id] = entry
        if limits:
            self.save()

    def mark_completed_all(self, applied: Mapping[str, AppliedLimit]) -> None:
        """:meth:`mark_completed` of every limit of a round applied, in one write."""
        now = self._clock()
        for share_id, done in applied.items():
            entry = self._entry(share_id)
            self.entries[share_id] = msgspec.structs.replace(
                entry, phase="completed", applied=done, updated_at=now
            )
        if applied:
            self.save()

    def mark_removing_all(self, share_ids: Sequence[str]) -> None:
        """:meth:`mark_removing` of every removal of a round, in one durable write."""
        now = self._clock()
        marked = False
        for share_id in share_ids:
            entry = self.entries.get(share_id)
            if entry is not None:
                self.entries[share_id] = msgspec.structs.replace(
                    entry, phase="removing", updated_at=now
                )
                marked = True
        if marked:
            self.save()

    def mark_removed_all(self, share_ids: Sequence[str]) -> None:
        """:meth:`mark_removed` of every removal of a round done, in one write."""
        if [self.entries.pop(s, None) for s in share_ids].count(None) < len(share_ids):
            self.save()

    def mark_removing(self, share_id: str) -> None:
        """Record, durably, that the limit of ``share_id`` is about to be removed."""
        entry = self.entries.get(share_id)
        if entry is not None:
            self._put(msgspec.structs.replace(entry, phase="removing", updated_at=self._clock()))

    def mark_removed(self, share_id: str) -> None:
        """Forget ``share_id``: its limit is gone (a no-op if it was never recorded)."""
        if self.entries.pop(share_id, None) is not None:
            self.save()

    def _entry(self, share_id: str) -> CheckpointEntry:
        entry = self.entries.get(share_id)
        if entry is None:
            raise KeyError(f"share {share_id} was never marked started")
        return entry

    def _put(self, entry: CheckpointEntry) -> None:
        if entry.share_id != entry.limit.share_id:
            raise ValueError(f"entry {entry.share_id} carries the limit of {entry.limit.share_id}")
        self.entries[entry.share_id] = entry
        self.save()


class _UnusableError(Exception):
    def __init__(self, reason: WarningReason, detail: str) -> None:
        super().__init__(detail)
        self.reason: WarningReason = reason
        self.detail = detail


def load(
    path: Path,
    *,
    boot_id_path: Path = BOOT_ID_PATH,
    clock: Clock = _utcnow,
) -> Checkpoint:
    """Read the checkpoint at ``path``; a missing file gives an empty one.

    A file that cannot be used is moved aside and an empty checkpoint comes back with
    :attr:`Checkpoint.warning` set; this function does not raise for bad content.
    """
    boot_id = read_boot_id(boot_id_path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Checkpoint(path, boot_id=boot_id, clock=clock)
    except OSError as exc:
        warning = CheckpointWarning(reason="unreadable", detail=str(exc), path=str(path))
        return Checkpoint(path, boot_id=boot_id, warning=warning, clock=clock)
    try:
        body = _decode(raw)
    except _UnusableError as exc:
        warning = _set_aside(path, exc.reason, exc.detail, clock())
        return Checkpoint(path, boot_id=boot_id, warning=warning, clock=clock)
    return Checkpoint(
        path, boot_id=boot_id, entries=body.entries, previous_boot_id=body.boot_id, clock=clock
    )


def _decode(raw: bytes) -> _Body:
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _UnusableError("corrupt", f"not JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise _UnusableError("corrupt", "not a JSON object")
    version = document.get("version")
    if type(version) is not int or version != CHECKPOINT_VERSION:
        raise _UnusableError(
            "foreign-version", f"version {version!r}, expected {CHECKPOINT_VERSION}"
        )
    body = document.get("body")
    if document.get("checksum") != checksum_of(body):
        raise _UnusableError("checksum-mismatch", "the checksum does not match the body")
    try:
        decoded = msgspec.convert(body, type=_Body, dec_hook=decode_hook)
    except (msgspec.ValidationError, ValueError) as exc:
        raise _UnusableError("corrupt", f"unexpected content: {exc}") from exc
    for key, entry in decoded.entries.items():
        if key != entry.share_id or key != entry.limit.share_id:
            raise _UnusableError("corrupt", f"entry {key!r} names another share")
    return decoded


def _set_aside(
    path: Path, reason: WarningReason, detail: str, now: datetime.datetime
) -> CheckpointWarning:
    stamp = now.astimezone(datetime.UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    try:
        os.replace(path, target)
        fsync_directory(path.parent)
    except OSError as exc:
        detail = f"{detail}; could not set it aside: {exc}"
        return CheckpointWarning(reason=reason, detail=detail, path=str(path))
    return CheckpointWarning(reason=reason, detail=detail, path=str(path), set_aside=str(target))
