"""The prompt-passthrough verdict, rule by rule (core/passthrough.py); end to end: test_passthrough.py."""

from __future__ import annotations

from typing import Any

import pytest

from epp_extproc.core.passthrough import FingerprintId, decide, fingerprint_id, fingerprints_match
from epp_extproc.core.render import Rendered

FP = {"digest": "ab" * 32, "compared": {"tokenizer": {"complete": True}, "use_harmony": False}, "info": {}}
WORKER = FingerprintId("ab" * 32, True)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def rendered(**kw: Any) -> Rendered:
    base: dict[str, Any] = {"token_ids": [1, 2, 3], "fingerprint": FP, "tokens_trusted": True,
                            "has_context": True}
    return Rendered(**{**base, **kw})


def chat(r: Rendered | None = None, worker: FingerprintId | None = WORKER, **kw: Any):  # noqa: ANN201
    return decide(kw.pop("policy", "auto"), "chat", kw.pop("values", CHAT), r if r is not None else rendered(),
                  salted_load_only=kw.pop("salted", False), worker=worker)


def test_matching_fingerprint_forwards_prompt_token_ids_for_chat() -> None:
    v = chat()
    assert (v.forward, v.reason, v.inject) == ("tokens", "ok", {"prompt_token_ids": [1, 2, 3]})


def test_policy_off_forwards_the_original_body() -> None:
    assert (chat(policy="off").forward, chat(policy="off").reason) == ("original", "off")


@pytest.mark.parametrize("worker", [None, FingerprintId("cd" * 32, True), FingerprintId("ab" * 32, False)])
def test_unknown_different_or_incomplete_worker_fingerprint_is_a_mismatch(worker: FingerprintId | None) -> None:
    assert chat(worker=worker).reason == "fingerprint_mismatch"


@pytest.mark.parametrize("fp", [None, {"digest": "ab" * 32}, {"digest": "ab" * 32, "compared": {
    "tokenizer": {"complete": False}}}, {"compared": {"tokenizer": {"complete": True}}}])
def test_missing_or_incomplete_renderer_fingerprint_is_a_mismatch(fp: Any) -> None:
    assert chat(rendered(fingerprint=fp)).reason == "fingerprint_mismatch"


def test_harmony_fingerprint_counts_as_complete() -> None:
    fp = {"digest": "ee", "compared": {"use_harmony": True}}
    assert fingerprints_match(FingerprintId("ee", True), fingerprint_id(fp))


def test_untrusted_tokens_forward_the_original_body() -> None:
    assert chat(rendered(tokens_trusted=False)).reason == "untrusted"


@pytest.mark.parametrize("kw", [{"resolved_thinking": True}, {"resolved_thinking": False},
                                {"prompt_tokens_excluded_from_usage": 2}, {"has_context": False}])
def test_non_trivial_or_absent_render_context_forwards_the_original_body(kw: dict[str, Any]) -> None:
    assert chat(rendered(**kw)).reason == "context"


def test_salted_load_only_request_forwards_the_original_body() -> None:
    v = decide("auto", "chat", CHAT, None, salted_load_only=True, worker=WORKER)
    assert (v.forward, v.reason, v.inject) == ("original", "salted_load_only", {})


def test_failed_render_forwards_the_original_body() -> None:
    assert decide("auto", "chat", CHAT, None, salted_load_only=False, worker=WORKER).reason == "render_failed"


def completion(prompt: Any, prompts: list[list[int]] | None, **values: Any):  # noqa: ANN201
    r = rendered(token_ids=(prompts or [[9]])[0], prompts=prompts)
    return decide("auto", "completion", {"model": "m", "prompt": prompt, **values}, r, salted_load_only=False,
                  worker=WORKER)


def test_one_completions_prompt_is_forwarded_as_a_list_of_ints() -> None:
    assert completion("hello", [[4, 5]]).inject == {"prompt": [4, 5]}


def test_several_completions_prompts_are_forwarded_as_a_list_of_lists() -> None:
    assert completion(["a", "b"], [[4], [5, 6]]).inject == {"prompt": [[4], [5, 6]]}


@pytest.mark.parametrize(("prompt", "prompts"), [(["a", "b"], [[4]]), (["a", "b"], None)])
def test_completions_render_that_missed_a_prompt_forwards_the_original(prompt: Any, prompts: Any) -> None:
    assert completion(prompt, prompts).reason == "partial_render"


def test_completions_with_echo_forward_the_original_body() -> None:
    assert completion("hello", [[4, 5]], echo=True).reason == "echo"


def test_ids_the_client_already_sent_are_not_injected_again() -> None:
    v = chat(values={**CHAT, "prompt_token_ids": [1, 2, 3]})
    assert (v.forward, v.inject) == ("tokens", {})
    assert completion([4, 5], [[4, 5]]).inject == {}


class MatchingRenderer:
    """A TensorRT-LLM renderer whose answer allows passthrough (trusted, trivial context, complete fp)."""

    protocol = "trtllm-render"

    def __init__(self, n_ids: int) -> None:
        self.n_ids = n_ids

    async def render(self, kind: str, body: bytes, *, count: bool = True) -> Rendered:
        return rendered(token_ids=list(range(10_000, 10_000 + self.n_ids)))


async def propose_chat(n_ids: int, max_body_bytes: int):  # noqa: ANN201
    from epp_extproc.config import Config
    from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
    from epp_extproc.core.load import LoadTracker
    from epp_extproc.core.request import RequestContext
    from epp_extproc.metrics import PickerMetrics
    from tests.scheduling_fakes import build_decider

    reg = EndpointRegistry()
    reg.replace([Endpoint("w0", "127.0.0.1:9")])
    metrics = PickerMetrics()
    cfg = Config(tokenizer_protocol="trtllm-render", tokenizer_service_url="http://127.0.0.1:1",
                 max_body_bytes=max_body_bytes, max_buffered_body_bytes=max_body_bytes)
    pipe = build_decider(cfg, reg, LoadTracker(metrics.endpoint_inflight), metrics, renderer=MatchingRenderer(n_ids),
                    fingerprint_of=lambda _: WORKER)
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    return await pipe.propose(RequestContext("POST", "/v1/chat/completions", {}, body)), body


async def test_pipeline_injects_the_ids_after_the_pick() -> None:
    p, body = await propose_chat(3, 1 << 20)
    assert p.body == body[:-1] + b',"prompt_token_ids":[10000, 10001, 10002]}'
    assert (p.passthrough.forward, p.passthrough.reason) == ("tokens", "ok")  # type: ignore[union-attr]


async def test_ids_that_would_push_the_body_past_the_size_limit_are_not_injected() -> None:
    p, body = await propose_chat(1000, 2000)
    assert p.body == body
    assert (p.passthrough.forward, p.passthrough.reason) == ("original", "too_large")  # type: ignore[union-attr]
