"""Issue 42's workload suite runs end to end in its --quick form: one command, every workload of
bench/workloads.py through bench_trace (AIPerf, Envoy, the picker, four mocks), each recorded as it finishes and
the suite's log written. What each workload must have done is asserted (every request served by a worker, no
errors, the picker used); figures are not: quality is judged by the full suite (`python -m bench.bench_suite`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import workloads as W

pytestmark = pytest.mark.slow  # ~3 minutes on 2 idle cores (25 s a workload), 9 beside a vLLM bench: `make test-slow`

ROOT = Path(__file__).resolve().parents[2]
QUICK_REQUESTS = 24  # bench_trace's QUICK plan


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench-suite-quick")
    proc = subprocess.run([sys.executable, "-m", "bench.bench_suite", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


@pytest.mark.timeout(1220)
def test_the_quick_suite_logs_every_workload_once_with_its_wall_time(suite_dir: Path) -> None:
    lines = [json.loads(x) for x in (suite_dir / "suite.jsonl").read_text().splitlines()]
    assert [x["workload"] for x in lines] == list(W.WORKLOADS)
    assert all(x["rc"] == 0 and x["wall_s"] > 0 for x in lines)


@pytest.mark.timeout(1220)
@pytest.mark.parametrize("name", list(W.WORKLOADS))
def test_each_workload_serves_every_request_through_the_picker(suite_dir: Path, name: str) -> None:
    doc = json.loads((suite_dir / name / "trace.json").read_text())
    assert doc["plan"]["workload"] == name
    (cell, *more) = doc["result"]["cells"]
    assert not more and cell["config"] == "c" and len(cell["runs"]) == 2
    for run in cell["runs"]:
        assert run["errors"] == 0 and run["requests"] == QUICK_REQUESTS
        assert sum(run["per_worker_served"].values()) == QUICK_REQUESTS
        assert run["routed_without_picker"] == 0
