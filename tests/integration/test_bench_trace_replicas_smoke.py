"""bench_trace's issue-28 configurations (r2, rs, rs2, cv) run their --quick setting end to end (AIPerf, Envoy, the
pickers or the plan picker, four iteration-scheduled mocks) and record what each must have done. Figures are
not asserted: performance is judged from the printed tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # about a minute: `make test-slow`

ROOT = Path(__file__).resolve().parents[2]


def quick_run(tmp_path_factory: pytest.TempPathFactory, only: str) -> dict:
    """bench_trace --quick with these configurations, one repeat: its trace.json."""
    out = tmp_path_factory.mktemp("bench-trace-" + only.replace(",", "-"))
    proc = subprocess.run([sys.executable, "-m", "bench.bench_trace", "--quick", "--only", only, "--repeats",
                           "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "trace.json").read_text())


@pytest.fixture(scope="module")
def quick_doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return quick_run(tmp_path_factory, "r2,rs,cv")


def _run(doc: dict, cfg: str) -> dict:
    (cell,) = [c for c in doc["result"]["cells"] if c["config"] == cfg]
    (run,) = cell["runs"]
    assert run["errors"] == 0 or cfg == "rs"
    return run


@pytest.fixture(scope="module")
def rs2_doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench-trace-rs2")
    proc = subprocess.run([sys.executable, "-m", "bench.bench_trace", "--quick", "--only", "rs2", "--repeats", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "trace.json").read_text())


@pytest.mark.timeout(180)
def test_a_rolling_restart_of_one_of_two_replicas_fails_no_request(rs2_doc: dict) -> None:
    run = _run(rs2_doc, "rs2")  # errors == 0
    restart = run["restart"]
    assert "error" not in restart, restart
    # Envoy saw the replica go before it stopped taking streams (its grace period), and nothing bypassed a picker
    assert restart["envoy_unhealthy_s"] < restart["drain_s"]
    assert run["routed_without_picker"] == 0
    assert len(run["picks_per_picker"]) == 2 and all(n > 0 for n in run["picks_per_picker"])


@pytest.mark.timeout(180)
def test_both_synced_replicas_route_requests_and_every_request_is_picked(quick_doc: dict) -> None:
    run = _run(quick_doc, "r2")
    assert len(run["picks_per_picker"]) == 2 and all(n > 0 for n in run["picks_per_picker"])
    assert run["routed_without_picker"] == 0


@pytest.mark.timeout(180)
def test_the_restarted_picker_comes_back_and_rewarms_its_index_from_the_workers_replay(quick_doc: dict) -> None:
    restart = _run(quick_doc, "rs")["restart"]
    assert "error" not in restart, restart
    assert restart["down_s"] >= restart["drain_s"] > 0
    assert restart["index_blocks_after_replay"] > 0  # caches are not cleared between: only the replay fills it


@pytest.mark.timeout(180)
def test_the_replayed_clairvoyant_plan_places_every_request_where_the_offline_router_did(quick_doc: dict) -> None:
    run = _run(quick_doc, "cv")
    assert run["plan_match"]["unmatched"] == 0 and run["plan_match"]["matched"] == run["requests"]
    (cap,) = quick_doc["result"]["capacities"]
    planned = cap["clairvoyant"][0]["runs"][0]["per_worker_requests"]
    assert [run["per_worker_served"][f"worker-{i}"] for i in range(4)] == planned
    assert "clairvoyant_replayed" in quick_doc["targets"]["scarce"]


@pytest.fixture(scope="module")
def r3_doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return quick_run(tmp_path_factory, "r3m,r3n")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cfg", ["r3m", "r3n"])
def test_three_replicas_synced_on_the_mesh_or_on_nats_all_route_and_every_request_is_picked(r3_doc: dict,
                                                                                         cfg: str) -> None:
    run = _run(r3_doc, cfg)
    assert len(run["picks_per_picker"]) == 3 and all(n > 0 for n in run["picks_per_picker"])
    assert run["routed_without_picker"] == 0
