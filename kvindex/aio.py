"""Stopping background tasks without the two traps of ``with suppress(CancelledError): await task``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


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
