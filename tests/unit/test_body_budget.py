"""The body budget counts a body once, wherever its bytes are; a refused body lets go of its bytes at once;
large blocks are mapped at a fixed threshold (issue 43: resident memory held to `--max-buffered-body-bytes`)."""

from __future__ import annotations

import platform

import pytest

from epp_extproc.core.admission import BodyBudget, InflightGate
from epp_extproc.core.decision import Decision
from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.exchange import PickerExchange
from epp_extproc.core.lean import LeanSignals
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.request import RequestContext
from epp_extproc.heap import map_large_blocks
from epp_extproc.metrics import PickerMetrics


def test_bytes_still_arriving_in_the_transport_count_against_the_same_total() -> None:
    budget = BodyBudget(per_request=100, total=100)
    arriving = [60]
    budget.in_transit = lambda: arriving[0]
    budget.take(0, 40)  # 40 taken + 60 arriving: exactly the total
    with pytest.raises(PickError) as e:
        budget.take(40, 1)
    assert e.value.problem is Problem.BODY_BUDGET and budget.used == 40  # refused without taking anything
    arriving[0] = 0  # the message completed and left the transport's count
    budget.take(40, 60)
    assert budget.used == 100


def test_without_a_transport_count_the_budget_is_its_own() -> None:
    budget = BodyBudget(per_request=100, total=100)
    budget.take(0, 100)
    assert budget.used == 100


def _exchange(budget: BodyBudget) -> PickerExchange:
    async def decide(_: RequestContext) -> Decision:  # never called: the body never completes
        raise AssertionError("no decision for a refused body")

    m = PickerMetrics()
    arriving = InflightGate(8)
    arriving.enter()
    return PickerExchange(decide, budget, arriving, InflightGate(8), LeanSignals(LoadTracker(), m), m,
                          knows=lambda a: True, count_rejection=lambda e: None)


def test_a_rejected_request_gives_its_body_bytes_back_before_its_answer_is_written() -> None:
    budget = BodyBudget(per_request=1 << 20, total=1 << 20)
    ex = _exchange(budget)
    ex.add_body(b"x" * 1000)
    assert budget.used == 1000
    ex.reject(PickError(Problem.BODY_BUDGET, "busy"), RequestContext())
    assert budget.used == 0  # not only at close(), which waits for the answer to be written
    ex.close()
    assert budget.used == 0


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_large_blocks_are_mapped_at_a_fixed_threshold_on_glibc() -> None:
    assert map_large_blocks() is True
