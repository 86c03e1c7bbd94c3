"""bench/suite_judge.py: issue 42's rule, declared before measuring, applied to recorded runs."""

from __future__ import annotations

from typing import Any

from bench import suite_judge as J


def _cell(cfg: str, ttft: list[float], served: list[int] | None = None, rate: float = 10.0) -> dict[str, Any]:
    runs = [{"ttft_p90_ms": t, "output_tokens_per_s": 1000.0, "itl_avg_ms": 10.0,
             "per_worker_served": dict(enumerate(served or [25, 25, 25, 25]))} for t in ttft]
    return {"config": cfg, "capacity": "75", "offered_rps": rate, "runs": runs}


def _doc(workload: str, *cells: dict[str, Any]) -> dict[str, Any]:
    return {"configs": {c["config"]: "" for c in cells}, "result": {"workload": {"name": workload},
                                                                     "cells": list(cells)}}


def test_a_default_more_than_5_percent_worse_with_disjoint_spreads_loses_the_cell() -> None:
    doc = _doc("rag", _cell("c", [110, 111, 112]), _cell("b", [100, 101, 102]), _cell("e", [60, 61, 62]))
    r = J.judge([doc])
    assert r["losses"] == ["rag 75 10 req/s"] and not r["holds"]


def test_a_default_worse_by_less_than_5_percent_or_within_the_noise_does_not_lose() -> None:
    slightly = _doc("rag", _cell("c", [103, 104, 105]), _cell("b", [100, 101, 102]))
    noisy = _doc("rag", _cell("c", [90, 120, 150]), _cell("b", [100, 101, 102]))
    assert J.judge([slightly])["losses"] == [] and J.judge([noisy])["losses"] == []


def test_a_workload_with_reuse_needs_a_claimed_win_and_no_reuse_does_not() -> None:
    tie = _doc("rag", _cell("c", [100, 101, 102]), _cell("b", [100, 101, 102]))
    control = _doc("no-reuse", _cell("c", [100, 101, 102]), _cell("b", [100, 101, 102]))
    win = _doc("rag", _cell("c", [50, 51, 52]), _cell("b", [100, 101, 102]))
    assert J.judge([tie])["workloads_with_reuse_without_a_win"] == ["rag"]
    assert J.judge([control])["holds"] and J.judge([win])["holds"]


def test_a_loaded_pool_with_a_worker_under_15_percent_in_any_run_fails_the_share_rule() -> None:
    # loaded: 1,000 tokens/s x 10 ms / 4 workers = 2.5 requests decoding per worker (Little's law)
    idle = _doc("rag", _cell("c", [50, 51, 52], served=[40, 30, 20, 10]), _cell("b", [100, 101, 102]))
    r = J.judge([idle])
    assert r["idle_worker_cells"] == ["rag 75 10 req/s"] and not r["holds"]
    assert r["cells"][0]["min_worker_share"] == 0.1


def test_round_robin_is_compared_only_when_asked_and_never_decides_the_verdict() -> None:
    doc = _doc("rag", _cell("c", [50, 51, 52]), _cell("b", [100, 101, 102]), _cell("a", [20, 21, 22]))
    plain, asked = J.judge([doc]), J.judge([doc], also=("a",))
    assert "a" not in plain["cells"][0]["against"]
    assert asked["cells"][0]["against"]["a"]["ttft_p90_ms"]["claim"] is not None  # (c) claimed worse than (a)
    assert plain["holds"] and asked["holds"] and asked["losses"] == []
