"""The selector worker process's side (see :mod:`services.runtime.ops.selectorpool`).

Kept apart from the pool so that a worker starts by importing only the selector module.

The worker keeps the pool's two limits in *CPU* time (``time.process_time`` and a
``SIGPROF`` interval timer): an evaluation still running when its share of CPU is spent
is stopped at its next node (:func:`events.celcost.interrupt`) and answered as stopped;
the worker goes on with the next item. A compile is not interrupted (the length limit
bounds it to about a second). CPU time, not wall-clock time: the worker runs at the lowest priority,
and on a busy machine it may wait long for a core without anybody's selector being to
blame.

Each answer is ``(key, value, message, stopped)``: ``message`` is the error of a failed
item (or why it was stopped), ``stopped`` says it hit a limit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING

from events import celcost
from events.errors import SelectorError
from events.selectors import DeviceView, Selector, compile_selector, selector_problem

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

__all__ = ["serve"]

#: One item's work: its value and, for an item that failed, the error message.
Work = Callable[[object], tuple[object, str | None]]
_WORK = {"check": "compilation", "evaluate": "evaluation"}
#: Less CPU time than this left in a job's budget counts as none.
_SLICE_S = 0.01
_DONE = {"check": "compiled", "evaluate": "evaluated"}


class _Timer:
    """A ``SIGPROF`` timer armed only around one item.

    Its handler raises nothing: it asks the evaluator to stop
    (:func:`events.celcost.interrupt`), which it does at its next node.
    """

    def __init__(self) -> None:
        signal.signal(signal.SIGPROF, self._expired)

    @staticmethod
    def _expired(_signum: int, _frame: FrameType | None) -> None:
        celcost.interrupt()

    @contextlib.contextmanager
    def limit(self, seconds: float) -> Iterator[None]:
        celcost.clear_interrupt()
        signal.setitimer(signal.ITIMER_PROF, max(seconds, 0.001))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
            celcost.clear_interrupt()


def serve(conn: Connection, niceness: int) -> None:
    """The worker process: answer each job item by item, until the pipe closes.

    Its imports ran at the service's priority (a worker that cannot start on a busy
    machine helps nobody); its work runs at ``niceness``.
    """
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    timer = _Timer()
    conn.send("ready")
    while True:
        try:
            kind, expression, consumable_capacity, limits, items = conn.recv()
        except (EOFError, OSError):
            return
        work = _work_of(kind, expression, consumable_capacity)
        _job(conn, timer, kind, work, limits, items)


def _work_of(
    kind: str, expression: str, flag: bool
) -> Callable[[object], tuple[object, str | None]]:
    """What to do with one item: compile it, or evaluate ``expression`` on it."""
    if kind == "check":
        return lambda text: (None, selector_problem(str(text), consumable_capacity=flag))
    try:
        selector: Selector | SelectorError = compile_selector(expression, consumable_capacity=flag)
    except SelectorError as exc:
        selector = exc

    def evaluate(view: object) -> tuple[object, str | None]:
        if isinstance(selector, SelectorError):
            return False, selector.message
        assert isinstance(view, DeviceView)
        try:
            return selector.matches(view), None
        except SelectorError as exc:
            return False, exc.message

    return evaluate


def _job(
    conn: Connection,
    timer: _Timer,
    kind: str,
    work: Work,
    limits: tuple[float, float],
    items: list[tuple[int, object]],
) -> None:
    deadline, budget = limits
    started = time.process_time()
    spent_out = False  # an item was stopped by the budget: what is left is none
    for key, payload in items:
        left = budget - (time.process_time() - started)
        # (the timer ticks coarser than process_time counts: after a stop by the budget
        # process_time may still show a few milliseconds left)
        if spent_out or left < _SLICE_S:
            spent = f"not {_DONE[kind]}: the job's budget of {budget:.3g}s of CPU time is spent"
            conn.send((key, None, spent, True))
            continue
        allowed = min(deadline, left)
        try:
            with timer.limit(allowed):
                value, message = work(payload)
        except celcost.Interrupted:
            which = "deadline" if allowed == deadline else "job's budget"
            spent_out = allowed != deadline
            stopped = f"{_WORK[kind]} stopped after {allowed:.3g}s of CPU time (the {which})"
            conn.send((key, None, stopped, True))
            continue
        conn.send((key, value, message, False))
