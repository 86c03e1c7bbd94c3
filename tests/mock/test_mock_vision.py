"""Vision mode (``--multimodal``) over real HTTP: placeholder expansion, refusals, identity, encoder time."""

from __future__ import annotations

import json

import aiohttp
import pytest

from tests.mock.test_mock_support import chat_body, post, running_worker
from tests.mock.test_mock_vision_support import data_uri, image_body, image_part, jpeg, png
from trtllm_mock import MockConfig
from trtllm_mock.cli import config_from_args

TPB = 16
CHAT = "/v1/chat/completions"


async def chat(s: aiohttp.ClientSession, url: str, body: dict) -> dict:
    status, doc = await post(s, url + CHAT, body)
    assert status == 200, doc
    return doc


async def stats(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/mock/stats") as r:
        return await r.json()


def vision_worker(**kw):
    return running_worker(multimodal=True, tokens_per_block=TPB, **kw)


async def test_prompt_length_grows_with_the_image_size_by_the_qwen_vl_token_count():
    async with vision_worker() as w, aiohttp.ClientSession() as s:
        small = await chat(s, w.url, image_body(image_part(data_uri(png(28, 28)))))  # 4 tokens
        large = await chat(s, w.url, image_body(image_part(data_uri(png(224, 224)))))  # 64 tokens
    assert large["usage"]["prompt_tokens"] - small["usage"]["prompt_tokens"] == 64 - 4


async def test_a_jpeg_counts_by_its_frame_header_size():
    async with vision_worker() as w, aiohttp.ClientSession() as s:
        as_png = await chat(s, w.url, image_body(image_part(data_uri(png(224, 224)))))
        as_jpeg = await chat(s, w.url, image_body(image_part(data_uri(jpeg(224, 224), "image/jpeg"))))
    assert as_jpeg["usage"]["prompt_tokens"] == as_png["usage"]["prompt_tokens"]


async def test_two_images_add_both_placeholder_runs():
    async with vision_worker() as w, aiohttp.ClientSession() as s:
        one = await chat(s, w.url, image_body(image_part(data_uri(png(224, 224)))))
        two = await chat(s, w.url, image_body(image_part(data_uri(png(224, 224))),
                                              image_part(data_uri(png(28, 28)))))
    assert two["usage"]["prompt_tokens"] - one["usage"]["prompt_tokens"] == 4 + 2  # pads + start/end tokens


async def test_a_body_that_is_not_an_image_is_refused_as_tensorrt_llm_refuses_it():
    async with vision_worker() as w, aiohttp.ClientSession() as s:
        status, doc = await post(s, w.url + CHAT, image_body(image_part(data_uri(b"plain text", "image/png"))))
    assert status == 400
    assert doc["object"] == "error" and doc["code"] == 400 and doc["type"] == "BadRequestError"
    assert doc["message"].startswith("cannot identify image file <_io.BytesIO object at 0x")


async def test_a_data_url_that_is_not_base64_is_refused_with_the_engines_text():
    async with vision_worker() as w, aiohttp.ClientSession() as s:
        status, doc = await post(s, w.url + CHAT, image_body(image_part("data:image/png,raw")))
    assert status == 400 and doc["message"] == "Only base64 data URLs are supported for now."


async def test_video_parts_are_refused_by_the_image_model():
    part = {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}
    async with vision_worker() as w, aiohttp.ClientSession() as s:
        status, doc = await post(s, w.url + CHAT, image_body(part))
    assert status == 400 and "'video_url' is not supported" in doc["message"]


async def test_an_http_image_is_never_fetched_and_stands_in_at_the_configured_size():
    async with vision_worker(url_image_size="224x224") as w, aiohttp.ClientSession() as s:
        # port 9 on localhost: a fetch would fail or hang; the mock must not even try
        url_doc = await chat(s, w.url, image_body(image_part("http://127.0.0.1:9/cat.png")))
        data_doc = await chat(s, w.url, image_body(image_part(data_uri(png(224, 224)))))
    assert url_doc["usage"]["prompt_tokens"] == data_doc["usage"]["prompt_tokens"]


async def test_without_multimodal_an_image_is_still_a_400():
    async with running_worker(tokens_per_block=TPB) as w, aiohttp.ClientSession() as s:
        status, doc = await post(s, w.url + CHAT, image_body(image_part(data_uri(png(28, 28)))))
    assert status == 400
    assert doc["message"] == "Content part type 'image_url' is not supported: the mock serves a text-only model."


async def test_text_requests_tokenize_and_cache_exactly_as_a_text_only_worker():
    body = chat_body("The same words on both workers, long enough to fill a couple of blocks of tokens here.")
    async with running_worker(tokens_per_block=TPB) as plain, vision_worker() as vis, \
            aiohttp.ClientSession() as s:
        a = await chat(s, plain.url, body)
        b = await chat(s, vis.url, body)
        async with s.get(plain.url + "/mock/cache") as r:
            ca = await r.json()
        async with s.get(vis.url + "/mock/cache") as r:
            cb = await r.json()
    assert a["usage"] == b["usage"] and a["choices"][0]["message"] == b["choices"][0]["message"]
    assert [x["engine_hash"] for x in ca["blocks"]] == [x["engine_hash"] for x in cb["blocks"]]


async def test_the_same_image_again_is_served_from_cache_past_the_image():
    img = image_part(data_uri(png(224, 224)))
    async with vision_worker() as w, aiohttp.ClientSession() as s:
        first = await chat(s, w.url, image_body(img))
        again = await chat(s, w.url, image_body(img))
    n = first["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // TPB * TPB > 64


async def test_another_image_of_the_same_size_gets_no_cache_past_where_it_starts():
    async with vision_worker() as w, aiohttp.ClientSession() as s:
        await chat(s, w.url, image_body(image_part(data_uri(png(224, 224, shade=1)))))
        other = await chat(s, w.url, image_body(image_part(data_uri(png(224, 224, shade=2)))))
    # the system prompt and the text before the image come to ~30 tokens: at most one block can match
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] <= TPB


async def test_a_caller_uuid_is_the_identity_whatever_the_bytes():
    async with vision_worker() as w, aiohttp.ClientSession() as s:
        await chat(s, w.url, image_body(image_part(data_uri(png(224, 224, shade=1)), uuid="img-1")))
        same_uuid = await chat(s, w.url, image_body(image_part(data_uri(png(224, 224, shade=2)), uuid="img-1")))
    assert same_uuid["usage"]["prompt_tokens_details"]["cached_tokens"] > 64  # vLLM trusts the uuid: so does the mock


LONG_TAIL = "and tell me, in a few careful words, what stands out in this picture and why it matters."


async def test_encoder_runs_for_an_uncached_image_only():
    img = image_part(data_uri(png(224, 224)))
    async with vision_worker(encoder_cache_tokens=0) as w, aiohttp.ClientSession() as s:
        await chat(s, w.url, image_body(img, after=LONG_TAIL))
        after_first = (await stats(s, w.url))["vision"]
        await chat(s, w.url, image_body(img, after=LONG_TAIL))  # the whole image is inside the prefix hit now
        after_second = (await stats(s, w.url))["vision"]
    assert after_first["images_encoded"] == 1 and after_first["patches_encoded"] == 256
    assert after_first["encoder_ms_total"] > 0
    assert after_second["images_encoded"] == 1 and after_second["images_skipped_prefix_cached"] == 1
    assert after_second["encoder_ms_total"] == after_first["encoder_ms_total"]


async def test_an_image_in_the_encoder_cache_is_not_encoded_again_behind_other_text():
    img = image_part(data_uri(png(224, 224)))
    async with vision_worker() as w, aiohttp.ClientSession() as s:
        await chat(s, w.url, image_body(img, before="First question about"))
        await chat(s, w.url, image_body(img, before="A quite different opening sentence for"))
        vision = (await stats(s, w.url))["vision"]
    assert vision["images_encoded"] == 1 and vision["images_skipped_encoder_cache"] == 1


async def test_without_an_encoder_cache_the_same_image_behind_other_text_is_encoded_again():
    img = image_part(data_uri(png(224, 224)))
    async with vision_worker(encoder_cache_tokens=0) as w, aiohttp.ClientSession() as s:
        await chat(s, w.url, image_body(img, before="First question about"))
        await chat(s, w.url, image_body(img, before="A quite different opening sentence for"))
        vision = (await stats(s, w.url))["vision"]
    assert vision["images_encoded"] == 2


async def test_an_image_ending_in_the_uncached_last_block_is_encoded_again_as_vllm_does():
    img = image_part(data_uri(png(224, 224)))
    async with vision_worker(encoder_cache_tokens=0) as w, aiohttp.ClientSession() as s:
        await chat(s, w.url, image_body(img, after="?"))
        again = await chat(s, w.url, image_body(img, after="?"))
        vision = (await stats(s, w.url))["vision"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # a prefix hit that stops inside the image
    assert vision["images_encoded"] == 2


async def test_a_text_only_worker_reports_no_vision_stats():
    async with running_worker() as w, aiohttp.ClientSession() as s:
        assert (await stats(s, w.url))["vision"] is None


async def test_a_restarted_worker_encodes_the_image_again():
    img = image_part(data_uri(png(224, 224)))
    async with vision_worker() as w, aiohttp.ClientSession() as s:
        await chat(s, w.url, image_body(img, before="First question about"))
        async with s.post(w.url + "/mock/faults/restart-publisher") as r:
            assert r.status == 200
        await chat(s, w.url, image_body(img, before="A quite different opening sentence for"))
        vision = (await stats(s, w.url))["vision"]
    assert vision["images_encoded"] == 2 and vision["images_skipped_encoder_cache"] == 0


async def test_streaming_an_image_request_reports_the_cache_hit_past_the_image():
    body = image_body(image_part(data_uri(png(224, 224))), after=LONG_TAIL, stream=True,
                      stream_options={"include_usage": True})
    async with vision_worker() as w, aiohttp.ClientSession() as s:
        await chat(s, w.url, {**body, "stream": False, "stream_options": None})
        async with s.post(w.url + CHAT, json=body) as r:
            text = await r.text()
    usage = json.loads([ln for ln in text.splitlines() if '"usage"' in ln][-1][len("data: "):])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 64


async def test_iteration_scheduler_adds_the_encoder_time_to_the_prefill_step():
    img = image_part(data_uri(png(224, 224)))  # 256 patches
    totals = []
    for per_patch in (0.0, 0.5):
        async with vision_worker(scheduler="iteration", encoder_ms_per_patch=per_patch, step_base_ms=0.0,
                                 speedup=1000.0) as w, aiohttp.ClientSession() as s:
            await chat(s, w.url, image_body(img))
            totals.append(w.engine.stats.step_ms_total)
    assert totals[1] - totals[0] == pytest.approx(256 * 0.5)


def test_cli_flags_fill_the_vision_settings():
    cfg, _ = config_from_args(["--multimodal", "--url-image-size", "320x200", "--encoder-ms-per-patch", "0.01",
                               "--encoder-cache-tokens", "0", "--render-dialect", "vllm", "--event-dialect", "vllm"])
    assert (cfg.multimodal, cfg.url_image_size, cfg.encoder_ms_per_patch, cfg.encoder_cache_tokens,
            cfg.render_dialect, cfg.event_dialect) == (True, "320x200", 0.01, 0, "vllm", "vllm")
    assert config_from_args([])[0].multimodal is False


def test_a_bad_url_image_size_is_refused_at_start():
    with pytest.raises(ValueError, match="640x480"):
        MockConfig(url_image_size="big").validate()
