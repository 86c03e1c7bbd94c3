"""The mock's inference API is as strict as trtllm-serve: unknown fields, bad salts and bad types are 400s."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.mock.test_mock_support import chat_body, ids_body, post, running_worker
from trtllm_mock import MockWorker
from trtllm_mock.schema import RequestValidationError, validate_chat, validate_completion

CACHE_SALT_MSG = "Parameter 'cache_salt' must be a non-empty string if provided."


@pytest.fixture
async def worker() -> AsyncIterator[MockWorker]:
    async with running_worker(kv_events=False) as w:
        yield w


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.mark.parametrize("value", [None, {"backend_instance_id": 3}])
async def test_top_level_nvext_on_chat_is_400_error_naming_it(worker, session, value):
    status, body = await post(session, worker.url + "/v1/chat/completions", chat_body("hi", nvext=value))
    assert status == 400
    assert list(body) == ["error"]
    assert "nvext" in body["error"] and "extra_forbidden" in body["error"]


async def test_top_level_nvext_on_completions_is_400(worker, session):
    req = {"model": "mock-model", "prompt": "hi", "nvext": None}
    status, body = await post(session, worker.url + "/v1/completions", req)
    assert status == 400
    assert "nvext" in body["error"] and "extra_forbidden" in body["error"]


async def test_every_unknown_field_is_named_in_the_error(worker, session):
    status, body = await post(session, worker.url + "/v1/chat/completions", chat_body("hi", foo=1, bar=2))
    assert status == 400
    assert "2 validation errors" in body["error"]
    assert "\nfoo\n" in body["error"] and "\nbar\n" in body["error"]


async def test_legacy_error_shape_is_the_openai_error_object():
    async with running_worker(kv_events=False, error_shape="legacy") as w, aiohttp.ClientSession() as s:
        status, body = await post(s, w.url + "/v1/chat/completions", chat_body("hi", nvext={}))
    assert status == 400
    message = body.pop("message")
    assert body == {"object": "error", "type": "BadRequestError", "param": None, "code": 400}
    assert "nvext" in message and "extra_forbidden" in message


@pytest.mark.parametrize("salt", ["", "   ", 7])
async def test_cache_salt_must_be_a_non_empty_string(worker, session, salt):
    status, body = await post(session, worker.url + "/v1/chat/completions", chat_body("hi", cache_salt=salt))
    assert status == 400
    assert CACHE_SALT_MSG in body["error"]


async def test_null_cache_salt_counts_as_absent(worker, session):
    status, _ = await post(session, worker.url + "/v1/chat/completions", chat_body("hi", cache_salt=None))
    assert status == 200


async def test_completions_has_no_cache_salt_field(worker, session):
    req = {"model": "mock-model", "prompt": "hi", "cache_salt": "tenant-a"}
    status, body = await post(session, worker.url + "/v1/completions", req)
    assert status == 400
    assert "cache_salt" in body["error"] and "extra_forbidden" in body["error"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_non_json_body_is_400(worker, session, route):
    async with session.post(worker.url + route, data=b"{not json", headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        assert "JSON" in (await r.json())["error"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("payload", [[1, 2], "text", 3])
async def test_non_object_json_body_is_400(worker, session, route, payload):
    status, body = await post(session, worker.url + route, payload)
    assert status == 400
    assert "valid dictionary" in body["error"]


@pytest.mark.parametrize("max_tokens", [0, -1, "5", 1.5, True])
async def test_max_tokens_must_be_an_integer_of_at_least_one(worker, session, max_tokens):
    status, body = await post(session, worker.url + "/v1/chat/completions", chat_body("hi", max_tokens=max_tokens))
    assert status == 400
    assert "max_tokens" in body["error"]


@pytest.mark.parametrize(
    "messages",
    ["hello", [{"content": "no role"}], [{"role": 3, "content": "x"}], ["just a string"], [{"role": "user", "content": 5}]],
)
async def test_messages_must_be_a_list_of_role_content_objects(worker, session, messages):
    req = {"model": "mock-model", "messages": messages}
    status, body = await post(session, worker.url + "/v1/chat/completions", req)
    assert status == 400
    assert "messages" in body["error"]


async def test_model_field_is_required(worker, session):
    status, body = await post(session, worker.url + "/v1/completions", {"prompt": "hi"})
    assert status == 400
    assert "model" in body["error"] and "missing" in body["error"]


async def test_stream_options_without_stream_is_rejected(worker, session):
    req = chat_body("hi", stream_options={"include_usage": True})
    status, body = await post(session, worker.url + "/v1/chat/completions", req)
    assert status == 400
    assert "stream_options can only be set if stream is true" in body["error"]


async def test_unknown_stream_option_is_extra_forbidden(worker, session):
    req = chat_body("hi", stream=True, stream_options={"include_usage": True, "chunk_size": 3})
    status, body = await post(session, worker.url + "/v1/chat/completions", req)
    assert status == 400
    assert "stream_options.chunk_size" in body["error"] and "extra_forbidden" in body["error"]


async def test_named_tool_choice_without_tools_is_rejected(worker, session):
    req = chat_body("hi", tool_choice={"type": "function", "function": {"name": "f"}})
    status, body = await post(session, worker.url + "/v1/chat/completions", req)
    assert status == 400
    assert "`tools` must be set" in body["error"]


async def test_prompt_token_ids_out_of_vocabulary_are_rejected(worker, session):
    status, body = await post(session, worker.url + "/v1/chat/completions", ids_body([1, 2, 10**9]))
    assert status == 400
    assert "prompt_token_ids" in body["error"]


async def test_request_longer_than_max_seq_len_is_rejected():
    async with running_worker(kv_events=False, max_seq_len=10) as w, aiohttp.ClientSession() as s:
        status, body = await post(s, w.url + "/v1/chat/completions", ids_body(list(range(100, 109)), max_tokens=5))
    assert status == 400
    assert "max_seq_len" in body["message"]  # a handler refusal: the flat ErrorResponse


async def test_known_openai_and_trtllm_fields_are_accepted(worker, session):
    """Negative control: strictness must not turn into rejecting legitimate requests."""
    req = chat_body(
        "hi",
        temperature=0.2,
        top_p=0.9,
        top_k=5,
        seed=1,
        stop=["\n"],
        n=1,
        user="u",
        frequency_penalty=0.0,
        presence_penalty=0.0,
        ignore_eos=True,
        min_tokens=0,
        add_generation_prompt=True,
        chat_template_kwargs={"enable_thinking": False},
        cache_salt="tenant-a",
        priority=0.5,
        max_completion_tokens=3,
        logprobs=False,
    )
    status, body = await post(session, worker.url + "/v1/chat/completions", req)
    assert status == 200, body
    completion = {"model": "mock-model", "prompt": [5, 6, 7], "max_tokens": 2, "echo": False, "top_k": 2, "seed": 3}
    status, body = await post(session, worker.url + "/v1/completions", completion)
    assert status == 200, body


async def test_chat_prompt_token_ids_skip_templating(worker, session):
    ids = [500 + i for i in range(40)]
    status, body = await post(session, worker.url + "/v1/chat/completions", ids_body(ids))
    assert status == 200
    assert body["usage"]["prompt_tokens"] == 40
    async with session.get(worker.url + "/mock/cache") as r:
        cache = await r.json()
    assert cache["blocks"][0]["token_ids"] == ids[:32]


async def test_max_tokens_is_honoured_and_output_is_deterministic(worker, session):
    _, first = await post(session, worker.url + "/v1/chat/completions", chat_body("same prompt", max_tokens=7))
    _, second = await post(session, worker.url + "/v1/chat/completions", chat_body("same prompt", max_tokens=7))
    assert first["usage"]["completion_tokens"] == 7
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


def _error_text(validate, body) -> str:  # noqa: ANN001
    with pytest.raises(RequestValidationError) as e:
        validate(body)
    return str(e.value)


def test_schema_errors_keep_the_exact_pydantic_text_in_body_field_order():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 3}, {"x": 1}]}],
            "nvext": None, "max_tokens": "5"}
    assert _error_text(validate_chat, body) == (
        "4 validation errors for ChatCompletionRequest\n"
        "nvext\n  Extra inputs are not permitted [type=extra_forbidden, input_value=None, input_type=NoneType]\n"
        "max_tokens\n  Input should be a valid integer [type=int_type, input_value='5', input_type=str]\n"
        "messages.0.content.0.text\n  Input should be a valid string [type=string_type, input_value=3, input_type=int]\n"
        "messages.0.content.1.type\n  Field required [type=missing, input_value={'x': 1}, input_type=dict]")


def test_completion_token_ids_are_located_without_the_union_branch():
    assert _error_text(validate_completion, {"model": "m", "prompt": [[1], [10**9]]}) == (
        "1 validation error for CompletionRequest\nprompt.1.0\n  Value error, token id 1000000000 is outside the "
        "vocabulary [0, 32000) [type=value_error, input_value=1000000000, input_type=int]")


def test_whole_body_rules_are_checked_only_once_every_field_is_valid():
    """As pydantic (so trtllm-serve) runs an after-model validator: a bad field hides the tool_choice rule."""
    bad = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0, "tool_choice": {"a": 1}}
    assert "`tools` must be set" not in _error_text(validate_chat, bad)
    assert "`tools` must be set" in _error_text(validate_chat, {**bad, "max_tokens": 1})
