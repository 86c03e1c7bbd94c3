"""Flow control through a real Envoy, the picker and a real mock TensorRT-LLM worker process saturated by its
own queue (one batch slot): requests beyond saturation wait in the picker, leave it by band, fairly between
tenants and FIFO per tenant, expire with 429, are shed at once when sheddable, and leave nothing behind when
their client goes away.

One worker, so the order the picker releases requests in is the order the engine serves them (its queue is
FIFO), which is what the order tests observe from the client side.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway_client import Reply
from tests.stack import GatewayStack
from tests.waiting import until

TTL_S = 2.0
DECODE_MS = 5.0
SHORT_TOKENS = 8  # ~40 ms of decode: a queued request


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    objectives = Path(tmp_path_factory.mktemp("flow")) / "objectives.yaml"
    objectives.write_text("premium: 10\nstandard: 0\nbatch: -1\n")
    s = GatewayStack(workers=1, worker_args=["--max-batch-size", "1", "--decode-ms-per-token", str(DECODE_MS)],
                     picker={"flow_control": True, "queue_depth_threshold": 1, "worker_metrics_interval_ms": 50,
                             "flow_control_queue_ttl_s": TTL_S,
                             "inference_objectives_file": str(objectives)}).start()
    yield s
    s.stop()


def engine(stack: GatewayStack) -> dict[str, Any]:
    return stack.mocks[0].get("/mock/stats")


def flow(stack: GatewayStack) -> dict[str, Any]:
    return stack.picker_get("/debug/flow")


def queued(stack: GatewayStack) -> int:
    return flow(stack)["queue"]["queued"]


def open_raw(stack: GatewayStack, max_tokens: int, headers: dict[str, str] | None = None) -> socket.socket:
    """A request on a raw socket, left open: it holds the worker until the caller closes it."""
    body = json.dumps({"model": "mock-model", "messages": [{"role": "user", "content": "block"}],
                       "max_tokens": max_tokens, "stream": True}).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    port = int(stack.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n{extra}"
                 f"content-length: {len(body)}\r\n\r\n".encode() + body)
    return sock


class Saturated:
    """Fill the worker with long requests: one running and one waiting in the engine (threshold 1), so the
    pool is saturated and further requests queue in the picker. Closing them frees the worker."""

    def __init__(self, stack: GatewayStack, max_tokens: int = 4000) -> None:
        self.stack = stack
        self.socks = [open_raw(stack, max_tokens)]
        until(lambda: engine(stack)["running"] == 1, "the first blocker runs")
        self.socks.append(open_raw(stack, max_tokens))
        until(lambda: engine(stack)["waiting"] == 1, "the second blocker waits in the engine")
        until(lambda: flow(stack)["workers"][stack.mocks[0].address]["saturated"], "the pool is saturated")

    def release(self) -> None:
        """One at a time, each after the queue has moved: two slots freed together would dispatch two
        requests at once, and their render calls may finish in either order before they reach the engine."""
        for s in self.socks:
            n = queued(self.stack)
            s.close()
            if n:
                until(lambda n=n: queued(self.stack) < n, "a queued request is dispatched")
        self.socks = []

    def __enter__(self) -> Saturated:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Clients:
    """Requests sent from threads; `done` records (tag, reply) in completion order."""

    def __init__(self, stack: GatewayStack) -> None:
        self.stack = stack
        self.done: list[tuple[str, Reply]] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def send(self, tag: str, headers: dict[str, str] | None = None, max_tokens: int = SHORT_TOKENS) -> None:
        def run() -> None:
            r = self.stack.chat([{"role": "user", "content": f"request {tag}"}], headers=headers,
                                max_tokens=max_tokens)
            with self.lock:
                self.done.append((tag, r))

        t = threading.Thread(target=run)
        self.threads.append(t)
        n = queued(self.stack)
        t.start()
        until(lambda: queued(self.stack) == n + 1, f"{tag} is queued in the picker")

    def join(self) -> list[tuple[str, Reply]]:
        for t in self.threads:
            t.join(30)
        return self.done


def settle(stack: GatewayStack) -> None:
    stack.wait_idle()
    until(lambda: queued(stack) == 0 and flow(stack)["queue"]["pending"] == 0, "the queue is empty")
    until(lambda: engine(stack)["running"] == 0 and engine(stack)["waiting"] == 0, "the engine is idle")
    # the picker learns it from its next scrape of the worker's metrics (every 50 ms here): until then it still
    # sees the pool saturated, and a sheddable request sent at once would be shed
    until(lambda: not any(w["saturated"] for w in flow(stack)["workers"].values()), "the picker sees room")


def test_requests_beyond_saturation_wait_in_the_picker_not_in_the_engine(stack: GatewayStack) -> None:
    clients = Clients(stack)
    with Saturated(stack):
        for i in range(3):
            clients.send(f"q{i}")
        assert engine(stack)["waiting"] == 1  # the engine queue did not grow: the three wait in the picker
        assert stack.picker_metric("epp_flow_control_queue_size", 'priority="0"') == 3
    done = clients.join()
    assert [r.status for _, r in done] == [200] * 3
    assert stack.picker_metric("epp_flow_control_dispatched_total", 'priority="0"') >= 3
    settle(stack)


def test_higher_band_is_served_before_earlier_lower_band_requests(stack: GatewayStack) -> None:
    clients = Clients(stack)
    with Saturated(stack):
        for i in range(3):
            clients.send(f"low{i}", {"x-gateway-inference-objective": "standard"})
        clients.send("high", {"x-gateway-inference-objective": "premium"})
    done = clients.join()
    assert [t for t, _ in done] == ["high", "low0", "low1", "low2"]
    assert all(r.status == 200 for _, r in done)
    settle(stack)


def test_tenants_in_a_band_take_turns_and_each_is_served_in_order(stack: GatewayStack) -> None:
    clients = Clients(stack)
    with Saturated(stack):
        for i in range(4):
            clients.send(f"a{i}", {"x-gateway-inference-fairness-id": "tenant-a"})
        for i in range(2):
            clients.send(f"b{i}", {"x-gateway-inference-fairness-id": "tenant-b"})
    done = [t for t, _ in clients.join()]
    assert done == ["a0", "b0", "a1", "b1", "a2", "a3"]
    settle(stack)


def test_sheddable_request_gets_429_at_once_while_saturated(stack: GatewayStack) -> None:
    with Saturated(stack):
        started = time.monotonic()
        r = stack.chat([{"role": "user", "content": "shed me"}], headers={"x-llm-d-inference-objective": "batch"})
        took = time.monotonic() - started
    assert r.status == 429 and took < TTL_S / 2
    assert r.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    settle(stack)
    ok = stack.chat([{"role": "user", "content": "not saturated"}], headers={"x-llm-d-inference-objective": "batch"})
    assert ok.status == 200  # sheddable traffic flows while there is room


def test_request_queued_past_the_ttl_gets_429_with_the_reason(stack: GatewayStack) -> None:
    before = stack.mocks[0].get("/mock/stats")["inference_requests"]
    with Saturated(stack):
        started = time.monotonic()
        r = stack.chat([{"role": "user", "content": "too late"}])
        took = time.monotonic() - started
        assert stack.mocks[0].get("/mock/stats")["inference_requests"] == before + 2  # only the blockers
    assert r.status == 429 and r.headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
    assert TTL_S <= took < TTL_S + 2
    assert stack.picker_metric("epp_flow_control_rejected_total", 'reason="rejected-ttl-expired"') >= 1
    settle(stack)


def test_client_that_disconnects_while_queued_leaves_nothing_behind(stack: GatewayStack) -> None:
    assert stack.app is not None
    before = stack.mocks[0].get("/mock/stats")["inference_requests"]
    cancelled = stack.picker_metric("epp_flow_control_rejected_total", 'reason="client_cancelled"')
    with Saturated(stack):
        sock = open_raw(stack, SHORT_TOKENS, {"x-gateway-inference-fairness-id": "leaver"})
        until(lambda: queued(stack) == 1, "the request is queued")
        sock.close()
        until(lambda: queued(stack) == 0, "the queue forgot it")
        until(lambda: stack.app.picker.open_requests == 2, "its stream is gone")  # type: ignore[union-attr]
        assert flow(stack)["queue"]["bands"] == {} and flow(stack)["queue"]["pending"] == 0
    assert stack.picker_metric("epp_flow_control_rejected_total", 'reason="client_cancelled"') == cancelled + 1
    settle(stack)
    assert stack.mocks[0].get("/mock/stats")["inference_requests"] == before + 2  # it never reached the worker
    assert stack.chat([{"role": "user", "content": "after"}]).status == 200
    settle(stack)




@pytest.fixture(scope="module")
def buffered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    s = GatewayStack(workers=1, body_mode="BUFFERED",
                     worker_args=["--max-batch-size", "1", "--decode-ms-per-token", str(DECODE_MS)],
                     picker={"flow_control": True, "queue_depth_threshold": 1, "worker_metrics_interval_ms": 50,
                             "flow_control_queue_ttl_s": 30.0, "tokenization_timeout_ms": 500},
                     envoy_opts={"render_timeout_ms": 500, "queue_ttl_s": 30.0}).start()
    yield s
    s.stop()


def test_in_buffered_mode_a_request_queued_longer_than_render_plus_5s_is_still_served(
        buffered: GatewayStack) -> None:
    """Envoy times the BUFFERED body message; a request the picker holds in its queue must outlive it."""
    clients = Clients(buffered)
    with Saturated(buffered):
        clients.send("patient")
        time.sleep(5.0 + 0.5 + 0.7)  # past render timeout + 5 s, the message timeout before the queue TTL counted
        assert queued(buffered) == 1
    (tag, r), = clients.join()
    assert r.status == 200, r.body
    settle(buffered)
