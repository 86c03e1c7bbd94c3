"""What a decision at a thousand workers must not pay for on every request: a full collection of the start-up
heap (frozen once, refrozen only after the pool settles)."""

from __future__ import annotations

import gc
import weakref

from epp_extproc.heap import freeze_startup_heap
from tests.clock import Clock


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freezing_the_start_up_heap_takes_it_out_of_collections_but_freezes_no_garbage() -> None:
    garbage = _Cycle()
    gone = weakref.ref(garbage)
    del garbage  # a cycle: only a collection frees it
    try:
        assert freeze_startup_heap() > 1000  # the imports' objects, at least
        assert gone() is None  # collected before the freeze, not frozen with the rest
        assert not any(type(o) is _Cycle for o in gc.get_objects())  # the walks no longer see the frozen heap
    finally:
        gc.unfreeze()


def test_a_refreeze_waits_for_the_pool_to_settle_and_comes_at_most_once_per_interval() -> None:
    from epp_extproc.heap import Refreezer

    clock = Clock()
    r = Refreezer(quiet_s=1.0, min_interval_s=30.0, clock=clock)
    try:
        assert not r.maybe()  # nothing changed
        r.changed()
        clock.t += 0.5
        assert not r.maybe()  # not quiet yet
        r.changed()
        clock.t += 0.9
        assert not r.maybe()  # the second change restarted the quiet period
        clock.t += 0.2
        garbage = _Cycle()
        gone = weakref.ref(garbage)
        del garbage
        assert r.maybe() and r.refreezes == 1
        assert gone() is None and gc.get_freeze_count() > 1000  # collected, then frozen
        r.changed()
        clock.t += 5
        assert not r.maybe()  # quiet, but 30 s have not passed since the last one
        clock.t += 30
        assert r.maybe() and r.refreezes == 2
        assert not r.maybe()  # done: nothing changed since
    finally:
        gc.unfreeze()
