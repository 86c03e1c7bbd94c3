"""Image requests end to end: real Envoy, the picker, a small fake renderer speaking vLLM's render dialect (or
TensorRT-LLM's, which refuses media) and echo workers that record the exact bytes they receive.

The fake renderer answers `/v1/chat/completions/render` the way vLLM 0.32.0's render server does
(`entrypoints/scale_out/render/api_router.py` -> `GenerateRequest`): `token_ids`, and for multimodal input
`features` = `MultiModalFeatures` {`mm_hashes`: {modality: [hash]}, `mm_placeholders`: {modality: [{offset,
length}]}, `kwargs_data`, `mm_metadata`} (`token_in_token_out/protocol.py`); an item's hash is its `uuid` when
the part carries one (`multimodal/processing/inputs.py` `get_mm_hashes`, no processor kwargs). Each image
expands to a size-dependent number of placeholder tokens (here: 8 + the URL's length mod 7), so a span can only
be known from the render. It never fetches a URL: a real vLLM renderer would, the picker never does.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from epp_extproc.core.media import DIGEST_PREFIX
from epp_extproc.dev import envoy_config
from tests.gateway_client import request
from tests.harness import BackgroundLoop, EchoUpstream, EnvoyProcess

PLACEHOLDER = 151655
MEDIA_MARKERS = ("image", "video", "audio")  # TensorRT-LLM serve/render/chat.py `_has_media`
REFUSAL = "Multimodal input is not supported by prompt rendering."
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
DATA = "data:image/png;base64," + base64.b64encode(PNG).decode()
DIGEST = DIGEST_PREFIX + hashlib.sha256(PNG).hexdigest()


class FakeRenderer:
    """vllm-render or trtllm-render, as `dialect` says; records every body it was sent."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        self.bodies: list[dict[str, Any]] = []
        self.overlapping = False  # hostile: answer overlapping placeholder ranges
        self.runner: web.AppRunner | None = None
        self.url = ""

    def _render(self, doc: dict[str, Any]) -> dict[str, Any]:
        ids: list[int] = []
        hashes: list[str] = []
        places: list[dict[str, int]] = []
        for m in doc["messages"]:
            ids.append(1)
            content = m.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
            for p in parts:
                if p.get("type") == "text":
                    ids += [100 + ord(c) % 50_000 for c in p["text"]]
                elif p.get("type") == "image_url":
                    url = (p.get("image_url") or {}).get("url") or ""
                    n = 8 + len(url) % 7
                    hashes.append(p.get("uuid") or hashlib.sha256(url.encode()).hexdigest())
                    places.append({"offset": len(ids), "length": n})
                    ids += [PLACEHOLDER] * n
            ids.append(2)
        ids.append(3)
        out: dict[str, Any] = {"request_id": "r", "token_ids": ids, "sampling_params": {}, "model": doc.get("model")}
        if hashes and self.overlapping:
            places = [{"offset": 0, "length": len(ids)}] * len(hashes)
        if hashes:
            out["features"] = {"mm_hashes": {"image": hashes}, "mm_placeholders": {"image": places},
                               "kwargs_data": None, "mm_metadata": None}
        return out

    async def handle(self, req: web.Request) -> web.Response:
        doc = json.loads(await req.read())
        self.bodies.append(doc)
        if self.dialect == "trtllm-render" and any(
                any(k in str(p.get("type", "")) for k in MEDIA_MARKERS)
                for m in doc["messages"] if isinstance(m.get("content"), list) for p in m["content"]):
            return web.json_response({"object": "error", "message": REFUSAL, "type": "BadRequestError",
                                      "code": 400}, status=400)
        return web.json_response(self._render(doc))

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions/render", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


class MediaGateway:
    """Envoy -> picker (`dialect` renderer) -> two echo workers, plus an image host that counts its hits."""

    def __init__(self, dialect: str, **cfg: Any) -> None:
        self.bg = BackgroundLoop()
        self.renderer = FakeRenderer(dialect)
        self.a, self.b = EchoUpstream("a"), EchoUpstream("b")
        self.images = EchoUpstream("image-host")
        for part in (self.a, self.b, self.images, self.renderer):
            self.bg.run(part.start())
        config = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                        endpoints=f"a={self.a.address},b={self.b.address}", endpoint_probe_interval_ms=0,
                        tokenizer_protocol=dialect, tokenizer_service_url=self.renderer.url,
                        cache_salt_policy="load-only", **cfg)
        self.app = PickerApp(config)
        if self.app.kv is not None:
            self.app.kv.facts.ask_server_info = False  # echo workers have no /server_info
        self.bg.run(self.app.start())
        self.envoy = EnvoyProcess(envoy_config.EnvoyOptions(picker_port=self.app.grpc_port)).start()

    def image_url(self, name: str) -> str:
        return f"http://{self.images.address}/{name}.png"

    def post(self, raw: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """The gateway's status and the bytes the serving worker received (b"" when none did)."""
        before = {w.name: len(w.seen) for w in (self.a, self.b)}
        r = request(self.envoy.url, body=raw, headers=headers)
        new = [w.seen[-1].body for w in (self.a, self.b) if len(w.seen) > before[w.name]]
        assert len(new) <= 1
        return r.status, (new[0] if new and r.status == 200 else b"")

    def count(self, scored: str, reason: str) -> float:
        return self.app.metrics.media_requests.labels(scored, reason)._value.get()

    def score(self, raw: bytes) -> dict[str, Any]:
        r = request(f"http://127.0.0.1:{self.app.admin_port}", path="/debug/score", body=raw)
        assert r.status == 200, r.body
        return r.json()

    def close(self) -> None:
        self.envoy.stop()
        self.bg.run(self.app.stop())
        for part in (self.a, self.b, self.images, self.renderer):
            self.bg.run(part.stop())
        self.bg.close()


@pytest.fixture(scope="module")
def vllm() -> Iterator[MediaGateway]:
    g = MediaGateway("vllm-render")
    yield g
    g.close()


@pytest.fixture(scope="module")
def trtllm() -> Iterator[MediaGateway]:
    g = MediaGateway("trtllm-render")
    yield g
    g.close()


def image_body(*images: dict[str, Any]) -> bytes:
    """A chat body with odd spacing and escapes that a re-encoder would change."""
    parts = ",\n   ".join(json.dumps(p, separators=(" ,", " : ")) for p in images)
    return ('{ "model" : "vlm",\n "messages" : [ {"role":"system","content":"caf\\u00e9 \\ud83d\\ude00 1.0e0"},'
            '\n  {"role":"user","content":[ {"type":"text","text":"compare these"},\n   ' + parts + ' ] } ],'
            '\t"max_tokens":3 , "temperature": 1.50 }').encode()


def image(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def test_image_parts_reach_the_worker_in_order_with_derived_uuids_and_every_other_byte_unchanged(vllm) -> None:
    url = vllm.image_url("cat")
    raw = image_body(image(DATA), image(url))
    status, got = vllm.post(raw)
    assert status == 200
    parts = json.loads(got)["messages"][1]["content"]
    assert [p["image_url"]["url"] for p in parts[1:]] == [DATA, url]
    assert parts[1]["uuid"] == DIGEST and "uuid" not in parts[2]  # an http URL gets no identity
    assert got == raw.replace(b'"}}', b'"},"uuid":"' + DIGEST.encode() + b'"}', 1)
    assert vllm.renderer.bodies[-1]["messages"][1]["content"][1]["uuid"] == DIGEST  # the render keys the same


def test_an_untrusted_caller_uuid_is_not_forwarded(vllm) -> None:
    raw = image_body(image(DATA, uuid="someone-elses-image"), image(vllm.image_url("dog"), uuid="dog"))
    status, got = vllm.post(raw)
    assert status == 200
    parts = json.loads(got)["messages"][1]["content"]
    assert parts[1]["uuid"] == DIGEST and "uuid" not in parts[2]
    assert b"someone-elses-image" not in got and b'"dog"' not in got


def test_a_tenants_caller_uuid_is_namespaced_by_its_salt(vllm) -> None:
    raw = image_body(image(DATA, uuid="shared-name"))
    got = [json.loads(vllm.post(raw, {"x-tenant-id": t})[1]) for t in ("tenant-a", "tenant-b")]
    uuids = [g["messages"][1]["content"][1]["uuid"] for g in got]
    assert uuids[0] != uuids[1] and "shared-name" not in uuids and DIGEST not in uuids
    assert [g["cache_salt"] for g in got] == ["tenant-a", "tenant-b"]


def test_an_untrusted_uuid_only_reference_is_answered_400(vllm) -> None:
    raw = image_body({"type": "image_url", "image_url": None, "uuid": "someone-elses-image"})
    status, got = vllm.post(raw)
    assert status == 400 and got == b""


def test_http_image_urls_are_never_fetched(vllm) -> None:
    raw = image_body(image(vllm.image_url("never")), image(vllm.image_url("never-either")))
    for _ in range(3):
        assert vllm.post(raw)[0] == 200
    vllm.score(raw)
    assert vllm.images.seen == []


def test_image_requests_are_scored_exactly_and_counted(vllm) -> None:
    before = vllm.count("exact", "spans")
    assert vllm.post(image_body(image(DATA)))[0] == 200
    assert vllm.count("exact", "spans") == before + 1


def test_debug_score_shows_each_items_identity_span_and_blocks(vllm) -> None:
    url = vllm.image_url("cat")
    doc = vllm.score(image_body(image(DATA), image(url)))
    media = doc["media"]
    assert (media["scored"], media["reason"]) == ("exact", "spans")
    first, second = media["items"]
    rendered = vllm.renderer._render(json.loads(image_body(image(DATA, uuid=DIGEST), image(url))))
    places = rendered["features"]["mm_placeholders"]["image"]
    assert (first["identifier"], first["offset"], first["length"]) == (DIGEST, places[0]["offset"],
                                                                       places[0]["length"])
    bs = first["block_size"]
    assert first["blocks"] == [places[0]["offset"] // bs, (places[0]["offset"] + places[0]["length"] - 1) // bs]
    assert second["identifier"] == hashlib.sha256(url.encode()).hexdigest() and second["identity_source"] == "engine"


@pytest.mark.parametrize(("part", "reason"), [
    ({"type": "video_url", "video_url": {"url": "http://127.0.0.1:9/v.mp4"}}, "video"),
    ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "audio"),
])
def test_video_and_audio_are_routed_by_load_and_counted(vllm, part: dict[str, Any], reason: str) -> None:
    renders = len(vllm.renderer.bodies)
    before = vllm.count("load_only", reason)
    raw = image_body(image(DATA), part)
    status, got = vllm.post(raw)
    assert status == 200 and json.loads(got)["messages"][1]["content"][2] == part
    assert len(vllm.renderer.bodies) == renders  # not rendered: routed by load
    assert vllm.count("load_only", reason) == before + 1


def test_trtllm_render_routes_an_image_request_by_the_text_before_the_image(trtllm) -> None:
    raw = image_body(image(trtllm.image_url("cat")))
    before = trtllm.count("text_prefix", "renderer_refuses_media")
    status, got = trtllm.post(raw)
    assert status == 200 and got == raw  # the original bytes: no derived uuid, no prompt_token_ids
    assert trtllm.count("text_prefix", "renderer_refuses_media") == before + 1
    probes = trtllm.renderer.bodies[-2:]
    assert [len(p["messages"]) for p in probes] == [2, 2]
    assert all(isinstance(p["messages"][1]["content"], str) for p in probes)  # no media sent to be refused
    doc = trtllm.score(raw)
    system = json.loads(raw)["messages"][0]["content"]
    assert doc["prompt_tokens"] == 1 + len(system) + 1  # the system message, certainly before the image
    assert trtllm.images.seen == []


def test_a_renderer_answering_impossible_spans_is_not_believed_and_the_request_still_served(vllm) -> None:
    before = vllm.count("load_only", "invalid_features")
    vllm.renderer.overlapping = True
    try:
        status, got = vllm.post(image_body(image(DATA), image(DATA)))
    finally:
        vllm.renderer.overlapping = False
    assert status == 200 and got
    assert vllm.count("load_only", "invalid_features") == before + 1
