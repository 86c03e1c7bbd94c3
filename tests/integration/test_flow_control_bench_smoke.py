"""The flow-control benchmark starts, runs its --quick setting against real processes and writes
well-formed results (figures are judged from its printed table, not asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_bench_smoke import run_bench


@pytest.mark.slow  # the benchmark's whole quick run (~40 s): make test-slow
@pytest.mark.timeout(90)
def test_flow_control_quick(tmp_path: Path) -> None:
    doc = run_bench("flow_control", tmp_path, timeout=85)
    rows = doc["result"]["rows"]
    assert {(r["config"], r["load"]) for r in rows} == {(c, x) for c in "qn" for x in (0.5, 2.0)}
    for r in rows:
        assert r["requests"] > 0 and r["served"] > 0
        assert set(r["per_class"]) == {"high", "tenant-a", "tenant-b"}
    q2 = next(r for r in rows if r["config"] == "q" and r["load"] == 2.0)
    assert q2["fairness"] is not None
    assert set(doc["targets"]) == {"high_ttft_p90_2x_over_half", "no_request_lost", "backlogged_tenants_share_40_60"}
