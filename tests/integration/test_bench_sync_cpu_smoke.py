"""bench_sync_cpu's --quick setting runs end to end (3 replica processes behind Envoy, nosync / mesh / NATS /
NATS + relay, a real nats-server) and records what each run must have: CPU per replica, the requests each
replica picked, the nats-server's and the relay's CPU where they ran, and the peers' booking visibility.
Figures are not asserted: performance is judged from the printed tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # about two minutes: `make test-slow`

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_every_configuration_runs_three_replicas_and_records_cpu_and_visibility(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.bench_sync_cpu", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=290)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "sync_cpu.json").read_text())
    runs = {r["config"]: r for r in doc["result"]["runs"]}
    assert set(runs) == {"nosync", "mesh", "nats", "natsr"}
    for cfg, r in runs.items():
        assert r["errors"] == 0
        assert len(r["picks_per_replica"]) == 3 and all(n > 0 for n in r["picks_per_replica"])
        assert sum(r["picks_per_replica"]) == r["requests"]
        assert all(c is not None for c in r["cpu_ms_per_request_per_replica"])
        assert (r["nats_cpu_s"] is not None) == (cfg in ("nats", "natsr"))
        assert (r["relay_cpu_s"] is not None) == (cfg == "natsr")
        if cfg != "nosync":  # the peers applied the replicas' bookings
            assert r["visible_lag"]["count"] > 0
    summary = doc["result"]["summary"]
    assert "sync_extra_picker_cpu_ms_per_request" in summary["nats"]
