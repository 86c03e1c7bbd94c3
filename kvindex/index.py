"""The KV-cache index: which worker holds which chain of full blocks.

Layout (chosen for lookup speed and memory, see the bench):

* ``_blocks``: one dict ``our_hash -> int bitmask`` shared by all workers; bit ``i`` = worker slot ``i`` holds
  the block.  ``overlap()`` walks the prompt's chain once, ANDing masks, and stops when no worker is left,
  so a lookup is O(prompt blocks) whatever the number of workers.
* per (worker, data-parallel rank) slot: an insertion-ordered dict ``engine_hash -> our_hash``.  Engine hashes
  are only needed to resolve ``parent_block_hash`` and to apply ``BlockRemoved``; the dict order doubles as the
  eviction order for the per-worker cap, so missed removals cannot grow the index forever.
* predictions (blocks a request was just routed to, not yet confirmed by a ``BlockStored``) live in a second
  ``hash -> bitmask`` dict, with a heap of expiries processed lazily at the start of each call.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import xxhash

from kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch
from kvindex.hashing import MASK64, block_hashes, pack_tokens, root_seed

log = logging.getLogger(__name__)

_xxh3 = xxhash.xxh3_64_intdigest
_FIRST_CHUNK_TOKENS = 8192  # lookups pack the prompt lazily, so an early stop does not pay for the tail


@dataclass(slots=True)
class WorkerStats:
    """Per-worker counters.  The index fills the event counters, the subscriber the sequence/liveness ones;
    both end up in :meth:`KvIndex.snapshot` and in the ``epp_kv_*`` metrics."""

    batches: int = 0
    heartbeats: int = 0
    events_applied: int = 0
    skipped_length: int = 0
    skipped_medium: int = 0
    skipped_group: int = 0
    skipped_extra_keys: int = 0
    skipped_unknown_parent: int = 0
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
    last_seq: int | None = None
    gaps: int = 0
    replays: int = 0
    replay_lost: int = 0
    replay_failures: int = 0
    restarts: int = 0
    heartbeating: bool = False
    stale: bool = False
    last_message_monotonic: float | None = None

    @property
    def events_skipped(self) -> int:
        """Events deliberately not applied, all reasons together."""
        return (
            self.skipped_length + self.skipped_medium + self.skipped_group + self.skipped_extra_keys
            + self.skipped_unknown_parent
        )

    @property
    def garbage(self) -> int:
        """Everything unusable that this worker sent: frames, whole batches and single events."""
        return self.garbage_frames + self.garbage_batches + self.garbage_events


class _Slot:
    """One (worker, dp rank): its bit in the shared masks and its engine->our hash map."""

    __slots__ = ("worker", "rank", "index", "bit", "engine", "multi")

    def __init__(self, worker: _Worker, rank: int, index: int) -> None:
        self.worker = worker
        self.rank = rank
        self.index = index
        self.bit = 1 << index
        self.engine: dict[int, int] = {}
        # our_hash -> number of engine hashes of this slot mapping to it, only when > 1 (rare: e.g. salted
        # blocks whose engine hash differs but whose tokens, hence our hash, are the same)
        self.multi: dict[int, int] = {}


class _Worker:
    __slots__ = ("id", "block_size", "cap", "slots", "stats", "pred", "pred_gen", "mask", "warned")

    def __init__(self, worker_id: str, block_size: int, cap: int) -> None:
        self.id = worker_id
        self.block_size = block_size
        self.cap = cap
        self.slots: dict[int, _Slot] = {}
        self.stats = WorkerStats()
        self.pred: dict[int, float] = {}  # our_hash -> expiry (monotonic), predictions live on rank 0's bit
        self.pred_gen = 0
        self.mask = 0
        self.warned = False


class KvIndex:
    """Which leading blocks of a prompt each worker holds, built from the workers' KV events."""

    def __init__(
        self,
        default_block_size: int = 32,
        max_blocks_per_worker: int = 1_000_000,
        registry: Any = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``registry``: a prometheus ``CollectorRegistry`` to export ``epp_kv_*`` metrics into (None: no
        export, so tests and benches can build many indexes).  ``clock`` is injectable so prediction expiry
        is testable without sleeping."""
        if default_block_size <= 0 or max_blocks_per_worker <= 0:
            raise ValueError("block size and cap must be positive")
        self.default_block_size = default_block_size
        self.max_blocks_per_worker = max_blocks_per_worker
        self._clock = clock
        self._blocks: dict[int, int] = {}
        self._pred: dict[int, int] = {}
        self._pred_heap: list[tuple[float, int, _Worker, int, tuple[int, ...]]] = []
        self._counter = itertools.count()
        self._workers: dict[str, _Worker] = {}
        self._slots: list[_Slot | None] = []
        self._free: list[int] = []
        self._groups: dict[int, int] | None = None
        if registry is not None:
            from kvindex.metrics import register_index

            register_index(self, registry)

    # ------------------------------------------------------------------ workers
    def add_worker(self, worker_id: str) -> None:
        """Make a worker known (idempotent); it then shows up in snapshots with zero blocks."""
        self._worker(worker_id)

    def _worker(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            w = _Worker(worker_id, self.default_block_size, self.max_blocks_per_worker)
            self._workers[worker_id] = w
            self._slot(w, 0)
        return w

    def _slot(self, w: _Worker, rank: int) -> _Slot:
        s = w.slots.get(rank)
        if s is None:
            if self._free:
                idx = heapq.heappop(self._free)
            else:
                idx = len(self._slots)
                self._slots.append(None)
            s = _Slot(w, rank, idx)
            self._slots[idx] = s
            w.slots[rank] = s
            w.mask |= s.bit
            self._groups = None
        return s

    def drop_worker(self, worker_id: str) -> None:
        """Forget a worker entirely (entries, predictions, counters) and recycle its slots."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return
        self._clear(w)
        for s in w.slots.values():
            self._slots[s.index] = None
            heapq.heappush(self._free, s.index)
        w.slots.clear()
        self._groups = None

    def clear_worker(self, worker_id: str) -> None:
        """Drop a worker's blocks and predictions but keep it (lost state: gap, restart, AllBlocksCleared)."""
        w = self._workers.get(worker_id)
        if w is not None:
            self._clear(w)

    def _clear(self, w: _Worker) -> None:
        w.stats.clears += 1
        for s in w.slots.values():
            self._clear_slot(s)
        self._clear_predictions(w)

    def _clear_slot(self, s: _Slot) -> None:
        blocks = self._blocks
        keep = ~s.bit
        for h in s.engine.values():
            m = blocks.get(h)
            if m is not None:
                m &= keep
                if m:
                    blocks[h] = m
                else:
                    del blocks[h]
        s.engine.clear()
        s.multi.clear()

    def _clear_predictions(self, w: _Worker) -> None:
        pred = self._pred
        keep = ~w.slots[0].bit
        for h in w.pred:
            m = pred.get(h, 0) & keep
            if m:
                pred[h] = m
            else:
                pred.pop(h, None)
        w.pred.clear()
        w.pred_gen += 1

    def workers(self) -> list[str]:
        """Known worker ids."""
        return list(self._workers)

    def stats(self, worker_id: str) -> WorkerStats:
        """The worker's mutable counters (creates the worker); the subscriber updates them in place."""
        return self._worker(worker_id).stats

    def set_capacity(self, worker_id: str, max_blocks: int) -> None:
        """Per-worker block cap, e.g. from the worker's reported ``kv_cache_max_blocks``."""
        if max_blocks <= 0:
            raise ValueError("cap must be positive")
        w = self._worker(worker_id)
        w.cap = max_blocks
        for s in w.slots.values():
            if len(s.engine) > max_blocks:
                self._evict(w, s)

    # --------------------------------------------------------------- block size
    def block_sizes(self) -> list[int]:
        """The distinct block sizes of the indexed workers (usually one per pool)."""
        return list(self._group_masks())

    def block_size(self, worker_id: str) -> int:
        """The block size this worker's prompts are hashed with (configured default until learned)."""
        w = self._workers.get(worker_id)
        return w.block_size if w is not None else self.default_block_size

    def set_block_size(self, worker_id: str, n: int) -> None:
        """Set a worker's block size explicitly (e.g. from ``/server_info`` ``tokens_per_block``)."""
        if n <= 0:
            raise ValueError("block size must be positive")
        w = self._worker(worker_id)
        if n != w.block_size:
            self._change_block_size(w, n)

    def _change_block_size(self, w: _Worker, n: int) -> None:
        # entries hashed under another block size live in another hash space: drop them, they cannot match
        if any(s.engine for s in w.slots.values()) or w.pred:
            self._clear(w)
        w.block_size = n
        self._groups = None

    def _event_block_size(self, w: _Worker, n: int) -> None:
        w.stats.block_size_mismatch += 1
        if not w.warned:
            w.warned = True
            log.warning(
                "worker %s publishes block_size=%d but %d was configured/learned; adopting %d for it",
                w.id, n, w.block_size, n,
            )
        self._change_block_size(w, n)

    def _group_masks(self) -> dict[int, int]:
        g = self._groups
        if g is None:
            g = {}
            for w in self._workers.values():
                g[w.block_size] = g.get(w.block_size, 0) | w.mask
            self._groups = g
        return g

    # ------------------------------------------------------------------- ingest
    def apply_batch(self, worker_id: str, batch: DecodedBatch) -> None:
        """Apply one decoded batch from ``worker_id`` (its ``dp_rank`` selects the slot)."""
        w = self._worker(worker_id)
        st = w.stats
        if batch.garbage:
            st.garbage_batches += 1
            return
        st.batches += 1
        c = batch.counters
        if c.skipped or c.garbage_events or c.unknown_events or c.unknown_keys:
            st.skipped_length += c.skipped_length
            st.skipped_medium += c.skipped_medium
            st.skipped_group += c.skipped_group
            st.skipped_extra_keys += c.skipped_extra_keys
            st.garbage_events += c.garbage_events
            st.unknown_events += c.unknown_events
            st.unknown_keys += c.unknown_keys
        if batch.raw_event_count == 0:
            st.heartbeats += 1
            st.heartbeating = True
            return
        if not batch.events:
            return
        if self._pred_heap:
            self._expire(self._clock())
        slot = self._slot(w, batch.dp_rank or 0)
        for ev in batch.events:
            t = type(ev)
            if t is BlockStored:
                self._store(w, slot, ev)
            elif t is BlockRemoved:
                self._remove(slot, ev.block_hashes)
                st.events_applied += 1
            elif t is AllBlocksCleared:
                self._clear_slot(slot)
                if slot.rank == 0:
                    self._clear_predictions(w)
                st.clears += 1
                st.events_applied += 1

    def _store(self, w: _Worker, slot: _Slot, ev: BlockStored) -> None:
        st = w.stats
        bs = ev.block_size
        if bs != w.block_size:
            self._event_block_size(w, bs)
        eng = slot.engine
        setdefault = eng.setdefault
        parent = ev.parent_block_hash
        if parent is None:
            h = root_seed(ev.lora_name)
        else:
            h = eng.get(parent)
            if h is None:
                # the chain hangs off a block we never saw (lost before a gap, evicted, or before we
                # connected): its prefix tokens are unknown, so our hash cannot be computed; never guess
                st.skipped_unknown_parent += 1
                return
        blocks = self._blocks
        bit = slot.bit
        multi = slot.multi
        wpred = w.pred
        step = bs * 4
        mv = memoryview(ev.token_ids).cast("B")
        off = 0
        for eh in ev.block_hashes:
            h = _xxh3(mv[off : off + step], h)
            off += step
            prev = setdefault(eh, h)
            if prev is not h:  # engine hash already known (re-stored, or reused for other tokens)
                del eng[eh]
                eng[eh] = h  # move to the young end of the eviction order
                if prev == h:
                    continue
                self._unref(slot, prev)
            m = blocks.get(h, 0)
            if m & bit:
                multi[h] = multi.get(h, 1) + 1
            else:
                blocks[h] = m | bit
            if wpred and h in wpred:
                self._confirm(w, h)
        st.blocks_stored += len(ev.block_hashes)
        st.events_applied += 1
        if len(eng) > w.cap:
            self._evict(w, slot)

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
        blocks = self._blocks
        m = blocks.get(h)
        if m is not None:
            m &= ~slot.bit
            if m:
                blocks[h] = m
            else:
                del blocks[h]

    def _remove(self, slot: _Slot, hashes: Sequence[int]) -> None:
        eng = slot.engine
        st = slot.worker.stats
        unknown = 0
        for eh in hashes:
            h = eng.pop(eh, None)
            if h is None:
                unknown += 1
            else:
                self._unref(slot, h)
        st.blocks_removed += len(hashes) - unknown
        st.removed_unknown += unknown

    def _evict(self, w: _Worker, slot: _Slot) -> None:
        # evict a batch down to a low-water mark: one ordered scan per batch keeps eviction O(1) amortised
        eng = slot.engine
        target = w.cap - (w.cap // 16 if w.cap >= 1024 else 0)
        n = len(eng) - target
        if n <= 0:
            return
        for eh in list(itertools.islice(eng, n)):
            self._unref(slot, eng.pop(eh))
        w.stats.evicted += n

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

    def predict_hashes(self, worker_id: str, hashes: Sequence[int], ttl_s: float) -> None:
        """:meth:`predict` for chain hashes already computed with :func:`block_hashes` in this worker's
        block size, so a picker that just scored the prompt does not hash it a second time."""
        now = self._clock()
        if self._pred_heap:
            self._expire(now)
        w = self._worker(worker_id)
        if not hashes:
            return
        exp = now + ttl_s
        bit = w.slots[0].bit
        blocks = self._blocks
        pred = self._pred
        wpred = w.pred
        new: list[int] = []
        for h in hashes:
            if blocks.get(h, 0) & bit:
                continue
            wpred[h] = exp
            pb = pred.get(h, 0)
            if not pb & bit:
                pred[h] = pb | bit
            new.append(h)
        if new:
            heapq.heappush(self._pred_heap, (exp, next(self._counter), w, w.pred_gen, tuple(new)))

    def _confirm(self, w: _Worker, h: int) -> None:
        del w.pred[h]
        self._unpredict(w, h)
        w.stats.predictions_confirmed += 1

    def _unpredict(self, w: _Worker, h: int) -> None:
        pred = self._pred
        m = pred.get(h, 0) & ~w.slots[0].bit
        if m:
            pred[h] = m
        else:
            pred.pop(h, None)

    def _expire(self, now: float) -> None:
        heap = self._pred_heap
        while heap and heap[0][0] <= now:
            _, _, w, gen, hashes = heapq.heappop(heap)
            if gen != w.pred_gen or not w.slots:
                continue
            wpred = w.pred
            for h in hashes:
                e = wpred.get(h)
                if e is not None and e <= now:
                    del wpred[h]
                    self._unpredict(w, h)
                    w.stats.predictions_expired += 1

    # ------------------------------------------------------------------- lookup
    def _allowed(self, workers: Iterable[str] | None) -> int:
        if workers is None:
            return -1
        allowed = 0
        get = self._workers.get
        for wid in workers:
            w = get(wid)
            if w is not None:
                allowed |= w.mask
        return allowed

    def _record(self, res: dict[str, int], dead: int, count: int) -> None:
        if count <= 0:
            return
        slots = self._slots
        while dead:
            low = dead & -dead
            s = slots[low.bit_length() - 1]
            dead ^= low
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
    ) -> dict[str, int]:
        """Per worker, how many consecutive leading full blocks of the prompt it holds (real or predicted).

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
                self._walk_tokens(token_ids, n_tok // bs, bs, root_seed(lora_name, salt), alive, res)
        return res

    def _walk_tokens(
        self, tokens: Sequence[int], nblocks: int, bs: int, seed: int, alive: int, res: dict[str, int]
    ) -> None:
        blocks_get = self._blocks.get
        pred_get = self._pred.get if self._pred else None
        step = bs * 4
        chunk = max(1, _FIRST_CHUNK_TOKENS // bs)
        h = seed
        i = 0
        while i < nblocks:
            j = min(nblocks, i + chunk)
            mv = memoryview(pack_tokens(tokens[i * bs : j * bs])).cast("B")
            for off in range(0, (j - i) * step, step):
                h = _xxh3(mv[off : off + step], h)
                m = blocks_get(h, 0)
                if pred_get is not None:
                    m |= pred_get(h, 0)
                m &= alive
                if m != alive:
                    self._record(res, alive ^ m, i + off // step)
                    alive = m
                    if not alive:
                        return
            i = j
            chunk *= 2
        self._record(res, alive, nblocks)

    def overlap_hashes(
        self, hashes: Sequence[int], block_size: int, workers: Iterable[str] | None = None
    ) -> dict[str, int]:
        """Like :meth:`overlap` for chain hashes already computed with :func:`block_hashes`; only workers
        whose block size is ``block_size`` can match."""
        if self._pred_heap:
            self._expire(self._clock())
        alive = self._group_masks().get(block_size, 0) & self._allowed(workers)
        res: dict[str, int] = {}
        if not alive:
            return res
        blocks_get = self._blocks.get
        pred_get = self._pred.get if self._pred else None
        for i, h in enumerate(hashes):
            m = blocks_get(h & MASK64, 0)
            if pred_get is not None:
                m |= pred_get(h & MASK64, 0)
            m &= alive
            if m != alive:
                self._record(res, alive ^ m, i)
                alive = m
                if not alive:
                    return res
        self._record(res, alive, len(hashes))
        return res

    # ------------------------------------------------------------ observability
    def blocks_indexed(self, worker_id: str) -> int:
        """Engine blocks currently indexed for a worker (all ranks)."""
        w = self._workers.get(worker_id)
        return sum(len(s.engine) for s in w.slots.values()) if w is not None else 0

    def engine_hashes(self, worker_id: str) -> set[int]:
        """The worker's engine block hashes (u64) currently indexed, all ranks: to compare with its cache."""
        w = self._workers.get(worker_id)
        return {eh for s in w.slots.values() for eh in s.engine} if w is not None else set()

    def predicted_count(self, worker_id: str) -> int:
        """Blocks currently predicted (not yet confirmed or expired) for a worker."""
        if self._pred_heap:
            self._expire(self._clock())
        w = self._workers.get(worker_id)
        return len(w.pred) if w is not None else 0

    def unique_blocks(self) -> int:
        """Distinct chain hashes held by at least one worker."""
        return len(self._blocks)

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for the picker's ``/debug`` API."""
        if self._pred_heap:
            self._expire(self._clock())
        out: dict[str, Any] = {
            "default_block_size": self.default_block_size,
            "max_blocks_per_worker": self.max_blocks_per_worker,
            "unique_blocks": len(self._blocks),
            "predicted_unique_blocks": len(self._pred),
            "workers": {},
        }
        for wid, w in self._workers.items():
            d = asdict(w.stats)
            d.update(
                block_size=w.block_size,
                block_size_mismatch_flag=w.warned,
                max_blocks=w.cap,
                blocks_indexed=sum(len(s.engine) for s in w.slots.values()),
                predicted=len(w.pred),
                events_skipped=w.stats.events_skipped,
                garbage=w.stats.garbage,
                ranks={str(r): {"blocks_indexed": len(s.engine)} for r, s in sorted(w.slots.items())},
            )
            out["workers"][wid] = d
        return out
