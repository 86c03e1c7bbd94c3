"""Two picker replicas over the same pool: both subscribe to every worker and converge on the same index.

The KV view is shared through the workers' own events, so a prefix routed by replica A is found by replica B
without any picker-to-picker traffic. Load is shared through replica sync (--peers): a request in flight
through A is load B sees, as soon as A books it.
"""

from __future__ import annotations

import json

import pytest

from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from tests.gateway_client import request
from tests.netutil import free_port
from tests.stack import GatewayStack
from tests.waiting import until

PROMPTS = [f"Shared system prompt number {g} for the replica test. " * 12 for g in range(4)]


@pytest.fixture(scope="module")
def replicas():  # noqa: ANN201
    port_a, port_b = free_port(), free_port()
    stack = GatewayStack(workers=3, picker={"replica_sync_port": port_a, "peers": f"127.0.0.1:{port_b}"}).start()
    cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1", endpoints=stack.endpoints_spec(),
                 tokenizer_protocol="trtllm-render", tokenizer_service_url=stack.renderer.url,
                 prediction_ttl_s=0.0, replica_sync_port=port_b, peers=f"127.0.0.1:{port_a}")
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
    until(lambda: blocks_by_worker(b) == blocks_by_worker(a),
          lambda: f"B's index to equal A's: {blocks_by_worker(b)} != {blocks_by_worker(a)}", interval=0.05)
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


def test_a_request_in_flight_through_replica_a_is_load_on_replica_b(replicas) -> None:  # noqa: ANN001
    stack, b = replicas
    worker = stack.mocks[0].address
    held = stack.bg.run(_book(stack.app, worker, 10))  # a long request in flight through replica A
    try:
        until(lambda: b.load.load(worker).inflight, "A's booking to reach B")
        assert b.load.load(worker).inflight == 1 and b.load.load(worker).prefill_blocks == 10
        assert b.load.total_inflight() == 0  # B counts it as load, not as its own request
    finally:
        stack.bg.run(_free(held))
    until(lambda: b.load.load(worker).inflight == 0, lambda: f"A's free to reach B: {b.load.load(worker)}")


async def _free(booking) -> None:  # noqa: ANN001 - on A's loop, where its sync links run
    booking.free()


def test_replica_b_avoids_the_worker_replica_a_just_loaded(replicas) -> None:  # noqa: ANN001
    stack, b = replicas
    names = {m.address: m.name for m in stack.mocks}
    body = {"model": "mock-model", "messages": [{"role": "user", "content": "a fresh prompt " * 40}]}
    before = request(f"http://127.0.0.1:{b.admin_port}", path="/debug/score",
                     body=json.dumps(body).encode()).json()
    target = before["pick"]
    held = stack.bg.run(_book(stack.app, target, 1000))
    try:
        until(lambda: b.load.load(target).inflight, "A's booking to reach B")
        after = request(f"http://127.0.0.1:{b.admin_port}", path="/debug/score",
                        body=json.dumps(body).encode()).json()
        assert after["pick"] != target, f"B still picks {names[target]}, which A loaded"
    finally:
        stack.bg.run(_free(held))


async def _book(app: PickerApp, worker: str, blocks: float):  # noqa: ANN202 - on A's loop
    return app.load.book(worker, blocks)
