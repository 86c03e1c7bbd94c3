"""Render endpoints: TensorRT-LLM response shape, strictness, and token ids equal to what inference caches."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.mock.test_mock_support import chat_body, post, running_worker
from trtllm_mock import MockWorker

OBJECT_ERROR_KEYS = {"object": "error", "type": "BadRequestError", "param": None, "code": 400}


@pytest.fixture
async def worker() -> AsyncIterator[MockWorker]:
    async with running_worker(enable_render_endpoints=True, tokens_per_block=4) as w:
        yield w


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def render(session: aiohttp.ClientSession, worker: MockWorker, body: dict) -> dict:
    status, out = await post(session, worker.url + "/v1/chat/completions/render", body)
    assert status == 200, out
    return out


@pytest.mark.parametrize("route", ["/v1/chat/completions/render", "/v1/completions/render"])
async def test_render_routes_are_404_unless_enabled(session, route):
    async with running_worker(kv_events=False) as w:
        async with session.post(w.url + route, json=chat_body("hi")) as r:
            assert r.status == 404


async def test_chat_render_answers_one_object_in_the_trtllm_shape(worker, session):
    out = await render(session, worker, chat_body("hello"))
    assert out["schema_version"] == 1 and out["kind"] == "chat"
    assert re.fullmatch(r"[0-9a-f]{64}", out["fingerprint"]["digest"])
    assert set(out["fingerprint"]) == {"digest", "compared", "info"}
    assert all(isinstance(t, int) for t in out["token_ids"]) and out["token_ids"]
    assert out["tokens_trusted"] is True and out["untrusted_reason"] is None
    assert out["context"] == {"prompt_tokens_excluded_from_usage": 0, "resolved_thinking": None}
    assert out["request"] == chat_body("hello")


async def test_render_fingerprint_equals_server_info_render_fingerprint(worker, session):
    out = await render(session, worker, chat_body("hello"))
    async with session.get(worker.url + "/server_info") as r:
        info = await r.json()
    assert out["fingerprint"] == info["render_fingerprint"]


async def test_completions_render_answers_an_array_with_one_object_per_prompt(worker, session):
    req = {"model": "mock-model", "prompt": ["first prompt", "second one"]}
    status, out = await post(session, worker.url + "/v1/completions/render", req)
    assert status == 200
    assert isinstance(out, list) and len(out) == 2
    assert [o["kind"] for o in out] == ["completion", "completion"]
    assert out[0]["token_ids"] != out[1]["token_ids"]


async def test_completions_render_of_token_ids_returns_them(worker, session):
    req = {"model": "mock-model", "prompt": [[7, 8, 9], [10, 11]]}
    _, out = await post(session, worker.url + "/v1/completions/render", req)
    assert [o["token_ids"] for o in out] == [[7, 8, 9], [10, 11]]


async def test_chat_render_of_prompt_token_ids_returns_exactly_those_ids(worker, session):
    out = await render(session, worker, chat_body("ignored", prompt_token_ids=[4, 5, 6]))
    assert out["token_ids"] == [4, 5, 6]


async def test_render_strips_nvext_and_cache_namespace(worker, session):
    out = await render(session, worker, chat_body("hi", nvext={"x": 1}, cache_namespace="ns"))
    assert "nvext" not in out["request"] and "cache_namespace" not in out["request"]
    assert out["token_ids"] == (await render(session, worker, chat_body("hi")))["token_ids"]


async def test_render_rejects_other_unknown_fields_with_the_object_error(worker, session):
    status, out = await post(session, worker.url + "/v1/chat/completions/render", chat_body("hi", routing_hint=1))
    assert status == 400
    message = out.pop("message")
    assert out == OBJECT_ERROR_KEYS
    assert "routing_hint" in message and "extra_forbidden" in message


async def test_render_rejects_multimodal_content(worker, session):
    content = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    req = {"model": "mock-model", "messages": [{"role": "user", "content": content}]}
    status, out = await post(session, worker.url + "/v1/chat/completions/render", req)
    assert status == 400
    assert out == {**OBJECT_ERROR_KEYS, "message": "Multimodal input is not supported by prompt rendering."}


async def test_render_rejects_non_object_body_with_the_object_error(worker, session):
    status, out = await post(session, worker.url + "/v1/chat/completions/render", [1, 2])
    assert status == 400
    assert out["object"] == "error" and out["code"] == 400


async def test_completions_render_rejects_cache_salt(worker, session):
    req = {"model": "mock-model", "prompt": "hi", "cache_salt": "s"}
    status, out = await post(session, worker.url + "/v1/completions/render", req)
    assert status == 400
    assert "cache_salt" in out["message"] and "extra_forbidden" in out["message"]


async def test_named_tool_choice_marks_tokens_untrusted(worker, session):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    req = chat_body("hi", tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})
    out = await render(session, worker, req)
    assert out["tokens_trusted"] is False and out["untrusted_reason"] == "named_tool_choice"


async def test_text_content_parts_render_like_the_same_plain_string(worker, session):
    parts = {"model": "mock-model", "messages": [{"role": "user", "content": [{"type": "text", "text": "a b"}]}]}
    assert (await render(session, worker, parts))["token_ids"] == (await render(session, worker, chat_body("a b")))[
        "token_ids"
    ]


async def test_identical_message_prefixes_give_identical_token_prefixes(worker, session):
    turn1 = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    turn2 = turn1 + [{"role": "assistant", "content": "Seven."}, {"role": "user", "content": "Another."}]
    short = await render(session, worker, {"model": "m", "messages": turn1, "add_generation_prompt": False})
    long = await render(session, worker, {"model": "m", "messages": turn2})
    assert long["token_ids"][: len(short["token_ids"])] == short["token_ids"]
    assert len(long["token_ids"]) > len(short["token_ids"])


async def test_render_token_ids_equal_the_blocks_inference_caches(worker, session):
    body = chat_body("The cache must hold exactly the tokens the renderer predicted, block by block.")
    rendered = (await render(session, worker, body))["token_ids"]
    status, _ = await post(session, worker.url + "/v1/chat/completions", body)
    assert status == 200
    async with session.get(worker.url + "/mock/cache") as r:
        cache = await r.json()
    chain = sorted(cache["blocks"], key=lambda b: b["position"])
    cached_tokens = [t for b in chain for t in b["token_ids"]]
    full = len(rendered) // 4 * 4
    assert cached_tokens == rendered[:full]


async def test_renderer_role_serves_render_health_and_server_info(session):
    async with running_worker(role="renderer") as w:
        async with session.get(w.url + "/health") as r:
            assert await r.json() == {"status": "ok"}
        async with session.get(w.url + "/server_info") as r:
            info = await r.json()
        status, out = await post(session, w.url + "/v1/chat/completions/render", chat_body("hi"))
    assert info["role"] == "renderer" and info["schema_version"] == 1 and info["model"] == "mock-model"
    assert info["render_fingerprint"]["digest"] == out["fingerprint"]["digest"]
    assert status == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics")],
)
async def test_renderer_role_does_not_serve_inference_or_worker_routes(session, method, path):
    async with running_worker(role="renderer") as w:
        async with session.request(method, w.url + path, json=chat_body("hi")) as r:
            assert r.status == 404
