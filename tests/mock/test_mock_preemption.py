"""KV admission by preemption (``kv_admission="preempt"``, the vLLM dialects' default): vLLM V1 allocates a
request's blocks as it computes them and, when none is free, preempts the newest running request, which is
recomputed when admitted again. TensorRT-LLM's GUARANTEED_NO_EVICT (``reserve``) reserves prompt + max_tokens at
admission instead, so a request waits for room it may never use.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trtllm_mock import MockConfig
from trtllm_mock.engine import Engine, Prefilled
from trtllm_mock.kvcache import KVCache
from trtllm_mock.tokenizer import output_token_ids

TPB = 32


def engine(admission: str, num_blocks: int, **overrides: object) -> Engine:
    cfg = MockConfig(scheduler="iteration", speedup=1e6, tokens_per_block=TPB, num_blocks=num_blocks,
                     kv_admission=admission, step_base_ms=1.0, step_prefill_ms_per_token=0.01,
                     step_decode_ms_per_token=0.01, step_kv_read_ms_per_token=0.0)  # type: ignore[arg-type]
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg.validate()
    return Engine(cfg, KVCache(TPB, num_blocks, cfg.host_blocks), None)


def prompt(blocks: int, seed: int) -> list[int]:
    return [100 + (seed * 7919 + i) % 30000 for i in range(blocks * TPB)]


async def run(e: Engine, ids: list[int], max_tokens: int) -> tuple[list[int], list[Prefilled]]:
    tokens: list[int] = []
    prefilled: list[Prefilled] = []
    async for item in e.generate(ids, None, max_tokens):
        (prefilled if isinstance(item, Prefilled) else tokens).append(item)  # type: ignore[arg-type]
    return tokens, prefilled


async def peak_running(e: Engine, *jobs: tuple[list[int], int]) -> int:
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, e.running)
            await asyncio.sleep(0)

    w = asyncio.create_task(watch())
    await asyncio.gather(*(run(e, ids, n) for ids, n in jobs))
    w.cancel()
    return peak


def test_auto_admission_preempts_for_the_vllm_dialects_only() -> None:
    def cfg(dialect: str, scheduler: str = "iteration") -> MockConfig:
        return MockConfig(scheduler=scheduler, event_dialect=dialect)  # type: ignore[arg-type]

    assert cfg("vllm").preempts and cfg("vllm-array").preempts
    assert not cfg("trtllm").preempts and not cfg("sglang").preempts
    assert not cfg("vllm", "independent").preempts  # preemption happens between engine steps
    with pytest.raises(ValueError, match="iteration"):
        MockConfig(kv_admission="preempt").validate()


async def test_reserve_makes_a_request_wait_for_room_its_output_has_not_used_yet() -> None:
    # two 4-block prompts with 4 blocks of output each: reserved whole they need 16 of 12 blocks
    e = engine("reserve", 12)
    assert await peak_running(e, (prompt(4, 1), 4 * TPB), (prompt(4, 2), 4 * TPB)) == 1


async def test_preempt_admits_on_the_prompt_alone() -> None:
    e = engine("preempt", 12)  # the same two requests as above
    assert await peak_running(e, (prompt(4, 1), 4 * TPB), (prompt(4, 2), 4 * TPB)) == 2


async def test_the_newest_request_is_preempted_when_a_decode_needs_a_block_and_still_returns_every_token() -> None:
    alone = engine("preempt", 64)
    expected = [await run(alone, prompt(4, s), 4 * TPB) for s in (1, 2)]
    e = engine("preempt", 12)  # both prompts fit (8 blocks); both outputs (4 blocks each) do not
    first, second = await asyncio.gather(run(e, prompt(4, 1), 4 * TPB), run(e, prompt(4, 2), 4 * TPB))
    assert e.stats.preemptions >= 1
    assert [first[0], second[0]] == [expected[0][0], expected[1][0]]  # same tokens, none repeated or lost
    assert len(first[1]) == len(second[1]) == 1  # one first-chunk report each, resumed or not
    assert e.running == 0 and e.cache.private_in_use == 0 and not e.waiting  # nothing leaked


async def test_a_resumed_request_recomputes_its_output_but_reuses_its_cached_prompt() -> None:
    e = engine("preempt", 12)
    await asyncio.gather(run(e, prompt(4, 1), 4 * TPB), run(e, prompt(4, 2), 4 * TPB))
    # the newest was preempted while decoding: its 4 prompt blocks were stored and stayed cached, so what it
    # recomputes is the output it had produced (plus the prompt's last block, never reused), not the prompt
    assert 0 < e.stats.recomputed_tokens_total
    assert e.stats.recomputed_tokens_total < e.stats.preemptions * (4 * TPB + 4 * TPB)


async def test_the_first_admitted_request_is_never_the_one_preempted() -> None:
    e = engine("preempt", 12)
    order: list[str] = []

    async def one(name: str, seed: int) -> None:
        async for item in e.generate(prompt(4, seed), None, 4 * TPB):
            if not isinstance(item, Prefilled):
                order.append(name)

    a = asyncio.create_task(one("a", 1))
    await asyncio.sleep(0)  # a is admitted first
    await asyncio.gather(a, one("b", 2))
    # a decodes to the end before b's last tokens: b gave its blocks up and waited to be admitted again
    assert order[-1] == "b" and order.count("a") == order.count("b") == 4 * TPB
    assert e.stats.preemptions >= 1


async def test_a_client_leaving_while_preempted_gives_up_its_place_in_the_queue() -> None:
    e = engine("preempt", 12)
    b_first_token = asyncio.Event()

    async def b() -> None:
        async for item in e.generate(prompt(4, 2), None, 4 * TPB):
            if not isinstance(item, Prefilled):
                b_first_token.set()

    a = asyncio.create_task(run(e, prompt(4, 1), 4 * TPB))
    await asyncio.sleep(0)
    tb = asyncio.create_task(b())
    for _ in range(10_000):
        if e.stats.preemptions:
            break
        await asyncio.sleep(0)
    assert b_first_token.is_set() and len(e.waiting) == 1  # b, preempted, waits at the head
    tb.cancel()
    with pytest.raises(asyncio.CancelledError):
        await tb
    await a
    assert (await run(e, prompt(4, 3), TPB))[0]  # the queue still moves
    assert e.running == 0 and e.cache.private_in_use == 0 and not e.waiting


async def test_a_preempted_prompt_evicted_to_host_memory_is_loaded_on_resume_not_recomputed() -> None:
    # a outgrows the room while b waits preempted: b's cached prompt blocks are evicted (leaves first), into
    # host memory when there is a host tier; b's resumption loads them from there instead of computing them
    async def recomputed(host_blocks: int) -> tuple[int, int]:
        e = engine("preempt", 12, host_blocks=host_blocks)
        await asyncio.gather(run(e, prompt(4, 1), 6 * TPB), run(e, prompt(4, 2), 6 * TPB))
        assert e.stats.preemptions >= 1
        return e.stats.recomputed_tokens_total, e.stats.loaded_tokens_total

    gpu_only, host = await recomputed(0), await recomputed(32)
    assert gpu_only[1] == 0 and host[1] > 0
    assert host[0] == gpu_only[0] - host[1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(6, 24), st.lists(st.tuples(st.integers(1, 5), st.integers(1, 96), st.integers(0, 3),
                                              st.booleans()), min_size=1, max_size=8), st.integers(0, 16))
def test_any_mix_of_requests_and_clients_leaving_ends_with_every_token_and_nothing_held(
        num_blocks: int, jobs: list[tuple[int, int, int, bool]], host_blocks: int) -> None:
    """Whatever preempts whom: each request that stays gets exactly its tokens once, and when all are done
    no block is pinned or private, nothing waits and nothing runs."""
    async def scenario() -> None:
        e = engine("preempt", num_blocks, host_blocks=host_blocks)

        async def one(i: int, blocks: int, max_tokens: int, seed: int, leaves: bool) -> None:
            ids = prompt(blocks, seed * 10 + i)
            if not e.fits_at_all(len(ids) + max_tokens):
                return
            got: list[int] = []
            gen = e.generate(ids, None, max_tokens)
            try:
                async for item in gen:
                    if not isinstance(item, Prefilled):
                        got.append(item)
                        if leaves and len(got) == max(1, max_tokens // 2):
                            return  # the client goes away mid-answer
            finally:
                await gen.aclose()  # what the server does when a client disconnects
            assert got == output_token_ids(ids, max_tokens)

        await asyncio.gather(*(one(i, *job) for i, job in enumerate(jobs)))
        assert e.running == 0 and not e.waiting and e.cache.private_in_use == 0
        assert all(b.ref_count == 0 for b in e.cache.blocks.values())

    asyncio.run(scenario())
