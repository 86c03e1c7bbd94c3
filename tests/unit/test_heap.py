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


class _Live:
    """Stands in for a new worker's long-lived objects (a subscription, its socket, its task)."""


def test_a_refreeze_after_workers_were_only_added_freezes_them_without_walking_the_frozen_heap() -> None:
    """Issue 45: the unfreeze + full collection took 9 ms at 8 workers and 18 ms at 1,000 on the shard's loop,
    where lookups waited behind it; after additions only, the young generations are walked and nothing else."""
    from epp_extproc.heap import Refreezer

    clock = Clock()
    r = Refreezer(quiet_s=1.0, min_interval_s=30.0, clock=clock)
    generations: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            generations.append(info["generation"])

    try:
        freeze_startup_heap()
        new_workers = [_Live() for _ in range(100)]
        garbage = _Cycle()
        gone = weakref.ref(garbage)
        del garbage
        r.changed()
        clock.t += 1.5
        gc.callbacks.append(seen)
        try:
            assert r.maybe() and r.refreezes == 1
        finally:
            gc.callbacks.remove(seen)
        assert generations and max(generations) < 2  # no full collection: the frozen heap was not walked
        assert r.full_refreezes == 0
        assert gone() is None  # the burst's garbage was collected, not frozen
        assert not any(type(o) is _Live for o in gc.get_objects())  # the new workers' objects are frozen
        assert len(new_workers) == 100
    finally:
        gc.unfreeze()


def test_a_removed_workers_frozen_cycles_are_freed_by_the_refreeze_after_the_removal() -> None:
    """The memory bound: a worker's objects frozen with the heap, in a cycle, are freed by nothing but a full
    collection of the unfrozen heap; a removal asks for one (and a refreeze after additions does not do it)."""
    from epp_extproc.heap import Refreezer

    clock = Clock()
    r = Refreezer(quiet_s=1.0, min_interval_s=30.0, clock=clock)
    try:
        freeze_startup_heap()
        worker = _Cycle()  # a subscription and its task refer to each other
        gone = weakref.ref(worker)
        gc.freeze()  # frozen by an earlier refreeze
        del worker  # the worker is removed
        r.changed()  # another worker added
        clock.t += 1.5
        assert r.maybe()
        assert gone() is not None  # additions only: the frozen heap is not walked
        r.changed(removed=True)
        r.changed()  # a later addition does not cancel the pending full refreeze
        clock.t += 31
        assert r.maybe() and r.full_refreezes == 1
        assert gone() is None
        assert gc.get_freeze_count() > 1000  # frozen again afterwards
    finally:
        gc.unfreeze()
