"""Native KV events as bytes on the wire, decoded with plain msgpack and compared with the simulated cache."""

from __future__ import annotations

import time

import aiohttp
import msgpack
import pytest

from tests.mock.test_mock_support import (
    U64,
    decode_frames,
    float_type_byte,
    ids_body,
    int_type_bytes,
    post,
    replay,
    running_worker,
    subscribed,
)
from tests.netutil import free_base_port, free_port

TPB = 4
HB = 0.02  # heartbeat used only to know when the SUB is connected


def ids(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


async def infer(session: aiohttp.ClientSession, url: str, prompt: list[int], **extra) -> dict:
    status, body = await post(session, url + "/v1/chat/completions", ids_body(prompt, **extra))
    assert status == 200, body
    return body


async def cache_view(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/mock/cache") as r:
        return await r.json()


async def test_block_stored_bytes_match_the_simulated_cache():
    async with running_worker(tokens_per_block=TPB, heartbeat_interval=HB) as w, aiohttp.ClientSession() as s:
        async with subscribed(w) as sub:
            await sub.synced()
            await infer(s, w.url, ids(2 * TPB + 3))
            batch = await sub.recv_events()
            cache = await cache_view(s, w.url)
    (event,) = batch.events
    assert event["type"] == "BlockStored"
    assert event["parent_block_hash"] is None and event["block_size"] == TPB
    assert event["medium"] == "GPU" and event["lora_id"] is None and event["lora_name"] is None
    assert len(event["token_ids"]) == TPB * len(event["block_hashes"])
    chain = sorted(cache["blocks"], key=lambda b: b["position"])
    assert [h & U64 for h in event["block_hashes"]] == [b["engine_hash"] for b in chain]
    assert event["token_ids"] == [t for b in chain for t in b["token_ids"]] == ids(2 * TPB)


async def test_extending_a_prompt_publishes_only_the_new_blocks_under_the_right_parent():
    async with running_worker(tokens_per_block=TPB, heartbeat_interval=HB) as w, aiohttp.ClientSession() as s:
        async with subscribed(w) as sub:
            await sub.synced()
            await infer(s, w.url, ids(2 * TPB + 1))
            first = (await sub.recv_events()).events[0]
            await infer(s, w.url, ids(4 * TPB + 1))
            second = (await sub.recv_events()).events[0]
    assert second["parent_block_hash"] & U64 == first["block_hashes"][-1] & U64
    assert len(second["block_hashes"]) == 2
    assert second["token_ids"] == ids(4 * TPB)[2 * TPB :]


async def test_salted_blocks_publish_unsalted_token_ids_with_different_hashes():
    async with running_worker(tokens_per_block=TPB, heartbeat_interval=HB) as w, aiohttp.ClientSession() as s:
        async with subscribed(w) as sub:
            await sub.synced()
            await infer(s, w.url, ids(TPB + 1))
            plain = (await sub.recv_events()).events[0]
            await infer(s, w.url, ids(TPB + 1), cache_salt="tenant")
            salted = (await sub.recv_events()).events[0]
    assert salted["token_ids"] == plain["token_ids"]
    assert salted["block_hashes"] != plain["block_hashes"]


async def test_eviction_publishes_block_removed_for_the_blocks_that_left_the_cache():
    async with (
        running_worker(tokens_per_block=TPB, num_blocks=3, heartbeat_interval=HB) as w,
        aiohttp.ClientSession() as s,
    ):
        async with subscribed(w) as sub:
            await sub.synced()
            await infer(s, w.url, ids(2 * TPB, start=100), max_tokens=1)  # stores 2 blocks
            stored = (await sub.recv_events()).events[0]
            await infer(s, w.url, ids(TPB, start=500), max_tokens=1)  # needs 2 blocks, 1 free
            removed = (await sub.recv_events()).events[0]
            cache = await cache_view(s, w.url)
    assert removed == {"type": "BlockRemoved", "block_hashes": [stored["block_hashes"][1]], "medium": "GPU"}
    left = {b["engine_hash"] for b in cache["blocks"]}
    assert stored["block_hashes"][1] & U64 not in left and stored["block_hashes"][0] & U64 in left


async def test_sequence_numbers_are_contiguous_and_start_at_zero():
    async with replay_worker(tokens_per_block=TPB) as w, aiohttp.ClientSession() as s:
        for i in range(3):
            await infer(s, w.url, ids(TPB + 1, start=100 * (i + 1)))
        answers = await replay_from(w, 0)
    assert [int.from_bytes(f[2], "big") for f in answers[:-1]] == [0, 1, 2]


async def replay_from(worker, start: int) -> list[list[bytes]]:
    assert worker.replay_endpoint
    return await replay(worker.replay_endpoint, start)


def replay_worker(**kw):
    return running_worker(replay_endpoint=f"tcp://127.0.0.1:{free_port()}", **kw)


async def test_subscriber_sees_contiguous_sequence_numbers():
    async with running_worker(tokens_per_block=TPB, heartbeat_interval=HB) as w, aiohttp.ClientSession() as s:
        async with subscribed(w) as sub:
            first = await sub.synced()
            for i in range(3):
                await infer(s, w.url, ids(TPB + 1, start=100 * (i + 1)))
            seqs = [first.seq]
            stored = 0
            while stored < 3:
                b = await sub.recv()
                seqs.append(b.seq)
                stored += bool(b.events)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


async def sync_by_clearing(session: aiohttp.ClientSession, url: str, sub) -> int:
    """Connect a SUB without heartbeats: publish AllBlocksCleared until one arrives; return the last seq seen."""
    for _ in range(200):
        await session.post(url + "/mock/cache/clear")
        try:
            last = (await sub.recv(timeout=0.05)).seq
            break
        except TimeoutError:
            continue
    while True:  # drain the clears still in flight
        try:
            last = (await sub.recv(timeout=0.2)).seq
        except TimeoutError:
            return last


async def test_dropped_batch_leaves_a_gap_and_never_reaches_subscribers():
    async with running_worker(tokens_per_block=TPB) as w, aiohttp.ClientSession() as s:
        async with subscribed(w) as sub:
            last = await sync_by_clearing(s, w.url, sub)
            await s.post(w.url + "/mock/faults/drop-next-batch")
            await infer(s, w.url, ids(TPB + 1, start=200))
            await infer(s, w.url, ids(TPB + 1, start=300))
            nxt = await sub.recv()
    assert nxt.seq == last + 2
    assert nxt.events[0]["token_ids"] == ids(TPB, start=300)


async def test_restart_publisher_makes_sequence_numbers_jump_backwards():
    async with running_worker(tokens_per_block=TPB) as w, aiohttp.ClientSession() as s:
        async with subscribed(w) as sub:
            await sync_by_clearing(s, w.url, sub)
            for _ in range(50):
                await s.post(w.url + "/mock/cache/clear")
            before = await sync_by_clearing(s, w.url, sub)
            async with s.post(w.url + "/mock/faults/restart-publisher") as r:
                assert (await r.json())["next_seq"] == 0
            for i in range(40):  # the SUB reconnects on its own; publish until it hears the new process
                await infer(s, w.url, ids(TPB + 1, start=100 * (i + 1)))
                try:
                    after = await sub.recv(timeout=0.05)
                    break
                except TimeoutError:
                    continue
    assert after.seq < before


async def test_restart_publisher_empties_the_cache_like_a_new_process():
    async with running_worker(tokens_per_block=TPB) as w, aiohttp.ClientSession() as s:
        await infer(s, w.url, ids(2 * TPB + 1))
        await s.post(w.url + "/mock/faults/restart-publisher")
        cache = await cache_view(s, w.url)
        again = await infer(s, w.url, ids(2 * TPB + 1))
    assert cache["blocks"] == []
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_replay_answers_buffered_batches_from_start_seq_then_the_end_marker():
    async with replay_worker(tokens_per_block=TPB, kv_events_topic="kv") as w, aiohttp.ClientSession() as s:
        for i in range(3):
            await infer(s, w.url, ids(TPB + 1, start=100 * (i + 1)))
        answers = await replay_from(w, 1)
    assert answers[-1] == [b"", b"", b"\xff" * 8, b""]
    assert [f[0] for f in answers[:-1]] == [b"", b""]
    assert [f[1] for f in answers[:-1]] == [b"kv", b"kv"]
    batches = [decode_frames(f[1:]) for f in answers[:-1]]
    assert [b.seq for b in batches] == [1, 2]
    assert [b.events[0]["token_ids"] for b in batches] == [ids(TPB, start=200), ids(TPB, start=300)]


async def test_replay_recovers_a_batch_dropped_on_the_pub():
    async with replay_worker(tokens_per_block=TPB) as w, aiohttp.ClientSession() as s:
        await s.post(w.url + "/mock/faults/drop-next-batch")
        await infer(s, w.url, ids(TPB + 1))
        answers = await replay_from(w, 0)
    assert decode_frames(answers[0][1:]).events[0]["token_ids"] == ids(TPB)


async def test_replay_buffer_is_bounded_so_old_batches_are_gone():
    async with replay_worker(tokens_per_block=TPB, replay_buffer=2) as w, aiohttp.ClientSession() as s:
        for i in range(5):
            await infer(s, w.url, ids(TPB + 1, start=100 * (i + 1)))
        answers = await replay_from(w, 0)
    assert [int.from_bytes(f[2], "big") for f in answers[:-1]] == [3, 4]


async def test_replay_from_beyond_the_newest_seq_returns_only_the_end_marker():
    async with replay_worker(tokens_per_block=TPB) as w, aiohttp.ClientSession() as s:
        await infer(s, w.url, ids(TPB + 1))
        answers = await replay_from(w, 99)
    assert answers == [[b"", b"", b"\xff" * 8, b""]]


async def test_heartbeat_is_an_empty_events_batch_carrying_the_rank():
    base = free_base_port((0, 3))  # rank 3 binds the base port + 3
    async with running_worker(heartbeat_interval=HB, dp_rank=3, kv_events_endpoint=f"tcp://127.0.0.1:{base}") as w:
        async with subscribed(w) as sub:
            batch = await sub.synced()
    assert batch.events == [] and batch.rank == 3 and isinstance(batch.ts, float)


async def test_no_heartbeat_when_disabled():
    async with running_worker(heartbeat_interval=0, replay_endpoint=f"tcp://127.0.0.1:{free_port()}") as w:
        answers = await replay_from(w, 0)
    assert answers == [[b"", b"", b"\xff" * 8, b""]]


async def test_time_ns_sequence_starts_at_wall_clock_with_all_blocks_cleared():
    t0 = time.time_ns()
    async with replay_worker(seq_start="time_ns") as w:
        answers = await replay_from(w, 0)
    first = decode_frames(answers[0][1:])
    assert first.seq >= t0
    assert first.events == [{"type": "AllBlocksCleared"}]


async def test_cache_clear_publishes_all_blocks_cleared_and_empties_the_cache():
    async with replay_worker(tokens_per_block=TPB) as w, aiohttp.ClientSession() as s:
        await infer(s, w.url, ids(2 * TPB + 1))
        await s.post(w.url + "/mock/cache/clear")
        cache = await cache_view(s, w.url)
        answers = await replay_from(w, 0)
    assert cache["blocks"] == []
    assert decode_frames(answers[-2][1:]).events == [{"type": "AllBlocksCleared"}]


async def test_topic_frame_carries_the_configured_topic():
    async with running_worker(heartbeat_interval=HB, kv_events_topic="kv@w1") as w:
        async with subscribed(w, topic=b"kv@w1") as sub:
            batch = await sub.synced()
    assert batch.topic == b"kv@w1"


async def test_int64_encoding_uses_0xd3_for_every_integer_and_float64_ts():
    async with replay_worker(tokens_per_block=TPB, event_encoding="int64") as w, aiohttp.ClientSession() as s:
        await infer(s, w.url, ids(2 * TPB + 1, start=1))  # small ids that compact would encode as fixints
        payload = (await replay_from(w, 0))[0][3]
    types = int_type_bytes(payload)
    assert types and set(types) == {0xD3}
    assert float_type_byte(payload) == 0xCB
    ts, events, rank = msgpack.unpackb(payload)
    assert events[0]["token_ids"] == ids(2 * TPB, start=1) and rank == 0


async def test_compact_encoding_uses_the_smallest_integers():
    async with replay_worker(tokens_per_block=TPB) as w, aiohttp.ClientSession() as s:
        await infer(s, w.url, ids(2 * TPB + 1, start=1))
        payload = (await replay_from(w, 0))[0][3]
    types = int_type_bytes(payload)
    assert any(t <= 0x7F for t in types)  # token ids 1..8 as positive fixints
    assert payload[-1] == 0x00  # rank 0 as a one-byte fixint


@pytest.mark.parametrize("encoding", ["compact", "int64"])
async def test_both_encodings_decode_to_the_same_events(encoding):
    async with replay_worker(tokens_per_block=TPB, event_encoding=encoding) as w, aiohttp.ClientSession() as s:
        await infer(s, w.url, ids(3 * TPB + 1))
        batch = decode_frames((await replay_from(w, 0))[0][1:])
        cache = await cache_view(s, w.url)
    chain = sorted(cache["blocks"], key=lambda b: b["position"])
    assert [h & U64 for h in batch.events[0]["block_hashes"]] == [b["engine_hash"] for b in chain]


# ---------------------------------------------------------------------------------------------------------------
# Other engines' publisher behaviours (event_dialect and friends), checked on the bytes with plain msgpack.

END = b"\xff" * 8


async def replay_raw(endpoint: str, start: int = 0, timeout: float = 2.0) -> tuple[list[list[bytes]], bool]:
    """Every reply to one replay request but the end marker, and whether the end marker came."""
    answers = await replay(endpoint, start, timeout, partial=True)
    ended = bool(answers) and answers[-1][-2] == END and answers[-1][-1] == b""
    return (answers[:-1] if ended else answers), ended


def replayed_events(replies: list[list[bytes]]) -> list:
    evs = []
    for frames in replies:
        env = msgpack.unpackb(frames[-1], raw=False)
        evs.extend(env["events"] if isinstance(env, dict) else env[1])
    return evs


async def dialect_worker(dialect: str, **kw):
    return replay_worker(tokens_per_block=TPB, event_dialect=dialect, **kw)


async def test_vllm_dialect_puts_the_salt_in_the_first_blocks_extra_keys_in_map_events_of_an_array_batch():
    """vLLM 0.32.0 kv_events.py: `EventBatch` is msgspec array_like ([ts, events, rank]); its events are tagged
    maps (`tag=True`, not array_like)."""
    async with await dialect_worker("vllm") as w, aiohttp.ClientSession() as s:
        await infer(s, w.url, ids(2 * TPB + 1), cache_salt="tenant-a")
        replies, ended = await replay_raw(w.replay_endpoint)
    assert ended and len(replies[0]) == 4  # [b"", topic, seq, payload]: vLLM 0.32+ replays carry the topic
    env = msgpack.unpackb(replies[0][-1], raw=False)
    assert isinstance(env, list) and len(env) == 3
    (ev,) = env[1]
    assert ev["type"] == "BlockStored" and ev["extra_keys"] == [["tenant-a"], None]
    assert "_salt" not in ev and "_tail" not in ev


async def test_vllm_array_dialect_sends_positional_events_and_three_frame_replays():
    async with await dialect_worker("vllm-array") as w, aiohttp.ClientSession() as s:
        await infer(s, w.url, ids(TPB + 1), cache_salt="t")
        replies, ended = await replay_raw(w.replay_endpoint)
    assert ended and len(replies[0]) == 3  # [b"", seq, payload]
    (ev,) = replayed_events(replies)
    tag, hashes, parent, tokens, bs, lora_id, medium, lora_name, extra = ev
    assert (tag, parent, tokens, bs, medium, extra) == ("BlockStored", None, ids(TPB), TPB, "GPU", [["t"]])


async def test_sglang_dialect_sends_a_typed_cache_salt_and_bigram_pages():
    async with await dialect_worker("sglang", bigram_pages=True) as w, aiohttp.ClientSession() as s:
        await infer(s, w.url, ids(TPB + 1), cache_salt="t")
        replies, ended = await replay_raw(w.replay_endpoint)
    assert ended and len(replies[0]) == 3
    (ev,) = replayed_events(replies)
    assert ev["cache_salt"] == "t" and "lora_name" not in ev
    assert ev["token_ids"] == [[t, t + 1] for t in ids(TPB)][:-1] + [[ids(TPB)[-1], 0]]


async def test_tail_blocks_are_published_in_their_own_block_size_under_the_last_full_block():
    async with replay_worker(tokens_per_block=TPB, tail_block_size=2) as w, aiohttp.ClientSession() as s:
        await infer(s, w.url, ids(TPB + 3))
        replies, _ = await replay_raw(w.replay_endpoint)
    main, tail = replayed_events(replies)
    assert tail["block_size"] == 2 and tail["parent_block_hash"] == main["block_hashes"][-1]
    assert tail["token_ids"] == ids(TPB + 3)[TPB : TPB + 2]


async def test_dp_rank_binds_the_base_ports_plus_the_rank():
    base = free_base_port((0, 2))
    async with running_worker(kv_events_endpoint=f"tcp://127.0.0.1:{base}", dp_rank=2) as w:
        assert w.kv_events_endpoint == f"tcp://127.0.0.1:{base + 2}"


async def test_a_small_replay_send_hwm_drops_frames_of_a_large_replay_like_the_engines():
    async with replay_worker(tokens_per_block=TPB, replay_hwm=2, num_blocks=100_000) as w, \
            aiohttp.ClientSession() as s:
        for i in range(300):
            await infer(s, w.url, ids(TPB + 1, start=1000 + 10 * i))
        replies, ended = await replay_raw(w.replay_endpoint, timeout=0.5)
    seqs = [int.from_bytes(r[-2], "big") for r in replies]
    assert len(seqs) < 300 and seqs == sorted(seqs)  # lost frames, never reordered
