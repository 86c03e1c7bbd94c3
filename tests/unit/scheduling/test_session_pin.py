"""Session affinity in the decision: a valid token sends the request back to its worker while that worker can
take it; anything else is re-picked by the cost rule, and each outcome is counted once, at commit."""

from __future__ import annotations

import os
from typing import Any

import pytest

from epp_extproc.config import Config
from epp_extproc.core.admission import BodyBudget, InflightGate
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.lean import LeanSignals
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.picker import Picker
from epp_extproc.core.request import RequestContext
from epp_extproc.core.session import SESSION_HEADER, SessionTokens
from epp_extproc.metrics import PickerMetrics
from tests.scheduling_fakes import ADDRS, Decider, FakeKv, FakeRenderer, build_decider

COST_PICK, OTHER = ADDRS  # FakeKv credits ADDRS[0] with 2 cached blocks: the cost rule picks it


def make(saturated: set[str] | None = None, sessions: bool = True) -> tuple[Decider, SessionTokens]:
    reg = EndpointRegistry()
    reg.replace([Endpoint(f"w{i}", a) for i, a in enumerate(ADDRS)])
    metrics = PickerMetrics()
    tokens = SessionTokens([os.urandom(32)], 60)
    config = Config(tokenizer_protocol="trtllm-render", tokenizer_service_url="http://127.0.0.1:1")
    full = saturated if saturated is not None else set()
    pipe = build_decider(config, reg, LoadTracker(metrics.endpoint_inflight), metrics, renderer=FakeRenderer(),
                    kv=FakeKv(), sessions=tokens if sessions else None, saturated=full.__contains__)
    return pipe, tokens


def request(token: str | None, subset: list[str] | None = None) -> RequestContext:
    headers = {SESSION_HEADER: [token]} if token is not None else {}
    return RequestContext("POST", "/v1/chat/completions", headers, b'{"messages":[]}', subset=subset)


def outcomes(pipe: Decider) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in pipe.metrics.session_affinity.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                out[s.labels["outcome"]] = s.value
    return out


async def pick(pipe: Decider, ctx: RequestContext) -> Any:
    picker = Picker(pipe, gate=InflightGate(64), bodies=BodyBudget(1 << 20, 1 << 24),
                    lean=LeanSignals(pipe.load, pipe.metrics))
    ex = picker.open()
    d = await ex.decide(ctx)
    headers = ex.response_headers({":status": ["200"]})
    ex.close()
    return d, headers


async def test_a_valid_token_goes_back_to_its_worker_over_the_cost_rule() -> None:
    pipe, tokens = make()
    d, _ = await pick(pipe, request(tokens.seal(OTHER)))
    assert d.address == OTHER
    assert outcomes(pipe) == {"honoured": 1}


async def test_without_affinity_configured_the_header_changes_nothing() -> None:
    pipe, tokens = make(sessions=False)
    d, headers = await pick(pipe, request(tokens.seal(OTHER)))
    assert d.address == COST_PICK and headers == []


async def test_a_request_without_the_header_gets_no_token() -> None:
    pipe, _ = make()
    d, headers = await pick(pipe, request(None))
    assert d.address == COST_PICK and headers == [] and outcomes(pipe) == {}


async def test_opting_in_gets_a_token_naming_the_worker_that_served() -> None:
    pipe, tokens = make()
    d, headers = await pick(pipe, request("new"))
    assert d.address == COST_PICK and [h for h, _ in headers] == [SESSION_HEADER]
    assert tokens.open(headers[0][1])[1] == COST_PICK
    assert outcomes(pipe) == {"new": 1}


@pytest.mark.parametrize("why,setup", [
    ("saturated", lambda: make(saturated={OTHER})),
    ("unhealthy", lambda: _unhealthy(make())),
])
async def test_a_token_whose_worker_cannot_take_it_is_re_picked(why: str, setup: Any) -> None:
    pipe, tokens = setup()
    d, headers = await pick(pipe, request(tokens.seal(OTHER)))
    assert d.address == COST_PICK, why
    assert outcomes(pipe) == {"unavailable": 1}
    assert tokens.open(headers[0][1])[1] == COST_PICK  # the fresh token names the new worker


def _unhealthy(made: tuple[Decider, SessionTokens]) -> tuple[Decider, SessionTokens]:
    made[0].registry.set_healthy(OTHER, False)
    return made


async def test_a_token_outside_the_gateways_subset_is_re_picked() -> None:
    pipe, tokens = make()
    d, _ = await pick(pipe, request(tokens.seal(OTHER), subset=[COST_PICK]))
    assert d.address == COST_PICK and outcomes(pipe) == {"unavailable": 1}


async def test_a_token_naming_an_address_outside_the_pool_is_re_picked() -> None:
    pipe, tokens = make()
    d, _ = await pick(pipe, request(tokens.seal("10.9.9.9:80")))
    assert d.address == COST_PICK and outcomes(pipe) == {"unavailable": 1}


async def test_a_forged_token_is_re_picked_and_counted_as_tampered() -> None:
    pipe, _ = make()
    forged = SessionTokens([os.urandom(32)], 60).seal(OTHER)
    d, headers = await pick(pipe, request(forged))
    assert d.address == COST_PICK and outcomes(pipe) == {"tampered": 1} and headers


async def test_a_proposal_that_is_never_committed_counts_nothing() -> None:
    pipe, tokens = make()
    p = await pipe.propose(request(tokens.seal(OTHER)))
    assert p.address == OTHER and p.session == "honoured"
    assert outcomes(pipe) == {}
