"""The mock's error bodies are trtllm-serve's, shape for shape (checked against NVIDIA/TensorRT-LLM
00057725d9a6591f033e44f31c219e2426827bb7, tensorrt_llm/serve/openai_server.py and openai_protocol.py):

- schema refusals: trtllm-serve's RequestValidationError handler, 400 `{"error": "<text>"}`;
- refusals inside the route handler: `create_error_response`, 400 flat `ErrorResponse`
  `{"object": "error", "message", "type": "BadRequestError", "param": null, "code": 400}`;
- FastAPI's own HTTPExceptions: `{"detail": "..."}`.

The picker passes a worker's error through as the engine sent it, so each test also pins what the openai SDK
(the installed package) shows for that shape: it reads only `{"error": {...}}` objects, or a flat object's
`message`; the picker's own errors are `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from tests.mock.test_mock_support import chat_body, ids_body, post, running_worker
from trtllm_mock import MockWorker

FLAT = {"object": "error", "type": "BadRequestError", "param": None, "code": 400}


@pytest.fixture
async def worker() -> AsyncIterator[MockWorker]:
    async with running_worker(kv_events=False, max_seq_len=10) as w:
        yield w


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_a_schema_refusal_is_a_bare_error_string(worker: MockWorker) -> None:
    async with aiohttp.ClientSession() as s:
        status, body = await post(s, worker.url + "/v1/chat/completions", chat_body("hi", nvext={}))
    assert status == 400 and list(body) == ["error"] and isinstance(body["error"], str)
    assert "nvext" in body["error"]


async def test_the_sdk_shows_a_schema_refusal_only_in_body(worker: MockWorker) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await sdk(worker.url).chat.completions.create(model="mock-model", messages=[{"role": "user", "content": "hi"}],
                                                      extra_body={"nvext": {}})
    assert e.value.message == "Error code: 400"  # the SDK finds no message in a string
    assert isinstance(e.value.body, str) and "nvext" in e.value.body
    assert (e.value.type, e.value.code) == (None, None)


async def test_a_handler_refusal_is_the_flat_error_response(worker: MockWorker) -> None:
    async with aiohttp.ClientSession() as s:
        status, body = await post(s, worker.url + "/v1/chat/completions", ids_body(list(range(100, 109)),
                                                                                    max_tokens=5))
    assert status == 400
    assert "max_seq_len" in body.pop("message") and body == FLAT


async def test_a_handler_refusal_is_a_flat_error_response_whatever_the_validation_shape() -> None:
    async with running_worker(kv_events=False, max_seq_len=10, error_shape="legacy") as w, \
            aiohttp.ClientSession() as s:
        status, body = await post(s, w.url + "/v1/completions", {"model": "mock-model", "prompt": list(range(9)),
                                                                  "max_tokens": 5})
    assert status == 400 and "max_seq_len" in body.pop("message") and body == FLAT


async def test_the_sdk_shows_a_flat_error_responses_message(worker: MockWorker) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await sdk(worker.url).chat.completions.create(model="mock-model", messages=[], max_tokens=5,
                                                      extra_body={"prompt_token_ids": list(range(100, 109))})
    assert e.value.message.startswith("Error code: 400 - ") and "max_seq_len" in e.value.message
    assert isinstance(e.value.body, dict) and e.value.body["object"] == "error"
    assert (e.value.type, e.value.code) == ("BadRequestError", "400")


async def test_a_body_that_is_not_text_is_fastapis_detail(worker: MockWorker) -> None:
    async with aiohttp.ClientSession() as s, s.post(worker.url + "/v1/chat/completions",
                                                    data=gzip.compress(b'{"a": 1}'),
                                                    headers={"content-type": "application/json"}) as r:
        assert (r.status, await r.json()) == (400, {"detail": "There was an error parsing the body"})


async def test_an_unknown_path_and_a_wrong_method_are_fastapis_detail(worker: MockWorker) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(worker.url + "/v1/embeddings", json={}) as r:
            assert (r.status, await r.json()) == (404, {"detail": "Not Found"})
        async with s.get(worker.url + "/v1/chat/completions") as r:
            assert (r.status, await r.json()) == (405, {"detail": "Method Not Allowed"})
            assert r.headers["Allow"] == "POST"


async def test_the_sdk_shows_a_detail_body_as_is(worker: MockWorker) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        await sdk(worker.url).embeddings.create(model="mock-model", input="hi")
    assert e.value.message == "Error code: 404" and e.value.body == {"detail": "Not Found"}


async def test_the_sdk_shows_the_pickers_own_error_object_in_full() -> None:
    from epp_extproc.envoy.errors import HttpError

    picker_error = HttpError(503, "endpoint picker overloaded", "overloaded", openai=True)

    async def answer(_: web.Request) -> web.Response:
        return web.Response(status=picker_error.status, body=picker_error.body(), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        with pytest.raises(openai.InternalServerError) as e:
            await sdk(f"http://127.0.0.1:{port}").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}])
    finally:
        await runner.cleanup()
    assert e.value.message == "Error code: 503 - endpoint picker overloaded"
    assert e.value.body == orjson.loads(picker_error.body())["error"]
    assert (e.value.type, e.value.code) == ("server_error", "overloaded")
