"""The circuit breaker's state machine, on a fake clock."""

from __future__ import annotations

import pytest

from epp_extproc.adapters.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def breaker(clock: Clock, failures: int = 3, open_s: float = 5.0, max_open_s: float = 20.0) -> CircuitBreaker:
    return CircuitBreaker("r", failures=failures, open_s=open_s, max_open_s=max_open_s, clock=clock)


def fail(b: CircuitBreaker, n: int = 1) -> None:
    for _ in range(n):
        t = b.admit()
        assert t is not None
        t.failure("boom")


def test_opens_after_the_threshold_of_consecutive_failures_only(clock: Clock) -> None:
    b = breaker(clock)
    fail(b, 2)
    t = b.admit()
    assert t is not None
    t.success()  # a success in between resets the count
    fail(b, 2)
    assert b.state == CLOSED
    fail(b)
    assert (b.state, b.opens) == (OPEN, 1)
    assert b.admit() is None


def test_open_circuit_lets_exactly_one_probe_through_after_the_open_time(clock: Clock) -> None:
    b = breaker(clock)
    fail(b, 3)
    clock.t += 4.9
    assert b.admit() is None
    clock.t += 0.2
    probe = b.admit()
    assert probe is not None and b.state == HALF_OPEN
    assert b.admit() is None  # others keep skipping while the probe is out
    probe.success()
    assert b.state == CLOSED and b.admit() is not None


def test_failed_probe_reopens_for_twice_as_long_up_to_the_cap(clock: Clock) -> None:
    b = breaker(clock)
    fail(b, 3)
    for expected in (10.0, 20.0, 20.0):
        clock.t += b.open_s
        fail(b)  # the probe
        assert (b.state, b.open_s) == (OPEN, expected)
        assert b.retry_in() == pytest.approx(expected)
    clock.t += b.open_s
    probe = b.admit()
    assert probe is not None
    probe.success()
    assert b.open_s == 5.0  # back to the base once it answered


def test_a_probe_released_without_verdict_frees_the_slot(clock: Clock) -> None:
    b = breaker(clock)
    fail(b, 3)
    clock.t += 5
    probe = b.admit()
    assert probe is not None
    probe.release()  # the request was cancelled mid-call
    assert b.admit() is not None


def test_late_failures_of_calls_admitted_before_opening_do_not_extend_it(clock: Clock) -> None:
    b = breaker(clock)
    early = [b.admit() for _ in range(5)]
    for t in early[:3]:
        assert t is not None
        t.failure("timeout")
    assert b.state == OPEN
    opened = b.opened_at
    clock.t += 1
    for t in early[3:]:
        assert t is not None
        t.failure("timeout")
    assert (b.state, b.opened_at, b.opens) == (OPEN, opened, 1)


def test_zero_failures_disables_the_breaker(clock: Clock) -> None:
    b = breaker(clock, failures=0)
    fail(b, 100)
    assert b.state == CLOSED and b.admit() is not None


def test_state_changes_are_reported(clock: Clock) -> None:
    seen: list[str] = []
    b = CircuitBreaker("r", failures=1, open_s=1.0, clock=clock, on_change=seen.append)
    fail(b)
    clock.t += 1
    probe = b.admit()
    assert probe is not None
    probe.success()
    assert seen == [OPEN, HALF_OPEN, CLOSED]


def test_timeouts_while_the_upstream_answers_others_are_the_requests_own_and_never_open_it(
        clock: Clock) -> None:
    b = breaker(clock, failures=3)
    for _ in range(20):  # each bait call times out, and meanwhile another request was answered
        bait = b.admit()
        clock.t += 0.1
        ok = b.admit()
        assert bait is not None and ok is not None
        ok.success()
        clock.t += 5.0
        bait.timed_out("no answer within 5s")
    assert (b.state, b.opens, b.outliers) == (CLOSED, 0, 20)


def test_timeouts_during_which_nothing_answered_open_it_like_any_failure(clock: Clock) -> None:
    b = breaker(clock, failures=3)
    ok = b.admit()
    assert ok is not None
    ok.success()  # the renderer worked, then hung
    clock.t += 1.0
    calls = [b.admit() for _ in range(3)]
    clock.t += 5.0
    for t in calls:
        assert t is not None
        t.timed_out("no answer within 5s")
    assert (b.state, b.opens, b.outliers) == (OPEN, 1, 0)


def test_a_probe_that_times_out_with_nobody_answering_reopens_it(clock: Clock) -> None:
    b = breaker(clock, failures=1, open_s=5.0)
    fail(b)
    clock.t += 5.0
    probe = b.admit()
    assert probe is not None and b.state == HALF_OPEN
    clock.t += 5.0
    probe.timed_out("no answer within 5s")
    assert (b.state, b.opens, b.open_s) == (OPEN, 2, 10.0)
