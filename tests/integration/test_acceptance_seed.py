"""Seed 000's validation table, automated: real Envoy, real ZMQ, two mock TensorRT-LLM workers, one renderer.

Each test is one row of the table. The stack is shared by the module (rows run in order, as in the seed).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest

from epp_extproc.core.plan import TRTLLM_SALT_MESSAGE
from tests.gateway_client import request
from tests.stack import GatewayStack

SYSTEM = "You are a careful assistant for the gateway team. " * 12  # ~8 blocks of 32 tokens


@pytest.fixture(scope="module")
def stack():  # noqa: ANN201
    s = GatewayStack(workers=2, worker_args=["--decode-ms-per-token", "25"]).start()
    yield s
    s.stop()


def renders(stack: GatewayStack) -> int:
    return stack.renderer.get("/mock/stats")["render_requests"]


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_plain_prefix_and_streaming_chats_all_succeed_and_prefix_repeats_stick(stack: GatewayStack) -> None:
    statuses, reported = [], 0
    for i in range(6):
        r = stack.chat(user(f"plain question number {i} about something else entirely"))
        statuses.append(r.status)
        reported += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    prefix_workers = []
    for _ in range(4):
        r = stack.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "same question"}])
        statuses.append(r.status)
        prefix_workers.append(r.headers["x-trtllm-mock-worker"])
        reported += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    status, _, events = stack.stream_chat([{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": "streamed"}])
    statuses.append(status)
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage, "the last SSE chunk carries usage"
    reported += usage[-1]["prompt_tokens_details"]["cached_tokens"]
    assert statuses == [200] * 11
    assert len(set(prefix_workers)) == 1, prefix_workers
    stack.wait_idle()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and stack.picker_metric("dynamo_epp_cached_tokens_count") < 11:
        time.sleep(0.05)
    assert stack.picker_metric("dynamo_epp_cached_tokens_count") == 11
    total = stack.picker_metric("dynamo_epp_cached_tokens_sum")
    assert total > 0
    assert total == reported
    served = sum(m.get("/mock/stats")["cached_tokens_total"] for m in stack.mocks)
    assert served == reported


@pytest.mark.parametrize("nvext", ['{"agent_hints": {"latency_sensitivity": 1.0, "osl": 64}}', "null"])
def test_nvext_through_the_gateway_is_200_and_direct_to_the_worker_is_400(stack: GatewayStack, nvext: str) -> None:
    body = ('{"model":"mock-model","messages":[{"role":"user","content":"hints"}],"max_tokens":2,"nvext":'
            + nvext + "}").encode()
    assert stack.post_raw(body).status == 200
    direct = request(stack.mocks[0].url, body=body)
    assert direct.status == 400
    assert "extra_forbidden" in direct.body.decode() and "nvext" in direct.body.decode()


@pytest.mark.parametrize("how", ["x-tenant-id", "nvext.cache_salt", "cache_salt"])
def test_salted_requests_get_400_before_any_render_call(stack: GatewayStack, how: str) -> None:
    before = renders(stack)
    doc = {"model": "mock-model", "messages": user("tenant question"), "max_tokens": 2}
    headers = {}
    if how == "x-tenant-id":
        headers["x-tenant-id"] = "tenant-a"
    elif how == "nvext.cache_salt":
        doc["nvext"] = {"cache_salt": "tenant-a"}
    else:
        doc["cache_salt"] = "tenant-a"
    r = stack.post_raw(json.dumps(doc).encode(), headers)
    assert r.status == 400
    assert r.error_message() == TRTLLM_SALT_MESSAGE
    assert renders(stack) == before


def test_unsalted_control_is_200_and_adds_exactly_one_render_call(stack: GatewayStack) -> None:
    before = renders(stack)
    assert stack.chat(user("tenant question")).status == 200
    assert renders(stack) == before + 1


def test_malformed_body_is_400(stack: GatewayStack) -> None:
    before = renders(stack)
    assert stack.post_raw(b'{"model": "mock-model", "messages": [').status == 400
    assert renders(stack) == before


def test_renderer_down_routes_by_load_and_kv_routing_resumes_when_it_is_back(stack: GatewayStack) -> None:
    stack.renderer.stop()
    failed_before = stack.picker_metric("epp_render_requests_total", 'outcome="unavailable"')
    for i in range(3):
        assert stack.chat(user(f"while the renderer is down {i}")).status == 200
    assert stack.picker_metric("epp_render_requests_total", 'outcome="unavailable"') == failed_before + 3
    stack.renderer.start()
    ok_before = stack.picker_metric("epp_render_requests_total", 'outcome="ok"')
    workers = []
    for _ in range(3):
        r = stack.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "after restart"}])
        assert r.status == 200
        workers.append(r.headers["x-trtllm-mock-worker"])
    assert stack.picker_metric("epp_render_requests_total", 'outcome="ok"') == ok_before + 3
    assert len(set(workers)) == 1  # routed by prefix again


def test_multi_turn_conversations_stick_to_their_worker_and_are_balanced(stack: GatewayStack) -> None:
    convs: dict[str, list[dict[str, str]]] = {
        "a": [{"role": "system", "content": "Conversation A is about ocean currents. " * 10}],
        "b": [{"role": "system", "content": "Conversation B is about mountain geology. " * 10}],
    }
    placed: dict[str, list[str]] = {"a": [], "b": []}

    def turn(name: str, k: int) -> None:
        convs[name].append({"role": "user", "content": f"{name} follow-up number {k}, tell me more"})
        r = stack.chat(convs[name], max_tokens=8)
        assert r.status == 200
        placed[name].append(r.headers["x-trtllm-mock-worker"])
        convs[name].append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})

    for k in range(4):
        ta = threading.Thread(target=turn, args=("a", k))
        ta.start()
        time.sleep(0.05)  # b's turn arrives while a's is in flight
        tb = threading.Thread(target=turn, args=("b", k))
        tb.start()
        ta.join()
        tb.join()
    assert len(set(placed["a"])) == 1 and len(set(placed["b"])) == 1, placed
    assert placed["a"][0] != placed["b"][0], placed
    # later turns really reused the growing prefix
    assert Counter(placed["a"] + placed["b"]) == Counter({placed["a"][0]: 4, placed["b"][0]: 4})
