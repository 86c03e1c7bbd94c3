"""The image-conversation benchmark runs end to end in its --quick setting (real Envoy, real pickers with
vllm-render, mock vision workers publishing vLLM extra_keys over ZeroMQ) and writes well-formed results.

Figures are not asserted as targets (2 seeds at one tiny load prove nothing on a shared machine); what is asserted
is what must hold whatever the timing: every request answered, the picker scored every image request the way its
--media-credit flag says, and the exact-credit picker's workers reused more than round-robin's in the same run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # over 15 s: `make test-slow`

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("mm")
    proc = subprocess.run([sys.executable, "-m", "bench.bench_multimodal", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "multimodal.png").stat().st_size > 0
    return json.loads((out / "multimodal.json").read_text())


@pytest.mark.timeout(180)
def test_quick_run_answers_every_request_in_every_config_and_seed(doc: dict) -> None:
    runs = doc["result"]["runs"]
    assert {(r["config"], r["seed"]) for r in runs} == {(c, s) for c in "atx" for s in (0, 1)}
    for r in runs:
        assert r["requests"] > 0 and r["errors"] == 0
        assert r["ttft_p50_ms"] <= r["ttft_p90_ms"]
        assert abs(r["cached_ratio"] - r["mock_stats_cached_ratio"]) < 1e-9  # usage agrees with the workers
        assert r["images_encoded"] > 0 and r["loadavg_1m_end"] >= 0


@pytest.mark.timeout(180)
def test_each_picker_scores_image_requests_as_its_media_credit_flag_says(doc: dict) -> None:
    for r in doc["result"]["runs"]:
        if r["config"] == "a":
            assert r["media_scored"] is None
            continue
        scored = r["media_scored"]
        want = 'scored="exact"' if r["config"] == "x" else 'scored="text_prefix"'
        assert scored and all(want in k for k in scored), scored
        assert sum(scored.values()) == r["requests"]  # every request of the workload carries its image


@pytest.mark.timeout(180)
def test_exact_credit_predicts_the_image_blocks_the_workers_reuse_and_text_prefix_does_not(doc: dict) -> None:
    for r in doc["result"]["runs"]:
        if r["config"] == "a":
            continue
        predicted, observed = r["picker_predicted_cached_tokens"], r["picker_observed_cached_tokens"]
        assert observed > 0
        if r["config"] == "x":  # text, image and later blocks: what the picked worker then reused
            assert 0.9 <= predicted / observed <= 1.1, r
        else:  # credit stops before the image, the worker reuses past it
            assert predicted < 0.9 * observed, r


@pytest.mark.timeout(180)
def test_exact_credit_reuses_more_than_round_robin_and_stays_under_the_offline_bounds(doc: dict) -> None:
    by = {(r["config"], r["seed"]): r for r in doc["result"]["runs"]}
    for seed in (0, 1):
        assert by[("x", seed)]["cached_ratio"] > by[("a", seed)]["cached_ratio"]
    for b in doc["result"]["bounds"]:
        x = by[("x", b["seed"])]["cached_ratio"]
        assert 0 < b["clairvoyant"] <= b["infinite"] <= 1
        assert x <= b["infinite"] + 1e-9
    assert {c["metric"] for c in doc["claims"]} == {"ttft_p50_ms", "ttft_p90_ms", "follow_up_ttft_p90_ms",
                                                "cached_ratio"}
    assert "x_ttft_p90_2x_below_t_at_saturation" in doc["targets"]
