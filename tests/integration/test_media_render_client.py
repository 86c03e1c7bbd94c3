"""The render client reads a vLLM render answer's `features` over real HTTP: items with their spans, and a
hostile answer's features refused (the ids still usable, the items not believed), never a crash."""

from __future__ import annotations

from typing import Any

import pytest

from epp_extproc.adapters.render_client import RenderClient
from epp_extproc.core.contract import MediaItem
from epp_extproc.metrics import PickerMetrics
from tests.integration.test_render_and_salt import StubRenderer


@pytest.fixture
async def stub():
    s = StubRenderer()
    await s.start()
    yield s
    await s.stop()


def client(stub: StubRenderer, protocol: str = "vllm-render") -> RenderClient:
    return RenderClient(protocol, f"http://127.0.0.1:{stub.port}", timeout_ms=2000, max_response_bytes=16 << 20,
                        metrics=PickerMetrics())


def answer(features: Any) -> dict[str, Any]:
    return {"request_id": "r", "token_ids": list(range(64)), "features": features, "sampling_params": {}}


GOOD = {"mm_hashes": {"image": ["b", "a"]},
        "mm_placeholders": {"image": [{"offset": 40, "length": 8}, {"offset": 4, "length": 16}]},
        "kwargs_data": None, "mm_metadata": None}


async def test_vllm_features_become_items_sorted_by_offset(stub: StubRenderer) -> None:
    stub.doc = answer(GOOD)
    c = client(stub)
    r = await c.render("chat", b"{}")
    assert r.media == (("image", MediaItem("a", 4, 16)), ("image", MediaItem("b", 40, 8)))
    assert r.media_invalid is None and r.token_ids == list(range(64))
    await c.close()


async def test_a_text_answer_has_no_items(stub: StubRenderer) -> None:
    stub.doc = {"token_ids": [1, 2, 3]}
    c = client(stub)
    r = await c.render("chat", b"{}")
    assert (r.media, r.media_invalid) == (None, None)
    await c.close()


@pytest.mark.parametrize("features", [
    "garbage", {"mm_hashes": {"image": ["a"]}, "mm_placeholders": {"image": [{"offset": 60, "length": 10}]}},
    {"mm_hashes": {"image": ["a"] * 100_000}, "mm_placeholders": {"image": [{"offset": 0, "length": 1}] * 100_000}},
])
async def test_hostile_features_are_refused_and_the_answer_still_parsed(stub: StubRenderer, features: Any) -> None:
    stub.doc = answer(features)
    c = client(stub)
    r = await c.render("chat", b"{}")
    assert r.media is None and r.media_invalid is not None and len(r.media_invalid) <= 200
    assert r.token_ids == list(range(64))
    await c.close()


async def test_other_protocols_ignore_features(stub: StubRenderer) -> None:
    stub.doc = answer(GOOD)
    c = client(stub, "trtllm-render")
    assert (await c.render("chat", b"{}")).media is None
    await c.close()
