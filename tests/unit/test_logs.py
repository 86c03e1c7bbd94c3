"""Repeated per-request warnings are throttled, and say how many were suppressed."""

from __future__ import annotations

import logging

from epp_extproc.core.logs import Throttled


def test_a_repeated_warning_is_logged_once_per_interval_with_the_suppressed_count(caplog) -> None:
    now = [0.0]
    t = Throttled(logging.getLogger("t"), interval_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        written = [t.warning("render-down", "renderer down") for _ in range(1000)]
        now[0] = 11.0
        t.warning("render-down", "renderer down")
    assert sum(written) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "renderer down", "renderer down (999 similar messages suppressed in the last 10s)"]


def test_different_keys_are_not_throttled_by_each_other() -> None:
    t = Throttled(logging.getLogger("t"), interval_s=10, clock=lambda: 0.0)
    assert t.warning("a", "x") and t.warning("b", "y")
