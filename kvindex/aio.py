"""Stopping background tasks without the two traps of ``with suppress(CancelledError): await task``."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any


async def cancel_and_wait(tasks: Iterable[asyncio.Future | None], timeout: float | None = None) -> set[asyncio.Future]:
    """Cancel each task and wait for it to end; returns the ones still running after ``timeout``.

    Suppressing ``CancelledError`` around ``await task`` also swallows a cancel aimed at the caller, which then
    runs on; ``asyncio.wait`` lets it through. With a ``timeout``, a task that swallowed its own cancel
    (``asyncio.wait_for`` does that on Python 3.11 when its result is ready in the same instant) is returned
    rather than waited for forever. A task's own failure is retrieved here, so a shutdown does not log it as
    never retrieved."""
    tasks = [t for t in tasks if t is not None]
    for t in tasks:
        t.cancel()
    running = {t for t in tasks if not t.done()}
    if running:
        _, running = await asyncio.wait(running, timeout=timeout)
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()
    return running


class TaskSet:
    """The background tasks one owner starts and must end at its close.

    Why a class: asyncio holds running tasks only weakly, so each owner kept a set of its own, added each task
    and discarded it when done, in the same four lines; the KV views and their shared worker facts now spawn
    into one set, so one ``cancel`` ends them all and a test can wait for ``len() == 0``."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel(self) -> None:
        """Cancel every task still running and wait for each to end (``cancel_and_wait``)."""
        await cancel_and_wait(list(self._tasks))
