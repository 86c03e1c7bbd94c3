"""The CPU cost of rendering a prompt (chat template + tokenizer) that a real trtllm-serve pays per request.

trtllm-serve renders and tokenizes every chat request in a worker thread (``asyncio.to_thread``) before the
scheduler sees it, so that time lands in time-to-first-token and burns a frontend core. A request that
carries ``prompt_token_ids`` (or a completions prompt given as ids) skips it. The mock reproduces both
effects: :meth:`RenderCost.charge` really burns CPU for ``chars * render_us_per_char`` (hashing a buffer,
which releases the GIL, so the event loop keeps serving other requests as it does upstream) on a small thread
pool, where the mock's own template + tokenizer pass then runs too (off the event loop, like upstream's
``asyncio.to_thread``), so queueing behind other renders shows at saturation, and it counts what it charged and skipped for
``GET /mock/stats``. With ``render_us_per_char = 0`` (the test default) nothing is burnt.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from .config import MockConfig

T = TypeVar("T")
_BUF = b"\x5a" * 65536  # sha256 over >= 2 KiB releases the GIL; 64 KiB is ~0.1 ms of work per call


def _burn_then(seconds: float, work: Callable[[], T]) -> tuple[T, float]:
    """Spin on real CPU work until ``seconds`` of wall time passed, then do ``work`` (the mock's own template
    and tokenizer pass); returns its result and the thread CPU time both used."""
    cpu0 = time.thread_time()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        hashlib.sha256(_BUF).digest()
    out = work()
    return out, time.thread_time() - cpu0


@dataclass
class RenderStats:
    """What ``/mock/stats`` reports under ``render``: requests this server templated vs. got as ids."""

    rendered_requests: int = 0
    pretokenized_requests: int = 0
    rendered_chars_total: int = 0
    render_wall_seconds_total: float = 0.0
    render_cpu_seconds_total: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {
            "rendered_requests": self.rendered_requests,
            "pretokenized_requests": self.pretokenized_requests,
            "rendered_chars_total": self.rendered_chars_total,
            "render_wall_seconds_total": round(self.render_wall_seconds_total, 6),
            "render_cpu_seconds_total": round(self.render_cpu_seconds_total, 6),
        }


class RenderCost:
    """Charges (or records the skipping of) the per-request render cost of one mock server."""

    def __init__(self, config: MockConfig) -> None:
        self.config = config
        self.stats = RenderStats()
        self._pool: ThreadPoolExecutor | None = None

    async def render(self, chars: int, work: Callable[[], T]) -> T:
        """This request's prompt (``chars`` characters of text) must be rendered here: pay the configured
        cost, then run ``work`` (the actual templating + tokenizing) on the render thread, as trtllm-serve
        does; with no cost configured ``work`` runs inline (fast tests)."""
        self.stats.rendered_requests += 1
        self.stats.rendered_chars_total += chars
        seconds = chars * self.config.render_us_per_char / 1e6 / self.config.speedup
        if seconds <= 0:
            return work()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.render_threads, thread_name_prefix="mock-render")
        started = time.perf_counter()
        out, cpu = await asyncio.get_running_loop().run_in_executor(self._pool, _burn_then, seconds, work)
        self.stats.render_wall_seconds_total += time.perf_counter() - started
        self.stats.render_cpu_seconds_total += cpu
        return out

    def skipped(self) -> None:
        """This request arrived as token ids: no template, no tokenizer."""
        self.stats.pretokenized_requests += 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
