"""--eviction-aware: the churn estimate from a worker's own KV events, the two rules of the choice, the flag
off (and on without churn) deciding exactly as today, and the figures /debug/score shows."""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from typing import Any

import pytest

from epp_extproc.config import Config
from epp_extproc.core.contract import PromptIdentity
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.load import EndpointLoad, LoadTracker
from epp_extproc.core.request import RequestContext
from epp_extproc.core.scheduling.eviction_scorer import EvictionScorer
from epp_extproc.metrics import PickerMetrics
from kvindex.churn import ChurnWindow
from kvindex.events import BlockRemoved, BlockStored, DecodedBatch
from kvindex.index import KvIndex
from tests.scheduling_fakes import (
    CostParams,
    Decider,
    Row,
    TokensRenderer,
    apply_eviction,
    build_decider,
    choose,
)

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
BS = 32


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def store(index: KvIndex, worker: str, first: int, n: int) -> None:
    """The worker's event: it stored `n` blocks with engine hashes first..first+n-1 (one chain)."""
    tokens = array("I", range(first * BS, (first + n) * BS))
    ev = BlockStored(list(range(first, first + n)), None, tokens, BS)
    index.apply_batch(worker, DecodedBatch(events=[ev], raw_event_count=1))


def remove(index: KvIndex, worker: str, first: int, n: int) -> None:
    index.apply_batch(worker, DecodedBatch(events=[BlockRemoved(list(range(first, first + n)))],
                                           raw_event_count=1))


def full_worker(index: KvIndex, worker: str, capacity: int) -> None:
    """A worker that filled its cache with `capacity` blocks, then evicted one and stored one in its place."""
    store(index, worker, 1, capacity)
    remove(index, worker, 1, 1)
    store(index, worker, 100_000, 1)


# ------------------------------------------------------------------ the estimate, from real events


def test_removal_rate_counts_removed_blocks_over_the_window() -> None:
    clock, index = Clock(), KvIndex(BS)
    churn = ChurnWindow(index, window_s=10.0, buckets=10, clock=clock)
    store(index, A, 1, 50)
    churn.removal_rate(A)  # first look
    remove(index, A, 1, 20)
    clock.t += 1.0
    assert churn.removal_rate(A) == 2.0  # 20 blocks over the 10 s window


def test_removals_older_than_the_window_are_forgotten() -> None:
    clock, index = Clock(), KvIndex(BS)
    churn = ChurnWindow(index, window_s=10.0, buckets=10, clock=clock)
    store(index, A, 1, 50)
    churn.removal_rate(A)
    remove(index, A, 1, 20)
    churn.removal_rate(A)
    clock.t += 11.0
    assert churn.removal_rate(A) == 0.0


def test_capacity_is_unknown_until_the_worker_removes_a_block() -> None:
    index = KvIndex(BS)
    churn = ChurnWindow(index, clock=Clock())
    store(index, A, 1, 40)
    assert churn.capacity(A) is None


def test_capacity_is_the_most_blocks_held_once_removals_start() -> None:
    index = KvIndex(BS)
    churn = ChurnWindow(index, clock=Clock())
    store(index, A, 1, 40)
    churn.capacity(A)
    remove(index, A, 1, 10)
    assert churn.capacity(A) == 40
    assert churn.held(A) == 30


# ------------------------------------------------------------------ the rules


def cand(address: str, *, prompt: float, overlap: int, prefill: float = 0.0, decode: float = 0.0) -> Row:
    return Row(address, EndpointLoad(inflight=1, prefill_blocks=prefill, decode_blocks=decode),
                     prompt_blocks=prompt, overlap_blocks=overlap)


def pressured(capacity: int) -> tuple[KvIndex, EvictionScorer]:
    index = KvIndex(BS)
    full_worker(index, A, capacity)
    return index, EvictionScorer(ChurnWindow(index, clock=Clock()), lambda _a: None)


def test_overlap_on_a_full_worker_with_a_long_queue_is_discounted() -> None:
    _, ev = pressured(100)
    c = cand(A, prompt=20, overlap=10, prefill=200)  # 200 booked blocks to allocate before this one: all evicted
    apply_eviction(ev, [c])
    assert c.overlap_discount == 10


def test_overlap_on_a_worker_with_free_room_is_not_discounted() -> None:
    index = KvIndex(BS)
    store(index, A, 1, 10)  # never removed a block: not known to be full
    ev = EvictionScorer(ChurnWindow(index, clock=Clock()), lambda _a: None)
    c = cand(A, prompt=20, overlap=10, prefill=200)
    apply_eviction(ev, [c])
    assert c.overlap_discount == 0


def test_discounted_overlap_sends_the_prefix_where_it_survives() -> None:
    index, ev = pressured(100)
    store(index, B, 1, 10)  # B holds the same prefix and has room
    a = cand(A, prompt=20, overlap=10, prefill=150)
    b = cand(B, prompt=20, overlap=4, prefill=140)
    apply_eviction(ev, [a, b])
    assert choose([a, b], CostParams(overlap_credit=2.0)).address == B


def test_without_the_rule_the_prefix_goes_to_the_full_worker() -> None:
    a = cand(A, prompt=20, overlap=10, prefill=150)
    b = cand(B, prompt=20, overlap=4, prefill=140)
    assert choose([a, b], CostParams(overlap_credit=2.0)).address == A


def test_a_long_new_prefix_is_not_flushed_into_a_full_worker_when_another_has_room() -> None:
    index, ev = pressured(100)
    store(index, B, 1, 10)
    a = cand(A, prompt=60, overlap=0, decode=0)
    b = cand(B, prompt=60, overlap=0, decode=30)  # busier, but its cache has room
    apply_eviction(ev, [a, b])
    assert a.eviction_penalty > 0 and b.eviction_penalty == 0
    assert choose([a, b], CostParams()).address == B


def test_no_flush_penalty_when_every_worker_would_flush_alike() -> None:
    index, ev = pressured(100)
    full_worker(index, B, 100)
    a, b = cand(A, prompt=60, overlap=0), cand(B, prompt=60, overlap=0)
    apply_eviction(ev, [a, b])
    assert a.eviction_penalty == b.eviction_penalty == 0


def test_usage_gauge_sets_the_pinned_blocks() -> None:
    index = KvIndex(BS)
    full_worker(index, A, 100)
    ev = EvictionScorer(ChurnWindow(index, clock=Clock()), lambda _a: 0.5)
    c = cand(A, prompt=10, overlap=0, decode=3)
    apply_eviction(ev, [c])
    assert c.eviction.pressure.pinned == 50 and c.eviction.pressure.pinned_source == "usage_gauge"


# ------------------------------------------------------------------ the pipeline: off = today, debug


class FakeKv:
    def __init__(self) -> None:
        self.overlaps: dict[str, int] = {}

    def prompt(self, tokens: Sequence[int], identity: PromptIdentity) -> list[int]:
        return list(tokens)

    def block_size(self, address: str) -> int:
        return BS

    def base_model_for(self, model: object) -> str | None:
        return None

    def overlap(self, prompt: Any, workers: Sequence[str]) -> dict[str, int]:
        return dict(self.overlaps)

    def credit(self, prompt: Any, workers: Sequence[str]) -> dict[str, Any]:
        return {}

    def held(self, address: str) -> int:
        return 0

    def predict(self, address: str, prompt: Any, booking: str | None = None) -> None:
        pass


def pipeline(churn: ChurnWindow | None) -> tuple[Decider, TokensRenderer, FakeKv]:
    """The decision with the flag off (`churn` None) or on, reading `churn` and no usage gauge."""
    reg = EndpointRegistry()
    reg.replace([Endpoint("a", A), Endpoint("b", B)])
    metrics = PickerMetrics()
    r, kv = TokensRenderer(), FakeKv()
    config = Config(tokenizer_protocol="trtllm-render", tokenizer_service_url="http://127.0.0.1:1",
                    eviction_aware=churn is not None)
    return build_decider(config, reg, LoadTracker(metrics.endpoint_inflight), metrics, renderer=r, kv=kv,
                         churn=churn, usage=lambda _a: None), r, kv


def chat() -> RequestContext:
    return RequestContext(method="POST", path="/v1/chat/completions", headers={},
                          body=b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')


async def scripted_run(pipe: Decider, r: TokensRenderer, kv: FakeKv, seed: int) -> list[tuple[str, float]]:
    """Forty decisions with varied prompts and overlaps, committed (so bookings pile up): (pick, cost) each."""
    rng = random.Random(seed)
    out = []
    for _ in range(40):
        r.tokens = list(range(rng.randint(1, 40) * BS))
        kv.overlaps = {A: rng.randint(0, 20), B: rng.randint(0, 20)}
        p = await pipe.propose(chat())
        pipe.commit(p)
        out.append((p.address, p.primary.table.cost[p.primary.chosen]))
    return out


def test_the_flag_is_off_by_default() -> None:
    assert Config().eviction_aware is False


async def test_without_churn_the_flag_on_decides_exactly_as_off() -> None:
    """A pool whose caches never evicted: every decision and cost equal to the flag off (the rules only act on
    a worker known to be full)."""
    index = KvIndex(BS)
    store(index, A, 1, 50)
    off = pipeline(None)
    on = pipeline(ChurnWindow(index, clock=Clock()))
    random.seed(7)  # ties are broken at random
    picks_off = await scripted_run(*off, seed=1)
    random.seed(7)
    picks_on = await scripted_run(*on, seed=1)
    assert picks_on == picks_off


async def test_with_churn_the_flag_changes_decisions() -> None:
    """The same scripted run on a full worker A: the eviction-aware picks differ (so the test above can fail)."""
    index = KvIndex(BS)
    full_worker(index, A, 30)
    random.seed(7)
    picks_off = await scripted_run(*pipeline(None), seed=1)
    random.seed(7)
    picks_on = await scripted_run(*pipeline(ChurnWindow(index, clock=Clock())),
                                  seed=1)
    assert picks_on != picks_off


async def test_debug_score_explains_the_discount_and_the_penalty() -> None:
    index = KvIndex(BS)
    full_worker(index, A, 30)
    pipe, r, kv = pipeline(ChurnWindow(index, clock=Clock()))
    r.tokens = list(range(20 * BS))
    kv.overlaps = {A: 10}
    pipe.load.book(A, 40)  # 40 blocks booked ahead on A
    doc = pipe.explain(await pipe.propose(chat()))
    row = next(w for w in doc["workers"] if w["address"] == A)["eviction"]
    assert row["capacity_blocks"] == 30 and row["survival"] == 0.0 and row["overlap_discount"] == 10
    assert row["would_flush"] > 0 and row["flush_penalty"] > 0


async def test_debug_score_has_no_eviction_figures_with_the_flag_off() -> None:
    pipe, r, kv = pipeline(None)
    r.tokens = list(range(5 * BS))
    doc = pipe.explain(await pipe.propose(chat()))
    assert all("eviction" not in w for w in doc["workers"])


def test_the_flag_is_refused_with_ingest_apart() -> None:
    with pytest.raises(ValueError, match="eviction"):
        Config(eviction_aware=True, kv_ingest="apart").validate()
