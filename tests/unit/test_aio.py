"""Stopping tasks and waiting with a timeout without losing a cancel (Python 3.11's asyncio.wait_for does)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from kvindex.aio import TaskSet, cancel_and_wait

ROOT = Path(__file__).resolve().parents[2]


def test_no_product_module_waits_with_asyncio_wait_for():
    """On 3.11 wait_for returns a result that is ready as its task is cancelled, so the cancel is lost and the
    task runs on: a subscriber did so and hung the manager's close(). ``async with asyncio.timeout()`` does not."""
    users = [str(p.relative_to(ROOT)) for pkg in ("epp_extproc", "kvindex", "trtllm_mock")
             for p in sorted((ROOT / pkg).rglob("*.py")) if re.search(r"\bwait_for\(", p.read_text())]
    assert users == []


async def test_cancel_and_wait_ends_the_tasks_and_retrieves_their_failures():
    async def fails() -> None:
        raise RuntimeError("boom")

    failed = asyncio.ensure_future(fails())
    await asyncio.sleep(0)
    sleeper = asyncio.ensure_future(asyncio.sleep(60))
    assert await cancel_and_wait([failed, sleeper, None]) == set()
    assert sleeper.cancelled() and not failed._log_traceback  # retrieved: no "never retrieved" at shutdown


async def test_cancel_and_wait_returns_a_task_that_ignores_its_cancel_after_the_timeout():
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                continue

    t = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    assert await cancel_and_wait([t], timeout=0.05) == {t}
    release.set()
    t.cancel()
    await asyncio.wait({t})


async def test_a_cancel_of_the_caller_while_it_waits_is_not_swallowed():
    """``with suppress(CancelledError): await task`` would let the cancelled caller run on."""
    inner = asyncio.ensure_future(asyncio.sleep(60))
    after: list[str] = []

    async def stopper() -> None:
        await cancel_and_wait([inner])
        after.append("ran on")

    caller = asyncio.ensure_future(stopper())
    await asyncio.sleep(0)
    caller.cancel()
    await asyncio.wait({caller})
    assert caller.cancelled() and after == []


async def test_a_task_set_forgets_finished_tasks_and_cancels_the_rest_at_close():
    tasks = TaskSet()
    done = tasks.spawn(asyncio.sleep(0))
    sleeper = tasks.spawn(asyncio.sleep(60))
    await done
    await asyncio.sleep(0)  # the done callback runs on the next loop turn
    assert len(tasks) == 1
    await tasks.cancel()
    assert sleeper.cancelled() and len(tasks) == 0
