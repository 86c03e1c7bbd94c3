"""The kvindex benchmark runs in quick mode and writes well-formed results (figures are not asserted:
performance is judged from the printed table against the same-run baseline)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_bench_writes_ingest_lookup_and_memory_figures(tmp_path):
    out = tmp_path / "kvindex.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_kvindex", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["ingest"]["blocks_per_s"] > 0 and data["ingest"]["baseline_blocks_per_s"] > 0
    assert {(r["tokens"], r["workers"]) for r in data["lookup"]} == {(1024, 8), (8192, 8), (1024, 64), (8192, 64)}
    assert all(r["p50_ms"] <= r["p99_ms"] for r in data["lookup"])
    stages = {r["dialect"]: r for r in data["ingest_stages"]}
    assert set(stages) == {"vllm", "vllm-array", "trtllm", "trtllm-int64"}  # both engines' wire forms
    for r in stages.values():  # decode, hashing, insert apart and all together, next to the naive baseline
        assert min(r[k] for k in ("blocks_per_s", "decode_blocks_per_s", "hashing_blocks_per_s",
                                  "insert_blocks_per_s", "baseline_blocks_per_s")) > 0 and r["blocks"] > 0
    assert data["memory"]["bytes_per_entry"] > 0 and data["memory"]["entries"] > 0
