"""The selector pool: a real worker process, its deadline, its budget and its fairness."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from events.errors import SelectorDeadlineExceeded, SelectorError
from events.quantities import Quantity
from events.selectors import DeviceView, compile_selector
from services.runtime.ops.selectorpool import SelectorPool
from tests.fixtures.polling import until

DRIVER = "gpu.test.io"


def view(model: str) -> DeviceView:
    return DeviceView.from_qualified_names(
        DRIVER, {"model": model, "cores": 108}, {"memory": Quantity.parse("40Gi")}
    )


def nested(n: int) -> str:
    items = "[" + ",".join(str(i) for i in range(1, n + 1)) + "]"
    return f"{items}.all(x, {items}.all(y, x*y >= 0))"


#: Just under the cost limit: tens of seconds in cel-python, so always past a short deadline.
SLOW = nested(370)
DEVICES = [(i, view(m)) for i, m in enumerate(["a", "b", "c"])]


@pytest.fixture
async def pool() -> AsyncIterator[SelectorPool]:
    selectors = SelectorPool(deadline_s=30.0, job_budget_s=60.0)
    try:
        yield selectors
    finally:
        await selectors.close()


@pytest.mark.parametrize(
    "expression",
    [
        f'device.attributes["{DRIVER}"].model == "b"',
        f'device.attributes["{DRIVER}"].missing == "b"',  # a runtime error on every device
        f'device.capacity["{DRIVER}"].memory.compareTo(quantity("40Gi")) == 0',
    ],
)
async def test_results_are_those_of_evaluating_here(pool: SelectorPool, expression: str) -> None:
    got = await pool.evaluate(expression, DEVICES, owner="tenant-a")
    selector = compile_selector(expression)
    for index, device in DEVICES:
        try:
            expected: bool | str = selector.matches(device)
        except SelectorError as exc:
            expected = exc.message
        result = got[index]
        assert (result.message if isinstance(result, SelectorError) else result) == expected


async def test_an_evaluation_past_its_deadline_is_stopped(pool: SelectorPool) -> None:
    pool.deadline_s = 0.5
    got = await pool.evaluate(SLOW, DEVICES[:2], owner="tenant-a")
    for stopped in got.values():
        assert isinstance(stopped, SelectorDeadlineExceeded)
        assert "evaluation stopped after 0.5s of CPU time (the deadline)" in stopped.message
    assert pool.restarts == 0  # the worker stopped the evaluation itself and went on
    light = await pool.evaluate(f'device.driver == "{DRIVER}"', DEVICES, owner="tenant-b")
    assert light == {0: True, 1: True, 2: True}


async def test_a_job_that_spends_its_budget_leaves_the_rest_unevaluated() -> None:
    pool = SelectorPool(deadline_s=0.4, job_budget_s=0.6)  # SLOW needs far more than both
    try:
        got = await pool.evaluate(SLOW, DEVICES, owner="tenant-a")
    finally:
        await pool.close()
    assert all(isinstance(r, SelectorDeadlineExceeded) for r in got.values())
    messages = [r.message for r in got.values() if isinstance(r, SelectorError)]
    assert "(the deadline)" in messages[0]
    assert "(the job's budget)" in messages[1]
    assert "not evaluated: the job's budget of 0.6s of CPU time is spent" in messages[2]


async def test_a_worker_that_stops_answering_is_restarted() -> None:
    pool = SelectorPool(deadline_s=600, job_budget_s=600, stuck_s=0.5)
    try:
        got = await pool.evaluate(SLOW, DEVICES[:1], owner="tenant-a")
        assert isinstance(got[0], SelectorDeadlineExceeded)
        assert "did not answer within 0.5s and was restarted" in got[0].message
        assert pool.restarts == 1
        pool.stuck_s = 60
        light = await pool.evaluate(f'device.driver == "{DRIVER}"', DEVICES, owner="tenant-b")
        assert light == {0: True, 1: True, 2: True}  # a fresh worker answers
    finally:
        await pool.close()


async def test_owners_take_turns(pool: SelectorPool) -> None:
    order: list[str] = []
    expression = f'device.driver == "{DRIVER}"'

    async def job(owner: str, tag: str) -> None:
        await pool.evaluate(expression, DEVICES, owner=owner)
        order.append(tag)

    jobs = [job("greedy", "g1"), job("greedy", "g2"), job("greedy", "g3"), job("other", "o1")]
    await asyncio.gather(*jobs)
    assert order == ["g1", "o1", "g2", "g3"]


@pytest.mark.parametrize("how", ["closed", "cancelled"])
async def test_a_stopping_service_frees_the_thread_waiting_on_a_busy_worker(how: str) -> None:
    """Whether the pool is closed or its runner torn down mid-job, the worker process dies
    and the thread waiting on it returns: the loop's executor does not wait out stuck_s."""
    pool = SelectorPool(deadline_s=600, job_budget_s=600, stuck_s=600)
    waiting = asyncio.ensure_future(pool.evaluate(SLOW, DEVICES[:1], owner="tenant-a"))
    try:
        await until(lambda: pool.busy and pool._process is not None, 120)
        process = pool._process
        assert process is not None
        if how == "closed":
            await pool.close()
        else:
            runner = pool._runner
            assert runner is not None
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        await until(lambda: not process.is_alive(), 30)
        # the thread is back in the executor: shutting it down does not wait for the worker
        await asyncio.wait_for(asyncio.get_running_loop().shutdown_default_executor(), 30)
    finally:
        waiting.cancel()
        await pool.close()
