"""Each benchmark starts, runs its tiny --quick setting against real processes and writes well-formed
results (figures are not asserted: performance is judged from the printed tables, as ratios against the
baseline measured in the same run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(name: str, out: Path, timeout: float = 110) -> dict:
    proc = subprocess.run([sys.executable, "-m", f"bench.bench_{name}", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / f"{name}.png").stat().st_size > 0
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow  # a benchmark's whole quick run (40-70 s): make test-slow
@pytest.mark.timeout(120)
def test_overhead_quick(tmp_path: Path) -> None:
    doc = run_bench("overhead", tmp_path)
    rows = doc["e2e"]["rows"]
    assert {(r["config"], r["concurrency"]) for r in rows} == {(c, n) for c in "abc" for n in (1, 16, 32, 64)}
    for r in rows:
        assert r["errors"] == 0 and r["rps"] > 0 and r["p50_ms"] <= r["p99_ms"]
        assert r["p50_ratio"] is not None and r["rps_ratio"] is not None
        if r["config"] != "a":
            assert r["epp_decision_seconds"]["count"] >= r["requests"]
    assert {d["workers"] for d in doc["decision_8k"]} == {8, 64}
    for d in doc["decision_8k"]:
        assert d["prompt_tokens"] == 8192
        assert d["histogram_epp_decision"]["count"] == d["requests"]
        assert d["in_process"]["decide_without_render"]["p99_ms"] > 0
    assert set(doc["targets"]) == {"decision_p50_le_0.2ms", "decision_p99_le_1ms", "added_p50_at_c1_le_2ms",
                                   "c_sustains_1000_rps"}
    floor = doc["request_floor"]  # the picker really routed every stream (a refusal raises) and cost CPU
    for t in ("grpcio", "h2"):
        assert 0 < floor[t]["trivial_us_per_request"] and 0 < floor[t]["picker_us_per_request"]
    assert floor["render_call"]["aiohttp_us_per_call"] > 0 and floor["render_call"]["picker_render_client_us_per_call"] > 0


@pytest.mark.slow  # a benchmark's whole quick run (15-25 s): make test-slow
@pytest.mark.timeout(120)
def test_routing_quick(tmp_path: Path) -> None:
    doc = run_bench("routing", tmp_path)
    rows = doc["result"]["rows"]
    assert {r["config"] for r in rows} == {"a", "b", "c", "s"}
    for r in rows:
        assert r["errors"] == 0 and r["requests"] > 0
        # (s) opts every conversation in to session affinity: each answer brings a token, the others none
        assert r["session_tokens"] == (r["requests"] if r["config"] == "s" else 0)
        assert r["ttft_p50_ms"] <= r["ttft_p90_ms"]
        assert 0 <= r["cached_ratio"] <= 1 and r["output_tokens_per_s"] > 0
        assert abs(r["cached_ratio"] - r["mock_stats_cached_ratio"]) < 1e-9  # usage agrees with the workers
    for o in doc["result"]["oracle"].values():
        assert 0 <= o["affinity_lru"] <= o["infinite"] <= 1
    assert set(doc["targets"]["c"]) == {"ttft_p90_a_over_c_at_top_rate", "cached_ratio_within_10pct_of_oracle"}


@pytest.mark.timeout(120)
def test_scale_quick(tmp_path: Path) -> None:
    doc = run_bench("scale", tmp_path)
    rows = doc["rows"]
    assert {(r["workers"], r["prompt_tokens"]) for r in rows} == {(w, n) for w in (4, 16) for n in (1024, 8192)}
    for r in rows:
        assert r["decisions"] > 0 and r["rejected"] == 0
        assert r["ingest_lag"]["count"] > 0 and r["ingest_lag"]["p99_ms"] is not None
        assert r["lookup"]["p99_ms"] > 0 and r["picker_rss_mb"] > 0
        assert r["index_blocks_total"] > 0 and r["vs_fewest_workers"]["decision"] is not None
    assert "crossed" in doc["first_bottleneck"]


@pytest.mark.slow  # a benchmark's whole quick run (40-70 s): make test-slow
@pytest.mark.timeout(150)
def test_trace_quick_repeats_each_cell_and_reports_spreads_and_offline_bounds(tmp_path: Path) -> None:
    """The Mooncake replay runs end to end through AIPerf, Envoy, the picker and iteration-scheduled mocks,
    once per jitter seed, and reports each cell as median and spread beside the offline cached-ratio figures."""
    doc = run_bench("trace", tmp_path, timeout=140)
    res = doc["result"]
    assert [(c["capacity"], c["config"]) for c in res["cells"]] == [("scarce", "c")]
    cell = res["cells"][0]
    assert [r["seed"] for r in cell["runs"]] == [0, 1]
    for r in cell["runs"]:
        assert r["errors"] == 0 and r["requests"] == res["requests"] > 0
        assert r["ttft_p50_ms"] <= r["ttft_p90_ms"] and r["output_tokens_per_s"] > 0
        assert sum(r["per_worker_served"].values()) == r["requests"]
        assert r["workers_prompt_tokens"] == r["aiperf_prompt_tokens"] == res["prompt_tokens"]
    s = cell["summary"]["ttft_p90_ms"]
    assert s["n"] == 2 and s["min"] <= s["median"] <= s["max"]
    (cap,) = res["capacities"]
    assert cap["name"] == "scarce" and cap["blocks_per_worker"] * 4 == cap["pool_blocks"]
    assert 0 <= cap["oracle"]["pooled_lru"] <= cap["oracle"]["infinite"] <= 1
    assert [x["seed"] for x in cap["clairvoyant"][0]["runs"]] == [0, 1]
    assert doc["claims"] == []  # only (c) ran: nothing to compare
    assert set(doc["targets"]["scarce"]) == {"c_cached_within_5pct_of_clairvoyant"}


def test_run_all_rejects_unknown_names(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.run_all", "--quick", "--out", str(tmp_path), "--only",
                           "nope"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "unknown benchmark" in proc.stderr + proc.stdout


@pytest.mark.slow  # a benchmark's whole quick run (15-25 s): make test-slow
@pytest.mark.timeout(150)
def test_passthrough_quick(tmp_path: Path) -> None:
    doc = run_bench("passthrough", tmp_path, timeout=140)
    rows = doc["result"]["rows"]
    assert {(r["shape"], r["load"], r["config"]) for r in rows} == {
        (s, ld, c) for s in ("short", "long") for ld in ("c1", "saturating") for c in ("off", "auto")}
    for r in rows:
        assert r["errors"] == 0 and r["ttft_p50_ms"] <= r["ttft_p90_ms"]
        if r["config"] == "auto":  # every request reached its worker as ids, none rendered there
            assert r["worker_rendered"] == 0 and r["worker_pretokenized"] == r["requests"]
        else:
            assert r["worker_pretokenized"] == 0 and r["worker_rendered"] == r["requests"]
    assert all(v["identical"] for v in doc["result"]["identical_outputs"].values())
    assert len(doc["result"]["ratios"]) == 4


@pytest.mark.slow  # a benchmark's whole quick run (40-70 s): make test-slow
@pytest.mark.timeout(150)
def test_tokens_quick(tmp_path: Path) -> None:
    doc = run_bench("tokens", tmp_path, timeout=140)
    assert [m["mode"] for m in doc["modes"]] == ["none", "lean", "echo", "lean_grpcio", "echo_grpcio"]
    for m in doc["modes"]:
        assert [r["output_tokens"] for r in m["rows"]] == [8, 256, 1024]
        assert all(r["ok"] == r["requests"] for r in m["rows"])
    assert set(doc["summary"]) >= {"lean", "echo", "echo_floor"}
    for m in doc["modes"][1:]:  # with a picker: an idle rate, and net figures never above the raw ones
        assert m["picker_idle_cpu_ms_per_s"] >= 0
        assert all(0 <= r["picker_net_cpu_ms_per_request"] <= r["picker_cpu_ms_per_request"] for r in m["rows"])
    for t in ("grpcio", "h2"):  # quick: 8 streams of 300 chunks and the [DONE] chunk, every one echoed back
        floor = doc["echo_floor"][t]
        assert floor["picker_echoed_chunks"] == 8 * 301 and floor["trivial_us_per_chunk"] > 0


@pytest.mark.slow  # two pickers' quick flood runs (about 40 s): make test-slow
@pytest.mark.timeout(150)
def test_flood_quick_pauses_the_flooder_only_with_a_budget(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.bench_flood", "--quick", "--configs", "default,unpaced",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "flood.json").read_text())
    rows = {r["config"]: r for r in doc["rows"]}
    assert set(rows) == {"default", "unpaced"}
    for r in rows.values():
        assert r["flood_batches_sent"] > 0 and r["unflooded"]["decisions"] > 0 and r["flooded"]["decisions"] > 0
        assert r["unflooded"]["rejected"] == 0 and r["flooded"]["rejected"] == 0
    assert rows["default"]["flooder_throttled"] > 0  # the default budget paused the flooder
    assert not rows["unpaced"]["flooder_throttled"]  # a share of 1000 cores never does
