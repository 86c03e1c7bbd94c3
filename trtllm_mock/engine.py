"""Scheduler and timing model: a FIFO waiting queue in front of at most ``max_batch_size`` running requests.

Each admitted request holds its KV blocks, "prefills" for ``prefill_ms_per_token`` per UNCACHED prompt token
(so a picker that finds cache hits measurably lowers TTFT), stores its full prompt blocks and publishes them
when prefill completes, then "decodes" one token per ``decode_ms_per_token``. All times divide by
``speedup``. Running requests progress independently (no per-iteration batching slowdown); README.md says
how to pick realistic numbers.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .config import MockConfig
from .events import KvEventPublisher
from .kvcache import Allocation, KVCache
from .tokenizer import output_token_ids


@dataclass
class Prefilled:
    """First item a generation yields: prefill is done and this many prompt tokens came from cache."""

    cached_tokens: int


@dataclass(eq=False)
class _Waiter:
    prompt: list[int]
    salt: str | None
    total_tokens: int
    future: asyncio.Future[Allocation] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass
class EngineStats:
    """Counters exposed by ``GET /mock/stats`` and ``/metrics``."""

    requests_served: int = 0
    requests_started: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    completion_tokens_total: int = 0


class Engine:
    """Owns the cache, the queue and the publisher; :meth:`generate` is the whole life of one request."""

    def __init__(self, config: MockConfig, cache: KVCache, publisher: KvEventPublisher | None) -> None:
        self.config = config
        self.cache = cache
        self.publisher = publisher
        self.waiting: deque[_Waiter] = deque()
        self.running = 0
        self.stats = EngineStats()

    def _publish(self, events: list[dict]) -> None:
        if events and self.publisher is not None:
            self.publisher.publish(events)

    async def _sleep_ms(self, ms: float) -> None:
        await asyncio.sleep(ms / 1000.0 / self.config.speedup)

    def fits_at_all(self, total_tokens: int) -> bool:
        """Whether a request could EVER be admitted; larger ones are refused instead of waiting forever."""
        return self.cache.blocks_needed(total_tokens) <= self.cache.num_blocks

    def _schedule(self) -> None:
        """Admit waiting requests in strict FIFO order while batch slots and KV blocks allow."""
        while self.waiting and self.running < self.config.max_batch_size:
            head = self.waiting[0]
            if head.future.done():  # cancelled while waiting
                self.waiting.popleft()
                continue
            admitted = self.cache.admit(head.prompt, head.salt, head.total_tokens)
            if admitted is None:
                return  # head-of-line blocking on KV capacity, as a FIFO scheduler does
            alloc, events = admitted
            self._publish(events)
            self.waiting.popleft()
            self.running += 1
            head.future.set_result(alloc)

    def _finish(self, alloc: Allocation) -> None:
        self.cache.release(alloc)
        self.running -= 1
        self._schedule()

    async def _admit(self, prompt: list[int], salt: str | None, total_tokens: int) -> Allocation:
        waiter = _Waiter(prompt, salt, total_tokens)
        self.waiting.append(waiter)
        self._schedule()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self._finish(waiter.future.result())  # admitted just as the client went away
            else:
                waiter.future.cancel()
                self._schedule()
            raise

    async def generate(
        self, prompt: list[int], salt: str | None, max_tokens: int
    ) -> AsyncIterator[Prefilled | int]:
        """Yield :class:`Prefilled` once, then each output token id; releases everything when closed."""
        alloc = await self._admit(prompt, salt, len(prompt) + max_tokens)
        self.stats.requests_started += 1
        try:
            await self._sleep_ms((len(prompt) - alloc.cached_tokens) * self.config.prefill_ms_per_token)
            self._publish(self.cache.commit_prefill(alloc))
            self.stats.prompt_tokens_total += len(prompt)
            self.stats.cached_tokens_total += alloc.cached_tokens
            yield Prefilled(alloc.cached_tokens)
            for tok in output_token_ids(prompt, max_tokens):
                await self._sleep_ms(self.config.decode_ms_per_token)
                self.stats.completion_tokens_total += 1
                yield tok
            self.stats.requests_served += 1
        finally:
            self._finish(alloc)
