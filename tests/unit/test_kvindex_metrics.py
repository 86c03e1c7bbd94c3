"""The epp_kv_* metrics read the index's live per-worker state."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from epp_extproc.dev.kvwire import pack_batch, stored_event
from kvindex.decode import decode_payload
from kvindex.index import KvIndex
from kvindex.metrics import MAX_WORKER_SERIES, POOL, register_subscribers, sum_rows


def _with_blocks(registry: CollectorRegistry) -> KvIndex:
    idx = KvIndex(default_block_size=4, registry=registry)
    idx.apply_batch("w", decode_payload(pack_batch([stored_event([1, 2], None, list(range(8)), 4)])))
    return idx


def test_blocks_indexed_gauge_reports_per_worker_and_rank():
    reg = CollectorRegistry()
    _with_blocks(reg)
    assert reg.get_sample_value("epp_kv_blocks_indexed", {"worker": "w", "dp_rank": "0"}) == 2


def test_event_counters_follow_the_index():
    reg = CollectorRegistry()
    idx = _with_blocks(reg)
    idx.apply_batch("w", decode_payload(b"\xc1"))
    assert reg.get_sample_value("epp_kv_events_applied_total", {"worker": "w"}) == 1
    assert reg.get_sample_value("epp_kv_garbage_total", {"worker": "w", "kind": "batches"}) == 1


def test_block_size_mismatch_is_exported():
    reg = CollectorRegistry()
    idx = KvIndex(default_block_size=32, registry=reg)
    idx.apply_batch("w", decode_payload(pack_batch([stored_event([1], None, list(range(4)), 4)])))
    assert reg.get_sample_value("epp_kv_block_size_mismatch_total", {"worker": "w"}) == 1
    assert reg.get_sample_value("epp_kv_block_size", {"worker": "w"}) == 4


def test_two_indexes_can_share_a_registry_and_exposition_works():
    reg = CollectorRegistry()
    _with_blocks(reg)
    _with_blocks(reg)
    assert b"epp_kv_unique_blocks" in generate_latest(reg)


def _pool(registry: CollectorRegistry, n: int) -> KvIndex:
    """`n` workers, each holding the same two blocks."""
    idx = KvIndex(default_block_size=4, registry=registry)
    payload = pack_batch([stored_event([1, 2], None, list(range(8)), 4)])
    for i in range(n):
        idx.apply_batch(f"w{i}", decode_payload(payload))
    return idx


def test_a_pool_over_the_series_cap_is_exported_as_pool_totals_not_a_series_per_worker():
    """10,000 workers made every scrape 330,000 lines and ~2 s of the picker's loop (bench_tenk)."""
    n = MAX_WORKER_SERIES + 1
    reg = CollectorRegistry()
    _pool(reg, n)
    text = generate_latest(reg).decode()
    assert 'worker="w0"' not in text
    assert reg.get_sample_value("epp_kv_blocks_indexed", {"worker": POOL, "dp_rank": "all"}) == 2 * n
    assert reg.get_sample_value("epp_kv_events_applied_total", {"worker": POOL}) == n
    assert reg.get_sample_value("epp_kv_batches_total", {"worker": POOL}) == n
    assert reg.get_sample_value("epp_kv_workers") == n
    assert reg.get_sample_value("epp_kv_block_size", {"worker": POOL}) is None  # does not add up: left out
    assert len(text.splitlines()) < 200


def test_a_pool_at_the_series_cap_keeps_a_series_per_worker():
    reg = CollectorRegistry()
    _pool(reg, MAX_WORKER_SERIES)
    assert reg.get_sample_value("epp_kv_blocks_indexed", {"worker": "w0", "dp_rank": "0"}) == 2
    assert reg.get_sample_value("epp_kv_events_applied_total", {"worker": POOL}) is None


def test_the_pool_totals_are_the_per_worker_snapshot_summed():
    idx = _pool(CollectorRegistry(), 3)
    idx.apply_batch("w1", decode_payload(b"\xc1"))
    snap = idx.snapshot()
    want = sum_rows(snap["workers"].values())
    got = idx.pool_totals()
    assert got["workers"] == 3 and got["unique_blocks"] == snap["unique_blocks"]
    for key in ("batches", "events_applied", "garbage_batches", "blocks_indexed", "predicted", "skipped_length"):
        assert got[key] == want[key], key


def test_subscriber_series_over_the_cap_are_pool_totals():
    reg = CollectorRegistry()
    rows = {f"w{i}": {"gaps": 1, "stale": i % 2 == 0, "last_seq": 7} for i in range(MAX_WORKER_SERIES + 1)}
    register_subscribers(lambda: rows, reg)
    assert reg.get_sample_value("epp_kv_seq_gaps_total", {"worker": POOL}) == MAX_WORKER_SERIES + 1
    assert reg.get_sample_value("epp_kv_worker_stale", {"worker": POOL}) == MAX_WORKER_SERIES // 2 + 1
    assert reg.get_sample_value("epp_kv_last_seq", {"worker": POOL}) is None
    assert reg.get_sample_value("epp_kv_seq_gaps_total", {"worker": "w0"}) is None


async def test_the_subscribers_totals_are_their_snapshot_summed(tmp_path):  # noqa: ANN001
    from kvindex.subscriber import SubscriberManager

    m = SubscriberManager(KvIndex(), registry=CollectorRegistry())
    try:
        for i in range(3):
            await m.add(f"w{i}", f"ipc://{tmp_path}/w{i}")
        m.stats("w1").gaps = 2
        m.stats("w2").stale = True
        assert m.stats_totals(3) is None
        got, want = m.stats_totals(2), sum_rows(m.stats_snapshot().values())
        assert got is not None
        for key in ("gaps", "messages", "stale", "silent", "unsubscribed", "dropped_batches"):
            assert got[key] == want[key], key
        assert got["gaps"] == 2 and got["stale"] == 1
    finally:
        await m.close()
