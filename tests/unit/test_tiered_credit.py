"""Issue 44's `tiered-credit` plugin: a cached prefix credited block by block at the best tier holding each
block, added to the `credited` column every pricing plugin reads; flags, config file, `/debug/score`, metrics;
a GPU-only pool deciding exactly as without it."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest

from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.config import Config, load_config
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.request import RequestContext
from epp_extproc.core.scheduling.config_file import parse_config, spec_from_config, spec_to_yaml
from epp_extproc.core.scheduling.eviction_scorer import EvictionScorer
from epp_extproc.core.scheduling.tiered_credit_scorer import DEFAULT_WEIGHTS, TieredCreditScorer
from epp_extproc.dev.kvwire import pack_batch, removed_event, stored_event
from epp_extproc.metrics import PickerMetrics
from kvindex.decode import decode_payload
from kvindex.tiers import TIER_BIT
from tests.scheduling_fakes import Decider, Row, TokensRenderer, build_decider, request, table_of

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
BS = 4
GPU, CPU, DISK = TIER_BIT["gpu"], TIER_BIT["cpu"], TIER_BIT["disk"]


class View:
    """A tier view answering fixed runs."""

    def __init__(self, runs: Mapping[str, Sequence[tuple[int, int]]]) -> None:
        self.runs = dict(runs)

    def has_tiers(self) -> bool:
        return bool(self.runs)

    def tiers(self, prompt: Any, workers: Sequence[str]) -> Mapping[str, Sequence[tuple[int, int]]]:
        return {w: r for w, r in self.runs.items() if w in workers}


def prepared(scorer: TieredCreditScorer, rows: Sequence[Row]):
    t = table_of(rows)
    req = replace(request(), prompt=())  # type: ignore[arg-type]
    scorer.prepare(req, t)
    return t


def test_credited_is_the_sum_of_tier_weights_over_the_leading_blocks() -> None:
    s = TieredCreditScorer(View({A: [(GPU, 2), (CPU, 3), (DISK, 1)]}), DEFAULT_WEIGHTS)
    t = prepared(s, [Row(A, overlap_blocks=2)])
    assert t.credited[0] == pytest.approx(2 * 1.0 + 3 * 0.8 + 1 * 0.25)


def test_each_position_is_credited_once_at_its_best_tier() -> None:
    s = TieredCreditScorer(View({A: [(GPU | CPU | DISK, 2), (CPU | DISK, 2)]}), DEFAULT_WEIGHTS)
    t = prepared(s, [Row(A, overlap_blocks=2)])
    assert t.credited[0] == pytest.approx(2 * 1.0 + 2 * 0.8)
    assert t.notes["tiered_credit"][0].blocks == {"gpu": 2, "cpu": 2}


def test_the_best_tier_follows_the_weights_not_a_fixed_order() -> None:
    s = TieredCreditScorer(View({A: [(CPU | DISK, 1)]}), {**DEFAULT_WEIGHTS, "disk": 0.9})
    assert prepared(s, [Row(A)]).notes["tiered_credit"][0].blocks == {"disk": 1}


def test_a_gpu_only_pool_is_left_untouched() -> None:
    s = TieredCreditScorer(View({}), DEFAULT_WEIGHTS)
    t = prepared(s, [Row(A, overlap_blocks=3), Row(B)])
    assert t.credited == [3.0, 0.0] and "tiered-credit" not in t.notes


def test_tier_credit_adds_to_the_eviction_discount_when_run_after_it() -> None:
    class Churn:
        def capacity(self, w: str) -> int:
            return 10

        def held(self, w: str) -> int:
            return 10

        def removal_rate(self, w: str) -> float:
            return 0.0

    rows = [Row(A, prompt_blocks=8, overlap_blocks=4)]
    t = table_of(rows)
    req = replace(request(), prompt=())  # type: ignore[arg-type]
    EvictionScorer(Churn(), lambda _a: None).prepare(req, t)
    after_eviction = t.credited[0]
    TieredCreditScorer(View({A: [(GPU, 4), (CPU, 2)]}), DEFAULT_WEIGHTS).prepare(req, t)
    assert after_eviction < 4 and t.credited[0] == pytest.approx(after_eviction + 2 * 0.8)


def test_negative_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="hostWeight"):
        TieredCreditScorer.create({"hostWeight": -1.0}, _Deps(View({})))  # type: ignore[arg-type]


class _Deps:
    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.metrics = PickerMetrics()


def test_create_refuses_a_kv_side_without_tiers() -> None:
    with pytest.raises(ValueError, match="KV-aware picker"):
        TieredCreditScorer.create({}, _Deps(None))  # type: ignore[arg-type]


# ------------------------------------------------------------------ flags and the config file


def test_the_default_spec_has_no_tiered_credit() -> None:
    spec = spec_from_config(Config())
    assert all(s.type != "tiered-credit" for p in spec.profiles.values() for s, _ in p.scorers)


def test_the_flag_compiles_it_last_into_both_profiles() -> None:
    spec = spec_from_config(Config(tiered_credit=True, eviction_aware=True))
    for p in spec.profiles.values():
        assert [s.type for s, _ in p.scorers][-2:] == ["eviction-scorer", "tiered-credit"]


def test_a_dynamo_weight_flag_turns_it_on_with_that_weight() -> None:
    cfg = load_config(["--router-host-cache-hit-weight", "0.75", "--router-disk-cache-hit-weight", "0.1"], env={})
    (tiered,) = [s for s, _ in spec_from_config(cfg).profiles["decode"].scorers if s.type == "tiered-credit"]
    assert tiered.parameters["hostWeight"] == 0.75 and tiered.parameters["diskWeight"] == 0.1
    assert tiered.parameters["sharedWeight"] == 0.1 and tiered.parameters["unknownWeight"] == 0.25


def test_the_weights_read_dynamos_env_names() -> None:
    cfg = load_config([], env={"DYN_ROUTER_HOST_CACHE_HIT_WEIGHT": "0.6", "DYN_ROUTER_DISK_CACHE_HIT_WEIGHT": "0.2"})
    assert (cfg.router_host_cache_hit_weight, cfg.router_disk_cache_hit_weight) == (0.6, 0.2)
    assert cfg.tiered_credit_enabled()


def test_the_flag_is_accepted_with_ingest_apart() -> None:
    # the shards answer tiered lookups and read the storage streams (issue 44 under apart)
    Config(tiered_credit=True, kv_ingest="apart", kv_shared_stores="pvc=10.0.0.1:8000,10.0.0.2:8000").validate()


def test_the_flag_is_refused_with_the_time_cost() -> None:
    with pytest.raises(ValueError, match="tiered-credit"):
        Config(tiered_credit=True, cost_model="time").validate()


def test_a_config_file_names_tiered_credit_with_its_parameters() -> None:
    spec = parse_config({"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig",
                         "plugins": [{"type": "kv-block-cost-scorer"},
                                     {"type": "tiered-credit", "parameters": {"hostWeight": 0.7}},
                                     {"type": "min-cost-picker"}],
                         "schedulingProfiles": [{"name": "default", "plugins": [
                             {"pluginRef": "kv-block-cost-scorer"}, {"pluginRef": "tiered-credit"},
                             {"pluginRef": "min-cost-picker"}]}]})
    (_, (tiered, _w)) = spec.profiles["default"].scorers
    assert tiered.type == "tiered-credit" and tiered.parameters["hostWeight"] == 0.7
    assert parse_config(spec_to_yaml(spec)).profiles == spec.profiles


# ------------------------------------------------------------------ the pipeline, with the real index


def chat() -> RequestContext:
    return RequestContext(method="POST", path="/v1/chat/completions", headers={},
                          body=b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')


def events(kv: KvRouting, worker: str, *evs: dict[str, Any]) -> None:
    kv.index.apply_batch(worker, decode_payload(pack_batch(list(evs))))


def pipeline(tiered: bool) -> tuple[Decider, TokensRenderer, KvRouting]:
    reg = EndpointRegistry()
    reg.replace([Endpoint("a", A), Endpoint("b", B)])
    metrics = PickerMetrics()
    kv = KvRouting(reg, block_size=BS, max_blocks_per_worker=10_000, topic="", prediction_ttl_s=0.0,
                   metrics_registry=None, ask_server_info=False)
    r = TokensRenderer()
    config = Config(tokenizer_protocol="trtllm-render", tokenizer_service_url="http://127.0.0.1:1",
                    kv_cache_block_size=BS, tiered_credit=tiered)
    return build_decider(config, reg, LoadTracker(metrics.endpoint_inflight), metrics, renderer=r, kv=kv), r, kv


def toks(n_blocks: int, start: int = 1) -> list[int]:
    return list(range(start, start + n_blocks * BS))


async def test_a_prefix_held_in_host_memory_is_routed_to_its_worker() -> None:
    pipe, r, kv = pipeline(True)
    events(kv, A, stored_event([11, 12, 13, 14], None, toks(4), BS, medium="CPU"))
    r.tokens = toks(4) + [999]
    p = await pipe.propose(chat())
    t = p.primary.table
    assert p.address == A and t.credited[t.row(A)] == pytest.approx(4 * 0.8)


async def test_without_the_flag_host_blocks_earn_nothing() -> None:
    pipe, r, kv = pipeline(False)
    events(kv, A, stored_event([11, 12, 13, 14], None, toks(4), BS, medium="CPU"))
    r.tokens = toks(4) + [999]
    t = (await pipe.propose(chat())).primary.table
    assert t.credited == [0.0, 0.0]


async def test_an_offload_chunk_spanning_several_gpu_blocks_is_not_double_counted() -> None:
    """vLLM self-describing events: a 4-block chunk announced, then a chunk overlapping it re-announces the
    shared hashes; llm-d issue #2889 counted such CPU hits per announced key."""
    pipe, r, kv = pipeline(True)
    events(kv, A, stored_event([11, 12, 13, 14], None, toks(4), BS, medium="CPU"),
           stored_event([13, 14], 12, toks(2, start=9), BS, medium="CPU"))
    r.tokens = toks(4) + [999]
    t = (await pipe.propose(chat())).primary.table
    assert t.credited[t.row(A)] == pytest.approx(4 * 0.8)


async def test_a_prefix_continuing_on_the_host_is_credited_for_both_parts() -> None:
    pipe, r, kv = pipeline(True)
    events(kv, A, stored_event([11, 12], None, toks(2), BS),
           stored_event([11, 12, 13, 14], None, toks(4), BS, medium="CPU"))
    events(kv, B, stored_event([11, 12, 13], None, toks(3), BS))
    r.tokens = toks(4) + [999]
    p = await pipe.propose(chat())
    t = p.primary.table
    assert t.credited[t.row(A)] == pytest.approx(2 + 2 * 0.8) and t.credited[t.row(B)] == 3.0
    assert p.address == A


async def test_debug_score_shows_blocks_credited_per_tier() -> None:
    pipe, r, kv = pipeline(True)
    events(kv, A, stored_event([11, 12], None, toks(2), BS),
           stored_event([11, 12, 13], None, toks(3), BS, medium="CPU"), removed_event([12]))
    r.tokens = toks(3) + [999]
    doc = pipe.explain(await pipe.propose(chat()))
    row = {w["address"]: w for w in doc["workers"]}
    assert row[A]["tiered_credit"]["blocks_by_tier"] == {"gpu": 1, "cpu": 2}
    assert row[B]["tiered_credit"] is None


async def test_debug_score_has_no_tier_figures_in_a_gpu_only_pool() -> None:
    pipe, r, kv = pipeline(True)
    events(kv, A, stored_event([11, 12], None, toks(2), BS))
    r.tokens = toks(2) + [999]
    doc = pipe.explain(await pipe.propose(chat()))
    assert all("tiered_credit" not in w for w in doc["workers"])


async def test_a_committed_decision_counts_its_blocks_per_tier() -> None:
    pipe, r, kv = pipeline(True)
    events(kv, A, stored_event([11, 12, 13], None, toks(3), BS, medium="CPU"))
    r.tokens = toks(3) + [999]
    pipe.commit(await pipe.propose(chat()))
    assert pipe.metrics.registry.get_sample_value("epp_tiered_credit_blocks_total", {"tier": "cpu"}) == 3


async def scripted(pipe: Decider, r: TokensRenderer, kv: KvRouting, seed: int) -> list[tuple[str, float]]:
    """Forty committed decisions over GPU-only events and varied prompts: (pick, cost) each."""
    rng = random.Random(seed)
    out = []
    for i in range(40):
        n = rng.randint(1, 12)
        w = A if rng.random() < 0.5 else B
        events(kv, w, stored_event([1000 * i + k for k in range(n)], None, toks(n, start=rng.randint(1, 3)), BS))
        r.tokens = toks(rng.randint(1, 12), start=rng.randint(1, 3)) + [999]
        p = await pipe.propose(chat())
        pipe.commit(p)
        out.append((p.address, p.primary.table.cost[p.primary.chosen]))
    return out


async def test_a_gpu_only_pool_decides_exactly_as_without_the_flag() -> None:
    random.seed(5)
    off = await scripted(*pipeline(False), seed=2)
    random.seed(5)
    on = await scripted(*pipeline(True), seed=2)
    assert on == off


def test_start_up_says_the_load_bound_widens_while_blocks_sit_off_the_gpu() -> None:
    (note,) = [n for n in spec_from_config(Config(tiered_credit=True)).notes if n.entry == "tiered_credit"]
    assert "the load bound is 2.0 while any worker holds blocks off the GPU (0.5 otherwise" in note.detail
    (note,) = [n for n in spec_from_config(Config(tiered_credit=True, affinity_load_bound=1.0)).notes
               if n.entry == "tiered_credit"]
    assert "load bound" not in note.detail


def test_start_up_says_vllm_needs_self_describing_events() -> None:
    spec = spec_from_config(Config(tiered_credit=True))
    (note,) = [n for n in spec.notes if n.entry == "tiered_credit"]
    assert "self_describing_kv_events" in note.detail and "hostWeight=0.8" in note.detail


def test_a_bad_shared_store_spec_stops_start_up_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--kv-shared-stores"):
        Config(kv_shared_stores="p=a:1;q=a:1").validate()
