"""Integration: image blocks travel over real ZeroMQ from a publisher to the picker's KV view and are credited
exactly: vLLM 0.32.0's own encoded batches (tests/fixtures/make_vllm_mm_events.py, both key dialects) and
TensorRT-LLM native map events with per-block mm_keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.core.contract import MediaItem, PromptIdentity
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.dev.kvwire import stored_event
from kvindex.decode import encode_seq
from kvindex.subscriber import SubscriberManager
from tests.integration.test_kvindex_subscriber import FakeWorker
from tests.waiting import until_async

FIX = json.loads((Path(__file__).parents[1] / "fixtures" / "vllm_mm_events.json").read_text())
SC = FIX["scenarios"]
BS = FIX["block_size"]


@pytest.fixture
async def kv(ctx):
    routing = KvRouting(EndpointRegistry(), block_size=BS, max_blocks_per_worker=100_000, topic="",
                        prediction_ttl_s=0.0, metrics_registry=None, ask_server_info=False)
    await routing.subscribers.close()  # the picker's own manager, on this test's ZeroMQ context instead
    routing.subscribers = SubscriberManager(routing.index, heartbeat_stale_s=5.0, zmq_context=ctx)
    workers: list[FakeWorker] = []

    async def start(worker_id: str) -> FakeWorker:
        w = FakeWorker(ctx)
        workers.append(w)
        await routing.subscribers.add(worker_id, w.endpoint)
        await w.sync(routing.subscribers, worker_id)
        return w

    yield routing, start
    await routing.close()
    for w in workers:
        w.close()


async def publish_raw(mgr: SubscriberManager, w: FakeWorker, worker_id: str, payloads: list[str]) -> None:
    """Send the engine's own encoded batches as they are, then wait until the subscriber applied them."""
    for hexp in payloads:
        w.seq += 1
        await w.pub.send_multipart([b"", encode_seq(w.seq), bytes.fromhex(hexp)])
    await until_async(lambda: mgr.stats(worker_id).last_seq == w.seq)


def ask(routing: KvRouting, scenario: str, workers: list[str], media: tuple[MediaItem, ...] | None = None) -> dict:
    s = SC[scenario]
    items = tuple(MediaItem(i, o, n) for i, o, n in s["media"]) if media is None else media
    return routing.overlap(routing.prompt(s["tokens"] + [7, 8], PromptIdentity(salt=s["salt"], media=items)),
                           workers)


@pytest.mark.parametrize("dialect", ["vllm", "vllm-bare"])
async def test_vllm_image_blocks_over_zeromq_credit_the_same_image_only(kv, dialect):
    routing, start = kv
    a, b = await start("a"), await start("b")
    await publish_raw(routing.subscribers, a, "a", SC["image_a_after_text"]["payloads"][dialect])
    await publish_raw(routing.subscribers, b, "b", SC["image_b_after_text"]["payloads"][dialect])
    assert routing.facts.dialect("a") == routing.facts.dialect("b") == dialect
    assert ask(routing, "image_a_after_text", ["a", "b"]) == {"a": 8, "b": 2}  # b: the text before the image
    assert ask(routing, "image_b_after_text", ["a", "b"]) == {"a": 2, "b": 8}
    assert ask(routing, "image_a_after_text", ["a", "b"], media=()) == {"a": 2, "b": 2}  # text-only: no image


async def test_a_salted_image_prompt_over_zeromq_needs_its_salt(kv):
    routing, start = kv
    w = await start("w")
    await publish_raw(routing.subscribers, w, "w", SC["salted_image_in_first_block"]["payloads"]["vllm"])
    assert ask(routing, "salted_image_in_first_block", ["w"]) == {"w": 5}
    other = routing.prompt(SC["salted_image_in_first_block"]["tokens"] + [7],
                           PromptIdentity(salt="tenant-b", media=tuple(
                               MediaItem(i, o, n) for i, o, n in SC["salted_image_in_first_block"]["media"])))
    assert routing.overlap(other, ["w"]) == {}


async def test_trtllm_media_blocks_over_zeromq_are_indexed_but_never_credit_a_text_chain(kv):
    routing, start = kv
    w = await start("t")
    toks = list(range(1, 1 + 3 * BS))
    digest = "ab" * 32
    mm = [None, [{"hash": digest, "start_offset": 0}], [{"hash": digest, "start_offset": BS}]]
    await w.publish([stored_event([11, 12, 13], None, toks, BS, mm_keys=mm)])
    await until_async(lambda: routing.index.stats("t").mm_blocks_trtllm == 2)
    assert routing.facts.dialect("t") == "trtllm" and routing.index.blocks_indexed("t") == 3
    text = routing.prompt(toks + [0], PromptIdentity())
    assert routing.overlap(text, ["t"]) == {"t": 1}
    image = routing.prompt(toks + [0], PromptIdentity(media=(MediaItem(digest, BS, 2 * BS),)))
    assert routing.overlap(image, ["t"]) == {"t": 1}  # its render cannot rebuild the engine's media blocks
