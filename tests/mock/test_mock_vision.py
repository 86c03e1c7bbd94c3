"""Vision mode (``--multimodal``) over real HTTP: placeholder expansion, refusals, identity, encoder time."""

from __future__ import annotations

import aiohttp

from tests.mock.test_mock_support import chat_body, post, running_worker
from tests.mock.test_mock_vision_support import data_uri, image_body, image_part, jpeg, png

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
