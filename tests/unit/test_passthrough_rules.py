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
