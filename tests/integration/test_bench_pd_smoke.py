"""The P/D benchmark (bench/bench_pd.py) starts, runs its --quick setting end to end (AIPerf, Envoy, the picker,
four iteration-scheduled mocks, two epp-pd-sidecars) and writes well-formed results. Figures are not asserted:
performance is judged from the printed tables; what is asserted is what the run must have done."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # over 15 s: `make test-slow`

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench-pd")
    proc = subprocess.run([sys.executable, "-m", "bench.bench_pd", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "pd.png").stat().st_size > 0
    return json.loads((out / "pd.json").read_text())


def _cell(doc: dict, cfg: str) -> dict:
    return next(c for c in doc["result"]["cells"] if c["config"] == cfg)


@pytest.mark.timeout(180)
def test_both_pools_serve_the_whole_trace_without_errors(quick_doc: dict) -> None:
    res = quick_doc["result"]
    assert {c["config"] for c in res["cells"]} == {"agg", "pd"}
    for c in res["cells"]:
        for r in c["runs"]:
            assert r["errors"] == 0 and r["requests"] == res["requests"] > 0
            assert r["ttft_p50_ms"] <= r["ttft_p90_ms"] and r["itl_p50_ms"] <= r["itl_p90_ms"]
            assert sum(r[f"bucket_{b}_requests"] for b in res["buckets"]) == res["requests"]


@pytest.mark.timeout(180)
def test_the_pd_pool_disaggregates_long_prompts_and_keeps_short_ones_local(quick_doc: dict) -> None:
    res = quick_doc["result"]
    (run,) = _cell(quick_doc, "pd")["runs"]
    d = run["pd_decisions"]
    assert d.get("disaggregated/long_uncached_suffix", 0) > 0
    # every prompt shorter than the decider's threshold was kept on its decode worker
    assert d.get("local_prefill/short_uncached_suffix", 0) >= res["requests_per_bucket"]["short"] > 0
    assert sum(d.values()) == res["requests"]
    assert run["sidecar_requests"]["disaggregated/ok"] == d["disaggregated/long_uncached_suffix"]
    assert run["probe"]["short"]["decisions"] == {"local_prefill/short_uncached_suffix": 10}
    assert run["probe"]["long"]["decisions"] == {"disaggregated/long_uncached_suffix": 10}
    assert run["sidecar_cpu_ms_per_request"] > 0


@pytest.mark.timeout(180)
def test_the_aggregated_pool_decides_as_before(quick_doc: dict) -> None:
    (run,) = _cell(quick_doc, "agg")["runs"]
    assert run["pd_decisions"] == {"aggregated/no_prefill_workers": quick_doc["result"]["requests"]}
    assert run["sidecar_requests"] == {} and run["sidecar_cpu_ms_per_request"] is None
    assert len(quick_doc["claims"]) > 0 and all(k["claim"] is None for k in quick_doc["claims"])  # 1 run: no claim
