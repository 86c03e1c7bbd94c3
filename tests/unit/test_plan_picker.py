"""bench/plan_picker's matching of requests to the clairvoyant plan (issue 28.2, the replayed bound)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.plan_picker import Plan, body_texts, prompt_key, write_plan

WORKERS = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]


def chat(text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}], "stream": True}).encode()


def key_of(body: bytes) -> str | None:
    texts = body_texts(body)
    return prompt_key(texts) if texts is not None else None


def test_a_request_goes_to_the_worker_planned_for_its_prompt_whatever_the_arrival_order(tmp_path: Path) -> None:
    plan = Plan.load(write_plan(tmp_path / "p.json", WORKERS, ["w1 w2", "w3 w4", "w5"], [2, 0, 1]))
    assert [plan.take(key_of(chat(t))) for t in ("w5", "w1 w2", "w3 w4")] == [WORKERS[1], WORKERS[2], WORKERS[0]]
    assert plan.stats() == {"matched": 3, "unmatched": 0, "plan_entries_left": 0}


def test_identical_prompts_take_the_plan_entries_in_plan_order(tmp_path: Path) -> None:
    plan = Plan.load(write_plan(tmp_path / "p.json", WORKERS, ["same", "other", "same", "same"], [1, 0, 2, 0]))
    key = key_of(chat("same"))
    assert [plan.take(key) for _ in range(3)] == [WORKERS[1], WORKERS[2], WORKERS[0]]


def test_a_prompt_the_plan_does_not_know_is_routed_round_robin_and_counted(tmp_path: Path) -> None:
    plan = Plan.load(write_plan(tmp_path / "p.json", WORKERS, ["known"], [2]))
    assert plan.take(key_of(chat("known"))) == WORKERS[2]
    plan.take(key_of(chat("known")))  # its one entry is used up
    plan.take(key_of(b"not json"))
    assert plan.stats() == {"matched": 1, "unmatched": 2, "plan_entries_left": 0}


def test_the_key_covers_every_message_and_text_parts_read_as_their_text() -> None:
    parts = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a "},
                                                                   {"type": "text", "text": "b"}]}]}).encode()
    assert key_of(parts) == key_of(chat("a b"))
    two = json.dumps({"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": " b"}]})
    assert key_of(two.encode()) != key_of(chat("a b"))  # a message boundary is part of the prompt
