"""Prometheus export of the index and subscriber counters (names prefixed ``epp_kv_``).

A custom collector reads :class:`kvindex.index.WorkerStats` at scrape time instead of incrementing
prometheus-client counters on the ingest path: a locked ``Counter.inc()`` per event would cost more than
applying the event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

if TYPE_CHECKING:
    from kvindex.index import KvIndex

PREFIX = "epp_kv_"

# (stats attribute, metric suffix, help); counters get "_total" appended by prometheus-client
_COUNTERS = [
    ("batches", "batches", "Batches received and decoded"),
    ("heartbeats", "heartbeats", "Empty-event (heartbeat) batches"),
    ("events_applied", "events_applied", "Events applied to the index"),
    ("blocks_stored", "blocks_stored", "Blocks added from BlockStored events"),
    ("blocks_removed", "blocks_removed", "Blocks removed by BlockRemoved events"),
    ("removed_unknown", "removed_unknown_blocks", "BlockRemoved hashes the index did not know"),
    ("evicted", "evicted_blocks", "Blocks evicted by the per-worker cap"),
    ("clears", "clears", "Times a worker's entries were cleared (gap, restart, AllBlocksCleared)"),
    ("unknown_events", "unknown_events", "Events of an unknown type (ignored)"),
    ("unknown_keys", "unknown_keys", "Unknown keys inside known events (ignored)"),
    ("block_size_mismatch", "block_size_mismatch", "Events whose block_size disagreed with the worker's"),
    ("predictions_confirmed", "predictions_confirmed", "Predicted blocks confirmed by BlockStored"),
    ("predictions_expired", "predictions_expired", "Predicted blocks that expired unconfirmed"),
]
_GAUGES = [
    ("predicted", "predicted_blocks", "Predicted (unconfirmed) blocks"),
    ("block_size", "block_size", "Tokens per block used for this worker"),
    ("max_blocks", "max_blocks", "Per-worker block cap"),
]
# the subscriber's own counters (kvindex.subscriber.SubscriberStats), summed over a worker's ranks
_SUB_COUNTERS = [
    ("gaps", "seq_gaps", "Sequence gaps (lost batches)"),
    ("replays", "replays", "Replay requests sent"),
    ("replay_lost", "replay_lost", "Replays that no longer held the missing batches"),
    ("replay_failures", "replay_failures", "Replay requests that timed out, failed or overran their budget"),
    ("replay_holes", "replay_holes", "Replays with missing batches in the middle (frames dropped)"),
    ("restarts", "publisher_restarts", "Publisher restarts detected (seq back, seq jump, other history)"),
    ("dropped_batches", "dropped_batches", "Live batches dropped unread because ingest was over its budget"),
    ("oversized", "oversized_messages", "Messages refused for exceeding the byte or event budget"),
]
_SUB_GAUGES = [
    ("stale", "worker_stale", "1 if a heartbeating worker went silent"),
    ("silent", "worker_silent", "1 if nothing was ever received from a worker that answers its health probe"),
    ("last_seq", "last_seq", "Last applied sequence number"),
]
_SKIP_REASONS = ["length", "medium", "group", "extra_keys", "unknown_parent", "rank", "block_size"]
_GARBAGE_KINDS = ["frames", "batches", "events"]


def _per_worker(workers: dict[str, dict[str, Any]], counters: list[tuple[str, str, str]],
                gauges: list[tuple[str, str, str]]) -> Iterator[Metric]:
    for key, name, doc in gauges:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=["worker"])
        for wid, d in workers.items():
            v = d.get(key)
            if v is not None:
                g.add_metric([wid], float(v))
        yield g
    for key, name, doc in counters:
        c = CounterMetricFamily(PREFIX + name, doc, labels=["worker"])
        for wid, d in workers.items():
            c.add_metric([wid], d[key])
        yield c


class KvIndexCollector(Collector):
    """Yields one sample per worker (per rank for block counts) from the live index."""

    def __init__(self, index: KvIndex) -> None:
        self._index = index

    def describe(self) -> list[Metric]:
        # no up-front names: several indexes may share a registry in tests without name clashes
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self._index.snapshot()
        workers = snap["workers"]
        blocks = GaugeMetricFamily(PREFIX + "blocks_indexed", "Blocks indexed", labels=["worker", "dp_rank"])
        for wid, d in workers.items():
            for rank, r in d["ranks"].items():
                blocks.add_metric([wid, rank], r["blocks_indexed"])
        yield blocks
        yield from _per_worker(workers, _COUNTERS, _GAUGES)
        sk = CounterMetricFamily(PREFIX + "events_skipped", "Events not applied, by reason", labels=["worker", "reason"])
        for wid, d in workers.items():
            for r in _SKIP_REASONS:
                sk.add_metric([wid, r], d["skipped_" + r])
        yield sk
        gb = CounterMetricFamily(PREFIX + "garbage", "Unusable input dropped, by kind", labels=["worker", "kind"])
        for wid, d in workers.items():
            for k in _GARBAGE_KINDS:
                gb.add_metric([wid, k], d["garbage_" + k])
        yield gb
        yield GaugeMetricFamily(PREFIX + "unique_blocks", "Distinct block chains indexed", value=snap["unique_blocks"])
        yield GaugeMetricFamily(PREFIX + "workers", "Workers known to the index", value=len(workers))


class SubscriberCollector(Collector):
    """The subscribers' sequence/liveness counters, read at scrape time like the index's."""

    def __init__(self, snapshot: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from _per_worker(self._snapshot(), _SUB_COUNTERS, _SUB_GAUGES)


def register_index(index: KvIndex, registry: CollectorRegistry) -> KvIndexCollector:
    """Export ``index`` into ``registry`` (a fresh one in tests, the global REGISTRY in the picker)."""
    collector = KvIndexCollector(index)
    registry.register(collector)
    return collector


def register_subscribers(snapshot: Callable[[], dict[str, dict[str, Any]]],
                         registry: CollectorRegistry) -> SubscriberCollector:
    """Export the subscribers' per-worker stats (``SubscriberManager.stats_snapshot``) into ``registry``."""
    collector = SubscriberCollector(snapshot)
    registry.register(collector)
    return collector
