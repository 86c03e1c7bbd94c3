"""The trace benchmark's clairvoyant router: Belady eviction per worker, real capacity, batch limits, waits."""

from __future__ import annotations

import pytest

from bench.clairvoyant import EngineModel, route


def model(*, workers: int = 1, num_blocks: int = 100, max_batch: int = 8) -> EngineModel:
    """4-token blocks and 1 ms per step, nothing per token: a request's life is ~ its output length in ms."""
    return EngineModel(workers=workers, num_blocks=num_blocks, block_tokens=4, max_batch=max_batch,
                       max_num_tokens=64, step_base_ms=1.0, prefill_ms_per_token=0.0, decode_ms_per_token=0.0,
                       kv_read_ms_per_token=0.0)


def prompt(first: int) -> list[int]:
    """9 tokens: 2 full reusable blocks (the last token is never reused), a chain of its own per ``first``."""
    return list(range(first, first + 9))


def test_a_shared_prefix_follows_its_first_request_to_the_same_worker() -> None:
    out = route([prompt(0), prompt(100), prompt(0)], [1, 1, 1], [0.0, 0.0, 100.0], model(workers=2))
    assert out["placement"][2] == out["placement"][0] != out["placement"][1]
    assert out["cached_tokens"] == 8


def test_eviction_keeps_the_prefix_used_again_rather_than_the_least_recently_used() -> None:
    # A, B, C, then A again, one at a time on one worker with room for 6 blocks: admitting C (3 blocks)
    # must evict one cached block. LRU would take A's leaf; the clairvoyant takes B's (never used again).
    prompts = [prompt(0), prompt(100), prompt(200), prompt(0)]
    out = route(prompts, [1, 1, 1, 1], [0.0, 100.0, 200.0, 300.0], model(num_blocks=6))
    assert out["evicted_blocks"] >= 1
    assert out["cached_tokens"] == 8  # all of A's reusable blocks at the fourth request


def test_a_full_batch_sends_a_cache_hit_elsewhere_rather_than_waiting() -> None:
    # worker 0 holds the prefix but runs one request (max batch 1) until t=50; worker 1 is free now
    out = route([prompt(0), prompt(0)], [50, 1], [0.0, 1.0], model(workers=2, max_batch=1))
    assert out["placement"] == [0, 1] and out["waited_requests"] == 0 and out["cached_tokens"] == 0


def test_a_request_waits_for_capacity_until_a_running_one_ends() -> None:
    out = route([prompt(0), prompt(100)], [3, 1], [0.0, 1.0], model(num_blocks=4))
    assert out["waited_requests"] == 1
    assert out["mean_wait_ms"] == pytest.approx(3.0 - 1.0)  # 1 prefill step + 2 decode steps, from t=1


def test_a_request_larger_than_a_worker_is_refused() -> None:
    with pytest.raises(ValueError, match="can never fit"):
        route([list(range(40))], [1], [0.0], model(num_blocks=4))
