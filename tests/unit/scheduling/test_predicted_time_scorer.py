"""--cost-model time (core/time_cost.py): the per-worker model learns from samples, a cold pool picks what the
block cost picks, and llm-d's SLO headers filter the workers, refuse a sheddable request none can serve and
leave any other to best effort."""

from __future__ import annotations

import random

import pytest

from epp_extproc.core.admission import BodyBudget, InflightGate
from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.exchange import PickerExchange
from epp_extproc.core.lean import LeanSignals
from epp_extproc.core.load import EndpointLoad, LoadTracker
from epp_extproc.core.picker import Picker
from epp_extproc.core.request import RequestContext
from epp_extproc.core.scheduling.min_cost_picker import MinCostPicker
from epp_extproc.core.scheduling.predicted_time_scorer import PredictedTimeScorer
from epp_extproc.core.scheduling.table import SchedulingRequest
from epp_extproc.core.time_cost import (
    Features,
    Fit,
    Observation,
    Slo,
    TimeCost,
    parse_slo,
)
from epp_extproc.envoy.errors import http_error
from epp_extproc.metrics import PickerMetrics
from tests.scheduling_fakes import ADDRS, CostParams, Decider, Row, choose, decide, make, table_of

PARAMS = CostParams(overlap_credit=2.0, prefill_load_scale=1.0, temperature=0.0)
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


def cand(address: str, *, inflight: int = 0, prefill: float = 0.0, decode: float = 0.0, unbooked: float = 0.0,
         prompt: float = 0.0, overlap: int = 0) -> Row:
    return Row(address, EndpointLoad(inflight, prefill, decode, unbooked), prompt, overlap)


def features(tc: TimeCost, c: Row) -> Features:
    return tc.features(c.load, c.prompt_blocks, c.overlap_blocks, 32.0, PARAMS.overlap_credit,
                       PARAMS.prefill_load_scale)


def observe(tc: TimeCost, address: str, c: Row, booking_id: str | None = None) -> Observation:
    """The commit hook's stopwatch for a pick of `c` on `address` (its predicted TTFT as the scorer saw it)."""
    f = features(tc, c)
    return tc.observe(address, f, tc.predict(address, f)[0], booking_id)


def time_choose(tc: TimeCost, rows: list[Row], slo: Slo | None = None, sheddable: bool = False,
                rng: random.Random | None = None) -> tuple[Row, str | None]:
    """The predicted-time scorer over `rows`, then the argmin among the rows it admits: (chosen, SLO outcome)."""
    scorer = PredictedTimeScorer(tc, lambda _a: 32.0, overlap_credit=PARAMS.overlap_credit,
                                 prefill_load_scale=PARAMS.prefill_load_scale)
    t = table_of(rows)
    req = SchedulingRequest(RequestContext("POST", "/v1/chat/completions", slo=slo),
                            sheddable=lambda _c: sheddable)
    t.cost[:] = scorer.score(req, t)
    outcome: dict[str, str] = {}
    pool = scorer.admissible(req, t, outcome)
    i = MinCostPicker(rng).pick(req, t, range(len(rows)) if pool is None else pool)
    return rows[i], outcome.get("slo")


def feats(prefill: float, decode: float, batch: float = 1.0) -> Features:
    return Features(prefill, decode, batch)


# ------------------------------------------------------------------ the model


def test_ttft_fit_learns_a_known_prefill_rate_and_overhead() -> None:
    rng = random.Random(7)
    fit = Fit((0.01, 5e-5, 5e-5))
    for _ in range(400):
        p, d = rng.uniform(0, 8000), rng.uniform(0, 4000)
        fit.add((1.0, p, d), 0.030 + 2e-4 * p + 1e-5 * d)
    overhead, rate, interference = fit.theta()
    assert rate == pytest.approx(2e-4, rel=0.05)
    assert overhead == pytest.approx(0.030, rel=0.15)
    assert interference == pytest.approx(1e-5, rel=0.3)


def test_tpot_model_learns_the_slowdown_per_request_in_the_batch() -> None:
    tc = TimeCost()
    c = cand("w", inflight=0)
    for batch in [0, 3, 7, 1, 5, 2, 6, 4] * 20:
        c.load.inflight = batch
        o = observe(tc, "w", c)
        o.first_chunk(now=o.started + 0.01)
        o.finished(11, now=o.first_at + 10 * (0.02 + 0.004 * (batch + 1)))
    assert tc.model("w").predict_tpot(feats(0, 0, batch=9)) == pytest.approx(0.02 + 0.004 * 9, rel=0.05)


def test_memory_per_worker_does_not_grow_with_samples() -> None:
    fit = Fit((0.0, 0.0))
    before = (len(fit.xx), len(fit.xy))
    for i in range(10_000):
        fit.add((1.0, float(i)), float(i))
    assert (len(fit.xx), len(fit.xy)) == before


def test_models_kept_are_capped_least_recently_used_first() -> None:
    tc = TimeCost(max_workers=2)
    tc.model("a"), tc.model("b"), tc.model("a"), tc.model("c")
    assert set(tc.snapshot()) == {"a", "c"}


def test_observed_ttft_teaches_the_picked_worker_and_reports_the_error() -> None:
    errors: list[tuple[str, float, float]] = []
    tc = TimeCost(on_error=lambda a, seen, predicted: errors.append((a, seen, predicted)))
    c = cand("w", prompt=10.0)
    predicted = tc.predict("w", features(tc, c))[0]
    o = observe(tc, "w", c)
    o.first_chunk(now=o.started + 0.5)
    o.first_chunk(now=o.started + 0.9)  # only the first chunk counts
    assert tc.model("w").ttft.n == 1.0
    assert errors == [("w", pytest.approx(0.5), predicted)]


# ------------------------------------------------------------------ cold start decides like the block cost


def test_cold_pool_picks_exactly_what_the_block_cost_picks() -> None:
    rng = random.Random(3)
    for _ in range(300):
        def pool() -> list[Row]:
            return [cand(f"w{i}", inflight=rng.randrange(5), prefill=rng.choice([0.0, 3.0, 10.0, 40.0]),
                         decode=rng.choice([0.0, 5.0, 20.0]), unbooked=rng.choice([0.0, 2.0]),
                         prompt=rng.choice([10.0, 60.0]), overlap=rng.choice([0, 4, 30])) for i in range(4)]
        state = rng.getstate()
        blocks = pool()
        rng.setstate(state)
        timed = pool()
        a = choose(blocks, PARAMS, random.Random(11))
        b, outcome = time_choose(TimeCost(), timed, rng=random.Random(11))
        assert (b.address, outcome) == (a.address, None)


# ------------------------------------------------------------------ SLO


def warm_tpot(tc: TimeCost, address: str, per_request_s: float) -> None:
    c = cand(address)
    for batch in list(range(12)) * 20:
        c.load.inflight = batch
        o = observe(tc, address, c)
        o.first_chunk(now=o.started + 0.01)
        o.finished(2, now=o.first_at + 0.001 + per_request_s * (batch + 1))


def tpot_pool() -> list[Row]:
    # `busy` has the shortest queue but a big batch; `calm` more prefill work and a small batch
    return [cand("busy", inflight=8, prefill=0.0, prompt=10.0), cand("calm", inflight=0, prefill=30.0, prompt=10.0)]


def test_without_slo_the_least_predicted_time_wins() -> None:
    tc = TimeCost()
    warm_tpot(tc, "busy", 0.0001), warm_tpot(tc, "calm", 0.0001)
    chosen, outcome = time_choose(tc, tpot_pool())
    assert (chosen.address, outcome) == ("busy", None)


def test_tpot_slo_skips_a_worker_predicted_too_slow_per_token() -> None:
    tc = TimeCost()
    warm_tpot(tc, "busy", 0.0001), warm_tpot(tc, "calm", 0.0001)  # TPOT ~1.9 ms on busy, ~1.1 ms on calm
    chosen, outcome = time_choose(tc, tpot_pool(), Slo(tpot_ms=1.5))
    assert (chosen.address, outcome) == ("calm", "met")


def test_ttft_slo_no_worker_meets_refuses_a_sheddable_request() -> None:
    with pytest.raises(PickError) as e:
        time_choose(TimeCost(), tpot_pool(), Slo(ttft_ms=0.5), sheddable=True)
    assert e.value.problem is Problem.SLO_UNMET


def test_ttft_slo_no_worker_meets_routes_a_normal_request_best_effort() -> None:
    chosen, outcome = time_choose(TimeCost(), tpot_pool(), Slo(ttft_ms=0.5))
    assert (chosen.address, outcome) == ("busy", "best_effort")


# ------------------------------------------------------------------ headers


def test_slo_headers_are_read_as_milliseconds() -> None:
    assert parse_slo({"x-slo-ttft-ms": ["250"], "x-slo-tpot-ms": [" 12.5 "]}) == (Slo(250.0, 12.5), ())


def test_malformed_slo_header_is_ignored_and_named() -> None:
    assert parse_slo({"x-slo-ttft-ms": ["fast"], "x-slo-tpot-ms": ["nan"]}) == (None, ("x-slo-ttft-ms",
                                                                                      "x-slo-tpot-ms"))


def test_zero_or_negative_slo_means_no_objective_as_in_llm_d() -> None:
    assert parse_slo({"x-slo-ttft-ms": ["0"], "x-slo-tpot-ms": ["-3"]}) == (None, ())


def test_no_slo_headers_no_slo() -> None:
    assert parse_slo({"content-type": ["application/json"]}) == (None, ())


# ------------------------------------------------------------------ through the pipeline


def ctx(slo: Slo | None = None, objective: str | None = None, malformed: tuple[str, ...] = ()) -> RequestContext:
    headers: dict[str, list[str]] = {"x-gateway-inference-objective": [objective]} if objective else {}
    return RequestContext("POST", "/v1/chat/completions", headers, BODY, None, slo, malformed)


def picker(pipe: Decider) -> Picker:
    return Picker(pipe, gate=InflightGate(64), bodies=BodyBudget(1 << 20, 1 << 24),
                  lean=LeanSignals(pipe.load, pipe.metrics))


def time_pipe() -> Decider:
    pipe, _, _ = make(cost_model="time")
    pipe.sheddable = lambda c: c.headers.get("x-gateway-inference-objective") == ["batch"]
    return pipe


def test_block_cost_stays_the_default_and_learns_nothing() -> None:
    pipe, _, _ = make()
    assert pipe.config.cost_model == "blocks" and pipe.time_cost is None


async def test_time_mode_decision_carries_a_stopwatch_the_first_chunk_teaches() -> None:
    pipe = time_pipe()
    d = await decide(pipe, ctx())
    assert d.timing is not None
    ex = PickerExchange(lambda _r: d, None, None, None, None, pipe.metrics,  # type: ignore[arg-type]
                        knows=lambda _a: True, count_rejection=lambda _e: None)
    ex.decision = d
    ex.response_chunk(b"data: {}\n\n")
    assert pipe.time_cost is not None and pipe.time_cost.model(d.address).ttft.n == 1.0


async def test_sheddable_request_no_worker_meets_gets_429_and_is_counted() -> None:
    pipe = time_pipe()
    with pytest.raises(PickError) as e:
        await decide(pipe, ctx(Slo(ttft_ms=0.001), objective="batch"))
    assert e.value.problem is Problem.SLO_UNMET
    assert http_error(e.value, "/v1/chat/completions").status == 429
    picker(pipe).count_rejection(e.value)  # what the exchange does with a rejection (PickerExchange.reject)
    assert pipe.metrics.slo_decisions.labels("rejected")._value.get() == 1
    assert pipe.load.total_inflight() == 0  # nothing booked


async def test_normal_request_no_worker_meets_is_routed_best_effort_and_counted() -> None:
    pipe = time_pipe()
    d = await decide(pipe, ctx(Slo(ttft_ms=0.001)))
    assert d.address in ADDRS
    assert pipe.metrics.slo_decisions.labels("best_effort")._value.get() == 1


async def test_request_a_worker_meets_is_counted_met() -> None:
    pipe = time_pipe()
    await decide(pipe, ctx(Slo(ttft_ms=60_000)))
    assert pipe.metrics.slo_decisions.labels("met")._value.get() == 1


async def test_malformed_slo_header_is_counted_and_the_request_routed() -> None:
    pipe = time_pipe()
    d = await decide(pipe, ctx(malformed=("x-slo-ttft-ms",)))
    assert d.address in ADDRS
    assert pipe.metrics.slo_headers_malformed.labels("x-slo-ttft-ms")._value.get() == 1


async def test_debug_score_shows_each_candidates_predicted_ttft_and_tpot() -> None:
    pipe = time_pipe()
    pipe.kv.credit = lambda prompt, workers: {}  # type: ignore[union-attr]
    doc = pipe.explain(await pipe.propose(ctx(), count=False))
    assert doc["cost_model"] == "time"
    assert all(w["predicted_ttft_ms"] > 0 and w["predicted_tpot_ms"] > 0 for w in doc["workers"])


# ------------------------------------------------------------------ the booking's signals (lean mode too)


def tracked() -> tuple[TimeCost, LoadTracker]:
    tc, load = TimeCost(), LoadTracker()
    load.add_listener(lambda ch: tc.on_booking(ch.kind, ch.id, ch.address))
    return tc, load


def test_lean_first_chunk_signal_teaches_the_booked_worker() -> None:
    tc, load = tracked()
    b = load.book("w", 3.0)
    observe(tc, "w", cand("w", prompt=3.0), b.id)
    LeanSignals(load, PickerMetrics()).first_chunk(b.id)  # what Envoy's observer stream reports
    assert tc.model("w").ttft.n == 1.0 and tc.waiting == 0


def test_request_that_ends_before_its_first_chunk_teaches_nothing_and_is_forgotten() -> None:
    tc, load = tracked()
    b = load.book("w", 3.0)
    observe(tc, "w", cand("w", prompt=3.0), b.id)
    b.free()
    assert tc.model("w").ttft.n == 0.0 and tc.waiting == 0


def test_request_the_gateway_served_elsewhere_teaches_that_worker() -> None:
    tc, load = tracked()
    b = load.book("w", 3.0)
    observe(tc, "w", cand("w", prompt=3.0), b.id)
    b.move("v")
    b.prefill_done()
    assert (tc.model("v").ttft.n, tc.model("w").ttft.n) == (1.0, 0.0)


def test_time_cost_with_eviction_aware_is_refused_naming_both_flags() -> None:
    """Blocks and seconds do not add: the flush penalty cannot join the time cost (before issue 41 the time
    cost overwrote the block cost and --eviction-aware silently did nothing)."""
    from epp_extproc.config import Config

    with pytest.raises(ValueError) as e:
        Config(cost_model="time", eviction_aware=True).validate()
    assert "--eviction-aware" in str(e.value) and "--cost-model" in str(e.value)


async def test_the_time_cost_takes_the_router_temperature() -> None:
    """Before issue 41 the time cost picked its argmin whatever --router-temperature said; now it samples."""
    pipe, _, _ = make(cost_model="time", router_temperature=5.0, affinity_load_bound=0.0)
    random.seed(3)
    picks = set()
    for _ in range(40):
        p = await pipe.propose(ctx())
        picks.add(p.address)
    assert picks == set(ADDRS)
