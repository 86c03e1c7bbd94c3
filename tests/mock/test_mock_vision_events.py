"""Vision mode: image blocks on the KV-event wire, per engine dialect, decoded with plain msgpack."""

from __future__ import annotations

import hashlib
from typing import Any

import aiohttp
import msgpack

from tests.mock.test_mock_support import post, replay, running_worker
from tests.mock.test_mock_vision_support import data_uri, image_body, image_part, png
from tests.netutil import free_port
from trtllm_mock.mm_events import v1_json_event
from trtllm_mock.tokenizer import VOCAB_SIZE
from trtllm_mock.vision import IMAGE_PAD_ID

TPB = 16
TAIL = "and tell me, in a few careful words, what stands out in this picture and why it matters."
IMG_A = png(224, 224, shade=1)  # 64 placeholder tokens
IMG_B = png(224, 224, shade=2)


def content_id(data: bytes) -> str:
    """The mock's documented content identity: sha256 over a domain prefix and the data bytes."""
    return hashlib.sha256(b"trtllm-mock-image\x00" + data).hexdigest()


async def stored_events(dialect: str, *bodies: dict, **kw: Any) -> list[Any]:
    """Every BlockStored the worker published for these requests, in order (read back through replay)."""
    cfg: dict[str, Any] = {"multimodal": True, "tokens_per_block": TPB, "event_dialect": dialect,
                           "replay_endpoint": f"tcp://127.0.0.1:{free_port()}", **kw}
    async with running_worker(**cfg) as w, \
            aiohttp.ClientSession() as s:
        for b in bodies:
            status, doc = await post(s, w.url + "/v1/chat/completions", b)
            assert status == 200, doc
        answers = await replay(w.replay_endpoint or "", 0)
    out = []
    for frames in answers[:-1]:
        env = msgpack.unpackb(frames[-1], raw=False)
        events = env["events"] if isinstance(env, dict) else env[1]
        out.extend(e for e in events if (e["type"] if isinstance(e, dict) else e[0]) == "BlockStored")
    return out


def flat(evs: list[dict], key: str) -> list[Any]:
    return [x for e in evs for x in e[key]]


async def test_vllm_image_blocks_carry_identifier_and_offset_pairs():
    (ev,) = await stored_events("vllm", image_body(image_part(data_uri(IMG_A)), after=TAIL))
    ident = content_id(IMG_A)
    keyed = [(i, k) for i, k in enumerate(ev["extra_keys"]) if k is not None]
    pads = [i for i, t in enumerate(ev["token_ids"]) if t == IMAGE_PAD_ID]
    start = pads[0]
    assert len(pads) == 64
    # every block that overlaps the placeholder run, and only those, names the item with item start - block start
    assert [i for i, _ in keyed] == sorted({p // TPB for p in pads})
    assert [k for _, k in keyed] == [[[ident, start - i * TPB]] for i, _ in keyed]
    assert keyed[0][1][0][1] >= 0 and all(k[0][1] < 0 for _, k in keyed[1:])


async def test_vllm_uses_the_callers_uuid_as_identifier():
    (ev,) = await stored_events("vllm", image_body(image_part(data_uri(IMG_A), uuid="cat-42"), after=TAIL))
    assert {k[0][0] for k in ev["extra_keys"] if k} == {"cat-42"}


async def test_vllm_salt_follows_the_image_keys_on_the_first_block_only():
    body = image_body(image_part(data_uri(IMG_A)), before="x", after=TAIL, cache_salt="tenant")
    body["messages"] = body["messages"][1:]  # the image inside the first block
    (ev,) = await stored_events("vllm", body)
    first = ev["extra_keys"][0]
    assert first[-1] == "tenant" and isinstance(first[0], list)
    assert all(k is None or "tenant" not in k for k in ev["extra_keys"][1:])


async def test_older_vllm_sends_the_bare_identifier():
    (ev,) = await stored_events("vllm-array", image_body(image_part(data_uri(IMG_A)), after=TAIL))
    extra = ev[8]  # positional: tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys
    assert {tuple(k) for k in extra if k} == {(content_id(IMG_A),)}


async def test_same_image_same_place_gives_the_same_block_hashes():
    body = image_body(image_part(data_uri(IMG_A)), after=TAIL)
    first, *_ = await stored_events("vllm", body)
    again, *_ = await stored_events("vllm", body)  # a fresh worker: the keys are a function of the content
    assert first["block_hashes"] == again["block_hashes"]


async def test_another_image_changes_every_hash_from_its_first_block_on():
    a, *_ = await stored_events("vllm", image_body(image_part(data_uri(IMG_A)), after=TAIL))
    b, *_ = await stored_events("vllm", image_body(image_part(data_uri(IMG_B)), after=TAIL))
    first_img_block = next(i for i, k in enumerate(a["extra_keys"]) if k)
    assert a["token_ids"] == b["token_ids"]  # same size: the very same placeholder tokens
    assert a["block_hashes"][:first_img_block] == b["block_hashes"][:first_img_block]
    assert not set(a["block_hashes"][first_img_block:]) & set(b["block_hashes"][first_img_block:])


async def test_the_same_image_one_token_later_gets_other_keys():
    a, *_ = await stored_events("vllm", image_body(image_part(data_uri(IMG_A)), before="Describe", after=TAIL))
    b, *_ = await stored_events("vllm", image_body(image_part(data_uri(IMG_A)), before="Describe it", after=TAIL))
    ka = [(h, k) for h, k in zip(a["block_hashes"], a["extra_keys"], strict=True) if k]
    kb = [(h, k) for h, k in zip(b["block_hashes"], b["extra_keys"], strict=True) if k]
    assert kb[0][1][0][1] == ka[0][1][0][1] + 1  # the item starts one token later in its first block
    assert not {h for h, _ in ka} & {h for h, _ in kb}


async def test_tensorrt_llm_blocks_carry_mm_keys_with_the_block_start_inside_the_item():
    (ev,) = await stored_events("trtllm", image_body(image_part(data_uri(IMG_A)), after=TAIL))
    assert len(ev["mm_keys"]) == len(ev["block_hashes"])
    keyed = [(i, k) for i, k in enumerate(ev["mm_keys"]) if k]
    digest = keyed[0][1][0]["hash"]
    assert len(digest) == 64 and int(digest, 16) >= 0
    offsets = [k[0]["start_offset"] for _, k in keyed]
    assert offsets[0] == 0 and offsets[1:] == [i * TPB - offsets_start(ev) for i, _ in keyed[1:]]
    assert all(set(k[0]) == {"type", "hash", "start_offset"} and k[0]["type"] == "mm_key" for _, k in keyed)


def offsets_start(ev: dict) -> int:
    """Where the item starts in the prompt: the position of its digest in the TensorRT-LLM token ids."""
    return next(i for i, t in enumerate(ev["token_ids"]) if isinstance(t, str))


async def test_tensorrt_llm_item_tokens_are_its_digest_then_vocab_size_plus_offset():
    (ev,) = await stored_events("trtllm", image_body(image_part(data_uri(IMG_A)), after=TAIL))
    start = offsets_start(ev)
    digest = next(k for k in ev["mm_keys"] if k)[0]["hash"]
    assert ev["token_ids"][start] == digest
    assert ev["token_ids"][start + 1 : start + 64] == [VOCAB_SIZE + j for j in range(1, 64)]
    assert IMAGE_PAD_ID not in ev["token_ids"]


async def test_tensorrt_llm_sends_the_callers_uuid_beside_the_hash():
    (ev,) = await stored_events("trtllm", image_body(image_part(data_uri(IMG_A), uuid="cat-42"), after=TAIL))
    assert {k[0]["uuid"] for k in ev["mm_keys"] if k} == {"cat-42"}


async def test_tensorrt_llm_text_blocks_of_a_multimodal_model_carry_empty_mm_keys():
    body = {"model": "mock-model", "max_tokens": 2, "messages": [{"role": "user", "content": TAIL * 2}]}
    (ev,) = await stored_events("trtllm", body)
    assert ev["mm_keys"] == [[] for _ in ev["block_hashes"]]


async def test_tensorrt_llm_digest_differs_per_image():
    a, *_ = await stored_events("trtllm", image_body(image_part(data_uri(IMG_A)), after=TAIL))
    b, *_ = await stored_events("trtllm", image_body(image_part(data_uri(IMG_B)), after=TAIL))
    assert {k[0]["hash"] for k in a["mm_keys"] if k} != {k[0]["hash"] for k in b["mm_keys"] if k}


async def test_sglang_events_carry_no_multimodal_information():
    (ev,) = await stored_events("sglang", image_body(image_part(data_uri(IMG_A)), after=TAIL))
    assert "mm_keys" not in ev and "extra_keys" not in ev


async def test_a_text_only_worker_publishes_no_mm_keys():
    body = {"model": "mock-model", "max_tokens": 2, "messages": [{"role": "user", "content": TAIL * 2}]}
    (ev,) = await stored_events("trtllm", body, multimodal=False)
    assert "mm_keys" not in ev


def test_v1_json_serializes_blocks_as_unique_tokens_with_mm_keys():
    from trtllm_mock.vision import ImageItem, MmKey

    item = ImageItem("id", "ab" * 32, None, 224, 224, 256, 64)
    ev = {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": None, "token_ids": [1] * 4 + [5] * 4,
          "block_size": 4, "_mm": [(MmKey(item, 2, 0),), (MmKey(item, -2, 2),)]}
    out = v1_json_event(3, ev)
    assert out["event_id"] == 3 and out["data"]["type"] == "stored" and out["data"]["parent_hash"] is None
    b0, b1 = out["data"]["blocks"]
    assert b0["mm_keys"] == [{"type": "mm_key", "hash": "ab" * 32, "start_offset": 0}]
    assert b1["mm_keys"] == [{"type": "mm_key", "hash": "ab" * 32, "start_offset": 2}]
    assert [t["token_id"] for t in b0["tokens"]] == [1, 1, VOCAB_SIZE, VOCAB_SIZE + 1]
    assert b0["tokens"][0] == {"type": "unique_token", "token_id": 1, "token_extra_id": 0}
