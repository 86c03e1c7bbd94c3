"""propose() changes nothing and commit() cannot fail: no failing request leaves a booking or a prediction."""

from __future__ import annotations

import json
from typing import Any

import pytest

from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.render import RenderError, RenderFailure
from epp_extproc.core.request import RequestContext
from tests.scheduling_fakes import chat, decide, make


def deep_nvext_body(depth: int = 1000) -> bytes:
    """Nested deeper than the stdlib's recursion allows, yet within orjson's limit: parses, then the
    byte-preserving rewrite (which must drop `nvext`) fails."""
    return b'{"nvext":{},"messages":[],"x":' + b"[" * depth + b"]" * depth + b"}"


FAILURES: list[tuple[str, dict[str, Any], Any, Problem]] = [
    ("malformed", {}, lambda p, r, kv: chat(b"{"), Problem.BAD_REQUEST),
    ("gzip", {}, lambda p, r, kv: chat(b"\x1f\x8b", {"content-encoding": ["gzip"]}), Problem.UNSUPPORTED_ENCODING),
    ("salt", {}, lambda p, r, kv: chat(b'{"messages":[]}', {"x-tenant-id": ["t"]}), Problem.SALT_REJECTED),
    ("render", {"render_failure_policy": "fail"},
     lambda p, r, kv: (setattr(r, "fail", RenderError(RenderFailure.TIMEOUT, "slow")), chat(b'{"messages":[]}'))[1],
     Problem.RENDER_FAILED),
    ("no endpoint", {}, lambda p, r, kv: RequestContext("POST", "/v1/chat/completions", {}, b'{"messages":[]}',
                                                         ["10.9.9.9:1"]), Problem.NO_ENDPOINT),
    ("rewrite", {}, lambda p, r, kv: chat(deep_nvext_body()), Problem.BAD_REQUEST),
]


@pytest.mark.parametrize(("name", "cfg", "make_ctx", "problem"), FAILURES, ids=[f[0] for f in FAILURES])
async def test_a_request_failing_at_any_step_leaves_no_booking_and_no_prediction(
        name: str, cfg: dict[str, Any], make_ctx: Any, problem: Problem) -> None:
    pipe, r, kv = make(**cfg)
    ctx = make_ctx(pipe, r, kv)
    with pytest.raises(PickError) as e:
        await decide(pipe, ctx)
    assert e.value.problem is problem
    assert pipe.load.total_inflight() == 0
    assert all(ld.inflight == 0 and ld.prefill_blocks == 0 for ld in pipe.load.loads().values())
    assert kv.predicted == []


async def test_a_body_too_deep_for_the_rewrite_is_a_clear_400_not_a_500() -> None:
    pipe, _, _ = make()
    with pytest.raises(PickError) as e:
        await decide(pipe, chat(deep_nvext_body()))
    assert "nesting too deep" in e.value.detail


async def test_an_unexpected_error_while_scoring_books_nothing() -> None:
    pipe, _, kv = make()
    kv.fail_overlap = True
    with pytest.raises(RuntimeError):
        await decide(pipe, chat(b'{"messages":[]}'))
    assert pipe.load.total_inflight() == 0 and kv.predicted == []


async def test_propose_alone_books_and_predicts_nothing_and_commit_does_both() -> None:
    pipe, _, kv = make()
    p = await pipe.propose(chat(b'{"messages":[],"nvext":{"a":1}}'))
    assert pipe.load.total_inflight() == 0 and kv.predicted == []
    assert json.loads(p.body) == {"messages": []}
    d = pipe.commit(p)
    assert pipe.load.total_inflight() == 1 and kv.predicted == [d.address]
    d.booking.free()


async def test_a_proposal_does_not_count_as_a_routed_request_until_committed() -> None:
    pipe, _, _ = make()
    p = await pipe.propose(chat(b'{"messages":[]}'))
    routed = pipe.metrics.requests.labels("routed")._value.get()
    assert routed == 0
    pipe.commit(p).booking.free()
    assert pipe.metrics.requests.labels("routed")._value.get() == 1


async def test_a_debug_proposal_keeps_its_render_out_of_the_traffic_count() -> None:
    pipe, r, _ = make()
    await pipe.propose(chat(b'{"messages":[]}'), count=False)
    assert r.calls == [False]


async def test_the_route_follows_from_whether_the_prompt_is_known() -> None:
    pipe, r, _ = make()
    assert (await pipe.propose(chat(b'{"messages":[]}'))).plan.route == "kv"
    r.fail = RenderError(RenderFailure.UNAVAILABLE, "down")
    assert (await pipe.propose(chat(b'{"messages":[]}'))).plan.route == "load"


async def test_the_prompt_is_hashed_for_the_model_the_request_names_so_lora_blocks_can_match() -> None:
    pipe, _, kv = make()
    await pipe.propose(chat(b'{"model":"tenant-lora","messages":[]}'))
    assert kv.models == ["tenant-lora"]


async def test_a_lora_request_is_rendered_under_its_base_model_and_forwarded_unchanged() -> None:
    pipe, r, _ = make()
    body = b'{"model":"tenant-lora","messages":[]}'
    p = await pipe.propose(chat(body))
    assert json.loads(r.bodies[-1]) == {"model": "base-model", "messages": []}
    assert p.body == body  # the worker still gets the adapter's name
