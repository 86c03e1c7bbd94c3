"""The garbage collector's pauses, kept off the request path.

CPython's full (generation 2) collection walks every tracked object. A picker's long-lived heap is mostly
what its imports made (grpc, protobuf, aiohttp, prometheus: about 58,000 objects), so each full collection
took 10-12 ms, and at a thousand workers (a thousand candidates allocated per decision) one ran every half a
second or so: that pause was the decision p99 (bench/README.md, "Ingest apart": 11 ms against 3.6 ms with the
heap frozen). `gc.freeze()` moves what exists once the process has started into a generation the collector
never walks; objects made later (endpoints discovered, requests in flight) are collected as before. The
freeze happens once per process, after a full collection, so no garbage is frozen with it.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze everything alive (call once the process has started); the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
