"""Render client error mapping, cache-salt resolution and the salt/render-failure policies of the pipeline."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from epp_extproc.adapters.render_client import RenderClient
from epp_extproc.adapters.worker_facts import Prompt
from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.plan import TRTLLM_SALT_MESSAGE
from epp_extproc.core.render import RenderError, render_kind
from epp_extproc.core.request import RequestContext
from epp_extproc.core.salt import resolve_salt
from epp_extproc.envoy.errors import http_error, render_status
from epp_extproc.metrics import PickerMetrics


class StubRenderer:
    """A renderer whose next answer the test chooses; records what it was sent."""

    def __init__(self) -> None:
        self.status = 200
        self.doc: Any = {"token_ids": list(range(100))}
        self.raw: bytes | None = None
        self.delay = 0.0
        self.seen: list[tuple[str, bytes]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, req: web.Request) -> web.Response:
        self.seen.append((req.path, await req.read()))
        if self.delay:
            await asyncio.sleep(self.delay)
        body = self.raw if self.raw is not None else json.dumps(self.doc).encode()
        return web.Response(status=self.status, body=body, content_type="application/json")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture
async def stub():
    s = StubRenderer()
    await s.start()
    yield s
    await s.stop()


def client(url: str, protocol: str = "trtllm-render", **kw: Any) -> RenderClient:
    return RenderClient(protocol, url, timeout_ms=kw.get("timeout_ms", 2000),
                        max_response_bytes=kw.get("max_bytes", 1 << 20), metrics=PickerMetrics())


# ---------------------------------------------------------------- render client
async def test_chat_render_returns_token_ids_from_the_chat_route(stub: StubRenderer) -> None:
    c = client(f"http://127.0.0.1:{stub.port}")
    assert (await c.render("chat", b"{}")).token_ids == list(range(100))
    assert stub.seen[-1][0] == "/v1/chat/completions/render"
    await c.close()


async def test_completions_render_takes_the_first_object_of_the_array(stub: StubRenderer) -> None:
    stub.doc = [{"token_ids": [5, 6]}, {"token_ids": [7]}]
    c = client(f"http://127.0.0.1:{stub.port}")
    assert (await c.render("completion", b"{}")).token_ids == [5, 6]
    assert stub.seen[-1][0] == "/v1/completions/render"
    await c.close()


async def test_sglang_protocol_reads_input_ids(stub: StubRenderer) -> None:
    stub.doc = {"input_ids": [1, 2, 3], "token_ids": [9]}
    c = client(f"http://127.0.0.1:{stub.port}", "sglang-renderer")
    assert (await c.render("chat", b"{}")).token_ids == [1, 2, 3]
    await c.close()


@pytest.mark.parametrize(("status", "kind", "mapped"), [
    (400, "rejected", 400), (422, "rejected", 400), (429, "unavailable", 503), (503, "unavailable", 503),
    (500, "bad_gateway", 502), (404, "bad_gateway", 502), (401, "bad_gateway", 502)])
async def test_renderer_statuses_map_like_the_reference(stub: StubRenderer, status: int, kind: str,
                                                         mapped: int) -> None:
    stub.status = status
    c = client(f"http://127.0.0.1:{stub.port}")
    with pytest.raises(RenderError) as e:
        await c.render("chat", b"{}")
    assert (e.value.label, render_status(e.value)) == (kind, mapped)
    await c.close()


async def test_unreachable_renderer_is_unavailable_503() -> None:
    from tests.netutil import free_port

    c = client(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(RenderError) as e:
        await c.render("chat", b"{}")
    assert (e.value.label, render_status(e.value)) == ("unavailable", 503)
    await c.close()


async def test_slow_renderer_times_out_504(stub: StubRenderer) -> None:
    stub.delay = 1.0
    c = client(f"http://127.0.0.1:{stub.port}", timeout_ms=100)
    with pytest.raises(RenderError) as e:
        await c.render("chat", b"{}")
    assert (e.value.label, render_status(e.value)) == ("timeout", 504)
    await c.close()


@pytest.mark.parametrize("raw", [b"not json", b'{"token_ids": "x"}', b'{"token_ids": [1.5]}',
                                 b'{"token_ids": [-1]}', b'{"other": []}', b"[]"])
async def test_answers_without_valid_token_ids_are_bad_gateway(stub: StubRenderer, raw: bytes) -> None:
    stub.raw = raw
    c = client(f"http://127.0.0.1:{stub.port}")
    with pytest.raises(RenderError) as e:
        await c.render("chat", b"{}")
    assert e.value.label == "bad_gateway" and render_status(e.value) == 502
    await c.close()


async def test_oversized_render_answer_is_refused(stub: StubRenderer) -> None:
    stub.doc = {"token_ids": list(range(50_000))}
    c = client(f"http://127.0.0.1:{stub.port}", max_bytes=10_000)
    with pytest.raises(RenderError, match="cap"):
        await c.render("chat", b"{}")
    await c.close()


def test_render_kind_follows_the_path() -> None:
    assert render_kind("/v1/chat/completions") == "chat"
    assert render_kind("/v1/completions?x=1") == "completion"
    assert render_kind("/v1/models") is None


# ---------------------------------------------------------------- salt resolution
def test_tenant_header_wins_and_the_last_non_empty_value_counts() -> None:
    h = {"x-tenant-id": ["t1", "  t2 ", "   "]}
    assert resolve_salt(h, {"nvext": {"cache_salt": "n"}, "cache_salt": "c"}) == "t2"


def test_nvext_salt_beats_top_level_salt() -> None:
    assert resolve_salt({}, {"nvext": {"cache_salt": "n"}, "cache_salt": "c"}) == "n"


def test_empty_and_non_string_salts_are_ignored() -> None:
    assert resolve_salt({"x-tenant-id": [" "]}, {"nvext": {"cache_salt": ""}, "cache_salt": 5}) is None
    assert resolve_salt({}, {"nvext": None, "cache_salt": " c "}) == "c"


# ---------------------------------------------------------------- pipeline policies
async def picker(url: str, **kw: Any) -> PickerApp:
    cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                 endpoints="a=127.0.0.1:9;kv=tcp://127.0.0.1:1,b=127.0.0.1:10;kv=tcp://127.0.0.1:2",
                 tokenizer_protocol=kw.pop("protocol", "trtllm-render"), tokenizer_service_url=url, **kw)
    app = PickerApp(cfg)
    app.kv.facts.ask_server_info = False  # type: ignore[union-attr]  (no real workers behind these addresses)
    await app.start()
    return app


def chat(body: dict[str, Any], headers: dict[str, list[str]] | None = None) -> RequestContext:
    return RequestContext("POST", "/v1/chat/completions", headers or {}, json.dumps(body).encode())


async def test_trtllm_salt_is_rejected_before_rendering(stub: StubRenderer) -> None:
    app = await picker(f"http://127.0.0.1:{stub.port}")
    with pytest.raises(PickError) as e:
        await app.picker.decide(chat({"messages": []}, {"x-tenant-id": ["t"]}))
    assert (http_error(e.value, "/v1/chat/completions").status, e.value.detail) == (400, TRTLLM_SALT_MESSAGE)
    assert e.value.problem is Problem.SALT_REJECTED
    assert stub.seen == []
    await app.stop()


async def test_trtllm_salt_load_only_policy_forwards_the_salt_and_skips_rendering(stub: StubRenderer) -> None:
    app = await picker(f"http://127.0.0.1:{stub.port}", cache_salt_policy="load-only")
    d = await app.picker.decide(chat({"messages": [], "nvext": {"cache_salt": "t"}}))
    assert json.loads(d.body) == {"messages": [], "cache_salt": "t"}
    assert stub.seen == [] and d.predicted_cached_tokens is None
    d.booking.free()
    await app.stop()


async def test_trtllm_salt_load_only_policy_does_not_inject_into_completions(stub: StubRenderer) -> None:
    app = await picker(f"http://127.0.0.1:{stub.port}", cache_salt_policy="load-only")
    ctx = RequestContext("POST", "/v1/completions", {"x-tenant-id": ["t"]}, b'{"prompt":"p"}')
    d = await app.picker.decide(ctx)
    assert d.body == b'{"prompt":"p"}'  # TensorRT-LLM's completions API has no cache_salt field
    d.booking.free()
    await app.stop()


async def test_vllm_salt_is_forwarded_and_the_renderer_gets_the_body_without_nvext(stub: StubRenderer) -> None:
    app = await picker(f"http://127.0.0.1:{stub.port}", protocol="vllm-render")
    d = await app.picker.decide(chat({"messages": [], "nvext": {"x": 1}}, {"x-tenant-id": ["t"]}))
    assert json.loads(d.body) == {"messages": [], "cache_salt": "t"}
    assert json.loads(stub.seen[-1][1]) == {"messages": []}
    d.booking.free()
    await app.stop()


async def test_sglang_salt_is_used_for_selection_but_not_injected(stub: StubRenderer) -> None:
    stub.doc = {"input_ids": list(range(100))}
    app = await picker(f"http://127.0.0.1:{stub.port}", protocol="sglang-renderer")
    d = await app.picker.decide(chat({"messages": []}, {"x-tenant-id": ["t"]}))
    assert json.loads(d.body) == {"messages": []}
    d.booking.free()
    await app.stop()


async def test_salted_and_unsalted_prompts_do_not_share_predicted_blocks(stub: StubRenderer) -> None:
    app = await picker(f"http://127.0.0.1:{stub.port}", protocol="vllm-render")
    d = await app.picker.decide(chat({"messages": []}, {"x-tenant-id": ["t"]}))
    both = ["127.0.0.1:9", "127.0.0.1:10"]
    assert app.kv.overlap(Prompt(list(range(100)), "t"), both) == {d.address: 3}
    assert app.kv.overlap(Prompt(list(range(100)), None), both) == {}
    d.booking.free()
    await app.stop()


async def test_renderer_down_routes_by_load_by_default(stub: StubRenderer) -> None:
    stub.status = 503
    app = await picker(f"http://127.0.0.1:{stub.port}")
    d = await app.picker.decide(chat({"messages": []}))
    assert d.address in ("127.0.0.1:9", "127.0.0.1:10") and d.predicted_cached_tokens is None
    d.booking.free()
    await app.stop()


@pytest.mark.parametrize(("status", "expected"), [(503, 503), (500, 502)])
async def test_fail_policy_restores_the_reference_statuses(stub: StubRenderer, status: int, expected: int) -> None:
    stub.status = status
    app = await picker(f"http://127.0.0.1:{stub.port}", render_failure_policy="fail")
    with pytest.raises(PickError) as e:
        await app.picker.decide(chat({"messages": []}))
    assert http_error(e.value, "/v1/chat/completions").status == expected
    await app.stop()


async def test_renderer_4xx_routes_by_load_unless_the_reject_policy_is_fail(stub: StubRenderer) -> None:
    stub.status = 400
    app = await picker(f"http://127.0.0.1:{stub.port}")
    d = await app.picker.decide(chat({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}))
    d.booking.free()
    await app.stop()
    app = await picker(f"http://127.0.0.1:{stub.port}", render_reject_policy="fail")
    with pytest.raises(PickError) as e:
        await app.picker.decide(chat({"messages": []}))
    assert http_error(e.value, "/v1/chat/completions").status == 400
    await app.stop()


async def test_a_burst_of_one_prefix_sticks_to_one_worker_before_any_kv_event(stub: StubRenderer) -> None:
    stub.doc = {"token_ids": list(range(640))}
    app = await picker(f"http://127.0.0.1:{stub.port}")
    picks = []
    for _ in range(6):
        d = await app.picker.decide(chat({"messages": []}))
        picks.append(d.address)
        d.booking.prefill_done()
        d.booking.free()
    assert len(set(picks)) == 1
    assert d.predicted_cached_tokens == 19 * 32  # 640 tokens, last token never reusable
    await app.stop()


async def test_malformed_body_is_400_without_a_render_call(stub: StubRenderer) -> None:
    app = await picker(f"http://127.0.0.1:{stub.port}")
    with pytest.raises(PickError) as e:
        await app.picker.decide(RequestContext("POST", "/v1/chat/completions", {}, b"[1]"))
    assert e.value.problem is Problem.BAD_REQUEST and stub.seen == []
    await app.stop()


async def test_a_request_books_only_the_blocks_its_worker_must_compute(stub: StubRenderer) -> None:
    stub.doc = {"token_ids": list(range(640))}  # 20 blocks
    app = await picker(f"http://127.0.0.1:{stub.port}")
    first = await app.picker.decide(chat({"messages": []}))
    assert first.booking.prefill_blocks == 20  # cold: the whole prompt
    first.booking.free()
    second = await app.picker.decide(chat({"messages": []}))
    assert second.address == first.address
    assert second.booking.prefill_blocks == 1  # 19 blocks already there (predicted), 1 to compute
    second.booking.free()
    await app.stop()


# ---------------------------------------------------------------- /debug/score
async def test_debug_score_is_a_proposal_that_books_nothing_and_is_not_counted_as_traffic(
        stub: StubRenderer) -> None:
    app = await picker(f"http://127.0.0.1:{stub.port}")
    out = await app.debug_score({"messages": [{"role": "user", "content": "hi"}]})
    assert out["route"] == "kv" and out["pick"] in ("127.0.0.1:9", "127.0.0.1:10")
    assert len(stub.seen) == 1  # it did render
    assert app.metrics.render_requests.labels("trtllm-render", "ok")._value.get() == 0
    assert app.load.total_inflight() == 0
    await app.stop()


async def test_debug_score_says_which_blocks_events_confirmed_and_which_are_predictions(
        stub: StubRenderer) -> None:
    app = await picker(f"http://127.0.0.1:{stub.port}")
    tokens = list(range(1000, 1000 + 32 * 4 + 1))
    before = await app.debug_score({"token_ids": tokens})
    assert all((w["confirmed_blocks"], w["predicted_blocks"]) == (0, 0) for w in before["workers"])
    d = await app.picker.decide(RequestContext("POST", "/v1/chat/completions", {}, None))
    assert app.kv is not None
    app.kv.predict(d.address, app.kv.prompt(tokens))  # as a committed request with this prompt predicts it
    after = await app.debug_score({"token_ids": tokens})
    by = {w["address"]: w for w in after["workers"]}
    assert (by[d.address]["confirmed_blocks"], by[d.address]["predicted_blocks"]) == (0, 4)
    assert by[d.address]["overlap_blocks"] == 4
    d.booking.free()
    await app.stop()


async def test_debug_score_refuses_more_token_ids_than_its_cap(stub: StubRenderer) -> None:
    from epp_extproc.admin import MAX_DEBUG_TOKENS

    app = await picker(f"http://127.0.0.1:{stub.port}")
    with pytest.raises(ValueError, match="at most"):
        await app.debug_score({"token_ids": [1] * (MAX_DEBUG_TOKENS + 1)})
    assert (await app.debug_score({"token_ids": [1] * 64}))["prompt_tokens"] == 64
    await app.stop()


async def test_debug_score_over_http_refuses_a_body_over_four_mebibytes(stub: StubRenderer) -> None:
    import aiohttp

    app = await picker(f"http://127.0.0.1:{stub.port}")
    async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{app.admin_port}/debug/score",
            data=b'{"token_ids":[' + b"1," * (3 * 1024 * 1024) + b'1]}') as r:
        assert r.status == 413
    await app.stop()
