"""Two picker replicas over the same pool: both subscribe to every worker and converge on the same index.

Load bookings are per replica (each only knows what it routed); the KV view is shared through the workers'
own events, so a prefix routed by replica A is found by replica B without any picker-to-picker traffic.
"""

from __future__ import annotations

import json
import time

import pytest

from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from tests.gateway_client import request
from tests.stack import GatewayStack

PROMPTS = [f"Shared system prompt number {g} for the replica test. " * 12 for g in range(4)]


@pytest.fixture(scope="module")
def replicas():  # noqa: ANN201
    stack = GatewayStack(workers=3).start()
    cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1", endpoints=stack.endpoints_spec(),
                 tokenizer_protocol="trtllm-render", tokenizer_service_url=stack.renderer.url,
                 prediction_ttl_s=0.0)
    b = PickerApp(cfg)
    stack.bg.run(b.start())
    yield stack, b
    stack.bg.run(b.stop())
    stack.stop()


def blocks_by_worker(app: PickerApp) -> dict[str, int]:
    assert app.kv is not None
    return {w: app.kv.index.blocks_indexed(w) for w in app.kv.index.workers()}


def test_replica_b_converges_on_the_index_built_from_replica_a_traffic(replicas) -> None:  # noqa: ANN001
    stack, b = replicas
    placed = {}
    for i, p in enumerate(PROMPTS):
        r = stack.chat([{"role": "system", "content": p}, {"role": "user", "content": "q"}])
        assert r.status == 200
        placed[i] = r.headers["x-trtllm-mock-worker"]
    a = stack.app
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and blocks_by_worker(b) != blocks_by_worker(a):
        time.sleep(0.05)
    assert blocks_by_worker(b) == blocks_by_worker(a)
    truth = {m.address: len(m.get("/mock/cache")["blocks"]) for m in stack.mocks}
    assert blocks_by_worker(a) == truth


def test_replica_b_routes_a_known_prefix_to_the_worker_replica_a_chose(replicas) -> None:  # noqa: ANN001
    stack, b = replicas
    names = {m.address: m.name for m in stack.mocks}
    r = stack.chat([{"role": "system", "content": PROMPTS[0]}, {"role": "user", "content": "q"}])
    holder = r.headers["x-trtllm-mock-worker"]
    body = {"model": "mock-model", "messages": [{"role": "system", "content": PROMPTS[0]},
                                                {"role": "user", "content": "another question"}]}
    score = request(f"http://127.0.0.1:{b.admin_port}", path="/debug/score",
                    body=json.dumps(body).encode()).json()
    assert score["route"] == "kv"
    assert names[score["pick"]] == holder
    best = max(score["workers"], key=lambda w: w["overlap_blocks"])
    assert names[best["address"]] == holder and best["overlap_blocks"] > 0


def test_load_bookings_are_per_replica(replicas) -> None:  # noqa: ANN001
    stack, b = replicas
    held = stack.app.load.book(stack.mocks[0].address, 10)  # a long request in flight through replica A
    try:
        assert b.load.load(stack.mocks[0].address).inflight == 0
    finally:
        held.free()
