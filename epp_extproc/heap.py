"""The process's heap: the garbage collector's pauses kept off the request path, and large blocks returned.

CPython's full (generation 2) collection walks every tracked object. A picker's long-lived heap is mostly
what its imports made (grpc, protobuf, aiohttp, prometheus: about 58,000 objects), so each full collection
took 10-12 ms, and at a thousand workers (a thousand candidates allocated per decision) one ran every half a
second or so: that pause was the decision p99 (bench/README.md, "Ingest apart": 11 ms against 3.6 ms with the
heap frozen). `gc.freeze()` moves what exists once the process has started into a generation the collector
never walks; objects made later (endpoints discovered, requests in flight) are collected as before. The
freeze happens once per process, after a full collection, so no garbage is frozen with it.
"""

from __future__ import annotations

import ctypes
import gc
import platform
import time
from collections.abc import Callable

MAP_LARGE_BLOCKS_FROM = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def map_large_blocks(threshold: int = MAP_LARGE_BLOCKS_FROM) -> bool:
    """Have glibc's malloc serve every block of `threshold` bytes or more from its own mapping, returned to the
    kernel when it is freed; True when set (False: not glibc, nothing changed).

    Request bodies are the picker's large blocks: a body's buffer, the message it came in, its protobuf and
    the bytes the decision reads, 1-32 MiB each. glibc maps such a block on its own at first, but each mapped
    block freed raises its mapping threshold to that block's size (up to 32 MiB): after the first large body,
    the next ones come from the heap, where a buffer that grows is copied and every freed block leaves a hole
    that stays resident. Measured on the picker (issue 43), ten unfinished 30 MB bodies sent in 64 KiB chunks
    held +250 MB the first time and +405-423 MB every time after, against the 240 MB the budget let in.
    A fixed threshold ends that adjustment; blocks under it (nearly every request's) stay on the heap, whose
    pages are already resident (a fresh mapping costs a page fault per 4 KiB touched)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def freeze_startup_heap() -> int:
    """Collect, then freeze everything alive (call once the process has started); the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class Refreezer:
    """Freezes the heap again once a burst of long-lived objects has settled: a new worker set (a thousand
    subscriptions, sockets and tasks in an ingest shard) would otherwise be walked by every full collection,
    20-30 ms each at 1,000 workers, long enough to stall a lookup. At most every `min_interval_s` and only once
    no change came for `quiet_s`: one refreeze per change of the pool instead of a full walk every few seconds.

    How much it walks depends on what changed. After workers were only added, the new objects are young (or
    in the unfrozen part of the oldest generation): the young generations are collected (their garbage is not
    frozen) and everything is frozen, which splices lists and walks nothing else. Walking the frozen heap
    (unfreeze, full collection, freeze) took 9 ms at 8 workers and 18 ms at 1,000 on the shard's loop, where
    lookups wait behind it (issue 45: it landed at the start of the bench's measurements). Only a removal
    needs that walk: a removed worker's objects that sit in reference cycles inside the frozen heap are freed
    by nothing else, so it is done then (and its pause is paid once per removal, as before). Garbage frozen by
    a refreeze after additions (cycles that died after reaching the oldest generation and before the freeze)
    is freed by the next full one."""

    def __init__(self, *, quiet_s: float = 1.0, min_interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.quiet_s = quiet_s
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._changed_at: float | None = None
        self._removed = False
        self._last = -min_interval_s
        self.refreezes = 0
        self.full_refreezes = 0

    def changed(self, *, removed: bool = False) -> None:
        """Long-lived objects were made (`removed`: or some were dropped, e.g. a worker's subscription closed):
        refreeze once things are quiet."""
        self._changed_at = self._clock()
        self._removed = self._removed or removed

    def maybe(self) -> bool:
        """Refreeze when due (call it from a periodic task); True when it did."""
        now = self._clock()
        if (self._changed_at is None or now - self._changed_at < self.quiet_s
                or now - self._last < self.min_interval_s):
            return False
        self._changed_at = None
        self._last = now
        if self._removed:
            self._removed = False
            gc.unfreeze()
            freeze_startup_heap()
            self.full_refreezes += 1
        else:
            gc.collect(1)  # the young generations only: what the burst made and left as garbage
            gc.freeze()
        self.refreezes += 1
        return True
