"""`make run`'s one command: the whole local gateway starts, answers through Envoy, and stops on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.gateway_client import request
from tests.netutil import free_base_port, free_port, wait_port


def test_local_gateway_serves_a_chat_request_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    ports = {k: free_port() for k in ("port", "renderer-port", "picker-port", "health-port", "metrics-port",
                                       "envoy-admin-port")}
    wbase = free_base_port((0, 1))  # worker i listens on wbase + i
    kvbase = free_base_port((0, 1, 10, 11))  # worker i publishes on kvbase + 10*i and replays on +1
    argv = [str(Path(sys.executable).parent / "epp-local-gateway"), "--workdir", str(tmp_path),
            "--worker-base-port", str(wbase), "--kv-base-port", str(kvbase)]
    for k, v in ports.items():
        argv += [f"--{k}", str(v)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = b""
        deadline = time.monotonic() + 60
        while b"Local gateway ready" not in out and time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            out += line
        assert b"Local gateway ready" in out, out.decode(errors="replace")[-3000:]
        wait_port(ports["port"])
        body = json.dumps({"model": "mock-model", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 4}).encode()
        r = request(f"http://127.0.0.1:{ports['port']}", body=body)
        assert r.status == 200, r.body
        assert r.headers["x-trtllm-mock-worker"] in ("worker-0", "worker-1")
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        os.killpg(proc.pid, signal.SIGINT) if proc.poll() is None else None
        rest = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, rest.decode(errors="replace")[-3000:]
    # every child is gone: nothing listens on the gateway port any more
    import socket

    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", ports["port"])) != 0
