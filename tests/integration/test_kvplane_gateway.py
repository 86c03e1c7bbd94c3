"""`--kv-event-plane nats` through the whole gateway: real Envoy, the picker, two trtllm-mock workers without
any replay endpoint, one `epp-kv-relay` process for the pool and a real nats-server. NATS taken away under
live traffic fails no request (the workers fall back to their own ZeroMQ events, counted) and the plane comes
back without a restart; a restarted picker has the workers' caches from the relay's dumps at once."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from epp_extproc.dev.nats import NatsServer
from tests.stack import GatewayStack
from tests.waiting import until


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[GatewayStack, NatsServer]]:
    server = NatsServer()
    s = GatewayStack(workers=2, replay=False, picker={"kv_event_plane": "nats", "nats_url": server.url,
                                                       "kv_plane_pool": "gw"})
    s.bg.run(server.start())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    relay = subprocess.Popen([sys.executable, "-m", "epp_extproc.kvplane.relay", "--nats-url", server.url,
                              "--pool", "gw", "--endpoints", s.endpoints_spec(), "--heartbeat-s", "0.5",
                              "--log-level", "WARNING"], env=env)
    try:
        s.start()
        yield s, server
    finally:
        relay.terminate()
        relay.wait(10)
        if server.proc is not None:
            s.bg.run(server.stop())
        s.stop()


def plane(stack: GatewayStack) -> dict:
    return {m.address: stack.kv_snapshot()["workers"][m.address].get("kv_plane", {}) for m in stack.mocks}


def on_plane(stack: GatewayStack) -> bool:
    return all(p.get("mode") == "live" and not p.get("fallback") for p in plane(stack).values())


def chat_ok(stack: GatewayStack, n: int, tag: str) -> int:
    ok = 0
    for i in range(n):
        r = stack.chat([{"role": "user", "content": f"{tag} shared prefix of a conversation " * 8 + str(i % 3)}])
        ok += r.status == 200
    return ok


def test_requests_route_with_the_index_fed_by_the_plane(stack) -> None:
    s, _ = stack
    until(lambda: on_plane(s), lambda: f"the workers on the plane: {plane(s)}", timeout=20)
    assert chat_ok(s, 6, "plane") == 6
    s.wait_index_matches()
    assert s.picker_metric("epp_kv_plane_messages_total") > 0


def test_nats_down_fails_no_request_and_the_plane_returns_without_a_restart(stack) -> None:
    s, server = stack
    until(lambda: on_plane(s), "the workers on the plane", timeout=20)
    fallbacks = s.picker_metric("epp_kv_plane_fallbacks_total")
    s.bg.run(server.stop())
    until(lambda: s.picker_metric("epp_kv_plane_fallback_workers") == 2, "both workers to fall back")
    assert chat_ok(s, 10, "down") == 10
    s.wait_index_matches()  # the fallback's direct ZeroMQ events keep it exact
    assert s.picker_metric("epp_kv_plane_fallbacks_total") - fallbacks == 2
    s.bg.run(server.start())
    until(lambda: on_plane(s), lambda: f"the plane back: {plane(s)}", timeout=30)
    assert s.picker_metric("epp_kv_plane_fallback_workers") == 0
    assert chat_ok(s, 4, "back") == 4
    s.wait_index_matches()


def test_a_restarted_picker_has_the_caches_from_the_dumps_without_engine_replay(stack) -> None:
    s, _ = stack
    until(lambda: on_plane(s), "the workers on the plane", timeout=20)
    assert chat_ok(s, 6, "before restart") == 6
    s.wait_index_matches()
    s.restart_picker()
    until(lambda: on_plane(s), "the new picker on the plane", timeout=20)
    s.wait_index_matches(timeout=5)  # no request since the restart, and the workers have no replay
    assert sum(p["dumps"] for p in plane(s).values()) >= 2
