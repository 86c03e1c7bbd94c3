"""The P/D overlay of `epp-extproc envoy-config` (--pd) and of `make run` (epp-local-gateway --pd).

Envoy's side is checked the way the other generated configs are (`envoy --mode validate`), then run: a real
Envoy with the overlay strips a client's x-prefiller-host-port before anything else sees the request."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from epp_extproc.dev import envoy_config, local_gateway, procs
from epp_extproc.dev.envoy_config import EnvoyOptions
from epp_extproc.gaie import PREFILLER_HEADER
from tests.gateway_client import request
from tests.harness import BackgroundLoop, EchoUpstream, EnvoyProcess

PICKER = str(Path(sys.executable).parent / "epp-extproc")


def _validate(cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([envoy_config.envoy_binary(), "--mode", "validate", "-c", str(cfg), "--log-level",
                           "error"], capture_output=True, text=True, timeout=60)


def _filters(doc: dict) -> list[str]:
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return [f["name"] for f in hcm["http_filters"]]


@pytest.mark.parametrize("opts", [EnvoyOptions(pd=True), EnvoyOptions(pd=True, body_mode="BUFFERED"),
                                  EnvoyOptions(pd=True, response_mode="echo", failure_mode_allow=True),
                                  EnvoyOptions(pd=True, subset_hint_header="x-hint")],
                         ids=["streamed", "buffered", "echo-fail-open", "subset-hint"])
def test_the_pd_overlay_passes_envoy_validate(opts: EnvoyOptions, tmp_path: Path) -> None:
    r = _validate(envoy_config.write(opts, tmp_path / "envoy.yaml"))
    assert r.returncode == 0, r.stdout[-500:] + r.stderr[-500:]


def test_the_cli_overlay_strips_the_header_before_the_picker_sees_the_request() -> None:
    out = subprocess.run([PICKER, "envoy-config", "--pd", "true"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load(out.stdout)
    names = _filters(doc)
    assert names.index("epp.strip_prefiller_header") < names.index("envoy.filters.http.ext_proc")
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    strip = next(f for f in hcm["http_filters"] if f["name"] == "epp.strip_prefiller_header")
    assert strip["typed_config"]["mutations"]["request_mutations"] == [{"remove": PREFILLER_HEADER}]


def test_without_the_overlay_there_is_no_strip_filter() -> None:
    assert "epp.strip_prefiller_header" not in _filters(yaml.safe_load(envoy_config.render(EnvoyOptions(),
                                                                                             "yaml")))


def test_a_real_envoy_with_the_overlay_drops_every_client_copy() -> None:
    bg = BackgroundLoop()
    up = EchoUpstream("w")
    bg.run(up.start())
    envoy = EnvoyProcess(EnvoyOptions(with_picker=False, static_upstreams=(up.address,), pd=True)).start()
    try:
        r = request(envoy.url, body=b'{"messages":[]}',
                    headers=[(PREFILLER_HEADER, "10.6.6.6:1"), (PREFILLER_HEADER.upper(), "10.6.6.7:1")])
        assert r.status == 200
        assert PREFILLER_HEADER not in {k.lower() for k in up.seen[-1].headers}
    finally:
        envoy.stop()
        bg.run(up.stop())
        bg.close()


# ---------------------------------------------------------------------------------------------- make run --pd

def test_make_run_pd_fails_with_a_clear_message_when_the_sidecar_is_not_installed(monkeypatch, capsys) -> None:
    monkeypatch.setattr(procs, "PD_SIDECAR", "/nonexistent/epp-pd-sidecar")
    assert local_gateway.main(["--pd"]) == 1
    err = capsys.readouterr().err
    assert "epp-pd-sidecar" in err and "/nonexistent/epp-pd-sidecar" in err


def test_make_run_pd_builds_one_prefill_one_decode_behind_its_sidecar_and_no_aggregated_worker(
        monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(procs, "PD_SIDECAR", "/bin/true")
    args = local_gateway._parser({}).parse_args(["--pd", "--worker-base-port", "18001", "--sidecar-port", "18200"])
    children, endpoints = local_gateway._children(args, tmp_path)
    by_role = {e["role"]: e for e in endpoints}
    assert set(by_role) == {"prefill", "decode"} and len(endpoints) == 2
    assert by_role["prefill"]["address"] == "127.0.0.1:18001"
    assert by_role["decode"]["address"] == "127.0.0.1:18200"  # the decode endpoint is the sidecar
    (sidecar,) = [c for c in children if c.name == "pd-sidecar"]
    assert sidecar.argv[sidecar.argv.index("--decode-url") + 1] == "http://127.0.0.1:18002"
    assert sidecar.argv[sidecar.argv.index("--allowed-prefillers") + 1] == "127.0.0.1:18001"
    assert sidecar.argv[sidecar.argv.index("--engine") + 1] == "trtllm"
    (pick,) = [c for c in children if c.name == "picker"]
    assert pick.argv[pick.argv.index("--pd-min-uncached-tokens") + 1] == "16"
    assert not [c for c in children if c.name.startswith("worker-")]


def test_make_run_without_pd_is_unchanged(tmp_path: Path) -> None:
    args = local_gateway._parser({}).parse_args([])
    children, endpoints = local_gateway._children(args, tmp_path)
    assert [e["name"] for e in endpoints] == ["worker-0", "worker-1"] and "role" not in endpoints[0]
    assert not [c for c in children if c.name == "pd-sidecar"]


@pytest.mark.skipif(not Path(procs.PD_SIDECAR).exists(), reason="epp-pd-sidecar is not installed")
def test_make_run_pd_serves_a_long_prompt_disaggregated_and_a_short_one_locally(tmp_path: Path) -> None:
    import json
    import os
    import signal

    from tests.netutil import free_base_port, free_port

    ports = {k: free_port() for k in ("port", "renderer-port", "picker-port", "health-port", "metrics-port",
                                      "envoy-admin-port", "sidecar-port")}
    ports["worker-base-port"] = free_base_port((0, 1))
    ports["kv-base-port"] = free_base_port((0, 1, 10, 11))
    argv = [str(Path(sys.executable).parent / "epp-local-gateway"), "--pd", "--workdir", str(tmp_path)]
    for k, v in ports.items():
        argv += [f"--{k}", str(v)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    out = b""
    try:
        while b"Local gateway ready" not in out:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, out.decode(errors="replace")[-3000:]
            out += line
        gw = f"http://127.0.0.1:{ports['port']}"
        for content, path in (("tell me a long story about the sea " * 30, "disaggregated"), ("hi", "local_prefill")):
            body = json.dumps({"model": "mock-model", "max_tokens": 4,
                               "messages": [{"role": "user", "content": content}]}).encode()
            r = request(gw, body=body)
            assert r.status == 200, r.body
            assert r.json()["usage"]["completion_tokens"] == 4
            metrics = request(f"http://127.0.0.1:{ports['metrics-port']}", method="GET", path="/metrics").body
            assert f'epp_pd_decisions_total{{path="{path}"'.encode() in metrics
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=30)
