"""How a predicted block ends (confirmed, cancelled, expired) under both lifetimes: `fixed` (--prediction-ttl-s)
and `queue` (held while the request that made it waits for its prefill, then a grace, at most a cap)."""

from __future__ import annotations

from typing import Any

import pytest

from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.app import PickerApp
from epp_extproc.cli import load_config
from epp_extproc.config import Config
from epp_extproc.core.admission import BodyBudget, InflightGate
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.lean import LeanSignals
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.picker import Picker
from epp_extproc.core.render import Rendered
from epp_extproc.core.request import RequestContext
from epp_extproc.dev.kvwire import cleared_event, pack_batch, removed_event, stored_event
from epp_extproc.metrics import PickerMetrics
from kvindex.decode import decode_payload
from kvindex.index import KvIndex
from tests.scheduling_fakes import build_decider

BS = 4
GRACE = 2.0
CAP = 60.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def toks(n_blocks: int) -> list[int]:
    """A prompt of `n_blocks` reusable blocks (the last token is never part of one)."""
    return list(range(1, 1 + n_blocks * BS)) + [0]


def hashes(idx: KvIndex, n_blocks: int) -> list[int]:
    from kvindex.hashing import block_hashes

    return block_hashes(toks(n_blocks)[:-1], BS)


def store(idx: KvIndex, worker: str, engine_hashes: list[int], n_blocks: int, rank: int = 0) -> None:
    ev = stored_event(engine_hashes, None, toks(n_blocks)[: n_blocks * BS], BS)
    idx.apply_batch(worker, decode_payload(pack_batch([ev], rank=rank)))


def remove(idx: KvIndex, worker: str, engine_hashes: list[int], rank: int = 0) -> None:
    idx.apply_batch(worker, decode_payload(pack_batch([removed_event(engine_hashes)], rank=rank)))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def idx(clock: FakeClock) -> KvIndex:
    return KvIndex(default_block_size=BS, clock=clock)


# ---------------------------------------------------------------- endings in both lifetimes

def test_fixed_prediction_is_confirmed_by_a_store_on_a_dp_rank_above_zero(idx: KvIndex, clock: FakeClock) -> None:
    idx.predict_hashes("w", hashes(idx, 2), 5)
    store(idx, "w", [1, 2], 2, rank=1)
    assert idx.predicted_count("w") == 0
    assert idx.stats("w").predictions_confirmed == 2


def test_fixed_prediction_of_a_block_the_worker_then_removes_is_cancelled(idx: KvIndex) -> None:
    store(idx, "w", [1, 2], 2, rank=1)  # held by rank 1 only: a prediction (on rank 0's bit) is still made
    idx.predict_hashes("w", hashes(idx, 2), 5)
    remove(idx, "w", [1, 2], rank=1)
    assert idx.overlap(toks(2)) == {}
    assert idx.stats("w").predictions_cancelled == 2


def test_fixed_predictions_cleared_by_the_worker_are_counted_cancelled(idx: KvIndex) -> None:
    idx.predict_hashes("w", hashes(idx, 3), 5)
    idx.apply_batch("w", decode_payload(pack_batch([cleared_event()])))
    assert idx.overlap(toks(3)) == {}
    assert idx.stats("w").predictions_cancelled == 3


def test_fixed_prediction_expires_after_its_ttl_even_while_its_request_waits(idx: KvIndex, clock: FakeClock) -> None:
    idx.predict_hashes("w", hashes(idx, 2), 2)
    clock.t += 2.1
    assert idx.overlap(toks(2)) == {}
    assert idx.stats("w").predictions_expired == 2


def test_held_prediction_outlives_the_fixed_ttl_while_its_request_waits(idx: KvIndex, clock: FakeClock) -> None:
    idx.hold_hashes("w", hashes(idx, 2), CAP)
    clock.t += 30
    assert idx.overlap(toks(2)) == {"w": 2}
    assert idx.hold_count("w") == 2


def test_released_hold_stays_credited_for_the_grace_then_expires(idx: KvIndex, clock: FakeClock) -> None:
    hold = idx.hold_hashes("w", hashes(idx, 2), CAP)
    assert hold is not None
    clock.t += 10
    idx.release(hold, GRACE)
    clock.t += GRACE - 0.1
    assert idx.overlap(toks(2)) == {"w": 2}
    clock.t += 0.2
    assert idx.overlap(toks(2)) == {}
    assert idx.stats("w").predictions_expired == 2


def test_held_prediction_never_released_expires_at_its_cap(idx: KvIndex, clock: FakeClock) -> None:
    idx.hold_hashes("w", hashes(idx, 2), CAP)
    clock.t += CAP + 0.1
    assert idx.overlap(toks(2)) == {}
    assert idx.hold_count("w") == 0 and idx.stats("w").predictions_expired == 2


def test_release_never_extends_a_hold_past_its_cap(idx: KvIndex, clock: FakeClock) -> None:
    hold = idx.hold_hashes("w", hashes(idx, 2), 5)
    assert hold is not None
    clock.t += 4
    idx.release(hold, GRACE)
    clock.t += 1.1
    assert idx.overlap(toks(2)) == {}


def test_held_prediction_is_confirmed_by_the_store_and_a_later_release_changes_nothing(
        idx: KvIndex, clock: FakeClock) -> None:
    hold = idx.hold_hashes("w", hashes(idx, 2), CAP)
    assert hold is not None
    store(idx, "w", [1, 2], 2)
    idx.release(hold, GRACE)
    clock.t += CAP * 2
    assert idx.overlap(toks(2)) == {"w": 2}
    assert idx.stats("w").predictions_confirmed == 2 and idx.stats("w").predictions_expired == 0


def test_held_prediction_of_a_block_the_worker_removes_is_cancelled(idx: KvIndex) -> None:
    store(idx, "w", [1, 2], 2, rank=1)
    idx.hold_hashes("w", hashes(idx, 2), CAP)
    remove(idx, "w", [1, 2], rank=1)
    assert idx.overlap(toks(2)) == {}
    assert idx.hold_count("w") == 0 and idx.stats("w").predictions_cancelled == 2


def test_cleared_worker_cancels_held_predictions_and_a_late_release_does_nothing(
        idx: KvIndex, clock: FakeClock) -> None:
    hold = idx.hold_hashes("w", hashes(idx, 2), CAP)
    assert hold is not None
    idx.clear_worker("w")
    idx.hold_hashes("w", hashes(idx, 1), CAP)  # a new request's hold after the clear
    idx.release(hold, GRACE)  # the old one's release must not shorten the new one
    clock.t += GRACE + 1
    assert idx.overlap(toks(2)) == {"w": 1}
    assert idx.stats("w").predictions_cancelled == 2


def test_block_two_waiting_requests_hold_stays_until_the_last_is_released(idx: KvIndex, clock: FakeClock) -> None:
    first = idx.hold_hashes("w", hashes(idx, 2), CAP)
    second = idx.hold_hashes("w", hashes(idx, 2), CAP)
    assert first is not None and second is not None
    idx.release(first, GRACE)
    clock.t += GRACE + 1
    assert idx.overlap(toks(2)) == {"w": 2}
    idx.release(second, GRACE)
    clock.t += GRACE + 1
    assert idx.overlap(toks(2)) == {}


def test_a_peers_fixed_ttl_never_shortens_a_held_block(idx: KvIndex, clock: FakeClock) -> None:
    idx.hold_hashes("w", hashes(idx, 2), CAP)
    idx.predict_hashes("w", hashes(idx, 2), 1)  # a replica-sync peer's prediction of the same prompt
    clock.t += 5
    assert idx.overlap(toks(2)) == {"w": 2}


def test_held_blocks_are_never_more_than_the_predicted_ones(idx: KvIndex, clock: FakeClock) -> None:
    for i in range(50):
        idx.hold_hashes("w", hashes(idx, 1 + i % 5), CAP)
    store(idx, "w", [1, 2, 3], 3)
    assert idx.hold_count("w") == idx.predicted_count("w") == 2
    clock.t += CAP + 1
    assert idx.hold_count("w") == idx.predicted_count("w") == 0


def test_snapshot_and_metrics_show_held_blocks_and_cancellations(idx: KvIndex) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    idx2 = KvIndex(default_block_size=BS, registry=reg)
    idx2.hold_hashes("w", hashes(idx2, 2), CAP)
    assert idx2.snapshot()["workers"]["w"]["predicted_held"] == 2
    idx2.clear_worker("w")
    text = generate_latest(reg).decode()
    assert 'epp_kv_predictions_cancelled_total{worker="w"} 2.0' in text
    assert 'epp_kv_predicted_held_blocks{worker="w"} 0.0' in text


# ---------------------------------------------------------------- through the pipeline

ADDRS = ["127.0.0.1:9", "127.0.0.1:10"]


class Renderer:
    protocol = "trtllm-render"

    async def render(self, kind: str, body: bytes, *, count: bool = True) -> Rendered:
        return Rendered(toks(6))


async def _stack(clock: FakeClock, queue: bool) -> tuple[Picker, KvRouting, LoadTracker]:
    reg = EndpointRegistry()
    reg.replace([Endpoint(f"w{i}", a) for i, a in enumerate(ADDRS)])
    metrics = PickerMetrics()
    load = LoadTracker(metrics.endpoint_inflight)
    kv = KvRouting(reg, block_size=BS, max_blocks_per_worker=1000, topic="", prediction_ttl_s=GRACE,
                   metrics_registry=None, ask_server_info=False, clock=clock)
    if queue:
        kv.use_queue_lifetime(GRACE, CAP)
        load.add_listener(kv.on_booking)
    for a in ADDRS:
        kv.index.add_worker(a)
    config = Config(tokenizer_protocol="trtllm-render", tokenizer_service_url="http://127.0.0.1:1")
    pipe = build_decider(config, reg, load, metrics, renderer=Renderer(), kv=kv)
    picker = Picker(pipe, gate=InflightGate(64), bodies=BodyBudget(1 << 20, 1 << 24), lean=LeanSignals(load, metrics))
    return picker, kv, load


def _chat() -> RequestContext:
    return RequestContext("POST", "/v1/chat/completions", {}, b'{"model":"m","messages":[]}')


async def test_queue_lifetime_through_the_pipeline_holds_until_prefill_then_grace_then_expires(
        clock: FakeClock) -> None:
    picker, kv, _ = await _stack(clock, queue=True)
    d = await picker.decide(_chat())
    prompt = kv.prompt(toks(6))
    clock.t += 30  # the request waits in the worker's queue far past the fixed ttl
    assert kv.overlap(prompt, ADDRS) == {d.address: 6}
    assert kv.held(d.address) == 6
    d.booking.prefill_done()  # first response chunk
    assert kv.held(d.address) == 0
    clock.t += GRACE - 0.1
    assert kv.overlap(prompt, ADDRS) == {d.address: 6}
    clock.t += 0.2
    assert kv.overlap(prompt, ADDRS) == {}


async def test_queue_lifetime_releases_a_request_that_ends_without_a_first_chunk(clock: FakeClock) -> None:
    picker, kv, _ = await _stack(clock, queue=True)
    d = await picker.decide(_chat())
    d.booking.free()
    clock.t += GRACE + 0.1
    assert kv.overlap(kv.prompt(toks(6)), ADDRS) == {}


async def test_fixed_lifetime_through_the_pipeline_is_the_ttl_whatever_the_request_does(clock: FakeClock) -> None:
    picker, kv, _ = await _stack(clock, queue=False)
    d = await picker.decide(_chat())
    clock.t += GRACE + 0.1
    assert kv.overlap(kv.prompt(toks(6)), ADDRS) == {}
    assert kv.held(d.address) == 0


async def test_debug_score_shows_confirmed_predicted_and_held_blocks(clock: FakeClock) -> None:
    picker, kv, _ = await _stack(clock, queue=True)
    d = await picker.decide(_chat())
    p = await picker.director.propose(_chat())
    row = next(w for w in picker.director.explain(p)["workers"] if w["address"] == d.address)
    assert (row["confirmed_blocks"], row["predicted_blocks"], row["held_prediction_blocks"]) == (0, 6, 6)


# ---------------------------------------------------------------- flag wiring

def test_prediction_lifetime_defaults_to_fixed() -> None:
    c = load_config([], {})
    assert (c.prediction_lifetime, c.prediction_grace_s, c.prediction_max_lifetime_s) == ("fixed", 2.0, 60.0)


def test_prediction_lifetime_flags_and_env_are_read() -> None:
    c = load_config(["--prediction-lifetime", "queue", "--prediction-grace-s", "1.5"],
                    {"DYN_EPP_PREDICTION_MAX_LIFETIME_S": "30"})
    assert (c.prediction_lifetime, c.prediction_grace_s, c.prediction_max_lifetime_s) == ("queue", 1.5, 30.0)
    assert load_config([], {"DYN_EPP_PREDICTION_LIFETIME": "queue"}).prediction_lifetime == "queue"


def test_queue_lifetime_with_ingest_apart_is_refused() -> None:
    with pytest.raises((ValueError, SystemExit)):
        load_config(["--prediction-lifetime", "queue", "--kv-ingest", "apart", "--tokenizer-protocol",
                     "trtllm-render", "--tokenizer-service-url", "http://127.0.0.1:1"], {})


def _app(*flags: str) -> PickerApp:
    return PickerApp(load_config(["--tokenizer-protocol", "trtllm-render", "--tokenizer-service-url",
                                  "http://127.0.0.1:1", "--endpoints", "a=127.0.0.1:9", "--kv-cache-block-size", str(BS),
                                  *flags], {}))


async def test_queue_lifetime_flag_makes_the_picker_follow_its_bookings() -> None:
    app: Any = _app("--prediction-lifetime", "queue")
    assert isinstance(app.kv, KvRouting) and app.kv.grace_s == 2.0
    b = app.load.book("127.0.0.1:9", 1)
    app.kv.predict("127.0.0.1:9", app.kv.prompt(toks(3)), b.id)
    assert app.kv.held("127.0.0.1:9") == 3
    b.prefill_done()
    assert app.kv.held("127.0.0.1:9") == 0
    await app.kv.close()


async def test_fixed_lifetime_flag_leaves_predictions_on_the_ttl() -> None:
    app: Any = _app()
    b = app.load.book("127.0.0.1:9", 1)
    app.kv.predict("127.0.0.1:9", app.kv.prompt(toks(3)), b.id)
    assert app.kv.held("127.0.0.1:9") == 0 and app.kv.index.predicted_count("127.0.0.1:9") == 3
    await app.kv.close()
