"""bench_trace's issue-42 item-3 configurations run their --quick setting end to end: (g2), two pickers without
replica sync behind one Envoy, and (c-oob30)/(e-oob30), 30% of the requests sent straight to the workers
beside AIPerf's replay. What each must have done is asserted (every request served, the out-of-band ones
past the pickers, both pickers used); figures are not: performance is judged from the printed tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # about a minute: `make test-slow`

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 60


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench-trace-item3")
    proc = subprocess.run([sys.executable, "-m", "bench.bench_trace", "--quick", "--workload", "multi-turn",
                           "--requests", str(REQUESTS), "--speedup", "1", "--repeats", "1",
                           "--only", "g2,c-oob30,e-oob30", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "trace.json").read_text())


def _run(doc: dict, cfg: str) -> dict:
    (cell,) = [c for c in doc["result"]["cells"] if c["config"] == cfg]
    (run,) = cell["runs"]
    assert run["errors"] == 0
    return run


@pytest.mark.timeout(180)
def test_two_unsynced_pickers_both_route_and_every_request_is_picked(doc: dict) -> None:
    run = _run(doc, "g2")
    assert len(run["picks_per_picker"]) == 2 and all(n > 0 for n in run["picks_per_picker"])
    assert run["routed_without_picker"] == 0 and sum(run["per_worker_served"].values()) == REQUESTS


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cfg", ["c-oob30", "e-oob30"])
def test_the_out_of_band_share_reaches_the_workers_past_the_picker(doc: dict, cfg: str) -> None:
    run = _run(doc, cfg)
    oob = run["oob"]
    assert oob["requests"] == run["oob_requests"] == 18 and oob["errors"] == 0 and oob["error"] is None
    assert oob["sent_per_worker"] == [5, 5, 4, 4]  # round-robin over the four workers
    assert run["requests"] == REQUESTS - 18  # AIPerf replayed the rest, through Envoy and the picker
    assert sum(run["per_worker_served"].values()) == REQUESTS and run["routed_without_picker"] == 18
    assert oob["sync_lag_ms"] is not None and run["all_ttft_p90_ms"] is not None
    assert "c-oob30_beats_e-oob30" in doc["targets"]["scarce"]
