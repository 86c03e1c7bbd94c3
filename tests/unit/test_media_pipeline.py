"""Image requests through the decision (core/pipeline.py with core/media.py): what is rendered, what is scored,
what is forwarded, and how it is counted; with in-process fakes for the renderer and the index."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import pytest

from epp_extproc.config import Config
from epp_extproc.core.contract import MediaItem, PromptIdentity
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.media import DIGEST_PREFIX, SENTINELS
from epp_extproc.core.render import Rendered
from epp_extproc.core.request import RequestContext
from epp_extproc.metrics import PickerMetrics
from tests.scheduling_fakes import Decider, build_decider

ADDRS = ["127.0.0.1:9", "127.0.0.1:10"]
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
DATA = "data:image/png;base64," + base64.b64encode(PNG).decode()
DIGEST = DIGEST_PREFIX + hashlib.sha256(PNG).hexdigest()
IDS = list(range(1000, 1100))  # 100 tokens; the image's placeholders at 40..59


class Renderer:
    """vllm-render: answers IDS and one image item at 40..59 whose hash is the uuid it was sent (as vLLM keys a
    uuid); other protocols: a shared text prefix then tokens that depend on the sentinel they were sent."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.bodies: list[dict[str, Any]] = []
        self.features: Any = "auto"

    async def render(self, kind: str, body: bytes, *, count: bool = True) -> Rendered:
        doc = json.loads(body)
        self.bodies.append(doc)
        if self.protocol != "vllm-render":
            last = doc["messages"][-1]["content"]
            return Rendered([1, 2, 3, 4, 5, 6] + [7 if last == SENTINELS[0] else 8, 9])
        r = Rendered(list(IDS))
        if self.features == "auto":
            parts = [p for m in doc["messages"] if isinstance(m["content"], list) for p in m["content"]
                     if p.get("type") == "image_url"]
            r.media = tuple(("image", MediaItem(p.get("uuid") or "engine-hash", 40 + 20 * i, 20))
                            for i, p in enumerate(parts))
        elif self.features == "invalid":
            r.media_invalid = "placeholder ranges overlap"
        return r


class Kv:
    def __init__(self) -> None:
        self.prompts: list[tuple[list[int], PromptIdentity]] = []

    def prompt(self, tokens: Sequence[int], identity: PromptIdentity) -> list[int]:
        self.prompts.append((list(tokens), identity))
        return list(tokens)

    def block_size(self, address: str) -> int:
        return 16

    def base_model_for(self, model: object) -> str | None:
        return None

    def overlap(self, prompt: Any, workers: Sequence[str]) -> dict[str, int]:
        return {ADDRS[0]: 3}

    def credit(self, prompt: Any, workers: Sequence[str]) -> dict[str, Any]:
        return {}

    def held(self, address: str) -> int:
        return 0

    def predict(self, address: str, prompt: Any, booking: str | None = None) -> None:
        pass


def make(protocol: str = "vllm-render", **cfg: Any) -> tuple[Decider, Renderer, Kv]:
    reg = EndpointRegistry()
    reg.replace([Endpoint(f"w{i}", a) for i, a in enumerate(ADDRS)])
    metrics = PickerMetrics()
    r, kv = Renderer(protocol), Kv()
    config = Config(tokenizer_protocol=protocol, tokenizer_service_url="http://127.0.0.1:1", **cfg)
    return build_decider(config, reg, LoadTracker(metrics.endpoint_inflight), metrics, renderer=r, kv=kv), r, kv


def chat(*parts: dict[str, Any], headers: dict[str, list[str]] | None = None, **extra: Any) -> RequestContext:
    doc = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                                   *parts]}], **extra}
    return RequestContext("POST", "/v1/chat/completions", headers or {}, json.dumps(doc).encode())


def image(url: str = DATA, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def media_count(pipe: Decider, scored: str, reason: str) -> float:
    return pipe.metrics.media_requests.labels(scored, reason)._value.get()


async def test_vllm_images_are_scored_with_the_renders_items_and_spans() -> None:
    pipe, _, kv = make()
    p = await pipe.propose(chat(image()))
    assert kv.prompts[-1] == (IDS, PromptIdentity(None, "m", (MediaItem(DIGEST, 40, 20),)))
    assert p.plan.media_outcome() == ("exact", "spans")


async def test_the_render_is_sent_the_derived_uuid_and_asked_for_no_tensors() -> None:
    pipe, r, _ = make()
    await pipe.propose(chat(image()))
    sent = r.bodies[-1]
    assert sent["mm_payload"] == "none"
    assert sent["messages"][1]["content"][1]["uuid"] == DIGEST


async def test_the_worker_gets_the_derived_uuid_and_no_render_option() -> None:
    pipe, _, _ = make()
    ctx = chat(image())
    p = await pipe.propose(ctx)
    assert p.body is not None
    fwd = json.loads(p.body)
    assert fwd["messages"][1]["content"][1] == {**image(), "uuid": DIGEST} and "mm_payload" not in fwd
    assert p.body == ctx.body.replace(b'"}}]}', b'"},"uuid":"' + DIGEST.encode() + b'"}]}')  # type: ignore[union-attr]


async def test_text_prefix_credit_scores_only_the_tokens_before_the_first_image() -> None:
    pipe, _, kv = make(media_credit="text-prefix")
    p = await pipe.propose(chat(image()))
    assert kv.prompts[-1] == (IDS[:40], PromptIdentity(None, "m", ()))
    assert p.plan.media_outcome() == ("text_prefix", "flag_text_prefix")
    assert p.chosen.prompt_blocks == len(IDS) / 16  # the load is the whole prompt's


@pytest.mark.parametrize(("features", "reason"), [("invalid", "invalid_features"), (None, "no_features")])
async def test_a_render_without_believable_spans_routes_by_load(features: Any, reason: str) -> None:
    pipe, r, kv = make()
    r.features = features
    p = await pipe.propose(chat(image()))
    assert p.plan.tokens is None and kv.prompts == []
    assert p.plan.media_outcome() == ("load_only", reason)


async def test_a_render_reporting_other_items_than_the_request_has_routes_by_load() -> None:
    pipe, r, kv = make()
    r.features = "auto"
    ctx = chat(image())
    orig = r.render

    async def one_more(kind: str, body: bytes, *, count: bool = True) -> Rendered:
        out = await orig(kind, body, count=count)
        out.media = (*(out.media or ()), ("image", MediaItem("extra", 90, 5)))
        return out

    r.render = one_more  # type: ignore[method-assign]
    p = await pipe.propose(ctx)
    assert p.plan.media_outcome() == ("load_only", "mismatched_items") and kv.prompts == []


async def test_trtllm_render_scores_the_certain_text_prefix_of_two_sentinel_renders() -> None:
    pipe, r, kv = make("trtllm-render")
    p = await pipe.propose(chat(image("https://example.com/cat.png")))
    assert sorted(b["messages"][-1]["content"] for b in r.bodies) == sorted(SENTINELS)
    assert kv.prompts[-1][0] == [1, 2, 3, 4, 5]  # the 6 shared tokens minus the boundary one
    assert p.plan.media_outcome() == ("text_prefix", "renderer_refuses_media")


async def test_trtllm_image_requests_never_carry_prompt_token_ids() -> None:
    pipe, _, _ = make("trtllm-render")
    ctx = chat(image("https://example.com/cat.png"))
    p = await pipe.propose(ctx)
    assert p.passthrough is not None and (p.passthrough.forward, p.passthrough.reason) == ("original", "media")
    assert p.body == ctx.body


async def test_trtllm_does_not_get_a_derived_uuid() -> None:
    pipe, _, _ = make("trtllm-render")
    ctx = chat(image())
    assert (await pipe.propose(ctx)).body == ctx.body


@pytest.mark.parametrize(("part", "reason"), [
    ({"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}, "video"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
    ({"type": "image_embeds", "image_embeds": "AAAA"}, "embeds"),
])
async def test_video_audio_and_embeddings_are_routed_by_load_without_a_render(part: dict[str, Any],
                                                                              reason: str) -> None:
    pipe, r, _ = make()
    p = await pipe.propose(chat(image(), part))
    assert r.bodies == [] and p.plan.route == "load"
    pipe.commit(p).booking.free()
    assert media_count(pipe, "load_only", reason) == 1
    assert pipe.metrics.media_items.labels(reason, "engine")._value.get() == 1


async def test_an_untrusted_uuid_only_reference_is_a_bad_request() -> None:
    pipe, _, _ = make()
    with pytest.raises(PickError) as e:
        await pipe.propose(chat({"type": "image_url", "image_url": None, "uuid": "someone-elses"}))
    assert e.value.problem is Problem.BAD_REQUEST


async def test_a_trusted_caller_uuid_is_forwarded_untouched() -> None:
    pipe, _, kv = make(trust_media_uuids=True)
    ctx = chat(image(uuid="mine"))
    p = await pipe.propose(ctx)
    assert p.body == ctx.body
    assert kv.prompts[-1][1].media == (MediaItem("mine", 40, 20),)


async def test_a_salted_caller_uuid_is_namespaced_in_the_body_and_the_identity() -> None:
    pipe, _, kv = make()
    p = await pipe.propose(chat(image(uuid="mine"), headers={"x-tenant-id": ["t1"]}))
    assert p.body is not None
    fwd = json.loads(p.body)
    ns = fwd["messages"][1]["content"][1]["uuid"]
    assert ns not in ("mine", DIGEST) and fwd["cache_salt"] == "t1"
    assert kv.prompts[-1][1] == PromptIdentity("t1", "m", (MediaItem(ns, 40, 20),))


async def test_data_uris_count_against_the_body_budget() -> None:
    pipe, _, _ = make(max_body_bytes=4096, max_buffered_body_bytes=1 << 20)
    big = "data:image/png;base64," + base64.b64encode(bytes(4096)).decode()
    with pytest.raises(PickError) as e:
        await pipe.propose(chat(image(big)))
    assert e.value.problem is Problem.BODY_TOO_LARGE


async def test_image_requests_are_counted_only_when_committed() -> None:
    pipe, _, _ = make()
    p = await pipe.propose(chat(image(), image("https://example.com/b.png")))
    assert media_count(pipe, "exact", "spans") == 0
    pipe.commit(p).booking.free()
    assert media_count(pipe, "exact", "spans") == 1
    assert pipe.metrics.media_items.labels("image", "digest")._value.get() == 1
    assert pipe.metrics.media_items.labels("image", "engine")._value.get() == 1


async def test_debug_score_shows_each_items_identity_span_and_blocks() -> None:
    pipe, _, _ = make()
    p = await pipe.propose(chat(image(), image("https://example.com/b.png")))
    m = pipe.explain(p)["media"]
    assert (m["scored"], m["reason"], m["credited_tokens"]) == ("exact", "spans", 100)
    first, second = m["items"]
    assert first["identifier"] == DIGEST and first["identity_source"] == "digest"
    assert (first["offset"], first["length"], first["blocks"], first["block_size"]) == (40, 20, [2, 3], 16)
    assert (second["identifier"], second["blocks"], second["origin"]) == ("engine-hash", [3, 4], "http")


async def test_a_text_only_request_has_no_media_section() -> None:
    pipe, _, _ = make()
    ctx = RequestContext("POST", "/v1/chat/completions", {}, b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')
    p = await pipe.propose(ctx)
    assert pipe.explain(p)["media"] is None and p.plan.media is None


async def test_a_large_data_uri_gets_the_same_identity_rules() -> None:
    pipe, _, kv = make()
    big = bytes(range(256)) * 8192  # 2 MiB: hashed and spliced off the event loop
    ctx = chat(image("data:image/png;base64," + base64.b64encode(big).decode()))
    p = await pipe.propose(ctx)
    digest = DIGEST_PREFIX + hashlib.sha256(big).hexdigest()
    assert p.body == ctx.body.replace(b'"}}]}', b'"},"uuid":"' + digest.encode() + b'"}]}')  # type: ignore[union-attr]
    assert kv.prompts[-1][1].media == (MediaItem(digest, 40, 20),)
