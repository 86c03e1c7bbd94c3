"""Pair selection in a disaggregated pool: decode worker first, then the decider, then the prefill worker."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from epp_extproc.config import Config
from epp_extproc.core.admission import BodyBudget, InflightGate
from epp_extproc.core.contract import Credit, PromptIdentity, Role
from epp_extproc.core.decision import Decision
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.lean import LeanSignals
from epp_extproc.core.load import EndpointLoad, LoadTracker
from epp_extproc.core.picker import Picker
from epp_extproc.core.render import Rendered
from epp_extproc.core.request import RequestContext
from epp_extproc.core.scheduling.block_cost_scorer import BlockCostScorer
from epp_extproc.core.scheduling.min_cost_picker import MinCostPicker
from epp_extproc.core.scheduling.pd_profile_handler import PdProfileHandler
from epp_extproc.core.scheduling.profile import Profile, ProfileResult
from epp_extproc.core.scheduling.result import PdChoice, PdPath, PdReason
from epp_extproc.core.scheduling.table import CandidateTable, SchedulingRequest
from epp_extproc.metrics import PickerMetrics
from tests.scheduling_fakes import Decider, Row, build_decider, table_of

P0, P1, D0, D1, A0 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.1.1:8000", "10.0.1.2:8000", "10.0.2.1:8000"
BLOCK = 16


class Renderer:
    def __init__(self, n: int, protocol: str) -> None:
        self.n = n
        self.protocol = protocol

    async def render(self, kind: str, body: bytes, *, count: bool = True) -> Rendered:
        return Rendered(list(range(self.n)))


class Kv:
    """Per-worker overlap in blocks, set by the test; records predictions."""

    def __init__(self, overlaps: dict[str, int] | None = None) -> None:
        self.overlaps = overlaps or {}
        self.predicted: list[str] = []

    def prompt(self, tokens: Sequence[int], identity: PromptIdentity) -> list[int]:
        return list(tokens)

    def block_size(self, address: str) -> int:
        return BLOCK

    def base_model_for(self, model: object) -> str | None:
        return None

    def overlap(self, prompt: Any, workers: Sequence[str]) -> dict[str, int]:
        return {w: self.overlaps[w] for w in workers if w in self.overlaps}

    def held(self, address: str) -> int:
        return 0

    def predict(self, address: str, prompt: Any, booking: str | None = None) -> None:
        self.predicted.append(address)

    def credit(self, prompt: Any, workers: Sequence[str]) -> dict[str, Credit]:
        return {w: Credit(n, 0) for w, n in self.overlap(prompt, workers).items()}


def pool(*eps: tuple[str, Role]) -> EndpointRegistry:
    reg = EndpointRegistry()
    reg.replace([Endpoint(f"w{i}", a, role=r) for i, (a, r) in enumerate(eps)])
    return reg


def make(reg: EndpointRegistry, *, tokens: int = 320, overlaps: dict[str, int] | None = None,
         protocol: str = "trtllm-render", **cfg: Any) -> tuple[Decider, Kv]:
    metrics = PickerMetrics()
    kv = Kv(overlaps)
    config = Config(tokenizer_protocol=protocol, tokenizer_service_url="http://127.0.0.1:1",
                    kv_overlap_score_credit=1.0, **cfg)
    return build_decider(config, reg, LoadTracker(metrics.endpoint_inflight), metrics,
                    renderer=Renderer(tokens, protocol), kv=kv), kv


def chat() -> RequestContext:
    return RequestContext("POST", "/v1/chat/completions", {}, b'{"model":"m","messages":[]}')


async def decide(pipe: Decider, ctx: RequestContext | None = None) -> Decision:
    picker = Picker(pipe, gate=InflightGate(64), bodies=BodyBudget(1 << 20, 1 << 24),
                    lean=LeanSignals(pipe.load, pipe.metrics))
    return await picker.decide(ctx or chat())


def pd_pool() -> EndpointRegistry:
    return pool((P0, Role.PREFILL), (P1, Role.PREFILL), (D0, Role.DECODE), (D1, Role.DECODE))


# ------------------------------------------------------------------ the decider on plain values

def cand(address: str, overlap: int = 0, prompt_blocks: float = 20.0) -> Row:
    return Row(address, EndpointLoad(), prompt_blocks, overlap)


class Fixed:
    """A filter answering the prefill workers a test names."""

    name = "fixed"

    def __init__(self, addresses: Sequence[str]) -> None:
        self.addresses = addresses

    def filter(self, req: SchedulingRequest, addresses: Sequence[str] | None) -> Sequence[str]:
        return self.addresses


class Rows:
    """A table source answering the rows a test writes."""

    def __init__(self, score: Any) -> None:
        self.score = score

    def table(self, req: SchedulingRequest, addresses: Sequence[str]) -> CandidateTable:
        return table_of(self.score(addresses))


def decide_pair(decode: Row, *, prompt_tokens: int | None, block_size: int, min_uncached: int,
                prefill_addresses: Sequence[str], score: Any) -> PdChoice:
    """The P/D handler's decider after the decode worker `decode` was chosen, with a prefill profile of the
    block cost (credit 1) and the argmin over the rows `score` answers."""
    prefill = Profile("prefill", [Fixed(prefill_addresses)], [(BlockCostScorer(1.0, 1.0), 1.0)], MinCostPicker(),
                      Rows(score))  # type: ignore[arg-type]
    handler = PdProfileHandler(prefill, prefill, EndpointRegistry(), threshold=min_uncached,
                               block_size=lambda a: block_size, default_block_size=32)
    req = SchedulingRequest(chat(), rendered_tokens=prompt_tokens, inference=prompt_tokens is not None)
    return handler.decide(req, ProfileResult(table_of([decode]), 0))


def test_a_long_uncached_suffix_disaggregates_and_picks_the_prefill_worker_holding_the_prefix() -> None:
    c = decide_pair(cand(D0), prompt_tokens=320, block_size=BLOCK, min_uncached=16,
                    prefill_addresses=[P0, P1], score=lambda a: [cand(P0, 0), cand(P1, 12)])
    assert (c.path, c.reason, c.address, c.uncached_tokens) == (PdPath.DISAGGREGATED,
                                                                 PdReason.LONG_UNCACHED_SUFFIX, P1, 320)
    assert c.prefill_blocks == 8.0  # only the blocks the prefill worker must compute


def test_a_suffix_shorter_than_the_threshold_is_prefilled_on_the_decode_worker() -> None:
    c = decide_pair(cand(D0, overlap=19), prompt_tokens=320, block_size=BLOCK, min_uncached=17,
                    prefill_addresses=[P0], score=lambda a: [cand(P0)])
    assert (c.path, c.reason, c.address, c.uncached_tokens) == (PdPath.LOCAL_PREFILL,
                                                                 PdReason.SHORT_UNCACHED_SUFFIX, None, 16)


def test_a_suffix_exactly_at_the_threshold_disaggregates() -> None:
    c = decide_pair(cand(D0, overlap=19), prompt_tokens=320, block_size=BLOCK, min_uncached=16,
                    prefill_addresses=[P0], score=lambda a: [cand(P0)])
    assert c.path is PdPath.DISAGGREGATED


def test_a_zero_threshold_turns_disaggregation_off_as_llm_d_s_does() -> None:
    c = decide_pair(cand(D0), prompt_tokens=10_000, block_size=BLOCK, min_uncached=0,
                    prefill_addresses=[P0], score=lambda a: [cand(P0)])
    assert (c.path, c.reason) == (PdPath.LOCAL_PREFILL, PdReason.DISABLED)


def test_no_prefill_worker_available_keeps_the_prompt_local() -> None:
    c = decide_pair(cand(D0), prompt_tokens=320, block_size=BLOCK, min_uncached=16,
                    prefill_addresses=[], score=lambda a: [])
    assert (c.path, c.reason) == (PdPath.LOCAL_PREFILL, PdReason.NO_PREFILL_AVAILABLE)


def test_a_request_without_a_prompt_is_not_disaggregated() -> None:
    c = decide_pair(cand(D0), prompt_tokens=None, block_size=BLOCK, min_uncached=16,
                    prefill_addresses=[P0], score=lambda a: [cand(P0)])
    assert (c.path, c.reason) == (PdPath.LOCAL_PREFILL, PdReason.NOT_INFERENCE)


# ------------------------------------------------------------------ through the pipeline

async def test_the_decode_worker_is_the_destination_and_the_prefill_worker_is_named_beside_it() -> None:
    pipe, _ = make(pd_pool(), overlaps={P1: 5})
    d = await decide(pipe)
    assert d.address in (D0, D1) and d.prefill == P1


async def test_the_decode_worker_is_chosen_by_its_own_cached_prefix() -> None:
    pipe, _ = make(pd_pool(), overlaps={D1: 4})
    assert (await decide(pipe)).address == D1


async def test_a_prefill_worker_is_never_the_destination_even_when_it_holds_the_whole_prompt() -> None:
    pipe, _ = make(pd_pool(), overlaps={P0: 20})
    for _ in range(20):
        assert (await decide(pipe)).address in (D0, D1)


async def test_prefill_workers_are_chosen_by_their_prefill_load() -> None:
    pipe, _ = make(pd_pool())
    first = await decide(pipe)
    second = await decide(pipe)  # the first one's prefill leg still holds its prefill worker
    assert {first.prefill, second.prefill} == {P0, P1}


async def test_a_decode_worker_holding_the_prompt_prefills_it_locally() -> None:
    pipe, _ = make(pd_pool(), overlaps={D0: 20})  # 320 tokens, all cached on D0: nothing to prefill
    d = await decide(pipe)
    assert (d.address, d.prefill) == (D0, None)


async def test_short_prompts_stay_local() -> None:
    pipe, _ = make(pd_pool(), tokens=10)
    assert (await decide(pipe)).prefill is None


async def test_aggregated_workers_serve_both_phases_in_a_disaggregated_pool() -> None:
    reg = pool((P0, Role.PREFILL), (A0, Role.BOTH))
    pipe, _ = make(reg)
    d = await decide(pipe)
    assert (d.address, d.prefill) == (A0, P0)


async def test_a_pool_of_prefill_workers_only_has_no_destination() -> None:
    pipe, _ = make(pool((P0, Role.PREFILL)))
    with pytest.raises(PickError) as e:
        await decide(pipe)
    assert e.value.problem is Problem.NO_ENDPOINT and pipe.load.total_inflight() == 0


async def test_the_subset_hint_narrows_the_prefill_workers_too() -> None:
    pipe, _ = make(pd_pool())
    ctx = chat()
    ctx.subset = [D0, P1]
    for _ in range(4):
        d = await decide(pipe, RequestContext(ctx.method, ctx.path, {}, ctx.body, ctx.subset))
        assert (d.address, d.prefill) == (D0, P1)


async def test_the_decision_is_counted_by_path_and_reason() -> None:
    pipe, _ = make(pd_pool())
    await decide(pipe)
    pipe.renderer = Renderer(4, "trtllm-render")
    await decide(pipe)
    m = pipe.metrics.pd_decisions
    assert m.labels("disaggregated", "long_uncached_suffix")._value.get() == 1
    assert m.labels("local_prefill", "short_uncached_suffix")._value.get() == 1


# ------------------------------------------------------------------ predictions

async def test_trtllm_blocks_are_predicted_on_the_prefill_worker_only() -> None:
    pipe, kv = make(pd_pool(), overlaps={P0: 1})
    d = await decide(pipe)
    assert kv.predicted == [d.prefill] == [P0]


async def test_vllm_blocks_are_predicted_on_both_workers_since_nixl_lands_them_in_the_decode_cache() -> None:
    pipe, kv = make(pd_pool(), overlaps={P0: 1}, protocol="vllm-render")
    d = await decide(pipe)
    assert kv.predicted == [P0, d.address]


async def test_a_locally_prefilled_prompt_is_predicted_on_its_decode_worker() -> None:
    pipe, kv = make(pd_pool(), tokens=4)
    d = await decide(pipe)
    assert kv.predicted == [d.address]


# ------------------------------------------------------------------ no prefill workers: today's decision

async def test_a_pool_without_prefill_workers_decides_exactly_as_an_aggregated_one() -> None:
    """Same loads, same overlaps, same random ties: every pick, body, booking and prediction is identical
    whether the workers are labelled decode or not labelled at all."""
    addrs = [D0, D1, A0]
    overlaps = {D0: 3, A0: 3}
    runs = []
    for roles in ([Role.BOTH] * 3, [Role.DECODE, Role.DECODE, Role.BOTH]):
        pipe, kv = make(pool(*zip(addrs, roles, strict=True)), overlaps=overlaps)
        random.seed(7)
        out = []
        for i in range(12):
            d = await decide(pipe)
            out.append((d.address, d.body, d.prefill, d.predicted_cached_tokens, d.booking.prefill_blocks))
            if i % 3 == 0:
                d.booking.free()
        loads = {a: (ld.inflight, ld.prefill_blocks, ld.decode_blocks) for a, ld in pipe.load.loads().items()}
        runs.append((out, loads, kv.predicted))
        assert pipe.metrics.pd_decisions.labels("aggregated", "no_prefill_workers")._value.get() == 12
    assert runs[0] == runs[1]
    assert all(o[2] is None for o in runs[0][0])


async def test_debug_score_shows_both_choices_and_the_reason() -> None:
    pipe, _ = make(pd_pool(), overlaps={P1: 2})
    p = await pipe.propose(chat(), count=False)
    pd = pipe.explain(p)["pd"]
    assert pd["path"] == "disaggregated" and pd["reason"] == "long_uncached_suffix"
    assert pd["decode"] == p.address and pd["prefill"] == P1 and pd["uncached_tokens"] == 320
    assert {w["address"] for w in pd["prefill_workers"]} == {P0, P1}
    assert pipe.load.total_inflight() == 0  # explaining books nothing


async def test_a_disaggregated_answer_is_expected_to_report_the_prefill_worker_s_cached_tokens() -> None:
    pipe, _ = make(pd_pool(), overlaps={P1: 5, D0: 1, D1: 1})
    d = await decide(pipe)
    assert (d.prefill, d.predicted_cached_tokens) == (P1, 5 * BLOCK)


async def test_a_locally_prefilled_answer_is_expected_to_report_the_decode_worker_s_cached_tokens() -> None:
    pipe, _ = make(pd_pool(), tokens=40, overlaps={P1: 2, D0: 2, D1: 2})
    d = await decide(pipe)
    assert (d.prefill, d.predicted_cached_tokens) == (None, 2 * BLOCK)
