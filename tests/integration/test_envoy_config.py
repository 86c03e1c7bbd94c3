"""`epp-extproc envoy-config` and the generator behind it: every option combination is a configuration the
real Envoy accepts (`envoy --mode validate`), and the stanzas a picker needs are where Envoy reads them."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from epp_extproc.dev import envoy_config
from epp_extproc.dev.envoy_config import EnvoyOptions
from epp_extproc.envoy.tls import self_signed

PICKER = str(Path(sys.executable).parent / "epp-extproc")
SWITCHES = ("picker_tls", "picker_health_check", "forward_metadata", "failure_mode_allow")


def _combinations(ca: str) -> list[EnvoyOptions]:
    out = []
    for mode, with_ca, hint, *flags in itertools.product(envoy_config.BODY_MODES, (False, True), (None, "x-hint"),
                                                         *[(False, True)] * len(SWITCHES)):
        sw = dict(zip(SWITCHES, flags, strict=True))
        if with_ca and not sw["picker_tls"]:
            continue  # a CA without TLS means nothing
        out.append(EnvoyOptions(body_mode=mode, picker_tls_ca=ca if with_ca else None, subset_hint_header=hint,
                                **sw))
    for mode in envoy_config.BODY_MODES:  # GAIE's echo response mode (every combination above is lean)
        out.append(EnvoyOptions(body_mode=mode, response_mode="echo"))
    out.append(EnvoyOptions(with_picker=False, static_upstreams=("127.0.0.1:8001", "127.0.0.1:8002")))
    out.append(EnvoyOptions(picker_host="llm-pool-epp.default.svc.cluster.local"))  # a Service name
    return out


def _validate(cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([envoy_config.envoy_binary(), "--mode", "validate", "-c", str(cfg), "--log-level",
                           "error"], capture_output=True, text=True, timeout=60)


def test_every_option_combination_passes_envoy_validate(tmp_path: Path) -> None:
    ca = self_signed(cert_dir=tmp_path).cert_file
    combos = _combinations(str(ca))
    assert len(combos) == 2 * 2 * 2 * 2 * 2 * 2 + 2 * 2 * 2 * 2 * 2 + 2 + 2  # TLS +- CA, h2c, echo, baseline, DNS
    files = []
    for i, opts in enumerate(combos):
        files.append(envoy_config.write(opts, tmp_path / f"envoy-{i}.yaml"))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(_validate, files))
    bad = [(dataclasses.asdict(o), r.stdout[-500:] + r.stderr[-500:])
           for o, r in zip(combos, results, strict=True) if r.returncode != 0]
    assert bad == []


def _cluster(doc: dict, name: str) -> dict:
    return next(c for c in doc["static_resources"]["clusters"] if c["name"] == name)


def _ext_proc(doc: dict) -> dict:
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]


def test_cli_prints_yaml_with_the_picker_stanzas() -> None:
    out = subprocess.run([PICKER, "envoy-config", "--picker-port", "19002", "--listen-port", "18080"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load(out.stdout)
    mode = _ext_proc(doc)["processing_mode"]
    assert mode["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert "response_body_mode" not in mode  # lean by default: NONE, the enum's zero, omitted in proto JSON
    assert mode["request_trailer_mode"] == mode["response_trailer_mode"] == "SEND"
    assert _ext_proc(doc)["metadata_options"]["forwarding_namespaces"]["untyped"] == ["envoy.lb.subset_hint",
                                                                                      "envoy.lb"]
    workers = _cluster(doc, "workers")
    assert workers["type"] == "ORIGINAL_DST"
    assert workers["original_dst_lb_config"] == {"use_http_header": True,
                                                 "http_header_name": "x-gateway-destination-endpoint"}
    picker = _cluster(doc, "picker")
    assert picker["transport_socket"]["name"] == "envoy.transport_sockets.tls"
    assert picker["health_checks"][0]["grpc_health_check"]["service_name"] == \
        "envoy.service.ext_proc.v3.ExternalProcessor"
    assert picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"]["port_value"] == 19002


def test_picker_circuit_breaker_leaves_room_above_the_pickers_own_cap() -> None:
    """At the picker's cap its 503 "endpoint picker overloaded" must come first, not Envoy's empty 500."""
    for cap, incomplete in ((1024, 4096), (5000, 16), (64, 4096)):
        doc = envoy_config.to_dict(EnvoyOptions(picker_max_inflight=cap, picker_max_incomplete=incomplete))
        t = _cluster(doc, "picker")["circuit_breakers"]["thresholds"][0]
        assert min(t["max_requests"], t["max_pending_requests"], t["max_connections"]) > cap + incomplete


def test_picker_host_name_makes_a_dns_cluster_and_an_ip_a_static_one() -> None:
    assert _cluster(envoy_config.to_dict(EnvoyOptions(picker_host="epp.ns.svc")), "picker")["type"] == "STRICT_DNS"
    assert _cluster(envoy_config.to_dict(EnvoyOptions(picker_host="10.1.2.3")), "picker")["type"] == "STATIC"


def test_plaintext_option_drops_tls_and_the_health_checks_tls_options() -> None:
    out = subprocess.run([PICKER, "envoy-config", "--picker-tls=false", "--format", "json"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    picker = _cluster(yaml.safe_load(out.stdout), "picker")
    assert "transport_socket" not in picker and "tls_options" not in picker["health_checks"][0]


def test_picker_without_a_subcommand_still_runs_the_picker_cli() -> None:
    out = subprocess.run([PICKER, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--secure-serving" in out.stdout and "envoy-config" in out.stdout


def test_an_unknown_body_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="body mode"):
        envoy_config.build(EnvoyOptions(body_mode="STREAMED"))


def test_validate_mode_does_reject_a_broken_config(tmp_path: Path) -> None:
    """The check above can fail: a route to a cluster that does not exist is refused."""
    doc = envoy_config.to_dict(EnvoyOptions())
    doc["static_resources"]["clusters"] = [c for c in doc["static_resources"]["clusters"] if c["name"] != "workers"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert _validate(bad).returncode != 0


def test_at_the_pickers_cap_clients_get_its_503_not_envoys_circuit_breaker(tmp_path: Path) -> None:
    """Hold `cap` streaming responses open through Envoy, then one more request: the generated breaker leaves
    room, so the picker itself answers 503 "endpoint picker overloaded" (a breaker equal to the cap would
    make Envoy fail that stream with an empty 500 before the picker saw it)."""
    import http.client

    from epp_extproc.app import PickerApp
    from epp_extproc.config import Config
    from tests.gateway_client import request
    from tests.harness import BackgroundLoop, EchoUpstream, EnvoyProcess

    cap = 3
    bg = BackgroundLoop()
    up = EchoUpstream("a")
    bg.run(up.start())
    assert up.sse_release is not None
    app = PickerApp(Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                           endpoints=f"a={up.address}", endpoint_probe_interval_ms=0, max_inflight_requests=cap))
    bg.run(app.start())
    envoy = EnvoyProcess(EnvoyOptions(picker_port=app.grpc_port, picker_max_inflight=cap)).start()
    held = []
    try:
        for _ in range(cap):
            conn = http.client.HTTPConnection("127.0.0.1", envoy.opts.listen_port, timeout=20)
            conn.request("POST", "/sse", body=b'{"stream":true}', headers={"content-type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200 and resp.readline().startswith(b"data:")
            held.append(conn)
        r = request(envoy.url, body=b'{"model":"m","messages":[]}')
        assert r.status == 503 and b"endpoint picker overloaded" in r.body, (r.status, r.body)
        assert envoy.stats().get("cluster.picker.upstream_rq_pending_overflow", 0) == 0
    finally:
        bg.loop.call_soon_threadsafe(up.sse_release.set)
        for c in held:
            c.close()
        envoy.stop()
        bg.run(app.stop())
        bg.run(up.stop())
        bg.close()
