"""The iteration-level timing model (``scheduler="iteration"``): engine steps with a token budget.

Times are read from the engine's simulated clock (the summed duration of the steps it ran), never from the
wall clock: ``speedup`` makes the runs near instant and the assertions exact.
"""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.mock.test_mock_support import running_worker
from trtllm_mock import MockConfig
from trtllm_mock.engine import Engine, Prefilled
from trtllm_mock.kvcache import KVCache

BASE, PREFILL, DECODE, KV = 2.0, 0.5, 0.1, 0.001


def engine(**overrides: object) -> Engine:
    cfg = MockConfig(scheduler="iteration", speedup=1e6, tokens_per_block=32, step_base_ms=BASE,
                     step_prefill_ms_per_token=PREFILL, step_decode_ms_per_token=DECODE,
                     step_kv_read_ms_per_token=KV)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg.validate()
    return Engine(cfg, KVCache(cfg.tokens_per_block, cfg.num_blocks), None)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [100 + (seed * 7919 + i) % 30000 for i in range(n)]


async def token_times(e: Engine, ids: list[int], max_tokens: int) -> tuple[list[float], int]:
    """Simulated time at which each output token arrived, and the cached tokens prefill reported."""
    times: list[float] = []
    cached = -1
    async for item in e.generate(ids, None, max_tokens):
        if isinstance(item, Prefilled):
            cached = item.cached_tokens
        else:
            times.append(e.clock_ms)
    return times, cached


def test_step_time_grows_with_the_tokens_in_the_step() -> None:
    e = engine()
    assert e.step_ms(0, 1, 0) < e.step_ms(0, 8, 0) < e.step_ms(512, 8, 0)
    assert e.step_ms(0, 8, 10_000) > e.step_ms(0, 8, 0)  # decodes read their KV context
    assert e.step_ms(100, 0, 0) - e.step_ms(0, 0, 0) > e.step_ms(0, 100, 0) - e.step_ms(0, 0, 0)


def test_calibrated_defaults_cost_more_per_prefill_token_than_per_decode_token_only_with_context() -> None:
    """With the published-figure defaults, a decode token alone is about as cheap as a prefill token, but a
    decode at a 10k-token context costs more than a prefill token: long contexts make decode memory-bound."""
    cfg = MockConfig(scheduler="iteration")
    e = Engine(cfg, KVCache(cfg.tokens_per_block, cfg.num_blocks), None)
    per_prefill = e.step_ms(1, 0, 0) - e.step_ms(0, 0, 0)
    per_decode_10k = e.step_ms(0, 1, 10_000) - e.step_ms(0, 0, 0)
    assert per_decode_10k > per_prefill > 0


async def test_chunked_prefill_splits_a_long_prompt_into_budget_sized_block_aligned_steps() -> None:
    e = engine(max_num_tokens=300)
    times, cached = await token_times(e, prompt(1000), 1)
    # chunks of 288 (300 rounded down to whole 32-token blocks), 288, 288, then the last 136
    assert cached == 0 and e.stats.steps == 4
    assert times == [pytest.approx(4 * BASE + 1000 * PREFILL)]


async def test_a_prompt_that_fits_the_budget_prefills_in_one_step() -> None:
    e = engine(max_num_tokens=8192)
    times, _ = await token_times(e, prompt(1000), 3)
    assert e.stats.steps == 3  # one prefill step (which also samples token 1), then two decode steps
    assert times[0] == pytest.approx(BASE + 1000 * PREFILL)


async def test_a_cached_prefix_lowers_time_to_first_token() -> None:
    e = engine()
    ids = prompt(640)
    cold, cached0 = await token_times(e, ids, 1)
    start = e.clock_ms
    warm, cached1 = await token_times(e, ids, 1)
    assert cached0 == 0 and cached1 == 608  # 19 of 20 blocks: the last prompt token is never reused
    assert warm[0] - start == pytest.approx(BASE + 32 * PREFILL)
    assert warm[0] - start < cold[0] / 10


async def test_a_concurrent_prefill_slows_every_decode_step_it_shares() -> None:
    """Request A decodes alone, then B's 2000-token prompt joins one step: A's inter-token gap there grows
    by exactly B's prefill cost, as on an engine that batches prefill with decode."""
    import asyncio

    e = engine()
    a_ids, b_ids = prompt(32, 1), prompt(2000, 2)
    a_times: list[float] = []

    async def run_a() -> None:
        async for item in e.generate(a_ids, None, 12):
            if not isinstance(item, Prefilled):
                a_times.append(e.clock_ms)
                if len(a_times) == 4:
                    asyncio.get_running_loop().create_task(drain_b())

    b_done = asyncio.Event()

    async def drain_b() -> None:
        async for _ in e.generate(b_ids, None, 1):
            pass
        b_done.set()

    await run_a()
    await b_done.wait()
    gaps = [t1 - t0 for t0, t1 in zip(a_times, a_times[1:], strict=False)]
    slow = max(gaps)
    quiet = min(gaps)
    assert slow - quiet == pytest.approx(2000 * PREFILL, rel=0.01)
    assert sum(g > quiet * 2 for g in gaps) == 1  # only the one shared step was slow


async def test_decode_steps_slow_down_as_the_batch_grows() -> None:
    import asyncio

    e = engine()
    alone, _ = await token_times(e, prompt(64, 3), 6)
    gaps_alone = [b - a for a, b in zip(alone, alone[1:], strict=False)]
    runs = await asyncio.gather(*(token_times(e, prompt(64, 10 + i), 6) for i in range(16)))
    gaps_batch = [b - a for t, _ in runs for a, b in zip(t, t[1:], strict=False)]
    assert min(gaps_batch) > max(gaps_alone)


async def test_a_full_cache_evicts_the_least_recently_used_prefix() -> None:
    e = engine(num_blocks=12)
    first, second = prompt(192, 4), prompt(256, 5)  # 6 and 8 prompt blocks (+1 for the output token)
    await token_times(e, first, 1)
    _, cached = await token_times(e, first, 1)
    assert cached == 160  # still cached: 5 reusable blocks
    await token_times(e, second, 1)  # needs 9 blocks: 12 - 6 cached leaves 6 free, so 3 are evicted
    assert len(e.cache.blocks) == 8 + 3
    _, cached_after = await token_times(e, first, 1)
    assert cached_after == 96  # the 3 least recently used leaves of the first chain are gone


async def test_iteration_scheduler_serves_a_streamed_chat_over_http() -> None:
    async with running_worker(kv_events=False, scheduler="iteration", speedup=1000.0) as w, \
            aiohttp.ClientSession() as s:
        body = {"model": "mock-model", "messages": [{"role": "user", "content": "hello " * 50}],
                "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(w.url + "/v1/chat/completions", json=body) as r:
            text = (await r.read()).decode()
        chunks = [json.loads(line[6:]) for line in text.split("\n")
                  if line.startswith("data: ") and line != "data: [DONE]"]
        contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
        assert sum(1 for c in contents if c) == 5
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        assert w.engine.stats.steps == 5 and w.engine.running == 0
