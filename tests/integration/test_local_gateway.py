"""`make run`'s one command: the whole local gateway starts, answers through Envoy, and stops on Ctrl-C.

Every port is settable by flag or by environment, `--help` shows every default, ENVOY_BIN chooses Envoy
(a missing one is a one-line error), and the temporary folder is gone after exit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epp_extproc.dev.local_gateway import SETTINGS
from tests.gateway_client import request
from tests.netutil import free_base_port, free_port, wait_port

GATEWAY = str(Path(sys.executable).parent / "epp-local-gateway")
PORT_FLAGS = ("port", "renderer-port", "picker-port", "health-port", "metrics-port", "envoy-admin-port")


def _ports() -> dict[str, int]:
    """Ports for every flag, all distinct: a free port is free only until it is used, so two independent picks
    (or a base plus its offsets) can land on the same number, and the second process then fails to bind."""
    while True:
        ports = {k: free_port() for k in PORT_FLAGS}
        ports["worker-base-port"] = free_base_port((0, 1))  # worker i listens on base + i
        ports["kv-base-port"] = free_base_port((0, 1, 10, 11))  # worker i publishes on base + 10*i, replays +1
        used = [p for k, p in ports.items() if not k.endswith("base-port")]
        used += [ports["worker-base-port"] + i for i in (0, 1)]
        used += [ports["kv-base-port"] + i for i in (0, 1, 10, 11)]
        if len(set(used)) == len(used):
            return ports


def _run_until_ready_then_ctrl_c(argv: list[str], env: dict[str, str], gateway_port: int) -> str:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    out = b""
    try:
        deadline = time.monotonic() + 60
        while b"Local gateway ready" not in out and time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            out += line
        assert b"Local gateway ready" in out, out.decode(errors="replace")[-3000:]
        for _ in range(12):  # the rest of the banner (folder line, URLs)
            out += proc.stdout.readline()  # type: ignore[union-attr]
        wait_port(gateway_port)
        body = json.dumps({"model": "mock-model", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 4}).encode()
        r = request(f"http://127.0.0.1:{gateway_port}", body=body)
        assert r.status == 200, r.body
        assert r.headers["x-trtllm-mock-worker"] in ("worker-0", "worker-1")
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        os.killpg(proc.pid, signal.SIGINT) if proc.poll() is None else None
        rest = proc.communicate(timeout=30)[0]
    text = (out + rest).decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    with socket.socket() as s:  # every child is gone: nothing listens on the gateway port any more
        assert s.connect_ex(("127.0.0.1", gateway_port)) != 0
    return text


def test_local_gateway_serves_a_chat_request_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    ports = _ports()
    argv = [GATEWAY, "--workdir", str(tmp_path)]
    for k, v in ports.items():
        argv += [f"--{k}", str(v)]
    _run_until_ready_then_ctrl_c(argv, dict(os.environ), ports["port"])
    assert (tmp_path / "envoy.yaml").is_file()  # an explicit workdir is kept


def test_every_port_comes_from_the_environment_and_the_temp_folder_is_removed_on_exit() -> None:
    ports = _ports()
    env = dict(os.environ)
    for k, v in ports.items():
        env["GATEWAY_" + k.upper().replace("-", "_")] = str(v)
    text = _run_until_ready_then_ctrl_c([GATEWAY], env, ports["port"])
    m = re.search(r"in (/\S+?), removed on exit", text)
    assert m, text[-2000:]
    assert not Path(m.group(1)).exists()
    assert f"127.0.0.1:{ports['metrics-port']}/metrics" in text


def test_help_shows_every_option_with_its_env_name_and_default() -> None:
    out = subprocess.run([GATEWAY, "--help"], capture_output=True, text=True, timeout=30, env={
        k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")})
    assert out.returncode == 0, out.stderr
    flat = " ".join(out.stdout.split())
    for flag, var, default, _, _ in SETTINGS:
        assert flag in flat
        assert f"[env {var}] (default: {default})" in flat, flag
    assert "ENVOY_BIN" in flat


@pytest.mark.parametrize("envoy_bin", ["/nonexistent/envoy", "definitely-not-an-envoy-binary"])
def test_a_missing_envoy_is_a_one_line_error_not_a_traceback(envoy_bin: str) -> None:
    out = subprocess.run([GATEWAY, "--port", str(free_port())], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "ENVOY_BIN": envoy_bin})
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "ENVOY_BIN" in lines[0] and "Traceback" not in out.stderr, out.stderr
    assert out.stdout == ""  # nothing was started


def test_envoy_bin_chooses_the_envoy_binary(tmp_path: Path) -> None:
    """A wrapper named by ENVOY_BIN is what gets run (it records its arguments, then execs the real Envoy)."""
    from epp_extproc.dev.envoy_config import envoy_binary

    real = envoy_binary({})
    marker = tmp_path / "called"
    wrapper = tmp_path / "my-envoy"
    wrapper.write_text(f"#!/bin/sh\necho \"$@\" > {marker}\nexec {real} \"$@\"\n")
    wrapper.chmod(0o755)
    assert envoy_binary({"ENVOY_BIN": str(wrapper)}) == str(wrapper)
    ports = _ports()
    argv = [GATEWAY, "--workdir", str(tmp_path / "w")]
    for k, v in ports.items():
        argv += [f"--{k}", str(v)]
    _run_until_ready_then_ctrl_c(argv, {**os.environ, "ENVOY_BIN": str(wrapper)}, ports["port"])
    assert "-c" in marker.read_text()
