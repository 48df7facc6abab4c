"""A service of ``dracap up`` that runs as a child process: started, watched, stopped.

``dracap up`` runs its deciding services as tasks of one event loop (:mod:`services.stack`),
but the audit and billing subscribers run as ``dracap serve ledger``, a process of their
own: in the loop, each of their batches held it for 30-120 ms a few times a second,
and every claim in flight waited that long (issue 25, ``docs/services.md``).
:class:`ChildService` keeps such a process, as one asyncio task of ``dracap up``:

* **Start.** The command runs in a session of its own, as the embedded servers do: the
  terminal's Ctrl-C reaches ``dracap up`` only, which stops its children in order. Its
  environment names ``dracap up``'s pid in :data:`PARENT_PID_ENV`; the child's
  :func:`stop_with_parent` asks the kernel for a SIGTERM when that process dies, so a
  ``dracap up`` killed with SIGKILL leaves no child behind (Linux; elsewhere the child
  outlives it). It also names the child in :data:`LOG_TAG_ENV`: the child's log lines,
  on the standard error both share, carry ``[name]`` (:func:`log_tag`), so that a
  server's outage that both report reads as two processes' lines, not one said twice.
* **Watching.** A child that exits while ``dracap up`` runs is one log line (its exit
  status, or the signal that killed it; its own reasons are on the shared standard
  error) and is started again after a back-off: 0.5 s doubling to 30 s, back to 0.5 s
  once a run lasted :data:`STEADY_S`, or when a health check of ``dracap up`` passes
  again (:meth:`ChildService.retry_now`: a child that could not start during an
  outage starts as soon as the server is back). No traceback: a child's exit is
  expected.
* **Priority.** ``niceness`` makes the child nicer than ``dracap up`` (set on the
  process right after it starts, so its threads inherit it): on a busy machine the
  deciding services come first, and a subscriber catches up when they leave it a core.
* **Health.** :meth:`ChildService.trouble` is ``dracap up``'s check of it: None while
  the process runs, else why not (starting, exited and when it starts again).
* **Stop.** SIGTERM (the child drains as on Ctrl-C), SIGKILL after ``grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Final

from services.runtime.ground.waiting import first_of, wait_for

__all__ = [
    "LOG_TAG_ENV",
    "PARENT_PID_ENV",
    "STEADY_S",
    "ChildService",
    "exit_reason",
    "log_tag",
    "stop_with_parent",
]

log = logging.getLogger("dracap.children")

#: The variable that names the parent a child stops with (:func:`stop_with_parent`).
PARENT_PID_ENV: Final = "DRACAP_PARENT_PID"
#: The variable that names a child in its log lines (:func:`log_tag`): its service's name.
LOG_TAG_ENV: Final = "DRACAP_LOG_TAG"
#: A run this long resets the restart back-off to its first delay.
STEADY_S: Final = 60.0
_PR_SET_PDEATHSIG: Final = 1  # <linux/prctl.h>


def exit_reason(returncode: int) -> str:
    """``status 3`` or ``killed by SIGKILL``: how a process ended, in words."""
    if returncode >= 0:
        return f"status {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def stop_with_parent(env: Mapping[str, str] | None = None) -> bool:
    """In a child of ``dracap up``: have the kernel send SIGTERM when the parent
    :data:`PARENT_PID_ENV` names dies. False when that parent is already gone (the
    caller exits); True otherwise, also when no parent is named or the kernel has no
    such request (not Linux)."""
    named = (os.environ if env is None else env).get(PARENT_PID_ENV, "")
    if not named.isdigit():
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the child may outlive its parent
        return True
    return os.getppid() == int(named)  # it died before the request: no signal will come


def log_tag(env: Mapping[str, str] | None = None) -> str | None:
    """In a child of ``dracap up``: the name its log lines carry (they go to the standard
    error it shares with ``dracap up``, whose own lines say the same things about the
    same servers); None in a process of its own."""
    tag = (os.environ if env is None else env).get(LOG_TAG_ENV, "")
    return tag if tag.isidentifier() else None


class ChildService:
    """One child process of ``dracap up`` (module docstring): ``run(stop)`` keeps it."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        grace_s: float = 10.0,
        first_delay_s: float = 0.5,
        max_delay_s: float = 30.0,
        niceness: int = 0,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = {**env, PARENT_PID_ENV: str(os.getpid()), LOG_TAG_ENV: name}
        self.grace_s = grace_s
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.niceness = niceness
        self.pid: int | None = None  #: the running child's, else None
        self.starts = 0  #: processes started so far
        self._trouble: str | None = f"{name} is starting"
        self._retry = asyncio.Event()  # set by retry_now(): the back-off ends early

    @property
    def problem(self) -> str | None:
        """Why the child does not run (None: it does)."""
        return self._trouble

    async def trouble(self) -> str | None:
        """:attr:`problem`, as ``dracap up``'s health check asks it."""
        return self._trouble

    def retry_now(self, check: str = "") -> None:
        """End a back-off now (``check``, a health check that passes again, is not
        needed): a child that failed to start while a server was away starts as soon as
        the server is back, not after a delay that grew during the outage."""
        self._retry.set()
        self._retry = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Start the child, start it again whenever it exits, stop it on ``stop``."""
        delay = self.first_delay_s
        while not stop.is_set():
            started = time.monotonic()
            try:
                process = await asyncio.create_subprocess_exec(
                    *self.argv,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as exc:
                self._trouble = f"{self.name} could not start ({exc.strerror or exc})"
            else:
                self.starts += 1
                self._lower_priority(process.pid)
                self.pid, self._trouble = process.pid, None
                returncode = await self._until_exit(process, stop)
                self.pid = None
                if returncode is None:  # stopped
                    return
                if time.monotonic() - started >= STEADY_S:
                    delay = self.first_delay_s
                self._trouble = f"{self.name} exited ({exit_reason(returncode)})"
            log.warning("%s; starting it again in %.1fs", self._trouble, delay)
            retry = self._retry
            with contextlib.suppress(TimeoutError):
                await wait_for(first_of(stop.wait(), retry.wait()), delay)
            delay = self.first_delay_s if retry.is_set() else min(delay * 2, self.max_delay_s)

    def _lower_priority(self, pid: int) -> None:
        """Make the new child :attr:`niceness` nicer than this process (at most 19)."""
        if self.niceness <= 0:
            return
        wanted = min(19, os.getpriority(os.PRIO_PROCESS, 0) + self.niceness)
        with contextlib.suppress(ProcessLookupError):  # it exited already: run() sees it
            os.setpriority(os.PRIO_PROCESS, pid, wanted)

    async def _until_exit(
        self, process: asyncio.subprocess.Process, stop: asyncio.Event
    ) -> int | None:
        """The child's exit status; None when ``stop`` ended it (SIGTERM, then SIGKILL)."""
        exited = asyncio.ensure_future(process.wait())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({exited, stopped}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # cancelled past every grace period: no orphan
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            raise
        finally:
            stopped.cancel()
        if exited.done():
            return exited.result()
        self._trouble = f"{self.name} is stopping"
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            await wait_for(asyncio.shield(exited), self.grace_s)
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            raise
        except TimeoutError:
            log.warning("%s did not stop within %.0fs; killing it", self.name, self.grace_s)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await exited
        return None
