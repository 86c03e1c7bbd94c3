"""`make run ARGS=--kv-event-plane nats`: the local gateway with a nats-server and an epp-kv-relay, the picker
reading the plane; it answers through Envoy and stops cleanly on Ctrl-C."""

from __future__ import annotations

import os
from pathlib import Path

from tests.integration.test_local_gateway import GATEWAY, _ports, _run_until_ready_then_ctrl_c
from tests.netutil import free_port


def test_local_gateway_on_the_nats_plane_serves_and_stops_cleanly(tmp_path: Path) -> None:
    ports = _ports()
    argv = [GATEWAY, "--workdir", str(tmp_path), "--kv-event-plane", "nats", "--nats-port", str(free_port())]
    for k, v in ports.items():
        argv += [f"--{k}", str(v)]
    _run_until_ready_then_ctrl_c(argv, dict(os.environ), ports["port"])
    assert "live plane on" in (tmp_path / "kv-relay.log").read_text()
    assert "connected to NATS" in (tmp_path / "picker.log").read_text()
