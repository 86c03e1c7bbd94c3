"""The ingest shard's refreezes (epp_extproc/heap.py): workers added are frozen without walking the frozen heap
(that walk stalled lookups for 9-18 ms, issue 45); a dropped worker asks for the full one that frees its cycles."""

from __future__ import annotations

import gc

from epp_extproc.heap import Refreezer
from epp_extproc.ingest.server import IngestShard
from tests.clock import Clock


async def test_a_shard_walks_the_frozen_heap_only_after_a_worker_was_dropped(tmp_path) -> None:
    clock = Clock()
    s = IngestShard(str(tmp_path))
    s.refreezer = Refreezer(quiet_s=1.0, min_interval_s=30.0, clock=clock)
    try:
        await s.want("p", {"a:1": (), "b:2": ()})
        clock.t += 1.5
        assert s.refreezer.maybe()
        assert s.refreezer.full_refreezes == 0  # new workers only: frozen, nothing walked
        await s.want("p", {"a:1": (), "b:2": (), "c:3": ()})
        clock.t += 31
        assert s.refreezer.maybe() and s.refreezer.full_refreezes == 0
        await s.want("p", {"a:1": (), "c:3": ()})  # b:2 dropped
        clock.t += 31
        assert s.refreezer.maybe() and s.refreezer.full_refreezes == 1
        assert s.snapshot()["ingest"]["heap_full_refreezes"] == 1
    finally:
        gc.unfreeze()
        await s.close()
