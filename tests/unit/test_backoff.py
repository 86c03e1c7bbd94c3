"""The house's one retry schedule (kvindex/backoff.py)."""

from __future__ import annotations

import pytest

from kvindex.backoff import Backoff, backoff_delay


def test_delay_doubles_from_initial_up_to_the_cap_with_half_jitter() -> None:
    assert [backoff_delay(a, 0.5, 4.0, rng=lambda: 1.0) for a in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert [backoff_delay(a, 0.5, 4.0, rng=lambda: 0.0) for a in range(4)] == [0.25, 0.5, 1.0, 2.0]


def test_a_huge_attempt_count_stays_at_the_cap() -> None:
    assert backoff_delay(10_000, 1.0, 30.0, rng=lambda: 1.0) == 30.0


def test_success_starts_the_schedule_over() -> None:
    b = Backoff(1.0, 8.0, rng=lambda: 1.0)
    assert [b.failed() for _ in range(3)] == [1.0, 2.0, 4.0]
    assert b.failures == 3
    b.succeeded()
    assert b.failures == 0
    assert b.failed() == 1.0


def test_a_schedule_that_cannot_wait_is_refused() -> None:
    with pytest.raises(ValueError):
        Backoff(0.0, 1.0)
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)
