"""Issue 44: llm-d's file-system connector stream (one hash per offload chunk, no tokens, on its own socket) is
decoded, kept per store and credited, chunk by chunk at the shared tier, to every worker mounting the store."""

from __future__ import annotations

import random

import msgpack
import pytest

from epp_extproc.adapters.discovery_static import EndpointSpecError, parse_document, parse_flag
from epp_extproc.dev.kvwire import (
    pack_batch,
    pack_storage_batch,
    removed_event,
    storage_removed_event,
    storage_stored_event,
    stored_event,
)
from kvindex.decode import TOO_MANY_EVENTS, decode_payload, decode_storage_payload
from kvindex.events import ChunksRemoved, ChunksStored
from kvindex.hashing import block_hashes
from kvindex.index import KvIndex
from kvindex.tiers import TIER_BIT

BS = 4
CHUNK = 4  # GPU blocks per chunk: --kv-storage-block-size 16 over block size 4
GPU, SHARED = TIER_BIT["gpu"], TIER_BIT["shared"]
ENGINE = [101, 102, 103, 104, 105, 106, 107, 108]  # the engine hashes of the prompt's 8 GPU blocks
CHUNK_KEYS = [104, 108]  # the connector names a chunk by its LAST GPU block's hash


def toks(n_blocks: int) -> list[int]:
    return list(range(1, 1 + n_blocks * BS))


def chain(n_blocks: int) -> list[int]:
    return block_hashes(toks(n_blocks), BS)


def gpu_store(idx: KvIndex, worker: str, n: int = 8) -> None:
    idx.apply_batch(worker, decode_payload(pack_batch([stored_event(ENGINE[:n], None, toks(n), BS)])))


def gpu_remove(idx: KvIndex, worker: str, hashes: list[int]) -> None:
    idx.apply_batch(worker, decode_payload(pack_batch([removed_event(hashes)])))


def fs(idx: KvIndex, worker: str, *events) -> None:
    idx.apply_storage_batch(worker, decode_storage_payload(pack_storage_batch(list(events))))


@pytest.fixture
def idx() -> KvIndex:
    i = KvIndex(default_block_size=BS)
    i.set_storage_block_tokens(CHUNK * BS)
    return i


# ------------------------------------------------------------------ decoding the connector's wire
def test_the_connectors_prepacked_store_and_removal_decode_to_chunk_events():
    b = decode_storage_payload(pack_storage_batch([storage_stored_event([1, 2 ** 64 - 1]),
                                                  storage_removed_event([3], "OBJECT_STORE")]))
    assert not b.garbage and b.raw_event_count == 2
    assert b.events == [ChunksStored([1, 2 ** 64 - 1], "SHARED_STORAGE"), ChunksRemoved([3], "OBJECT_STORE")]


def test_the_connectors_events_on_the_gpu_decoder_stay_unindexed():
    """Why the stream needs its own decoder: as GPU events its stores are placeholders, its bins garbage."""
    b = decode_payload(pack_storage_batch([storage_stored_event([1])]))
    assert b.events == [] and b.counters.garbage_events == 1


@pytest.mark.parametrize("event", [
    ["BlockStored", [1], 7, [], 0, None, "SHARED_STORAGE"],  # a parent
    ["BlockStored", [1], 0, [1, 2, 3, 4], 4, None, "SHARED_STORAGE"],  # tokens and a block size
    ["BlockStored", [1], 0, [], 0, 3, "SHARED_STORAGE"],  # a LoRA id
    ["BlockStored", [1], 0, [], 0, None, "GPU"],  # a GPU stream given as the storage endpoint
    ["BlockRemoved", [1], "CPU"],
])
def test_a_shape_the_connector_does_not_send_is_skipped_not_guessed(event):
    b = decode_storage_payload(pack_storage_batch([event]))
    assert b.events == [] and b.counters.skipped_storage_shape == 1 and b.counters.garbage_events == 0


@pytest.mark.parametrize("event", [
    b"\xc1",  # a bin that is not msgpack
    msgpack.packb(b"nested bytes"),  # a bin holding a bin
    ["BlockStored", "not a list", 0, [], 0, None, "SHARED_STORAGE"],
    ["BlockStored", [], 0, [], 0, None, "SHARED_STORAGE"],
    ["BlockStored", [1.5], 0, [], 0, None, "SHARED_STORAGE"],
    ["BlockStored", [1], 0, [], 0, None, 42],
    ["BlockRemoved", [1]],  # no medium
    [7, [1]],
    42,
])
def test_a_malformed_event_is_counted_and_dropped_without_hurting_its_batch(event):
    b = decode_storage_payload(pack_storage_batch([event, storage_stored_event([9])]))
    assert b.counters.garbage_events == 1 and b.events == [ChunksStored([9], "SHARED_STORAGE")]


def test_clears_and_unknown_events_on_the_storage_stream_are_counted_not_applied():
    b = decode_storage_payload(pack_storage_batch([["AllBlocksCleared"], ["Whatever", 1]]))
    assert b.events == [] and b.counters.unknown_events == 2


@pytest.mark.parametrize("payload", [b"", b"\x92", msgpack.packb([1.0]), msgpack.packb({"x": 1}),
                                     msgpack.packb(["ts", []]), msgpack.packb([1.0, {"a": 1}]), "text"])
def test_a_malformed_batch_is_garbage(payload):
    assert decode_storage_payload(payload).garbage  # type: ignore[arg-type]


def test_random_bytes_never_raise():
    rnd = random.Random(44)
    good = pack_storage_batch([storage_stored_event([1, 2]), storage_removed_event([3])])
    for _ in range(2000):
        raw = bytearray(good)
        for _ in range(rnd.randint(1, 4)):
            raw[rnd.randrange(len(raw))] = rnd.randrange(256)
        decode_storage_payload(bytes(raw[: rnd.randint(0, len(raw))]))


def test_a_batch_over_the_event_budget_is_refused_before_decoding():
    b = decode_storage_payload(pack_storage_batch([storage_stored_event([i]) for i in range(5)]), max_events=4)
    assert b.garbage and b.reason == TOO_MANY_EVENTS


# ------------------------------------------------------------------ the index
def test_one_chunk_is_credited_as_its_gpu_blocks_once_each_not_as_one_or_many(idx):
    gpu_store(idx, "a")
    fs(idx, "a", storage_stored_event(CHUNK_KEYS))
    gpu_remove(idx, "a", ENGINE)  # evicted from the GPU: the store still holds both chunks
    assert idx.overlap_hashes(chain(8), BS) == {}
    assert idx.overlap_tiers(chain(8), BS) == {"a": ((SHARED, 8),)}


def test_a_chunk_also_on_the_gpu_is_one_position_per_block_not_two(idx):
    """llm-d issue #2889: CPU hits overcounted when a large offload block is split into smaller keys."""
    gpu_store(idx, "a")
    fs(idx, "a", storage_stored_event(CHUNK_KEYS))
    assert idx.overlap_tiers(chain(8), BS) == {"a": ((GPU | SHARED, 8),)}
    assert idx.overlap_tiers(chain(12), BS) == {"a": ((GPU | SHARED, 8),)}  # a longer prompt: still 8


def test_a_chunk_the_prompt_does_not_cover_whole_is_not_credited(idx):
    gpu_store(idx, "a")
    fs(idx, "a", storage_stored_event(CHUNK_KEYS))
    gpu_remove(idx, "a", ENGINE)
    assert idx.overlap_tiers(chain(6), BS) == {"a": ((SHARED, 4),)}  # the engine loads whole chunks only


def test_shared_store_chunks_are_credited_to_every_member_not_only_the_publisher(idx):
    idx.set_shared_store("a", "pvc")
    idx.set_shared_store("b", "pvc")
    gpu_store(idx, "a")
    gpu_store(idx, "c")
    fs(idx, "a", storage_stored_event(CHUNK_KEYS))
    res = idx.overlap_tiers(chain(8), BS)
    assert res["b"] == ((SHARED, 8),) and res["a"] == ((GPU | SHARED, 8),) and res["c"] == ((GPU, 8),)
    assert idx.overlap_tiers(chain(8), BS, ["b"]) == {"b": ((SHARED, 8),)}


def test_without_a_configured_store_the_chunks_are_the_publishers_alone(idx):
    gpu_store(idx, "a")
    idx.add_worker("b")
    fs(idx, "a", storage_stored_event(CHUNK_KEYS))
    gpu_remove(idx, "a", ENGINE)
    assert idx.overlap_tiers(chain(8), BS) == {"a": ((SHARED, 8),)}
    idx.drop_worker("a")  # nobody else can load a private store: it goes with its worker
    assert not idx.has_tiers() and "shared_stores" not in idx.snapshot()


def test_a_chunk_no_event_named_is_counted_not_indexed(idx):
    fs(idx, "a", storage_stored_event([999]))
    assert idx.stats("a").store_unresolved == 1 and not idx.has_tiers()


def test_a_chunk_is_resolved_through_another_members_events(idx):
    idx.set_shared_store("a", "pvc")
    idx.set_shared_store("b", "pvc")
    gpu_store(idx, "b")  # engine hashes are content hashes: the same on every worker that shares files
    fs(idx, "a", storage_stored_event(CHUNK_KEYS))
    assert idx.stats("a").store_chunks_stored == 2
    assert idx.overlap_tiers(chain(8), BS)["a"] == ((SHARED, 8),)


def test_a_chunk_announced_again_is_one_file_and_one_removal_ends_it(idx):
    idx.set_shared_store("a", "pvc")
    idx.set_shared_store("b", "pvc")
    gpu_store(idx, "a")
    gpu_store(idx, "b")
    fs(idx, "a", storage_stored_event(CHUNK_KEYS))
    fs(idx, "b", storage_stored_event(CHUNK_KEYS))  # b wrote the same blocks: the file is already there
    assert idx.stats("b").store_chunks_repeated == 2
    assert idx.snapshot()["shared_stores"]["pvc"]["chunks"] == 2
    fs(idx, "b", storage_removed_event([108, 555]))  # the evictor deleted one file (and names one never seen)
    assert idx.stats("b").store_chunks_removed == 1 and idx.stats("b").store_removed_unknown == 1
    gpu_remove(idx, "a", ENGINE)
    gpu_remove(idx, "b", ENGINE)
    assert idx.overlap_tiers(chain(8), BS) == {"a": ((SHARED, 4),), "b": ((SHARED, 4),)}


def test_losing_a_workers_gpu_state_keeps_the_store(idx):
    gpu_store(idx, "a")
    fs(idx, "a", storage_stored_event(CHUNK_KEYS))
    idx.clear_worker("a")  # a gap or restart of its GPU stream: the files on the store are still there
    assert idx.overlap_tiers(chain(8), BS) == {"a": ((SHARED, 8),)}


def test_a_store_is_bounded_by_the_per_worker_cap():
    idx = KvIndex(default_block_size=BS, max_blocks_per_worker=64)
    idx.set_storage_block_tokens(BS)  # one GPU block per chunk
    n = 200
    idx.apply_batch("a", decode_payload(pack_batch([stored_event(list(range(1, n + 1)), None, toks(n), BS)])))
    fs(idx, "a", storage_stored_event(list(range(1, n + 1))))
    snap = idx.snapshot()["shared_stores"]["own:a"]
    assert snap["chunks"] <= 64 and idx.stats("a").evicted >= n - 64


def test_a_hostile_storage_batch_is_counted_and_leaves_the_index_as_it_was(idx):
    gpu_store(idx, "a")
    fs(idx, "a", storage_stored_event(CHUNK_KEYS))
    before = idx.overlap_tiers(chain(8), BS)
    idx.apply_storage_batch("a", decode_storage_payload(b"\xff\x00garbage"))
    fs(idx, "a", b"\xc1", ["BlockStored", [1], 5, [1], 1, None, "SHARED_STORAGE"], ["AllBlocksCleared"])
    st = idx.stats("a")
    assert st.garbage_batches == 1 and st.garbage_events == 1 and st.skipped_storage_shape == 1
    assert st.unknown_events == 1 and idx.overlap_tiers(chain(8), BS) == before


def test_chunks_that_are_not_whole_blocks_are_not_credited(idx):
    idx.set_storage_block_tokens(BS * CHUNK + 1)
    gpu_store(idx, "a")
    fs(idx, "a", storage_stored_event(CHUNK_KEYS))
    gpu_remove(idx, "a", ENGINE)
    assert idx.overlap_tiers(chain(8), BS) == {}


def test_debug_kv_shows_each_store_and_the_blocks_it_credits_per_worker(idx):
    idx.set_shared_store("a", "pvc")
    idx.set_shared_store("b", "pvc")
    gpu_store(idx, "a")
    fs(idx, "a", storage_stored_event(CHUNK_KEYS))
    snap = idx.snapshot()
    assert snap["shared_stores"] == {"pvc": {"chunks": 2, "chunk_tokens": 16, "block_size": BS, "gpu_blocks": 8,
                                             "members": ["a", "b"]}}
    assert snap["workers"]["b"]["blocks_by_tier"] == {"gpu": 0, "shared": 8}
    assert snap["workers"]["a"]["store_chunks_stored"] == 2


def test_a_gpu_only_pool_shows_no_store_and_has_no_tiers(idx):
    gpu_store(idx, "a")
    snap = idx.snapshot()
    assert not idx.has_tiers() and "shared_stores" not in snap and "blocks_by_tier" not in snap["workers"]["a"]


# ------------------------------------------------------------------ where the endpoint is configured
def test_the_storage_endpoint_is_read_from_the_endpoints_file_and_flag():
    [e] = parse_document([{"address": "10.0.0.1:8000", "kv_events": "tcp://10.0.0.1:5557",
                           "kv_storage_events": "tcp://10.0.0.1:5559"}], kv_event_port=None, replay_port=None)
    assert e.kv_storage_events == "tcp://10.0.0.1:5559" and e.kv_events == "tcp://10.0.0.1:5557"
    [f] = parse_flag("w=10.0.0.1:8000;kv=tcp://10.0.0.1:5557;storage=tcp://10.0.0.1:5559",
                     kv_event_port=None, replay_port=None)
    assert f.kv_storage_events == "tcp://10.0.0.1:5559"
    [g] = parse_flag("10.0.0.1:8000", kv_event_port=5557, replay_port=None)
    assert g.kv_storage_events is None


@pytest.mark.parametrize("bad", ["10.0.0.1:5559", 5559, ["tcp://x:1"]])
def test_a_storage_endpoint_that_is_not_a_zmq_address_is_refused(bad):
    with pytest.raises(EndpointSpecError):
        parse_document([{"address": "10.0.0.1:8000", "kv_storage_events": bad}], kv_event_port=None,
                       replay_port=None)
