"""Per-worker ingest budgets (epp_extproc/ingest/pacing.py), on an injected clock."""

from __future__ import annotations

from epp_extproc.ingest.pacing import LagSamples, Pacer
from tests.clock import Clock


def test_a_worker_within_its_share_is_never_paused() -> None:
    clock = Clock()
    p = Pacer(0.1, 0.05, clock)
    for _ in range(1000):
        clock.t += 0.1
        assert p.charge("w", 0.005) == 0.0  # 5 ms per 100 ms = 5% of a core, under 10%


def test_a_worker_over_its_share_is_paused_until_its_debt_is_repaid() -> None:
    clock = Clock()
    p = Pacer(0.1, 0.05, clock)
    assert p.charge("flood", 0.05) == 0.0  # the burst
    pause = p.charge("flood", 0.02)
    assert pause == 0.02 / 0.1  # 20 ms of debt at 10% of a core: 200 ms
    assert p.snapshot()["flood"]["ingest_throttled"] == 1


def test_one_workers_debt_does_not_pause_another() -> None:
    clock = Clock()
    p = Pacer(0.1, 0.05, clock)
    p.charge("flood", 1.0)
    assert p.charge("quiet", 0.001) == 0.0
    assert "quiet" not in {w for w, d in p.snapshot().items() if d["ingest_throttled"]}


def test_lag_samples_keep_a_bounded_window() -> None:
    lag = LagSamples(size=10)
    for i in range(100):
        lag.add(i / 1000)
    s = lag.summary()
    assert s["count"] == 100
    assert s["max"] == 0.099 and s["p50"] >= 0.09  # only the last 10 samples are kept


def test_lookups_answered_inside_a_batch_on_the_shards_loop_are_not_charged_to_its_worker(tmp_path) -> None:
    from epp_extproc.ingest.server import IngestShard

    shard = IngestShard(str(tmp_path), worker_cpu_share=0.1, worker_burst_s=0.002, lookups="loop")
    try:
        assert shard._charge("flooder", 0.005) > 0  # over its 2 ms burst: paused
        shard._lookup_s = 0.004  # what poll_lookups spent answering pickers inside the next batch's handling
        assert shard._charge("honest", 0.005) == 0.0  # charged 1 ms: within its burst
    finally:
        shard._zmq.destroy(linger=0)


def test_the_flags_default_share_is_the_pacers_default() -> None:
    from epp_extproc.config import Config
    from epp_extproc.ingest.pacing import DEFAULT_WORKER_CPU_SHARE

    assert Config().kv_ingest_worker_cpu_share == DEFAULT_WORKER_CPU_SHARE
