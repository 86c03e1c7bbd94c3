"""Prometheus export of the index and subscriber counters (names prefixed ``epp_kv_``).

A custom collector reads :class:`kvindex.index.WorkerStats` at scrape time instead of incrementing
prometheus-client counters on the ingest path: a locked ``Counter.inc()`` per event would cost more than
applying the event.

A pool of more than :data:`MAX_WORKER_SERIES` workers is exported as pool totals (one sample per family,
``worker="_pool"``) instead of a sample per worker: about 48 series per worker made a scrape at 10,000 workers
330,000 lines (21 MB) and 1.9 s of the picker's event loop for the index's families alone, every scrape, with
decisions waiting behind it; the totals cost one pass over the workers' counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry


class IndexSnapshot(Protocol):
    """What the collector reads of the index (`KvIndex` is one): the index imports this module to register
    itself, so this module names only the shape it reads, not the index, and no import circle forms. An index
    may also have ``known_workers()`` and ``pool_totals()`` (one row of summed counters, as a worker's row of
    its snapshot): a large pool is then exported without building the whole snapshot."""

    def snapshot(self) -> dict[str, Any]: ...

PREFIX = "epp_kv_"
MAX_WORKER_SERIES = 1000  # more workers than this: pool totals, not a sample per worker (see the module's doc)
POOL = "_pool"  # the `worker` label of a pool total

# One table of the per-worker metrics: (source, kind, stats key, metric suffix, help).  "index" rows read
# KvIndex.snapshot(), "subscriber" rows SubscriberManager.stats_snapshot(); counters get "_total" appended.
_WORKER_METRICS = [
    ("index", "counter", "batches", "batches", "Batches received and decoded"),
    ("index", "counter", "heartbeats", "heartbeats", "Empty-event (heartbeat) batches"),
    ("index", "counter", "events_applied", "events_applied", "Events applied to the index"),
    ("index", "counter", "blocks_stored", "blocks_stored", "Blocks added from BlockStored events"),
    ("index", "counter", "blocks_removed", "blocks_removed", "Blocks removed by BlockRemoved events"),
    ("index", "counter", "removed_unknown", "removed_unknown_blocks", "BlockRemoved hashes the index did not know"),
    ("index", "counter", "evicted", "evicted_blocks", "Blocks evicted by the per-worker cap"),
    ("index", "counter", "clears", "clears", "Times a worker's entries were cleared (gap, restart, AllBlocksCleared)"),
    ("index", "counter", "unknown_events", "unknown_events", "Events of an unknown type (ignored)"),
    ("index", "counter", "unknown_keys", "unknown_keys", "Unknown keys inside known events (ignored)"),
    ("index", "counter", "block_size_mismatch", "block_size_mismatch", "Events in another block size than the worker's"),
    ("index", "counter", "predictions_confirmed", "predictions_confirmed", "Predicted blocks confirmed by BlockStored"),
    ("index", "counter", "predictions_expired", "predictions_expired", "Predicted blocks that expired unconfirmed"),
    ("index", "counter", "predictions_cancelled", "predictions_cancelled",
     "Predicted blocks the worker's events contradicted (BlockRemoved, cleared) or that left with the worker"),
    ("index", "gauge", "predicted", "predicted_blocks", "Predicted (unconfirmed) blocks"),
    ("index", "gauge", "predicted_held", "predicted_held_blocks",
     "Predicted blocks held by a request still waiting for its prefill (--prediction-lifetime queue)"),
    ("index", "gauge", "block_size", "block_size", "Tokens per block used for this worker"),
    ("index", "gauge", "max_blocks", "max_blocks", "Per-worker block cap"),
    ("subscriber", "counter", "gaps", "seq_gaps", "Sequence gaps (lost batches)"),
    ("subscriber", "counter", "dropped_batches", "dropped_batches", "Batches lost on the wire (sum of gap sizes)"),
    ("subscriber", "counter", "replays", "replays", "Replay requests sent"),
    ("subscriber", "counter", "replay_lost", "replay_lost", "Replays that no longer held the missing batches"),
    ("subscriber", "counter", "replay_failures", "replay_failures", "Replays that timed out, failed or overran budget"),
    ("subscriber", "counter", "replay_holes", "replay_holes", "Replays with frames missing in the middle"),
    ("subscriber", "counter", "restarts", "publisher_restarts", "Publisher restarts detected"),
    ("subscriber", "counter", "oversized", "oversized_messages", "Batches or replays refused for their size"),
    ("subscriber", "counter", "reconnects", "reconnects", "SUB reconnects after the peer was dropped"),
    ("subscriber", "gauge", "stale", "worker_stale", "1 if a heartbeating worker went silent"),
    ("subscriber", "gauge", "silent", "worker_silent", "1 if nothing ever came from a worker that is up"),
    ("subscriber", "gauge", "last_seq", "last_seq", "Last applied sequence number"),
    ("subscriber", "gauge", "unsubscribed", "worker_unsubscribed",
     "1 if its KV events could not be subscribed (no socket left: ZMQ_MAX_SOCKETS or RLIMIT_NOFILE)"),
]
_SKIP_REASONS = ["length", "medium", "group", "extra_keys", "mm_shape", "unknown_parent", "rank", "block_size",
                 "placeholder"]
# media blocks decoded, by the dialect their keys came in (stats key suffix -> label value)
_MM_DIALECTS = [("vllm", "vllm"), ("vllm_bare", "vllm-bare"), ("trtllm", "trtllm")]
_GARBAGE_KINDS = ["frames", "batches", "events"]


# per-worker values that do not add up over a pool: left out of the pool totals
_NOT_SUMMED = frozenset({"block_size", "max_blocks", "last_seq"})


def sum_rows(rows: Iterator[dict[str, Any]] | Any) -> dict[str, Any]:
    """One row of per-worker numbers summed over `rows` (booleans count the workers where true); the pool
    total of a snapshot too large to export per worker. `blocks_indexed_ranks` sums the per-rank counts."""
    out: dict[str, Any] = {}
    for d in rows:
        for k, v in d.items():
            if isinstance(v, bool | int | float) and k not in _NOT_SUMMED:
                out[k] = out.get(k, 0) + v
    return out


def _per_worker(workers: dict[str, dict[str, Any]], source: str, pooled: bool = False) -> Iterator[Metric]:
    for src, kind, key, name, doc in _WORKER_METRICS:
        if src != source or (pooled and key in _NOT_SUMMED):
            continue
        fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(PREFIX + name, doc, labels=["worker"])
        for wid, d in workers.items():
            v = d.get(key)
            if v is not None:
                fam.add_metric([wid], float(v))
        yield fam


class KvIndexCollector(Collector):
    """Yields one sample per worker (per rank for block counts) from the live index."""

    def __init__(self, index: IndexSnapshot, max_workers: int = MAX_WORKER_SERIES) -> None:
        self._index = index
        self.max_workers = max_workers

    def describe(self) -> list[Metric]:
        # no up-front names: several indexes may share a registry in tests without name clashes
        return []

    def collect(self) -> Iterator[Metric]:
        count, totals = getattr(self._index, "known_workers", None), getattr(self._index, "pool_totals", None)
        if count is not None and totals is not None and count() > self.max_workers:
            row = totals()
            yield from self._pooled(row, row.pop("workers"), row.pop("unique_blocks"))
            return
        snap = self._index.snapshot()
        workers = snap["workers"]
        if len(workers) > self.max_workers:
            yield from self._pooled(sum_rows(workers.values()), len(workers), snap["unique_blocks"])
            return
        blocks = GaugeMetricFamily(PREFIX + "blocks_indexed", "Blocks indexed", labels=["worker", "dp_rank"])
        for wid, d in workers.items():
            for rank, r in d["ranks"].items():
                blocks.add_metric([wid, rank], r["blocks_indexed"])
        yield blocks
        yield from _per_worker(workers, "index")
        sk = CounterMetricFamily(PREFIX + "events_skipped", "Events not applied, by reason", labels=["worker", "reason"])
        for wid, d in workers.items():
            for r in _SKIP_REASONS:
                sk.add_metric([wid, r], d.get("skipped_" + r, 0))
        yield sk
        # issue 44: blocks held off the GPU, per tier (only workers where a tier was seen have the key)
        tiers = GaugeMetricFamily(PREFIX + "tier_blocks", "Blocks indexed per tier (gpu, cpu, disk, shared, "
                                  "unknown), for workers whose events named a tier besides the GPU",
                                  labels=["worker", "tier"])
        for wid, d in workers.items():
            for tier, n in (d.get("blocks_by_tier") or {}).items():
                tiers.add_metric([wid, tier], n)
        yield tiers
        mm = CounterMetricFamily(PREFIX + "mm_blocks", "Multimodal blocks indexed with their item keys, by the "
                                 "dialect the engine sent them in", labels=["worker", "dialect"])
        for wid, d in workers.items():
            for key, label in _MM_DIALECTS:
                mm.add_metric([wid, label], d["mm_blocks_" + key])
        yield mm
        gb = CounterMetricFamily(PREFIX + "garbage", "Unusable input dropped, by kind", labels=["worker", "kind"])
        for wid, d in workers.items():
            for k in _GARBAGE_KINDS:
                gb.add_metric([wid, k], d["garbage_" + k])
        yield gb
        yield GaugeMetricFamily(PREFIX + "unique_blocks", "Distinct block chains indexed", value=snap["unique_blocks"])
        yield GaugeMetricFamily(PREFIX + "workers", "Workers known to the index", value=len(workers))

    def _pooled(self, row: dict[str, Any], n_workers: int, unique_blocks: int) -> Iterator[Metric]:
        """The same families, one sample each (``worker="_pool"``, ``dp_rank="all"``): the pool's totals."""
        blocks = GaugeMetricFamily(PREFIX + "blocks_indexed", "Blocks indexed", labels=["worker", "dp_rank"])
        blocks.add_metric([POOL, "all"], row.get("blocks_indexed", 0))
        yield blocks
        yield from _per_worker({POOL: row}, "index", pooled=True)
        sk = CounterMetricFamily(PREFIX + "events_skipped", "Events not applied, by reason", labels=["worker", "reason"])
        for r in _SKIP_REASONS:
            sk.add_metric([POOL, r], row.get("skipped_" + r, 0))
        yield sk
        mm = CounterMetricFamily(PREFIX + "mm_blocks", "Multimodal blocks indexed with their item keys, by the "
                                 "dialect the engine sent them in", labels=["worker", "dialect"])
        for key, label in _MM_DIALECTS:
            mm.add_metric([POOL, label], row.get("mm_blocks_" + key, 0))
        yield mm
        gb = CounterMetricFamily(PREFIX + "garbage", "Unusable input dropped, by kind", labels=["worker", "kind"])
        for k in _GARBAGE_KINDS:
            gb.add_metric([POOL, k], row.get("garbage_" + k, 0))
        yield gb
        yield GaugeMetricFamily(PREFIX + "unique_blocks", "Distinct block chains indexed", value=unique_blocks)
        yield GaugeMetricFamily(PREFIX + "workers", "Workers known to the index", value=n_workers)


class SubscriberCollector(Collector):
    """The subscribers' sequence/liveness counters, read at scrape time like the index's."""

    def __init__(self, snapshot: Callable[[], dict[str, dict[str, Any]]], max_workers: int = MAX_WORKER_SERIES,
                 totals: Callable[[int], dict[str, Any] | None] | None = None) -> None:
        """``totals(max_workers)``: the summed row when more than ``max_workers`` workers are subscribed
        (else None), without building the per-worker snapshot."""
        self._snapshot = snapshot
        self._totals = totals
        self.max_workers = max_workers

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self._totals is not None and (row := self._totals(self.max_workers)) is not None:
            yield from _per_worker({POOL: row}, "subscriber", pooled=True)
            return
        snap = self._snapshot()
        if len(snap) > self.max_workers:
            yield from _per_worker({POOL: sum_rows(snap.values())}, "subscriber", pooled=True)
            return
        yield from _per_worker(snap, "subscriber")


def register_index(index: IndexSnapshot, registry: CollectorRegistry) -> KvIndexCollector:
    """Export ``index`` into ``registry`` (a fresh one in tests, the global REGISTRY in the picker)."""
    collector = KvIndexCollector(index)
    registry.register(collector)
    return collector


def register_subscribers(snapshot: Callable[[], dict[str, dict[str, Any]]],
                         registry: CollectorRegistry,
                         totals: Callable[[int], dict[str, Any] | None] | None = None) -> SubscriberCollector:
    """Export the subscribers' per-worker stats (``SubscriberManager.stats_snapshot``) into ``registry``."""
    collector = SubscriberCollector(snapshot, totals=totals)
    registry.register(collector)
    return collector
