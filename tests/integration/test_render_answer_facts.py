"""The render client reads more than token ids: the facts prompt passthrough decides on (real HTTP stub)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.integration.test_render_and_salt import StubRenderer, client

FP = {"digest": "ab" * 32, "compared": {"tokenizer": {"complete": True}}, "info": {}}
CTX = {"prompt_tokens_excluded_from_usage": 0, "resolved_thinking": None}


@pytest.fixture
async def stub() -> AsyncIterator[StubRenderer]:
    s = StubRenderer()
    await s.start()
    yield s
    await s.stop()


async def render(stub: StubRenderer, kind: str = "chat", protocol: str = "trtllm-render"):  # noqa: ANN201
    c = client(f"http://127.0.0.1:{stub.port}", protocol)
    try:
        return await c.render(kind, b"{}")
    finally:
        await c.close()


async def test_chat_answer_facts_are_read(stub: StubRenderer) -> None:
    stub.doc = {"token_ids": [1, 2], "fingerprint": FP, "tokens_trusted": True, "context": {
        "prompt_tokens_excluded_from_usage": 3, "resolved_thinking": True}}
    r = await render(stub)
    assert (r.token_ids, r.fingerprint, r.tokens_trusted, r.has_context) == ([1, 2], FP, True, True)
    assert (r.resolved_thinking, r.prompt_tokens_excluded_from_usage, r.prompts) == (True, 3, None)


async def test_an_answer_without_trust_or_context_fields_is_not_trusted(stub: StubRenderer) -> None:
    stub.doc = {"token_ids": [1, 2]}  # vLLM's shape
    r = await render(stub, protocol="vllm-render")
    assert (r.tokens_trusted, r.has_context, r.fingerprint) == (False, False, None)


async def test_completions_answer_gives_every_prompts_ids(stub: StubRenderer) -> None:
    obj = {"fingerprint": FP, "tokens_trusted": True, "context": CTX}
    stub.doc = [{**obj, "token_ids": [5, 6]}, {**obj, "token_ids": [7]}]
    r = await render(stub, "completion")
    assert (r.token_ids, r.prompts, r.tokens_trusted, r.fingerprint) == ([5, 6], [[5, 6], [7]], True, FP)


async def test_completions_answer_with_a_bad_later_prompt_still_routes_on_the_first(stub: StubRenderer) -> None:
    obj = {"fingerprint": FP, "tokens_trusted": True, "context": CTX}
    stub.doc = [{**obj, "token_ids": [5, 6]}, {**obj, "token_ids": "nope"}]
    r = await render(stub, "completion")
    assert (r.token_ids, r.prompts) == ([5, 6], None)


async def test_completions_prompts_under_different_fingerprints_have_none(stub: StubRenderer) -> None:
    obj = {"tokens_trusted": True, "context": CTX}
    stub.doc = [{**obj, "token_ids": [5], "fingerprint": FP}, {**obj, "token_ids": [7], "fingerprint": {
        **FP, "digest": "cd" * 32}}]
    assert (await render(stub, "completion")).fingerprint is None
