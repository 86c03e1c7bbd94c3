"""The tests' one way to wait for something asynchronous: poll a predicate until it holds or a deadline passes.

Deadlines are generous (10 s unless a test says otherwise) and scale with ``TEST_WAIT_SCALE`` (e.g. 3 on a
machine shared with other work): a wait that passes returns as soon as the predicate holds, so a long deadline
costs nothing, and a short one only makes a busy machine fail tests that are right.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

SCALE = float(os.environ.get("TEST_WAIT_SCALE", "1") or 1)
Describe = str | Callable[[], str]


def _message(what: Describe, timeout: float) -> str:
    return f"timed out after {timeout:g}s waiting for {what() if callable(what) else what}"


def until(pred: Callable[[], object], what: Describe = "condition", timeout: float = 10.0,
          interval: float = 0.01) -> None:
    """Until `pred()` is true; AssertionError naming `what` (a string, or a function giving one from the state
    at the deadline) after `timeout` seconds (times ``TEST_WAIT_SCALE``)."""
    timeout *= SCALE
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(_message(what, timeout))
        time.sleep(interval)


async def until_async(pred: Callable[[], object], what: Describe = "condition", timeout: float = 10.0,
                      interval: float = 0.01) -> None:
    """`until` for a test running on the event loop: sleeps with `asyncio.sleep`, so the code under test runs."""
    timeout *= SCALE
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(_message(what, timeout))
        await asyncio.sleep(interval)
