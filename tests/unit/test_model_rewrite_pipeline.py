"""The model rewrite inside the decision: applied before the render and the scoring (a LoRA target is hashed
and rendered as the adapter), forwarded byte-preservingly, counted only when committed."""

from __future__ import annotations

import random

import pytest

from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.model_rewrite import (
    CONVERSATION_HEADER,
    ModelRewriter,
    RewriteRules,
    RewriteTable,
    Rule,
    Target,
)
from tests.scheduling_fakes import Decider, FakeKv, FakeRenderer, chat, decide, make


def with_rules(*rules: Rule) -> tuple[Decider, FakeRenderer, FakeKv]:
    pipe, r, kv = make()
    pipe.rewriter = ModelRewriter(RewriteTable(RewriteRules(rules)), random.Random(1))
    return pipe, r, kv


TO_LORA = Rule("lora-rollout", frozenset({"base"}), (Target("tenant-lora", 1),))


def count(pipe: Decider, *labels: str) -> float:
    return pipe.metrics.model_rewrites.labels(*labels)._value.get()


async def test_the_target_is_what_the_worker_receives_and_every_other_byte_is_the_clients() -> None:
    pipe, _, _ = with_rules(TO_LORA)
    body = b'{ "model" : "base",\n  "messages": [{"role":"user","content":"caf\\u00e9 \xc3\xa9"}], "top_p":1.00}'
    d = await decide(pipe, chat(body))
    assert d.body == body.replace(b'"base"', b'"tenant-lora"')
    assert d.model == "tenant-lora"
    d.booking.free()


async def test_a_lora_target_is_scored_under_the_adapters_identity_and_rendered_under_its_base() -> None:
    pipe, r, kv = with_rules(TO_LORA)
    p = await pipe.propose(chat(b'{"model":"base","messages":[]}'))
    assert kv.models == ["tenant-lora"]  # the KV identity is the adapter's
    assert b'"model":"base-model"' in r.bodies[-1]  # FakeKv: tenant-lora's base is base-model
    assert p.plan.model == "tenant-lora"


async def test_nvext_is_still_dropped_from_a_rewritten_body() -> None:
    pipe, _, _ = with_rules(TO_LORA)
    p = await pipe.propose(chat(b'{"model":"base","nvext":{"a":1},"messages":[]}'))
    assert p.body == b'{"model":"tenant-lora","messages":[]}'


async def test_a_model_without_a_rule_is_forwarded_as_the_same_bytes_and_not_counted() -> None:
    pipe, _, _ = with_rules(TO_LORA)
    body = b'{"model":"other","messages":[]}'
    d = await decide(pipe, chat(body))
    assert d.body == body
    assert list(pipe.metrics.model_rewrites.collect()[0].samples) == []
    d.booking.free()


async def test_a_rewrite_is_counted_by_rule_model_and_target_only_when_committed() -> None:
    pipe, _, _ = with_rules(TO_LORA)
    p = await pipe.propose(chat(b'{"model":"base","messages":[]}'))
    assert count(pipe, "lora-rollout", "base", "tenant-lora") == 0  # /debug/score proposes, never commits
    assert pipe.explain(p)["model_rewrite"] == {"rewrite": "lora-rollout", "model": "base", "target": "tenant-lora"}
    pipe.commit(p).booking.free()
    assert count(pipe, "lora-rollout", "base", "tenant-lora") == 1


async def test_the_session_header_keeps_a_conversation_on_one_target_through_the_pipeline() -> None:
    split = Rule("canary", frozenset({"base"}), (Target("base", 50), Target("tenant-lora", 50)))
    pipe, _, _ = with_rules(split)
    for s in range(20):
        headers = {CONVERSATION_HEADER: [f"conv-{s}"]}
        models = {(await pipe.propose(chat(b'{"model":"base","messages":[]}', headers))).model for _ in range(4)}
        assert len(models) == 1


async def test_a_body_too_deep_to_splice_is_a_400_and_books_nothing() -> None:
    pipe, _, kv = with_rules(TO_LORA)
    body = b'{"model":"base","x":' + b"[" * 1000 + b"]" * 1000 + b"}"
    with pytest.raises(PickError) as e:
        await decide(pipe, chat(body))
    assert e.value.problem is Problem.BAD_REQUEST
    assert pipe.load.total_inflight() == 0 and kv.predicted == []


async def test_a_configured_session_header_keeps_a_conversation_on_one_target_and_the_default_no_longer_does() -> None:
    """--model-rewrite-session-header x-conversation: that header pins the target; x-session-id is then just a
    header, so requests carrying only it are drawn at random again."""
    split = Rule("canary", frozenset({"base"}), (Target("base", 50), Target("tenant-lora", 50)))
    pipe, _, _ = make()
    pipe.rewriter = ModelRewriter(RewriteTable(RewriteRules((split,))), random.Random(1),
                                  session_header="X-Conversation")
    for s in range(20):
        headers = {"x-conversation": [f"conv-{s}"]}
        models = {(await pipe.propose(chat(b'{"model":"base","messages":[]}', headers))).model for _ in range(4)}
        assert len(models) == 1
    default = {CONVERSATION_HEADER: ["one-conversation"]}
    drawn = {(await pipe.propose(chat(b'{"model":"base","messages":[]}', default))).model for _ in range(20)}
    assert drawn == {"base", "tenant-lora"}
