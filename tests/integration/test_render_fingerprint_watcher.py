"""The fingerprint watcher against a real HTTP worker stand-in: admission, a failed re-read, a restart."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from epp_extproc.adapters.render_fingerprint import FingerprintWatcher
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.metrics import PickerMetrics
from tests.waiting import until_async

FP = {"digest": "ab" * 32, "compared": {"tokenizer": {"complete": True}}}


class InfoServer:
    """Answers GET /server_info with whatever the test sets (`status`, `doc`)."""

    def __init__(self) -> None:
        self.status = 200
        self.doc: Any = {"render_fingerprint": FP}
        self.reads = 0
        self.runner: web.AppRunner | None = None
        self.address = ""

    async def handle(self, _: web.Request) -> web.Response:
        self.reads += 1
        return web.json_response(self.doc, status=self.status)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/server_info", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.address = f"127.0.0.1:{port}"


async def stop(task: asyncio.Task[None], srv: InfoServer) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert srv.runner is not None
    await srv.runner.cleanup()


async def watching(srv: InfoServer, refresh_s: float = 0.05) -> tuple[FingerprintWatcher, asyncio.Task[None]]:
    reg = EndpointRegistry()
    w = FingerprintWatcher(reg, PickerMetrics(), refresh_s=refresh_s, retry_s=0.02, timeout_s=1.0)
    task = asyncio.create_task(w.run())
    reg.replace([Endpoint("w", srv.address)])
    return w, task


async def test_fingerprint_is_read_at_admission() -> None:
    srv = InfoServer()
    await srv.start()
    w, task = await watching(srv, refresh_s=60)
    await until_async(lambda: w.state(srv.address) == "known")
    assert w.get(srv.address).digest == "ab" * 32  # type: ignore[union-attr]
    await stop(task, srv)


async def test_a_failed_re_read_keeps_the_fingerprint() -> None:
    srv = InfoServer()
    await srv.start()
    w, task = await watching(srv)
    await until_async(lambda: w.state(srv.address) == "known")
    srv.status = 503
    reads = srv.reads
    await until_async(lambda: srv.reads >= reads + 3)
    assert w.get(srv.address) is not None and w.state(srv.address) == "known"
    await stop(task, srv)


async def test_a_changed_fingerprint_is_picked_up_and_a_lost_worker_forgotten() -> None:
    srv = InfoServer()
    await srv.start()
    w, task = await watching(srv)
    await until_async(lambda: w.state(srv.address) == "known")
    srv.doc = {"render_fingerprint": {**FP, "digest": "cd" * 32}}
    await until_async(lambda: w.get(srv.address) is not None and w.get(srv.address).digest == "cd" * 32)  # type: ignore[union-attr]
    srv.doc = {"model": "no fingerprint here"}
    w.lost(srv.address)
    assert w.get(srv.address) is None
    await until_async(lambda: w.state(srv.address) == "missing")
    assert w.get(srv.address) is None
    await stop(task, srv)


class _CountingDict(dict):  # type: ignore[type-arg]
    """A dict that counts the elements every pass over it yields (keys, values, items, plain iteration)."""

    passed = 0

    def _count(self, it: Any) -> Any:
        for x in it:
            self.passed += 1
            yield x

    def __iter__(self) -> Any:
        return self._count(super().__iter__())

    def keys(self) -> Any:
        return self._count(super().keys())

    def values(self) -> Any:
        return self._count(super().values())

    def items(self) -> Any:
        return self._count(super().items())


async def test_a_wake_up_costs_what_is_due_not_a_pass_over_the_pool() -> None:
    """The reads come due a few workers at a time (each completes at its own moment), so the watcher wakes
    often: at 10,000 workers three passes over every entry per wake-up (the due list, the next due time, the
    connections to keep) cost the picker ~40% of a core doing nothing else. Counted, not timed: after the
    admission round, the wake-ups of several refresh rounds together pass over fewer entries than the pool
    holds once, while every worker keeps being re-read."""
    n, refresh_s = 2000, 0.1
    reg = EndpointRegistry()
    w = FingerprintWatcher(reg, PickerMetrics(), refresh_s=refresh_s, retry_s=0.02, timeout_s=1.0)
    w._entries = entries = _CountingDict()  # noqa: SLF001 - what a wake-up touches is the point
    reads: dict[str, int] = {}

    async def fetch(address: str) -> tuple[None, str]:
        reads[address] = reads.get(address, 0) + 1
        await asyncio.sleep((hash(address) % 40) * 0.002)  # completions (so due times) spread over 80 ms
        return None, "missing"

    w._fetch = fetch  # type: ignore[method-assign]  # noqa: SLF001 - no HTTP: the schedule is under test
    task = asyncio.create_task(w.run())
    reg.replace([Endpoint(f"w{i}", f"127.0.0.1:{20000 + i}") for i in range(n)])
    await until_async(lambda: len(reads) == n)
    await asyncio.sleep(0.1)  # the admission round has completed
    entries.passed = 0
    first = dict(reads)
    # every worker re-read twice, about every refresh_s (waited for, not slept: a loaded machine's loop is
    # slower, and what is asserted is counted per round, not per second)
    await until_async(lambda: min(reads[a] - first[a] for a in first) >= 2, "two rounds of re-reads")
    rounds = min(reads[a] - first[a] for a in first)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert entries.passed < n, f"{entries.passed} entries passed over in {rounds}+ rounds of {n} workers"
