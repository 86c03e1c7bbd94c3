"""Service streams that stay open for the life of a connection (Envoy's access log, health Watch).

They are not requests: a drain must not wait for them, or stopping a picker behind an idle Envoy takes the
whole drain timeout. Each such handler runs inside `track()`; once the requests in flight have ended,
`end_all()` cancels the handlers still open, so the server's own drain finds nothing left and returns. The
peer sees its stream end and reconnects (to another replica, since this one is no longer ready).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager


class LongLivedStreams:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[object]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    @contextmanager
    def track(self) -> Iterator[None]:
        """Run a stream handler as one of these (its task is what `end_all` cancels)."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        self._tasks.add(task)
        try:
            yield
        finally:
            self._tasks.discard(task)

    def end_all(self) -> int:
        """Cancel every open one; returns how many."""
        tasks = [t for t in self._tasks if not t.done()]
        for t in tasks:
            t.cancel()
        return len(tasks)
