"""Lean mode's usage matching: bounded whichever of the stream's end and the access-log entry comes first."""

from __future__ import annotations

from epp_extproc.core.late_usage import LateUsage
from tests.clock import Clock


def test_a_parked_request_is_taken_once_by_its_entry() -> None:
    lu = LateUsage()
    lu.park("b1", "m", 64)
    got = lu.take("b1")
    assert got is not None and (got.model, got.predicted_cached_tokens) == ("m", 64)
    assert lu.take("b1") is None and len(lu) == 0


def test_an_entry_before_the_stream_ends_is_taken_once_when_it_ends() -> None:
    lu = LateUsage()
    lu.hold_early("b1", b'"usage":{}')
    assert lu.take_early("b1") == (True, b'"usage":{}')
    assert lu.take_early("b1") == (False, None) and len(lu) == 0


def test_an_entry_without_usage_is_still_found() -> None:
    lu = LateUsage()
    lu.hold_early("b1", None)
    assert lu.take_early("b1") == (True, None)


def test_early_entries_are_bounded_in_count_oldest_first() -> None:
    lu = LateUsage(limit=2)
    for b in ("b1", "b2", "b3"):
        lu.hold_early(b, None)
    assert len(lu) == 2 and lu.expired == 1
    assert lu.take_early("b1") == (False, None) and lu.take_early("b3") == (True, None)


def test_early_entries_expire_like_parked_requests() -> None:
    clock = Clock(0.0)
    lu = LateUsage(ttl_s=60, clock=clock)
    lu.hold_early("b1", None)
    lu.park("b2", "m", None)
    clock.now = 61
    assert lu.take_early("b1") == (False, None) and lu.take("b2") is None
    assert lu.expired == 2 and len(lu) == 0
