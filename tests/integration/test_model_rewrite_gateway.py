"""Model rewrites end to end: real Envoy, the picker reading --model-rewrites-file, mock renderer and mock
TensorRT-LLM workers. What the worker received is read back from the worker itself (`/mock/last-request`:
the exact bytes), so the check is on the wire: only the model's value changed, and the answer is a 200."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway_client import Reply
from tests.stack import GatewayStack, MockProc

REWRITES = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModelRewrite
metadata: {name: rollout}
spec:
  rules:
    - matches: [{model: {value: mock-model}}]
      targets: [{modelRewrite: "mock-model-ft-\\u00e9t\\u00e9-v2"}]
    - matches: [{model: {value: canary}}]
      targets: [{modelRewrite: canary-a, weight: 50}, {modelRewrite: canary-b, weight: 50}]
"""
TARGET = "mock-model-ft-été-v2"


def last_body(m: MockProc) -> bytes:
    with urllib.request.urlopen(m.url + "/mock/last-request", timeout=10) as r:
        return r.read()


def served_by(stack: GatewayStack, r: Reply) -> MockProc:
    return next(m for m in stack.mocks if m.name == r.headers["x-trtllm-mock-worker"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    f: Path = tmp_path_factory.mktemp("rewrites") / "rewrites.yaml"
    f.write_text(REWRITES)
    # passthrough off: the worker gets the client's body itself, so every byte but the model's can be compared
    s = GatewayStack(workers=2, picker={"model_rewrites_file": str(f), "prompt_passthrough": "off"}).start()
    yield s
    s.stop()


def test_the_worker_receives_the_rewritten_model_and_every_other_byte_and_the_client_gets_200(stack) -> None:
    raw = (b'{"model" : "mock-model", "messages": [{"role": "user", "content": "caf\\u00e9 \xe2\x98\x95 '
           b'rewrite me"}],\n "max_tokens": 4, "temperature": 0.50}')
    r = stack.post_raw(raw, headers={"content-type": "application/json"})
    assert r.status == 200, r.body
    got = last_body(served_by(stack, r))
    assert got == raw.replace(b'"mock-model"', json.dumps(TARGET, ensure_ascii=False).encode())
    assert stack.picker_metric("epp_model_rewrites_total", f'target="{TARGET}"') >= 1


def test_a_session_stays_on_one_target_through_the_gateway(stack) -> None:
    for session in ("conversation-1", "conversation-2", "conversation-3"):
        targets = set()
        for turn in range(4):
            r = stack.chat([{"role": "user", "content": f"turn {turn}"}], model="canary",
                           headers={"content-type": "application/json", "x-session-id": session})
            assert r.status == 200, r.body
            targets.add(json.loads(last_body(served_by(stack, r)))["model"])
        assert len(targets) == 1 and targets <= {"canary-a", "canary-b"}, targets


def test_a_model_without_a_rule_reaches_the_worker_unchanged(stack) -> None:
    raw = b'{"model":"untouched","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
    r = stack.post_raw(raw, headers={"content-type": "application/json"})
    assert r.status == 200, r.body
    assert last_body(served_by(stack, r)) == raw
