"""GPU memory limits through CUDA MPS: one control daemon per share.

:class:`MpsEnforcer` implements :class:`~services.enforcement.enforcers.Enforcer` for
GPU memory shares. For each share it runs its **own** ``nvidia-cuda-mps-control``
daemon, with private directories under a root (default ``/run/dracap/mps``)::

    <root>/<share id>/pipe   CUDA_MPS_PIPE_DIRECTORY (sockets, the daemon's pid file)
    <root>/<share id>/log    CUDA_MPS_LOG_DIRECTORY  (control.log, server.log)

and hands the container that daemon through a CDI spec (:mod:`services.enforcement.cdi`).

apply(limit)
    1. The device's GPU UUID comes from the mapping given at construction (an unknown
       device is a permanent failure).
    2. The limit is the share's consumed ``memory`` (the capacity name is configurable)
       in **whole MiB, rounded down**: the daemon takes an integer with an ``M`` suffix,
       and rounding down means the limit in force is never above what the share was
       granted, so shares on one GPU never add up to more than the device. A share
       below 1 MiB cannot be expressed and fails permanently.
    3. The daemon starts with ``<control> -d`` and the share's env
       (``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_LOG_DIRECTORY`` and
       ``CUDA_VISIBLE_DEVICES=<uuid>``, which confines its servers to that GPU); it is
       ready when ``nvidia-cuda-mps-control.pid`` appears in the pipe directory and
       names a live process.
    4. ``set_default_device_pinned_mem_limit <uuid> <MiB>M`` goes to the daemon on the
       control tool's stdin (as ``echo ... | nvidia-cuda-mps-control`` does), then
       ``get_default_device_pinned_mem_limit <uuid>`` reads it back. The level is
       ``hard`` and ``actual`` the MiB set (as a binary quantity) only when the
       read-back matches; otherwise the apply fails.
    5. The CDI spec is written last, so no container can reach a daemon whose limit
       is not verified.

    The read-back is parsed strictly: ``<n>M`` must equal the MiB set; ``<n>G`` must
    equal it divided by 1024, rounded down — drivers print limits of 1 GiB and more in
    whole GiB (driver 595 shows a 1044M limit as ``1G``), so a read-back in G proves the
    limit only to the GiB; dracap shares are normally whole GiB, where it is exact.
    Any other reply is a mismatch.

Failures (:class:`~services.enforcement.enforcers.EnforcementError`)
    *retryable* (``RetryableEnforcementError``): the daemon did not start or is not
    ready yet, a control command timed out (daemon busy) or could not reach a daemon
    that is not running.
    *permanent* (``PermanentEnforcementError``): unknown device, a limit that cannot
    be expressed, a command the live daemon refused (invalid limit, unknown GPU), a
    read-back that does not match, or a different limit for a share whose daemon
    already has a server running (``set_default_*`` only affects servers started
    later). A permanent failure tears
    the share's daemon and directories down again.

remove(share_id)
    Deletes the CDI spec first (no new container gets the device), sends ``quit`` to
    the daemon (``SIGTERM`` if it does not exit), then deletes its directories.

observe()
    Every share under the root whose daemon is running and whose CDI spec exists,
    with the limit read back from the daemon now.

Every call is idempotent and keyed by ShareID; calls for one share are serialised.

.. warning:: **MPS limits apply per client process.** The default pinned device
   memory limit bounds each CUDA *process* (each MPS client) separately. A pod that
   runs several CUDA processes against the share's daemon can use the limit in
   *each* of them, so a share's total GPU memory is bounded by limit x processes, not
   by the limit. ``hard`` here means "hard per process". The stronger mechanism is the
   cgroup v2 ``dmem`` controller (device memory accounting per cgroup, i.e. per pod),
   to be added where the kernel and the GPU driver support it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from events.catalog import EnforcementLevel
from events.quantities import Format, Quantity
from services.enforcement.cdi import CdiShare, CdiSpecs, check_share_id, gpu_uuid_of
from services.enforcement.enforcers import (
    AppliedLimit,
    EnforcementError,
    PermanentEnforcementError,
    RetryableEnforcementError,
    ShareLimit,
)
from services.runtime.ground.waiting import wait_for

__all__ = ["MpsEnforcer", "MpsSettings", "mib_of", "parse_limit_reply"]

log = logging.getLogger("dracap.enforcement.mps")

MIB: Final = 1 << 20
PID_FILE: Final = "nvidia-cuda-mps-control.pid"
# GPU-<uuid>, MIG-<uuid> or the older MIG-GPU-<uuid>/<gi>/<ci>: no spaces, no newlines.
_GPU_UUID: Final = re.compile(r"(GPU|MIG)-[A-Za-z0-9/-]{1,120}")
_REPLY: Final = re.compile(r"([0-9]{1,12})([MG])")


@dataclass(frozen=True, kw_only=True)
class MpsSettings:
    """Where daemons live, which binary runs them, and how long to wait for them."""

    root: Path = Path("/run/dracap/mps")
    control_binary: str = "nvidia-cuda-mps-control"
    capacity: str = "memory"
    command_timeout_s: float = 10.0
    start_timeout_s: float = 10.0
    stop_timeout_s: float = 10.0
    poll_interval_s: float = 0.05


def mib_of(limit: ShareLimit, capacity: str = "memory") -> int:
    """The share's consumed ``capacity`` in whole MiB, rounded down (never above it)."""
    amount = limit.consumed.get(capacity)
    if amount is None:
        raise PermanentEnforcementError(
            f"share {limit.share_id} consumes no {capacity!r} capacity",
        )
    mib = amount.nanos // (10**9 * MIB)
    if mib < 1:
        raise PermanentEnforcementError(
            f"share {limit.share_id}: {amount} of {capacity} is below 1Mi, which MPS cannot "
            "express",
        )
    return mib


def parse_limit_reply(reply: str) -> tuple[int, int] | None:
    """A read-back as the range of MiB it proves, ``(low, high)``; ``None`` if unknown."""
    match = _REPLY.fullmatch(reply.strip())
    if match is None:
        return None
    value = int(match.group(1))
    if match.group(2) == "M":
        return (value, value)
    return (value * 1024, value * 1024 + 1023)


def _quantity_of_mib(mib: int) -> Quantity:
    return Quantity.from_int(mib * MIB, Format.BINARY_SI)


class _CommandFailedError(Exception):
    """The control tool exited non-zero (``output`` is what it said)."""

    def __init__(self, command: str, code: int, output: str) -> None:
        super().__init__(f"{command!r} exited {code}: {output.strip()[:300]}")
        self.output = output


class _Share:
    """The paths of one share's daemon."""

    def __init__(self, root: Path, share_id: str) -> None:
        self.share_id = check_share_id(share_id)
        self.dir = root / share_id
        self.pipe = self.dir / "pipe"
        self.log = self.dir / "log"

    def env(self, gpu_uuid: str | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log)
        if gpu_uuid is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu_uuid
        return env

    def pid(self) -> int | None:
        try:
            text = (self.pipe / PID_FILE).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            return None
        return int(text) if text.isdigit() and int(text) > 0 else None

    def running(self) -> bool:
        pid = self.pid()
        return pid is not None and _process_alive(pid)


def _process_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        return False
    except OSError:
        stat = ""
    if stat:
        # "pid (comm) S ...": the state follows the last ")"; a zombie has exited.
        return stat.rpartition(")")[2].split()[:1] != ["Z"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MpsEnforcer:
    """GPU memory limits through one MPS control daemon per share (see module docstring)."""

    level: EnforcementLevel = "hard"

    def __init__(
        self,
        gpus: Mapping[str, str],
        *,
        cdi: CdiSpecs,
        settings: MpsSettings | None = None,
    ) -> None:
        for device, uuid in gpus.items():
            if not _GPU_UUID.fullmatch(uuid):
                raise ValueError(f"device {device!r}: {uuid!r} is not a GPU UUID")
        self.gpus = dict(gpus)
        self.cdi = cdi
        self.settings = settings or MpsSettings()
        self._locks: dict[str, asyncio.Lock] = {}

    # -- the Enforcer protocol --------------------------------------------------------

    async def apply(self, limit: ShareLimit) -> AppliedLimit:
        """Run the share's daemon with its limit, verify it, publish its CDI spec."""
        uuid = self.gpus.get(limit.device)
        if uuid is None:
            raise PermanentEnforcementError(
                f"share {limit.share_id}: device {limit.device!r} has no known GPU UUID",
            )
        mib = mib_of(limit, self.settings.capacity)
        share = self._share(limit.share_id)
        async with self._lock(share.share_id):
            try:
                return await self._apply(share, limit, uuid, mib)
            except PermanentEnforcementError as exc:
                log.warning("share %s: tearing down after %s", share.share_id, exc)
                with contextlib.suppress(EnforcementError, OSError):
                    await self._teardown(share)
                raise

    async def remove(self, share_id: str) -> None:
        """Withdraw the CDI spec, stop the daemon, delete its directories."""
        share = self._share(share_id)
        async with self._lock(share.share_id):
            await self._teardown(share)

    async def health(self) -> dict[tuple[str, str, str], str | None]:
        """Nothing beyond discovery: a GPU that vanished is found by the inventory scan."""
        return {}

    async def usage(self) -> dict[str, int]:
        """Not observable here (an MPS client's attachment is not read back yet)."""
        return {}

    async def observe(self) -> dict[str, AppliedLimit]:
        """Shares whose daemon runs and whose CDI spec exists, with the limit read now."""
        out: dict[str, AppliedLimit] = {}
        for share_id in self._known_share_ids():
            share = self._share(share_id)
            spec = self.cdi.read(share_id)
            uuid = gpu_uuid_of(spec) if spec is not None else None
            if uuid is None or not share.running():
                continue
            try:
                proved = parse_limit_reply(await self._get_limit(share, uuid))
            except EnforcementError:
                continue
            if proved is not None and proved[0] >= 1:
                out[share_id] = AppliedLimit(
                    level="hard", actual={self.settings.capacity: _quantity_of_mib(proved[0])}
                )
        return out

    # -- apply ---------------------------------------------------------------------------

    async def _apply(self, share: _Share, limit: ShareLimit, uuid: str, mib: int) -> AppliedLimit:
        await self._ensure_running(share, uuid)
        current = parse_limit_reply(await self._get_limit(share, uuid))
        if not _confirms(current, mib):
            await self._set_limit(share, uuid, mib, had=current)
            reply = await self._get_limit(share, uuid)
            if not _confirms(parse_limit_reply(reply), mib):
                raise PermanentEnforcementError(
                    f"share {share.share_id}: the daemon reads back {reply.strip()!r} for "
                    f"{uuid}, not {mib}M",
                )
        self.cdi.write(
            CdiShare(
                share_id=share.share_id,
                device=limit.device,
                gpu_uuid=uuid,
                pipe_dir=share.pipe,
                log_dir=share.log,
            )
        )
        return AppliedLimit(level="hard", actual={self.settings.capacity: _quantity_of_mib(mib)})

    async def _ensure_running(self, share: _Share, uuid: str) -> None:
        if share.running():
            return
        share.pipe.mkdir(parents=True, exist_ok=True)
        share.log.mkdir(parents=True, exist_ok=True)
        (share.pipe / PID_FILE).unlink(missing_ok=True)  # a stale one from a dead daemon
        await self._start(share, uuid)
        await self._wait_ready(share)

    async def _start(self, share: _Share, uuid: str) -> None:
        binary = self.settings.control_binary
        out_path = share.log / "dracap-start.out"
        try:
            with out_path.open("wb") as out:
                proc = await asyncio.create_subprocess_exec(
                    binary,
                    "-d",
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    env=share.env(uuid),
                    start_new_session=True,
                )
        except OSError as exc:
            raise RetryableEnforcementError(f"cannot run {binary}: {exc}") from exc
        try:
            code = await wait_for(proc.wait(), self.settings.start_timeout_s)
        except TimeoutError as exc:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise RetryableEnforcementError(
                f"share {share.share_id}: {binary} -d did not return",
            ) from exc
        if code != 0:
            said = out_path.read_text(encoding="utf-8", errors="replace").strip()[:300]
            raise RetryableEnforcementError(
                f"share {share.share_id}: {binary} -d exited {code}: {said}",
            )

    async def _wait_ready(self, share: _Share) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.start_timeout_s
        while not share.running():
            if loop.time() >= deadline:
                raise RetryableEnforcementError(
                    f"share {share.share_id}: the MPS control daemon is still starting",
                )
            await asyncio.sleep(self.settings.poll_interval_s)

    async def _get_limit(self, share: _Share, uuid: str) -> str:
        return await self._command(share, f"get_default_device_pinned_mem_limit {uuid}")

    async def _set_limit(
        self, share: _Share, uuid: str, mib: int, *, had: tuple[int, int] | None
    ) -> None:
        if had is not None and await self._has_server(share):
            raise PermanentEnforcementError(
                f"share {share.share_id}: the daemon already serves clients with another "
                f"limit ({had[0]}Mi); a new default would not reach them",
            )
        reply = await self._command(share, f"set_default_device_pinned_mem_limit {uuid} {mib}M")
        if reply.strip():
            log.info("share %s: set limit replied %r", share.share_id, reply.strip()[:300])

    async def _has_server(self, share: _Share) -> bool:
        return bool((await self._command(share, "get_server_list")).strip())

    async def _command(self, share: _Share, command: str) -> str:
        """Send one command; classify failures (see the module docstring)."""
        try:
            return await self._run_control(share, command)
        except TimeoutError as exc:
            raise RetryableEnforcementError(
                f"share {share.share_id}: {command.split()[0]} timed out (daemon busy)",
            ) from exc
        except _CommandFailedError as exc:
            alive = share.running()
            what = "refused" if alive else "failed (daemon not running)"
            error = PermanentEnforcementError if alive else RetryableEnforcementError
            raise error(f"share {share.share_id}: {what}: {exc}") from exc
        except OSError as exc:
            raise RetryableEnforcementError(
                f"cannot run {self.settings.control_binary}: {exc}",
            ) from exc

    async def _run_control(self, share: _Share, command: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            self.settings.control_binary,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=share.env(),
        )
        try:
            out, _ = await wait_for(
                proc.communicate((command + "\n").encode("ascii")), self.settings.command_timeout_s
            )
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        text = out.decode("utf-8", errors="replace")
        if proc.returncode != 0:
            raise _CommandFailedError(command, proc.returncode or -1, text)
        return text

    # -- remove --------------------------------------------------------------------------

    async def _teardown(self, share: _Share) -> None:
        self.cdi.remove(share.share_id)
        pid = share.pid()
        if pid is not None and _process_alive(pid):
            with contextlib.suppress(EnforcementError):
                await self._command(share, "quit")
            if not await self._wait_exit(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                if not await self._wait_exit(pid):
                    raise RetryableEnforcementError(
                        f"share {share.share_id}: the MPS control daemon (pid {pid}) does not stop",
                    )
        await asyncio.to_thread(shutil.rmtree, share.dir, ignore_errors=True)

    async def _wait_exit(self, pid: int) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.stop_timeout_s
        while _process_alive(pid):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(self.settings.poll_interval_s)
        return True

    # -- bookkeeping ---------------------------------------------------------------------

    def _share(self, share_id: str) -> _Share:
        try:
            return _Share(self.settings.root, share_id)
        except ValueError as exc:
            raise PermanentEnforcementError(str(exc)) from exc

    def _lock(self, share_id: str) -> asyncio.Lock:
        return self._locks.setdefault(share_id, asyncio.Lock())

    def _known_share_ids(self) -> list[str]:
        root = self.settings.root
        dirs = [p.name for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
        names = set(self.cdi.share_ids()) | set(dirs)
        out = []
        for name in sorted(names):
            with contextlib.suppress(ValueError):
                out.append(check_share_id(name))
        return out


def _confirms(proved: tuple[int, int] | None, mib: int) -> bool:
    """Whether a read-back range proves the limit ``mib`` (see the module docstring)."""
    if proved is None:
        return False
    low, high = proved
    if low == high:
        return low == mib
    return mib >= 1024 and low <= mib <= high
