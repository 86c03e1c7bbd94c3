"""The epp_kv_* metrics read the index's live per-worker state."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from epp_extproc.dev.kvwire import pack_batch, stored_event
from kvindex.decode import decode_payload
from kvindex.index import KvIndex


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
