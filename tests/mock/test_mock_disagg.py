"""The mock's disaggregated serving (trtllm_mock/disagg.py): two in-process workers, one context one
generation, driven with the wire shapes TensorRT-LLM's orchestrator sends (tests/fixtures/pd/)."""

from __future__ import annotations

import base64
import json
from typing import Any

import aiohttp

from tests.mock.test_mock_support import post, running_worker, subscribed
from trtllm_mock.tokenizer import output_token_ids

TPB = 4


def ids(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def ctx_body(prompt: list[int], max_tokens: int = 5, **extra: Any) -> dict[str, Any]:
    """What openai_disagg_service._get_ctx_request sends: the client's request, context_only, not streamed."""
    return {"model": "mock-model", "messages": [{"role": "user", "content": "x"}], "prompt_token_ids": prompt,
            "max_tokens": max_tokens, "stream": False,
            "disaggregated_params": {"request_type": "context_only", "disagg_request_id": 4242}, **extra}


def gen_body(prompt: list[int], ctx: dict[str, Any], max_tokens: int = 5, **extra: Any) -> dict[str, Any]:
    """What _get_gen_request sends: the context's params as generation_only, ctx_usage, prompt_token_ids."""
    dp = dict(ctx["choices"][0]["disaggregated_params"])
    dp["request_type"] = "generation_only"
    dp["ctx_usage"] = ctx["usage"]
    return {"model": "mock-model", "messages": [{"role": "user", "content": "x"}],
            "prompt_token_ids": ctx["prompt_token_ids"], "max_tokens": max_tokens,
            "disaggregated_params": dp, **extra}


async def two_legs(s: aiohttp.ClientSession, cw, gw, prompt: list[int], **extra: Any) -> tuple[dict, int, dict]:
    st, ctx = await post(s, cw.url + "/v1/chat/completions", ctx_body(prompt, **extra))
    assert st == 200, ctx
    st, gen = await post(s, gw.url + "/v1/chat/completions", gen_body(prompt, ctx, **extra))
    return ctx, st, gen


def reopaque(ctx: dict[str, Any], **changes: Any) -> dict[str, Any]:
    dp = ctx["choices"][0]["disaggregated_params"]
    doc = json.loads(base64.b64decode(dp["encoded_opaque_state"]))
    doc.update(changes)
    dp["encoded_opaque_state"] = base64.b64encode(json.dumps(doc).encode()).decode()
    return ctx


async def test_context_only_returns_the_first_token_and_handoff_params():
    prompt = ids(3 * TPB + 1)
    async with running_worker(tokens_per_block=TPB) as cw, aiohttp.ClientSession() as s:
        st, ctx = await post(s, cw.url + "/v1/chat/completions", ctx_body(prompt))
    assert st == 200, ctx
    dp = ctx["choices"][0]["disaggregated_params"]
    assert dp["request_type"] == "context_only" and dp["first_gen_tokens"] == output_token_ids(prompt, 1)
    assert dp["ctx_request_id"] == 4242 and isinstance(dp["encoded_opaque_state"], str)
    assert ctx["choices"][0]["finish_reason"] == "not_finished"
    assert ctx["prompt_token_ids"] == prompt and ctx["usage"]["completion_tokens"] == 1


async def test_generation_leg_replays_the_first_token_and_equals_the_aggregated_answer():
    prompt = ids(3 * TPB + 1)
    async with running_worker(tokens_per_block=TPB) as cw, running_worker(tokens_per_block=TPB) as gw, \
            running_worker(tokens_per_block=TPB) as agg, aiohttp.ClientSession() as s:
        ctx, st, gen = await two_legs(s, cw, gw, prompt)
        _, whole = await post(s, agg.url + "/v1/chat/completions",
                              {"model": "mock-model", "messages": [{"role": "user", "content": "x"}],
                               "prompt_token_ids": prompt, "max_tokens": 5})
    assert st == 200, gen
    assert gen["choices"][0]["message"]["content"] == whole["choices"][0]["message"]["content"]
    assert gen["usage"]["completion_tokens"] == 5 == whole["usage"]["completion_tokens"]


async def test_generation_usage_takes_prompt_and_cached_tokens_from_ctx_usage():
    prompt = ids(3 * TPB + 1)
    async with running_worker(tokens_per_block=TPB) as cw, running_worker(tokens_per_block=TPB) as gw, \
            aiohttp.ClientSession() as s:
        await post(s, cw.url + "/v1/chat/completions", {**ctx_body(prompt), "disaggregated_params": None})
        ctx, st, gen = await two_legs(s, cw, gw, prompt)
    assert ctx["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * TPB
    assert gen["usage"]["prompt_tokens_details"] == ctx["usage"]["prompt_tokens_details"]
    assert gen["usage"]["prompt_tokens"] == len(prompt)


async def test_decode_worker_publishes_the_transferred_blocks():
    prompt = ids(3 * TPB + 1)
    async with running_worker(tokens_per_block=TPB) as cw, \
            running_worker(tokens_per_block=TPB, heartbeat_interval=0.02) as gw, aiohttp.ClientSession() as s:
        async with subscribed(gw) as sub:
            await sub.synced()
            ctx, st, gen = await two_legs(s, cw, gw, prompt)
            batch = await sub.recv_events()
        async with s.get(gw.url + "/mock/cache") as r:
            cache = await r.json()
    assert st == 200, gen
    stored = [e for e in batch.events if e["type"] == "BlockStored"]
    assert sum(len(e["block_hashes"]) for e in stored) == 3 == cache["cached_blocks"]


async def test_a_handoff_is_fetched_once_then_unknown():
    prompt = ids(2 * TPB + 1)
    async with running_worker(tokens_per_block=TPB) as cw, running_worker(tokens_per_block=TPB) as gw, \
            aiohttp.ClientSession() as s:
        ctx, st, _ = await two_legs(s, cw, gw, prompt)
        st2, again = await post(s, gw.url + "/v1/chat/completions", gen_body(prompt, ctx))
    assert st == 200 and st2 == 400
    assert "Unknown or expired" in again["message"] and again["type"] == "BadRequestError"


async def test_an_expired_handoff_is_refused_and_its_blocks_released():
    prompt = ids(2 * TPB + 1)
    async with running_worker(tokens_per_block=TPB, disagg_handoff_timeout_s=0.05) as cw, \
            running_worker(tokens_per_block=TPB) as gw, aiohttp.ClientSession() as s:
        _, ctx = await post(s, cw.url + "/v1/chat/completions", ctx_body(prompt))
        import asyncio
        await asyncio.sleep(0.3)
        running = cw.engine.running
        st, gen = await post(s, gw.url + "/v1/chat/completions", gen_body(prompt, ctx))
    assert st == 400 and "Unknown or expired" in gen["message"]
    assert running == 0


async def test_a_retyped_opaque_field_is_refused_not_guessed():
    prompt = ids(2 * TPB + 1)
    async with running_worker(tokens_per_block=TPB) as cw, running_worker(tokens_per_block=TPB) as gw, \
            aiohttp.ClientSession() as s:
        _, ctx = await post(s, cw.url + "/v1/chat/completions", ctx_body(prompt))
        reopaque(ctx, w=int(json.loads(base64.b64decode(
            ctx["choices"][0]["disaggregated_params"]["encoded_opaque_state"]))["w"]))
        st, gen = await post(s, gw.url + "/v1/chat/completions", gen_body(prompt, ctx))
    assert st == 400 and "lost its type" in gen["message"]


async def test_the_opaque_state_survives_a_json_round_trip():
    prompt = ids(2 * TPB + 1)
    async with running_worker(tokens_per_block=TPB) as cw, running_worker(tokens_per_block=TPB) as gw, \
            aiohttp.ClientSession() as s:
        _, ctx = await post(s, cw.url + "/v1/chat/completions", ctx_body(prompt))
        ctx = json.loads(json.dumps(ctx))
        st, gen = await post(s, gw.url + "/v1/chat/completions", gen_body(prompt, ctx))
    assert st == 200, gen


async def test_handoff_token_ids_outside_u32_are_refused():
    prompt = ids(2 * TPB + 1)
    async with running_worker(tokens_per_block=TPB) as cw, running_worker(tokens_per_block=TPB) as gw, \
            aiohttp.ClientSession() as s:
        _, ctx = await post(s, cw.url + "/v1/chat/completions", ctx_body(prompt))
        body = gen_body(prompt, ctx)
        body["disaggregated_params"]["first_gen_tokens"] = [1 << 32]
        st, gen = await post(s, gw.url + "/v1/chat/completions", body)
        body["disaggregated_params"]["first_gen_tokens"] = [2.5]
        st2, _ = await post(s, gw.url + "/v1/chat/completions", body)
    assert st == 400 and "u32" in gen["message"] and st2 == 400


async def test_logprob_of_the_first_token_is_replayed_only_if_the_context_computed_it():
    prompt = ids(2 * TPB + 1)
    async with running_worker(tokens_per_block=TPB) as cw, running_worker(tokens_per_block=TPB) as gw, \
            aiohttp.ClientSession() as s:
        _, with_lp, gen_lp = await two_legs(s, cw, gw, prompt, logprobs=True)
        _, without, gen_none = await two_legs(s, cw, gw, ids(2 * TPB + 1, 5000))
    assert gen_lp["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5
    assert gen_none["choices"][0]["logprobs"] is None


async def test_a_request_without_handoff_on_a_decode_worker_is_served_aggregated():
    prompt = ids(2 * TPB + 1)
    async with running_worker(tokens_per_block=TPB) as gw, aiohttp.ClientSession() as s:
        st, body = await post(s, gw.url + "/v1/chat/completions",
                              {"model": "mock-model", "messages": [{"role": "user", "content": "x"}],
                               "prompt_token_ids": prompt, "max_tokens": 3})
    assert st == 200 and body["usage"]["completion_tokens"] == 3


async def test_a_stop_token_first_makes_the_context_answer_final():
    prompt = ids(2 * TPB + 1)
    first = output_token_ids(prompt, 1)[0]
    async with running_worker(tokens_per_block=TPB) as cw, aiohttp.ClientSession() as s:
        st, ctx = await post(s, cw.url + "/v1/chat/completions", ctx_body(prompt, stop_token_ids=[first]))
    assert st == 200 and ctx["choices"][0]["finish_reason"] == "stop"
    assert "disaggregated_params" not in ctx["choices"][0]


async def test_a_generation_leg_waits_for_kv_room_taken_by_running_requests():
    """A generation worker whose cache is momentarily full queues the transferred context until running
    requests free room, as TensorRT-LLM's scheduler fits a generation-init request only when its KV fits
    (tensorrt_llm/_torch/pyexecutor/py_executor.py `_prepare_disagg_gen_init(fitting_disagg_gen_init_requests)`
    @9521caf); it is not refused. The mock's aggregated and context-only requests wait the same way."""
    import asyncio

    prompt = ids(3 * TPB + 1)
    async with running_worker(tokens_per_block=TPB) as cw, \
            running_worker(tokens_per_block=TPB, num_blocks=8, decode_ms_per_token=50.0) as gw, \
            aiohttp.ClientSession() as s:
        hog = asyncio.create_task(post(s, gw.url + "/v1/chat/completions",
                                       {"model": "mock-model", "messages": [{"role": "user", "content": "x"}],
                                        "prompt_token_ids": ids(20, 9000), "max_tokens": 8}))
        await asyncio.sleep(0.1)
        _, ctx = await post(s, cw.url + "/v1/chat/completions", ctx_body(prompt))
        st, gen = await post(s, gw.url + "/v1/chat/completions", gen_body(prompt, ctx))
        hog_status, _ = await hog
    assert hog_status == 200
    assert st == 200, gen
    assert gen["usage"]["completion_tokens"] == 5


async def test_unknown_disaggregated_params_fields_are_refused():
    async with running_worker(tokens_per_block=TPB) as cw, aiohttp.ClientSession() as s:
        body = ctx_body(ids(9))
        body["disaggregated_params"]["surprise"] = 1
        st, err = await post(s, cw.url + "/v1/chat/completions", body)
    assert st == 400 and "surprise" in err["message"]


async def test_the_context_answer_uses_only_fields_of_trtllm_serves_response_classes():
    from pathlib import Path
    fix = json.loads((Path(__file__).parents[1] / "fixtures" / "pd" / "trtllm_chat.json").read_text())
    async with running_worker(tokens_per_block=TPB) as cw, aiohttp.ClientSession() as s:
        _, ctx = await post(s, cw.url + "/v1/chat/completions", ctx_body(ids(9), logprobs=True))
    assert set(ctx) <= set(fix["chat_response_fields"])
    assert set(ctx["choices"][0]) <= set(fix["chat_choice_fields"])
    assert set(ctx["choices"][0]["disaggregated_params"]) <= set(fix["disaggregated_params_fields"])
