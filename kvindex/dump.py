"""A worker's entries out of one :class:`~kvindex.index.KvIndex` and into another: the relay's dump.

Why not replay events: the index keeps no tokens, only, per (rank, block size) slot, ``engine hash -> our
chained hash`` in eviction order, and that pair is all a picker needs: lookups walk our hashes, and the
engine's later events name their parents and removals by engine hash. So a dump is the slots' pairs, and
loading it gives the picker the same index it would have built from the events themselves.

This module reads and writes the index's slots directly (it is the index's friend, in its package) so that
the dump needs no change to ``index.py``; the loader mirrors ``KvIndex._store``'s bookkeeping (the shared
masks, duplicate our-hashes, the per-worker count and cap, predictions confirmed by a stored block), and the
tests compare a loaded index with one fed the same events.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from kvindex.index import KvIndex

__all__ = ["export_slots", "load_slots", "worker_block_size"]

_Q = "Q"


def export_slots(idx: KvIndex, worker_id: str, max_pairs: int) -> Iterator[tuple[int, int, array, array]]:
    """``(rank, block_size, engine hashes, our hashes)`` per non-empty slot of the worker, oldest first, in
    pieces of at most ``max_pairs`` pairs (a slot may come in several). Synchronous: nothing changes the
    index while a caller that does not await in between reads it."""
    w = idx._workers.get(worker_id)
    if w is None:
        return
    for s in list(w.slots.values()):
        if not s.engine:
            continue
        eng = array(_Q, s.engine.keys())
        ours = array(_Q, s.engine.values())
        for i in range(0, len(eng), max_pairs):
            yield s.rank, s.block_size, eng[i:i + max_pairs], ours[i:i + max_pairs]


def worker_block_size(idx: KvIndex, worker_id: str) -> tuple[int, str, str | None]:
    """The worker's prompt block size, where it came from (``default``, ``configured``, ``events``) and its
    media dialect (None until seen)."""
    w = idx._workers.get(worker_id)
    return (idx.default_block_size, "default", None) if w is None else (w.block_size, w.size_source, w.dialect)


def load_slots(idx: KvIndex, worker_id: str, block_size: int, size_source: str,
               slots: list[tuple[int, int, bytes, bytes]], dialect: str | None = None) -> int:
    """Add a dump's pairs to the worker's slots (the caller cleared the worker first); returns the blocks
    added. The relay's block size is adopted only where this index still has the default (what the worker
    said over HTTP wins, as with events). Ranks at or above the worker's rank count are skipped, counted."""
    w = idx._worker(worker_id)
    if w.size_source == "default" and size_source != "default":
        w.size_source = "events"
        idx._adopt_block_size(w, block_size)
    if dialect is not None:
        w.dialect = dialect
    st = w.stats
    wpred = w.pred
    added = 0
    last = None
    for rank, bs, eng_b, ours_b in slots:
        eng_a, ours_a = array(_Q), array(_Q)
        eng_a.frombytes(eng_b)
        ours_a.frombytes(ours_b)
        if rank >= w.max_ranks:
            st.skipped_rank += len(eng_a)
            continue
        slot = idx._slot(w, rank, bs)
        confirm = wpred if bs == w.block_size else None
        idx._insert(w, slot, eng_a, ours_a, confirm)  # a re-store's bookkeeping: eviction order, masks, confirms
        added += len(eng_a)
        last = slot
    w.n_blocks = sum(len(s.engine) for s in w.slots.values())
    st.blocks_stored += added
    if last is not None and w.n_blocks > w.cap:
        idx._evict(w, last)
    return added
