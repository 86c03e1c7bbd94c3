"""The trace benchmark's summary of repeated runs and its rule for claiming a ratio between configurations."""

from __future__ import annotations

from bench.trace_stats import cached_ratio_over, claim, fmt_spread, spread, summarize, window_cached_ratio


def test_spread_is_median_min_max_ignoring_missing_runs() -> None:
    s = spread([30.0, None, 10.0, 20.0])
    assert s is not None and (s.median, s.min, s.max, s.n) == (20.0, 10.0, 30.0, 3)
    assert spread([None, None]) is None


def test_claim_is_ratio_of_medians_when_spreads_are_disjoint() -> None:
    assert claim([100.0, 110.0, 120.0], [40.0, 50.0, 60.0]) == 110.0 / 50.0
    assert claim([40.0, 50.0, 60.0], [100.0, 110.0, 120.0]) == 50.0 / 110.0


def test_claim_is_none_when_spreads_overlap_even_with_distant_medians() -> None:
    assert claim([100.0, 110.0, 55.0], [40.0, 50.0, 60.0]) is None


def test_claim_treats_touching_spreads_as_overlapping() -> None:
    assert claim([60.0, 70.0, 80.0], [40.0, 50.0, 60.0]) is None


def test_claim_needs_at_least_two_runs_a_side() -> None:
    assert claim([100.0], [10.0, 11.0]) is None
    assert claim([100.0, 101.0], [10.0, 11.0]) is not None


def test_claim_ignores_missing_runs_and_a_zero_denominator() -> None:
    assert claim([100.0, None, 110.0], [None, None]) is None
    assert claim([1.0, 2.0], [0.0, 0.0]) is None


def test_summarize_gives_one_spread_per_metric_and_none_for_a_metric_no_run_has() -> None:
    runs = [{"ttft": 10.0, "tok": 5.0}, {"ttft": 30.0, "tok": None}, {"ttft": 20.0}]
    out = summarize(runs, ["ttft", "tok", "absent"])
    assert out["ttft"] == {"median": 20.0, "min": 10.0, "max": 30.0, "n": 3}
    assert out["tok"] == {"median": 5.0, "min": 5.0, "max": 5.0, "n": 1}
    assert out["absent"] is None
    assert fmt_spread(out["ttft"]) == "20 [10..30]" and fmt_spread(None) == "-"


def test_jitter_seed_zero_is_the_recorded_trace_and_other_seeds_move_arrivals_but_keep_order() -> None:
    from bench.trace_workload import jitter

    rows = [{"timestamp": float(t), "hash_ids": [t]} for t in (0, 10, 10, 20, 100)]
    assert jitter(rows, 0, 5.0) == rows
    a, b = jitter(rows, 1, 5.0), jitter(rows, 2, 5.0)
    assert a == jitter(rows, 1, 5.0) and a != b  # seeded: reproducible, and seeds differ
    for j in (a, b):
        ts = [r["timestamp"] for r in j]
        assert ts == sorted(ts) and [r["hash_ids"] for r in j] == [r["hash_ids"] for r in rows]
        assert all(abs(x - r["timestamp"]) <= 5.0 + 10.0 for x, r in zip(ts, rows, strict=True))


def test_window_cached_ratio_counts_only_the_requests_scheduled_inside_the_window() -> None:
    arrivals = [0.0, 1.0, 2.0, 3.0, 4.0]
    usage = {0: (100, 100), 1: (100, 10), 2: (100, 30), 3: (100, 100), 4: (100, 100)}
    w = window_cached_ratio(arrivals, usage, start_s=1.0, max_s=1.5)
    assert (w["requests"], w["served"], w["prompt_tokens"], w["cached_tokens"]) == (2, 2, 200, 40)
    assert w["cached_ratio"] == 0.2 and w["length_s"] == 1.5


def test_window_cached_ratio_ends_at_the_last_arrival_when_the_run_is_shorter_than_the_window() -> None:
    w = window_cached_ratio([0.0, 1.0, 2.5], {0: (10, 0), 1: (10, 5), 2: (10, 5)}, start_s=1.0, max_s=60.0)
    assert w["length_s"] == 1.5 and w["requests"] == 2


def test_window_cached_ratio_counts_failed_requests_apart_from_the_ratio() -> None:
    w = window_cached_ratio([0.0, 1.0, 2.0, 3.0], {1: None, 3: (100, 50)}, start_s=1.0)
    assert (w["requests"], w["served"], w["failed"]) == (3, 1, 2)
    assert w["cached_ratio"] == 0.5


def test_window_cached_ratio_is_none_when_no_request_in_the_window_was_served() -> None:
    assert window_cached_ratio([0.0, 1.0], {}, start_s=0.5)["cached_ratio"] is None


def test_cached_ratio_over_takes_one_run_s_figure_over_another_run_s_requests() -> None:
    usage = {0: (100, 80), 1: (100, 0), 2: (100, 40), 3: None}
    assert cached_ratio_over(usage, [0, 2, 3]) == 0.6
