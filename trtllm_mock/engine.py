"""Scheduler and timing model: a FIFO waiting queue in front of at most ``max_batch_size`` running requests.

Admission (``kv_admission``): a request reserves KV blocks for prompt + max_tokens (evicting least recently used
cached blocks if it must, TensorRT-LLM's GUARANTEED_NO_EVICT policy) or waits in FIFO order. With ``preempt``
(the iteration scheduler only; the default for the vLLM dialects) it reserves its prompt's blocks, takes one more
whenever a decode step crosses into a new block, and when none can be had the newest running request is
preempted: its blocks are freed (its stored prompt blocks stay cached), it goes back to the front of the queue
and, once admitted again, recomputes its prompt and the tokens it already produced (less what the cache still
holds, or loads from an off-GPU tier) before its next token, as vLLM V1's scheduler does. Its full prompt blocks
are stored and published when its prefill completes.

``scheduler="independent"`` (default, fast tests): each request sleeps ``prefill_ms_per_token`` per UNCACHED
prompt token, then ``decode_ms_per_token`` per output token, independently of the others.

``scheduler="iteration"`` (benchmarks): one loop runs engine steps like TensorRT-LLM's in-flight batching.
A step takes one token for every decoding request, then fills the rest of the ``max_num_tokens`` budget with
prefill chunks of the requests still prefilling (oldest first, chunks a multiple of the block size unless
they finish the prompt). Its duration grows with its contents (see :meth:`Engine.step_ms`), so a long prefill
in the same step delays every decode token, and a request's TTFT includes the steps it waited for budget.
The step that finishes a prompt also yields its first output token, as the engine's context phase does.

All times divide by ``speedup``; README.md says how the constants were calibrated.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import LOAD_VS_PREFILL, MockConfig
from .events import KvEventPublisher
from .kvcache import Allocation, KVCache
from .tokenizer import output_token_ids
from .vision import EncoderCache, VisionPrompt


@dataclass
class Prefilled:
    """First item a generation yields: prefill is done and this many prompt tokens came from cache."""

    cached_tokens: int


@dataclass(eq=False)
class _Waiter:
    prompt: list[int]
    salt: str | None
    total_tokens: int
    mm_blocks: Sequence[Sequence[Any]] | None = None
    future: asyncio.Future[Allocation] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    resume: _Seq | None = None  # a preempted request: admitting it puts it back among the running


@dataclass
class EngineStats:
    """Counters exposed by ``GET /mock/stats`` and ``/metrics``."""

    requests_served: int = 0
    requests_started: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    completion_tokens_total: int = 0
    steps: int = 0
    step_ms_total: float = 0.0
    encoder_ms_total: float = 0.0  # vision mode: simulated encoder time charged for uncached images
    loaded_tokens_total: int = 0  # off-GPU tiers: prompt tokens loaded from host memory or storage
    load_ms_total: float = 0.0  # and the simulated time it took (config.LOAD_VS_PREFILL)
    preemptions: int = 0  # kv_admission preempt: running requests sent back to the queue for want of KV room
    recomputed_tokens_total: int = 0  # and the tokens their resumptions computed again


@dataclass(eq=False)
class _Seq:
    """One running request as the iteration scheduler sees it; items for its consumer go to ``out``."""

    alloc: Allocation
    prompt_len: int
    tokens: list[int]
    prefill_left: int
    encoder_ms: float = 0.0  # vision mode: added to the first step that computes part of this prompt
    produced: int = 0
    out: asyncio.Queue[Prefilled | int | None] = field(default_factory=asyncio.Queue)
    waiter: _Waiter | None = None  # set while preempted: its place in the waiting queue


@dataclass
class StepPlan:
    """What one engine step computes: prefill chunks and decode tokens, and the KV context decodes read."""

    prefill: list[tuple[_Seq, int]] = field(default_factory=list)
    decode: list[_Seq] = field(default_factory=list)
    context_tokens: int = 0

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)


class Engine:
    """Owns the cache, the queue and the publisher; :meth:`generate` is the whole life of one request."""

    def __init__(self, config: MockConfig, cache: KVCache, publisher: KvEventPublisher | None) -> None:
        self.config = config
        self.cache = cache
        self.publisher = publisher
        self.waiting: deque[_Waiter] = deque()
        self.running = 0
        self.stats = EngineStats()
        self._active: dict[_Seq, None] = {}  # iteration scheduler: running requests in admission order
        self._loop: asyncio.Task[None] | None = None
        self.clock_ms = 0.0  # simulated engine time: the summed duration of every step run so far
        self.encoder = EncoderCache(config.encoder_cache_tokens) if config.multimodal else None

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
            admitted = self.cache.admit(head.prompt, head.salt, head.total_tokens, head.mm_blocks)
            if admitted is None:
                return  # head-of-line blocking on KV capacity, as a FIFO scheduler does
            alloc, events = admitted
            self._publish(events)
            self.waiting.popleft()
            self.running += 1
            if head.resume is not None:
                self._resume(head.resume, alloc)
            else:
                head.future.set_result(alloc)

    def _finish(self, alloc: Allocation) -> None:
        self.cache.release(alloc)
        self.running -= 1
        self._schedule()

    async def _admit(self, prompt: list[int], salt: str | None, total_tokens: int,
                     mm_blocks: Sequence[Sequence[Any]] | None = None) -> Allocation:
        waiter = _Waiter(prompt, salt, total_tokens, mm_blocks)
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

    async def hold(self, prompt: list[int], salt: str | None, total_tokens: int) -> Allocation:
        """KV room for ``total_tokens`` through the same FIFO waiting queue as every request (a disaggregated
        generation leg's landing area for the transferred context); give it back with :meth:`release`."""
        return await self._admit(prompt, salt, total_tokens)

    def release(self, alloc: Allocation) -> None:
        """Give back what :meth:`hold` admitted (frees the batch slot and lets the queue move)."""
        self._finish(alloc)

    # ------------------------------------------------------------ iteration scheduler
    def step_ms(self, prefill_tokens: int, decode_tokens: int, context_tokens: int) -> float:
        """Simulated duration of one step (before ``speedup``): a fixed cost plus what the step computes.

        Prefill tokens are compute-bound matrix work; each decode token adds its share of the batch, and each
        decoding request reads its whole KV context (``context_tokens`` summed over them) once per step.
        """
        c = self.config
        return (
            c.step_base_ms
            + prefill_tokens * c.step_prefill_ms_per_token
            + decode_tokens * c.step_decode_ms_per_token
            + context_tokens * c.step_kv_read_ms_per_token
        )

    def plan_step(self) -> StepPlan:
        """Decode first (one token per generating request), then prefill chunks within the token budget.

        With ``kv_admission`` preempt a decode that needs a new block gets it here or preempts the newest running
        request (itself last), as vLLM's ``schedule`` does for its running requests."""
        budget = self.config.max_num_tokens
        tpb = self.cache.tokens_per_block
        plan = StepPlan()
        preempts = self.config.preempts
        for seq in list(self._active):
            if seq not in self._active:
                continue  # preempted for an earlier request's block in this very plan
            if seq.prefill_left == 0 and budget > 0:
                if preempts and not self._room_to_decode(seq):
                    continue
                plan.decode.append(seq)
                plan.context_tokens += seq.prompt_len + seq.produced
                budget -= 1
        for seq in self._active:
            if seq.prefill_left == 0:
                continue
            chunk = min(seq.prefill_left, budget)
            if tpb <= chunk < seq.prefill_left:
                chunk -= chunk % tpb  # a partial chunk stays block-aligned, as TensorRT-LLM's chunking does
            if chunk <= 0:
                break  # FIFO: a later request never prefills ahead of an earlier one that did not fit
            plan.prefill.append((seq, chunk))
            budget -= chunk
        return plan

    async def _run_steps(self) -> None:
        """The engine loop: plan, sleep for the step's duration, hand out what it produced; idle when empty."""
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        try:
            while self._active:
                plan = self.plan_step()
                ms = self.step_ms(plan.prefill_tokens, len(plan.decode), plan.context_tokens)
                for seq, _ in plan.prefill:  # an uncached image is encoded before its first prefill chunk
                    ms += seq.encoder_ms
                    seq.encoder_ms = 0.0
                self.stats.steps += 1
                self.stats.step_ms_total += ms
                # steps end on a deadline chain, so the loop's own work does not lengthen every step
                deadline = max(deadline, loop.time()) + ms / 1000.0 / self.config.speedup
                await asyncio.sleep(max(0.0, deadline - loop.time()))
                self.clock_ms += ms
                for seq in plan.decode:
                    if seq in self._active:
                        self._emit_token(seq)
                for seq, n in plan.prefill:
                    if seq not in self._active:
                        continue  # cancelled during the step
                    seq.prefill_left -= n
                    if seq.prefill_left == 0:
                        self._publish(self.cache.commit_prefill(seq.alloc))
                        if seq.produced == 0:  # (a resumed request's first token went out before it was preempted)
                            seq.out.put_nowait(Prefilled(seq.alloc.cached_tokens))
                        self._emit_token(seq)  # the context step also samples the first (or next) token
        finally:
            self._loop = None

    def _room_to_decode(self, seq: _Seq) -> bool:
        """The block this decode step writes into, preempting the newest running requests for it if it must;
        False if ``seq`` itself had to go."""
        need = self.cache.blocks_needed(seq.prompt_len + seq.produced) - seq.alloc.blocks
        if need <= 0:
            return True
        while (events := self.cache.grow(seq.alloc, need)) is None:
            victim = next(reversed(self._active))
            self._preempt(victim)
            if victim is seq:
                return False
        self._publish(events)
        return True

    def _preempt(self, seq: _Seq) -> None:
        """Free a running request's blocks and queue it first, to recompute what it had when admitted again."""
        self._active.pop(seq, None)
        self.cache.release(seq.alloc)
        self.running -= 1
        self.stats.preemptions += 1
        seq.waiter = _Waiter(seq.alloc.prompt, seq.alloc.salt, seq.prompt_len + seq.produced, seq.alloc.mm_blocks,
                             resume=seq)
        self.waiting.appendleft(seq.waiter)

    def _resume(self, seq: _Seq, alloc: Allocation) -> None:
        """A preempted request admitted again: it recomputes its prompt and output so far, less what is cached."""
        seq.waiter = None
        seq.alloc = alloc
        seq.prefill_left = seq.prompt_len + seq.produced - alloc.cached_tokens
        seq.encoder_ms = self._load_ms(alloc)
        self.stats.recomputed_tokens_total += seq.prefill_left
        self._active[seq] = None
        if self._loop is None:
            self._loop = asyncio.get_running_loop().create_task(self._run_steps())

    def _end(self, seq: _Seq) -> None:
        """A request leaves (done, failed or cancelled): its blocks back, or its place in the queue given up."""
        self._active.pop(seq, None)
        if seq.waiter is not None:
            seq.waiter.future.cancel()  # skipped when it reaches the head
            seq.waiter = None
            self._schedule()
        else:
            self._finish(seq.alloc)

    def _emit_token(self, seq: _Seq) -> None:
        seq.out.put_nowait(seq.tokens[seq.produced])
        seq.produced += 1
        if seq.produced == len(seq.tokens):
            seq.out.put_nowait(None)
            self._active.pop(seq, None)

    async def _generate_iteration(self, seq: _Seq) -> AsyncIterator[Prefilled | int]:
        self._active[seq] = None
        if self._loop is None:
            self._loop = asyncio.get_running_loop().create_task(self._run_steps())
        while (item := await seq.out.get()) is not None:
            if isinstance(item, Prefilled):
                self.stats.prompt_tokens_total += seq.prompt_len
                self.stats.cached_tokens_total += item.cached_tokens
            else:
                self.stats.completion_tokens_total += 1
            yield item

    def _load_ms(self, alloc: Allocation) -> float:
        """Time to load the blocks the prompt found off the GPU: per token, the tier's fixed fraction of this
        mock's prefill cost per token (config.LOAD_VS_PREFILL), so it scales as the prefill does."""
        if not alloc.loaded:
            return 0.0
        c = self.config
        per_token = c.step_prefill_ms_per_token if c.scheduler == "iteration" else c.prefill_ms_per_token
        tpb = self.cache.tokens_per_block
        ms = sum(LOAD_VS_PREFILL[m] for m in alloc.loaded) * tpb * per_token
        self.stats.loaded_tokens_total += len(alloc.loaded) * tpb
        self.stats.load_ms_total += ms
        return ms

    def _encoder_ms(self, vision: VisionPrompt | None, cached_tokens: int) -> float:
        """Encoder time for the request's images that neither the prefix cache nor the encoder cache holds."""
        if self.encoder is None or vision is None or not vision.spans:
            return 0.0
        ms = self.encoder.charge(vision.spans, cached_tokens) * self.config.encoder_ms_per_patch
        self.stats.encoder_ms_total += ms
        return ms

    async def generate(
        self, prompt: list[int], salt: str | None, max_tokens: int, vision: VisionPrompt | None = None
    ) -> AsyncIterator[Prefilled | int]:
        """Yield :class:`Prefilled` once, then each output token id; releases everything when closed.

        ``vision`` (vision mode): the prompt's image spans, which key its blocks and cost encoder time."""
        if vision is None and self.encoder is not None:
            vision = VisionPrompt(prompt)  # a multimodal model keys (and publishes) text blocks with no items
        mm_blocks = vision.block_keys(self.cache.tokens_per_block) if vision is not None else None
        # preempt: the prompt's blocks now, the output's as decoding reaches them (see the module docstring)
        reserve = len(prompt) + (0 if self.config.preempts else max_tokens)
        alloc = await self._admit(prompt, salt, reserve, mm_blocks)
        self.stats.requests_started += 1
        seq: _Seq | None = None
        try:
            encoder_ms = self._encoder_ms(vision, alloc.cached_tokens) + self._load_ms(alloc)
            if self.config.scheduler == "iteration":
                seq = _Seq(alloc, len(prompt), output_token_ids(prompt, max_tokens),
                           len(prompt) - alloc.cached_tokens, encoder_ms)
                async for item in self._generate_iteration(seq):
                    yield item
                self.stats.requests_served += 1
                return
            await self._sleep_ms((len(prompt) - alloc.cached_tokens) * self.config.prefill_ms_per_token
                                 + encoder_ms)
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
            if seq is None:
                self._finish(alloc)
            else:
                self._end(seq)
