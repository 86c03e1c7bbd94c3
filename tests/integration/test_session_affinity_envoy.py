"""Session affinity through a real Envoy, real mock workers and KV routing: a token names its worker and
brings the client's later requests back there; a forged one is re-picked and counted."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from epp_extproc.core.session import SESSION_HEADER, SessionTokens
from tests.stack import GatewayStack

KEY = os.urandom(32)


@pytest.fixture(scope="module", params=["lean", "echo"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    """Lean mode with the answer's headers sent to the picker, and the full-duplex mode GAIE's config uses."""
    keys = Path(tmp_path_factory.mktemp("keys")) / "session-keys"
    keys.write_text(base64.b64encode(KEY).decode() + "\n")
    s = GatewayStack(workers=2, picker={"session_affinity_keys_file": str(keys)},
                     envoy_opts={"response_mode": request.param, "lean_response_headers": True}).start()
    yield s
    s.stop()


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def outcome(stack: GatewayStack, name: str) -> float:
    assert stack.app is not None
    return stack.app.metrics.registry.get_sample_value("epp_session_affinity_total", {"outcome": name}) or 0.0


def test_opting_in_returns_a_sealed_token_naming_the_worker_that_served(stack: GatewayStack) -> None:
    r = stack.chat(user("hello, a new session " * 20), headers={SESSION_HEADER: "new"}, max_tokens=4)
    assert r.status == 200
    token = r.headers[SESSION_HEADER]
    served = {m.name: m.address for m in stack.mocks}[r.headers["x-trtllm-mock-worker"]]
    assert SessionTokens([KEY], 60).open(token)[1] == served
    assert served.encode() not in base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))


def test_requests_carrying_a_token_all_go_to_its_worker(stack: GatewayStack) -> None:
    sealer = SessionTokens([KEY], 60)
    for m in stack.mocks:  # one group per worker: the cost rule alone cannot send both groups where named
        before = outcome(stack, "honoured")
        token = sealer.seal(m.address)
        served = set()
        for i in range(5):
            r = stack.chat(user(f"turn {i} of a conversation pinned to {m.name} " * 12),
                           headers={SESSION_HEADER: token}, max_tokens=4)
            assert r.status == 200
            served.add(r.headers["x-trtllm-mock-worker"])
            token = r.headers[SESSION_HEADER]  # each answer's fresh token, as a client keeps it
        assert served == {m.name}
        assert outcome(stack, "honoured") == before + 5


def test_a_token_sealed_with_another_key_is_re_picked_counted_and_replaced(stack: GatewayStack) -> None:
    before = outcome(stack, "tampered")
    forged = SessionTokens([os.urandom(32)], 60).seal(stack.mocks[0].address)
    r = stack.chat(user("a forged session"), headers={SESSION_HEADER: forged}, max_tokens=4)
    assert r.status == 200
    assert outcome(stack, "tampered") == before + 1
    assert SessionTokens([KEY], 60).open(r.headers[SESSION_HEADER])[0] == "honoured"


def test_a_request_without_the_header_gets_no_token(stack: GatewayStack) -> None:
    r = stack.chat(user("no session here"), max_tokens=4)
    assert r.status == 200 and SESSION_HEADER not in r.headers
