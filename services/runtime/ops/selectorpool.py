"""Tenants' CEL selectors, compiled and evaluated in a worker process under a deadline.

Why: a CEL selector may cost up to a million units (upstream's limit), and cel-python
spends tens of microseconds per unit — half a minute for one device; even parsing a
10 KiB expression takes it half a second. On the event loop that also serves every
tenant's API requests, plans every claim and runs the relay, one such selector would
stall everybody (invariant 11: no tenant can stall another). So a service never
spends more than a small budget on a tenant's selector on its loop: the claims API has
long expressions compiled here before it admits a claim, and the reservation service
has the heavy ones evaluated here while the claim waits
(:mod:`events.inventory`), and everybody else's claims go on.

The pool
--------
One worker process (started on first use with the ``spawn`` method, so it inherits no
event loop, socket or lock of the service; once started it lowers its CPU priority to
``niceness``, by default the lowest, so the services' own processes and the servers
win every contest for a core) does one *job*
at a time: compile a list of expressions, or evaluate one expression over a list of
devices, answering item by item. Jobs wait in one queue per owner (the tenant's
namespace) and are taken round robin, so a tenant who submits many expensive claims
delays its own, not another tenant's.

Two limits make the runtime budget, besides the cost limit every evaluation has
(:data:`events.selectors.MAX_COST` units, counted by the worker). Both count the
worker's *CPU* time, so a worker that a busy machine gives little of it (it runs at the
lowest priority) is not held to account for the wait; the worker keeps them itself
(:mod:`services.runtime.ops.selectorworker`, a CPU-time timer that interrupts the
evaluation):

* :attr:`SelectorPool.deadline_s` per item (one expression compiled, or evaluated on
  one device): the item is stopped and its result is an error naming the deadline
  (:class:`~events.errors.SelectorDeadlineExceeded`);
* :attr:`SelectorPool.job_budget_s` per job: once spent, the items not done yet get the
  same kind of error untried.

Both are dracap's own: with cel-go the cost limit alone bounds an evaluation to
milliseconds. A worker that stops answering altogether (stuck in C code) is killed
after :attr:`SelectorPool.stuck_s` of wall-clock time and started again for the rest
of the job. The blocking conversation with the worker runs in a thread
(``asyncio.to_thread``) that waits on the pipe, so the event loop never waits for it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Final, Literal

from events.errors import SelectorDeadlineExceeded, SelectorError
from events.selectors import DeviceView
from services.runtime.ground.outages import one_line
from services.runtime.ops.selectorworker import serve

__all__ = ["DEADLINE_S", "JOB_BUDGET_S", "SelectorPool"]

log = logging.getLogger("dracap.selectors")

#: CPU seconds one item (one expression compiled, or evaluated on one device) may use.
DEADLINE_S: Final = 2.0
#: CPU seconds one job may use.
JOB_BUDGET_S: Final = 10.0
#: Wall-clock seconds to wait for one item before the worker is taken for stuck (the
#: CPU limits are the worker's own; this only catches a worker that stopped answering).
STUCK_S: Final = 120.0
#: How often a thread waiting for the worker looks whether the pool was closed.
_POLL_SLICE_S: Final = 0.25
#: How long the worker may take to start and say it is ready.
_START_S: Final = 60.0
#: The worker's niceness once it has started: evaluations yield every core to the services.
LOWEST_PRIORITY: Final = 19

Kind = Literal["check", "evaluate"]
_DONE: Final = {"check": "compiled", "evaluate": "evaluated"}
#: An item's outcome as the worker reports it: (value, error message or None).
_Answer = tuple[object, str | None]


@dataclass(slots=True)
class _Job:
    kind: Kind
    expression: str  # "evaluate": the selector; "check": unused
    consumable_capacity: bool
    items: list[tuple[int, object]]  # (key, device view or expression)
    done: asyncio.Future[None]
    answers: dict[int, _Answer] = field(default_factory=dict)
    stopped: dict[int, str] = field(default_factory=dict)  # key -> why it was not done


class SelectorPool:
    """One worker process for tenants' selectors (see the module docstring)."""

    def __init__(
        self,
        *,
        deadline_s: float = DEADLINE_S,
        job_budget_s: float = JOB_BUDGET_S,
        niceness: int = LOWEST_PRIORITY,
        stuck_s: float = STUCK_S,
    ) -> None:
        self.deadline_s = deadline_s
        self.niceness = niceness
        self.stuck_s = stuck_s
        self.job_budget_s = job_budget_s
        self._queues: dict[str, collections.deque[_Job]] = {}
        self._owners: collections.deque[str] = collections.deque()  # round-robin order
        self._wake = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._process: BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._closed = False
        self.busy = False  #: a job is being worked on now
        self.restarts = 0  #: workers killed because they stopped answering

    # -- the two kinds of job --------------------------------------------------------------

    async def evaluate(
        self,
        expression: str,
        devices: Sequence[tuple[int, DeviceView]],
        *,
        owner: str,
        consumable_capacity: bool = True,
    ) -> dict[int, bool | SelectorError]:
        """The outcome of ``expression`` on each device (by inventory index)."""
        items: list[tuple[int, object]] = [(index, _bare(view)) for index, view in devices]
        job = await self._submit("evaluate", expression, consumable_capacity, items, owner)
        out: dict[int, bool | SelectorError] = {}
        for index, _ in items:
            if index in job.stopped:
                out[index] = SelectorDeadlineExceeded(expression, job.stopped[index])
                continue
            matched, message = job.answers[index]
            out[index] = SelectorError(expression, message) if message else bool(matched)
        return out

    async def check(
        self, expressions: Sequence[str], *, owner: str, consumable_capacity: bool = True
    ) -> dict[str, str | None]:
        """Why each expression does not compile (the compiler's message), or None."""
        items: list[tuple[int, object]] = list(enumerate(expressions))
        job = await self._submit("check", "", consumable_capacity, items, owner)
        out: dict[str, str | None] = {}
        for i, expression in enumerate(expressions):
            if i in job.stopped:
                out[expression] = job.stopped[i]
            else:
                out[expression] = job.answers[i][1]
        return out

    async def _submit(
        self,
        kind: Kind,
        expression: str,
        consumable_capacity: bool,
        items: list[tuple[int, object]],
        owner: str,
    ) -> _Job:
        if self._closed:
            raise RuntimeError("the selector pool is closed")
        done = asyncio.get_running_loop().create_future()
        job = _Job(kind, expression, consumable_capacity, items, done)
        if owner not in self._queues:
            self._queues[owner] = collections.deque()
            self._owners.append(owner)
        self._queues[owner].append(job)
        self._wake.set()
        if self._runner is None:
            self._runner = asyncio.create_task(self._run())
        await done
        return job

    # -- the queue -------------------------------------------------------------------------

    def _next_job(self) -> _Job | None:
        """The first job of the next owner in turn (round robin)."""
        if not self._owners:
            return None
        owner = self._owners.popleft()
        queue = self._queues[owner]
        job = queue.popleft()
        if queue:
            self._owners.append(owner)
        else:
            del self._queues[owner]
        return job

    async def _run(self) -> None:
        while not self._closed:
            job = self._next_job()
            if job is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            self.busy = True
            try:
                await asyncio.to_thread(self._work, job)
            except asyncio.CancelledError:  # the service's tasks are torn down: so is the pool
                self._closed = True
                self._kill()
                raise
            except Exception as exc:  # the worker could not be started or talked to
                if not self._closed:  # (closing kills it mid-job: that is no failure)
                    log.error("selector worker failed: %s", one_line(exc))
                for key, _ in job.items:
                    if key not in job.answers:
                        job.stopped.setdefault(
                            key, f"not {_DONE[job.kind]}: the worker failed ({exc})"
                        )
            finally:
                self.busy = False
            if not job.done.done():
                job.done.set_result(None)

    # -- in the thread ---------------------------------------------------------------------

    def _work(self, job: _Job) -> None:
        """Have the worker do ``job`` (blocking); the worker keeps both CPU limits."""
        todo = list(job.items)
        while todo and not self._closed:
            conn = self._connection()
            limits = (self.deadline_s, self.job_budget_s)
            conn.send((job.kind, job.expression, job.consumable_capacity, limits, todo))
            todo = self._collect(conn, job, todo)

    def _collect(
        self, conn: multiprocessing.connection.Connection, job: _Job, todo: list[tuple[int, object]]
    ) -> list[tuple[int, object]]:
        """Receive answers in order; kill a worker that stops answering; returns what is left."""
        for position, (key, _) in enumerate(todo):
            if not self._answered(conn):
                if self._closed:  # the service is stopping: nothing more is wanted
                    return []
                self._kill(stuck=True)
                job.stopped[key] = (
                    f"not {_DONE[job.kind]}: the selector worker did not answer within "
                    f"{self.stuck_s:.3g}s and was restarted"
                )
                return todo[position + 1 :]
            got, value, message, stopped = conn.recv()
            if got != key:
                raise RuntimeError(f"the selector worker answered for {got}, not {key}")
            if stopped:
                job.stopped[key] = message
            else:
                job.answers[key] = (value, message)
        return []

    def _answered(self, conn: multiprocessing.connection.Connection) -> bool:
        """Whether the worker answered within :attr:`stuck_s`; waits in short slices so a
        closing pool frees its thread at once (the loop's executor waits for it at exit)."""
        deadline = time.monotonic() + self.stuck_s
        while not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if conn.poll(min(left, _POLL_SLICE_S)):
                return True
        return False

    def _connection(self) -> multiprocessing.connection.Connection:
        if self._process is not None and self._process.is_alive() and self._conn is not None:
            return self._conn
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(
            target=serve, args=(child, self.niceness), name="dracap-selectors", daemon=True
        )
        process.start()
        child.close()
        if not parent.poll(_START_S) or parent.recv() != "ready":
            process.kill()
            raise RuntimeError("the selector worker did not start")
        self._process, self._conn = process, parent
        return parent

    def _kill(self, *, stuck: bool = False) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if process is not None:
            process.kill()
            process.join(5)
            self.restarts += stuck
        if conn is not None:
            conn.close()

    async def close(self) -> None:
        """Stop the worker; jobs still waiting end with nothing done."""
        self._closed = True
        self._wake.set()
        self._kill()
        if self._runner is not None and not self._runner.done():
            with contextlib.suppress(Exception):
                await self._runner
        for queue in self._queues.values():
            for job in queue:
                for key, _ in job.items:
                    job.stopped[key] = f"not {_DONE[job.kind]}: the service is stopping"
                if not job.done.done():
                    job.done.set_result(None)
        self._queues.clear()


def _bare(view: DeviceView) -> DeviceView:
    """The view without its cached CEL form (smaller to send, rebuilt in the worker)."""
    return DeviceView(view.driver, view.attributes, view.capacity, view.allow_multiple_allocations)
