"""--prediction-lifetime queue through a real Envoy, the picker and a real mock TensorRT-LLM worker with one batch
slot: a request waiting in the worker's queue keeps its predicted blocks held past the fixed ttl, and once it is
prefilled the worker's BlockStored confirms them, so nothing stays held afterwards. (That the first chunk alone
releases a hold is the pipeline test's, tests/unit/test_prediction_lifetime.py: the mock confirms every block.)"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.stack import GatewayStack
from tests.waiting import until

TTL_S = 0.5


@pytest.fixture(scope="module")
def stack() -> Iterator[GatewayStack]:
    s = GatewayStack(workers=1, worker_args=["--max-batch-size", "1", "--decode-ms-per-token", "5"],
                     picker={"prediction_lifetime": "queue", "prediction_ttl_s": TTL_S}).start()
    yield s
    s.stop()


def engine(stack: GatewayStack) -> dict[str, Any]:
    return stack.mocks[0].get("/mock/stats")


def worker_kv(stack: GatewayStack) -> dict[str, Any]:
    return stack.kv_snapshot()["workers"][stack.mocks[0].address]


def open_raw(stack: GatewayStack, text: str, max_tokens: int) -> socket.socket:
    """A streaming request on a raw socket, left open: the first holds the worker's only batch slot."""
    body = json.dumps({"model": "mock-model", "messages": [{"role": "user", "content": text}],
                       "max_tokens": max_tokens, "stream": True}).encode()
    port = int(stack.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_a_queued_request_holds_its_prediction_until_the_worker_confirms_it(stack: GatewayStack) -> None:
    blocker = open_raw(stack, "blocker " * 50, 4000)  # runs for ~20 s unless closed
    until(lambda: engine(stack)["running"] == 1, "the blocker runs")
    queued = open_raw(stack, "a long prompt that waits behind the blocker " * 30, 4)
    try:
        until(lambda: engine(stack)["waiting"] == 1, "the second request waits in the engine")
        until(lambda: worker_kv(stack)["predicted_held"] > 0, "the queued request's blocks to be held")
        held = worker_kv(stack)["predicted_held"]
        time.sleep(2 * TTL_S)  # longer than the fixed ttl: still waiting, still held
        assert engine(stack)["waiting"] == 1 and worker_kv(stack)["predicted_held"] == held
        blocker.close()  # the queued request is prefilled now: its blocks are stored, and its first chunk comes
        until(lambda: worker_kv(stack)["predicted_held"] == 0, "the hold to end", timeout=20)
        until(lambda: worker_kv(stack)["predictions_confirmed"] >= held, "the worker's events to confirm it")
    finally:
        blocker.close()
        queued.close()
    stack.wait_idle()
