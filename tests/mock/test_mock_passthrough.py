"""Pre-tokenized prompts: what a worker does with `prompt_token_ids` (the picker's passthrough relies on it).

A worker must render (template + tokenize, at a CPU cost per character) a prompt it gets as text, skip that
for a prompt it gets as ids, answer identically for the same ids either way, and refuse what TensorRT-LLM
refuses: a named tool_choice with prompt_token_ids, prompt_token_ids without messages, ids outside the
vocabulary. Its fingerprint must change with the rendering configuration.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.mock.test_mock_support import chat_body, post, running_worker
from trtllm_mock import MockWorker
from trtllm_mock.tokenizer import VOCAB_SIZE

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def render_ids(session: aiohttp.ClientSession, w: MockWorker, body: dict[str, Any]) -> list[int]:
    status, out = await post(session, w.url + "/v1/chat/completions/render", body)
    assert status == 200, out
    return out["token_ids"]


async def stats(session: aiohttp.ClientSession, w: MockWorker) -> dict[str, Any]:
    async with session.get(w.url + "/mock/stats") as r:
        return (await r.json())["render"]


def answer(doc: dict[str, Any]) -> tuple[Any, ...]:
    """What must not depend on how the prompt arrived: the text of every choice and the usage."""
    return tuple(c.get("message", {}).get("content", c.get("text")) for c in doc["choices"]), doc["usage"]


async def test_chat_answer_is_the_same_with_prompt_token_ids_as_with_messages(session):
    async with running_worker(enable_render_endpoints=True, kv_events=False) as w:
        body = chat_body("tell me about caches", max_tokens=6)
        ids = await render_ids(session, w, body)
        s1, templated = await post(session, w.url + "/v1/chat/completions", body)
        s2, pretokenized = await post(session, w.url + "/v1/chat/completions", {**body, "prompt_token_ids": ids})
    assert (s1, s2) == (200, 200)
    assert answer(templated) == answer(pretokenized)
    assert templated["usage"]["prompt_tokens"] == len(ids)


async def test_render_cost_is_paid_for_text_and_skipped_for_ids(session):
    prompt = "word " * 2000  # 10k characters at 5 us each: 50 ms of CPU
    async with running_worker(enable_render_endpoints=True, kv_events=False, render_us_per_char=5.0) as w:
        body = chat_body(prompt)
        ids = await render_ids(session, w, body)  # the render route pays too: it templates the same way
        after_render = await stats(session, w)
        await post(session, w.url + "/v1/chat/completions", {**body, "prompt_token_ids": ids})
        after_ids = await stats(session, w)
        await post(session, w.url + "/v1/chat/completions", body)
        after_text = await stats(session, w)
    assert after_render["rendered_requests"] == 1 and after_render["render_wall_seconds_total"] >= 0.05
    assert after_ids["pretokenized_requests"] == 1
    assert after_ids["render_wall_seconds_total"] == after_render["render_wall_seconds_total"]
    assert after_text["rendered_requests"] == 2
    assert after_text["rendered_chars_total"] > 2 * len(prompt)
    assert after_text["render_cpu_seconds_total"] > after_ids["render_cpu_seconds_total"]


async def test_completions_prompt_as_ids_skips_the_render_cost(session):
    async with running_worker(kv_events=False, render_us_per_char=1.0) as w:
        await post(session, w.url + "/v1/completions", {"model": "mock-model", "prompt": "some text"})
        await post(session, w.url + "/v1/completions", {"model": "mock-model", "prompt": [101, 102]})
        st = await stats(session, w)
    assert (st["rendered_requests"], st["pretokenized_requests"], st["rendered_chars_total"]) == (1, 1, 9)


async def test_named_tool_choice_with_prompt_token_ids_is_a_400(session):
    async with running_worker(enable_render_endpoints=True, kv_events=False) as w:
        body = chat_body("weather?", tools=TOOLS, tool_choice=NAMED)
        ids = await render_ids(session, w, body)
        ok, _ = await post(session, w.url + "/v1/chat/completions", body)
        status, err = await post(session, w.url + "/v1/chat/completions", {**body, "prompt_token_ids": ids})
    assert ok == 200
    assert status == 400 and "tool_choice" in err["error"] and "prompt_token_ids" in err["error"]


async def test_prompt_token_ids_do_not_make_messages_optional(session):
    async with running_worker(kv_events=False) as w:
        status, err = await post(session, w.url + "/v1/chat/completions",
                                 {"model": "mock-model", "prompt_token_ids": [101, 102]})  # fmt: skip
    assert status == 400 and "messages" in err["error"] and "Field required" in err["error"]


@pytest.mark.parametrize("bad", [VOCAB_SIZE, -1])
async def test_prompt_token_ids_outside_the_vocabulary_are_a_400(session, bad):
    async with running_worker(kv_events=False) as w:
        status, err = await post(session, w.url + "/v1/chat/completions", chat_body("x", prompt_token_ids=[5, bad]))
    assert status == 400 and "vocabulary" in err["error"]


async def test_completions_with_several_prompts_answer_one_choice_per_prompt_either_way(session):
    async with running_worker(enable_render_endpoints=True, kv_events=False) as w:
        body = {"model": "mock-model", "prompt": ["first prompt", "the second"], "max_tokens": 3}
        status, rendered = await post(session, w.url + "/v1/completions/render", body)
        ids = [o["token_ids"] for o in rendered]
        s1, text = await post(session, w.url + "/v1/completions", body)
        s2, pretok = await post(session, w.url + "/v1/completions", {**body, "prompt": ids})
    assert (status, s1, s2) == (200, 200, 200)
    assert [c["index"] for c in text["choices"]] == [0, 1]
    assert answer(text) == answer(pretok)
    assert text["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])


async def test_completions_render_objects_carry_their_own_prompt_as_ids(session):
    async with running_worker(enable_render_endpoints=True, kv_events=False) as w:
        _, out = await post(session, w.url + "/v1/completions/render", {"model": "mock-model", "prompt": ["a", "b c"]})
    assert [o["request"]["prompt"] for o in out] == [o["token_ids"] for o in out]
    assert all(o["tokens_trusted"] for o in out)


async def test_fingerprint_changes_with_the_chat_template_and_so_do_the_ids(session):
    async with running_worker(enable_render_endpoints=True, kv_events=False) as a, \
            running_worker(enable_render_endpoints=True, kv_events=False, chat_template="chatml-bos") as b:
        ids_a = await render_ids(session, a, chat_body("same words"))
        ids_b = await render_ids(session, b, chat_body("same words"))
        async with session.get(a.url + "/server_info") as r:
            fa = (await r.json())["render_fingerprint"]
        async with session.get(b.url + "/server_info") as r:
            fb = (await r.json())["render_fingerprint"]
    assert ids_a != ids_b and ids_b[1:] == ids_a
    assert fa["digest"] != fb["digest"]


async def test_an_incomplete_tokenizer_identity_is_reported_in_the_fingerprint(session):
    async with running_worker(kv_events=False) as a, \
            running_worker(kv_events=False, tokenizer_identity_complete=False) as b:
        async with session.get(a.url + "/server_info") as r:
            fa = (await r.json())["render_fingerprint"]
        async with session.get(b.url + "/server_info") as r:
            fb = (await r.json())["render_fingerprint"]
    assert fa["compared"]["tokenizer"]["complete"] is True
    assert fb["compared"]["tokenizer"]["complete"] is False and fa["digest"] != fb["digest"]


async def test_render_context_reports_the_configured_usage_exclusion_and_thinking(session):
    async with running_worker(enable_render_endpoints=True, kv_events=False,
                              prompt_tokens_excluded_from_usage=3) as w:  # fmt: skip
        _, out = await post(session, w.url + "/v1/chat/completions/render",
                            chat_body("x", chat_template_kwargs={"enable_thinking": True}))  # fmt: skip
    assert out["context"] == {"prompt_tokens_excluded_from_usage": 3, "resolved_thinking": True}


def test_generated_text_does_not_depend_on_which_prompt_words_the_process_tokenized_before():
    """The prompt piece ' w212' and the output word ' under' share an id: tokenizing the prompt first (what a
    worker that renders does, and one that gets prompt_token_ids does not) must not change the answer text."""
    import subprocess
    import sys

    code = ("from trtllm_mock.tokenizer import tokenize, piece_id, detokenize\n"
            "tokenize('x w212')\n"
            "print(detokenize([piece_id(' under')]))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout == " under\n"
