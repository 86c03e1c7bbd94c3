"""The debug page on a running picker's admin port: served with a strict CSP, its JSON joined from what the
picker keeps, and every `/debug` path refused to another site (Host, Origin, Sec-Fetch-Site) while /metrics
stays open to Prometheus. The browser test (test_debug_page_browser.py) checks what a browser makes of it."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.client
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from epp_extproc.admin_guard import host_allowed, hostname_of, refusal
from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from epp_extproc.core.request import RequestContext


def call(port: int, path: str, host: str | None = None, method: str = "GET", body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with exactly the Host header given (None: 127.0.0.1:port), as a browser would send it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", host if host is not None else f"127.0.0.1:{port}")
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


async def acall(*args: Any, **kw: Any) -> tuple[int, dict[str, str], bytes]:
    return await asyncio.to_thread(call, *args, **kw)


@pytest.fixture
async def app() -> AsyncIterator[PickerApp]:
    a = PickerApp(Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                         endpoints="alpha=127.0.0.1:9,beta=127.0.0.1:10;role=both",
                         endpoint_probe_interval_ms=0, worker_metrics_interval_ms=0))
    await a.start()
    yield a
    await a.stop()


async def test_the_page_is_served_with_a_strict_content_security_policy(app: PickerApp) -> None:
    status, headers, body = await acall(app.admin_port, "/debug/page")
    assert status == 200 and headers["content-type"].startswith("text/html")
    csp = dict(d.strip().split(" ", 1) for d in headers["content-security-policy"].split(";"))
    assert csp["default-src"] == "'none'" and csp["connect-src"] == "'self'"
    assert csp["frame-ancestors"] == "'none'" and csp["base-uri"] == "'none'"
    assert "unsafe" not in headers["content-security-policy"] and "http" not in headers["content-security-policy"]
    html = body.decode()
    # the one inline script and style are exactly what the policy's hashes allow
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        (inline,) = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
        digest = base64.b64encode(hashlib.sha256(inline.encode()).digest()).decode()
        assert csp[directive] == f"'sha256-{digest}'"
    assert "innerHTML" not in html and "insertAdjacentHTML" not in html and "document.write" not in html
    assert re.search(r"""(src|href)=["']?(https?:)?//""", html) is None  # nothing from elsewhere
    assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY"
    status, headers, _ = await acall(app.admin_port, "/debug")
    assert status == 302 and headers["location"] == "/debug/page"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.nip.io:{port}",
                                  "localhost.evil.example:{port}", "10.1.2.3:{port}", ""])
async def test_every_debug_path_refuses_a_host_that_is_not_loopback_or_the_bind_address(
        app: PickerApp, host: str) -> None:
    port = app.admin_port
    h = host.format(port=port)
    for path in ("/debug/page", "/debug/pool", "/debug/decisions", "/debug/endpoints", "/debug/kv"):
        status, _, body = await acall(port, path, host=h)
        assert status == 403, (path, h, status)
        assert b"Host" in body
    status, _, _ = await acall(port, "/debug/score", host=h, method="POST", body=b'{"token_ids": [1]}')
    assert status == 403


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:{port}", "[::1]:{port}",
                                  "127.0.0.2:{port}", "localhost"])
async def test_loopback_hosts_get_the_page_and_its_json(app: PickerApp, host: str) -> None:
    port = app.admin_port
    for path in ("/debug/page", "/debug/pool", "/debug/decisions"):
        status, _, _ = await acall(port, path, host=host.format(port=port))
        assert status == 200, (path, host)


async def test_a_cross_origin_or_cross_site_request_is_refused_even_with_a_loopback_host(app: PickerApp) -> None:
    port = app.admin_port
    body = b'{"token_ids": [1, 2, 3]}'
    for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"},
                    {"Origin": f"http://127.0.0.1:{port + 1}"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Sec-Fetch-Site": "same-site"}):
        status, _, _ = await acall(port, "/debug/score", method="POST", body=body, headers=headers)
        assert status == 403, headers
        status, _, _ = await acall(port, "/debug/pool", headers=headers)
        assert status == 403, headers
    # the page's own requests: same origin (Chrome sends Origin on a POST, and Sec-Fetch-Site)
    same = {"Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"}
    status, _, _ = await acall(port, "/debug/score", method="POST", body=body, headers=same)
    assert status == 200
    status, _, _ = await acall(port, "/debug/page", headers={"Sec-Fetch-Site": "none"})  # typed in the bar
    assert status == 200


async def test_metrics_stay_open_to_any_host(app: PickerApp) -> None:
    status, _, _ = await acall(app.admin_port, "/metrics", host="10.1.2.3:9090")
    assert status == 200


async def test_the_pool_shows_every_worker_with_its_role_health_and_load(app: PickerApp) -> None:
    d = await app.picker.decide(RequestContext("POST", "/v1/chat/completions", {}, None))
    status, _, body = await acall(app.admin_port, "/debug/pool")
    assert status == 200
    doc = json.loads(body)
    assert {w["name"] for w in doc["workers"]} == {"alpha", "beta"}
    assert all(w["role"] == "both" and w["healthy"] for w in doc["workers"])
    assert doc["inflight_total"] == 1 and doc["kv"] is None  # no tokenizer: no index
    assert {w["address"]: w["inflight"] for w in doc["workers"]}[d.address] == 1
    d.booking.free()


async def test_decisions_appear_once_the_page_reads_them(app: PickerApp) -> None:
    d = await app.picker.decide(RequestContext("POST", "/v1/chat/completions", {}, b'{"model": "before"}'))
    d.booking.free()
    status, _, body = await acall(app.admin_port, "/debug/decisions")
    assert status == 200 and json.loads(body)["decisions"] == []  # nobody was watching: nothing kept
    d = await app.picker.decide(RequestContext("POST", "/v1/chat/completions", {}, b'{"model": "after"}'))
    d.booking.free()
    doc = json.loads((await acall(app.admin_port, "/debug/decisions"))[2])
    (dec,) = doc["decisions"]
    assert dec["model"] == "after" and dec["route"] == "load" and dec["pick_name"] in ("alpha", "beta")
    assert {c["name"] for c in dec["candidates"]} == {"alpha", "beta"}
    assert dec["reason"].startswith("load only")
    doc = json.loads((await acall(app.admin_port, f"/debug/decisions?since={dec['seq']}"))[2])
    assert doc["decisions"] == []
    status, _, _ = await acall(app.admin_port, "/debug/decisions?since=x")
    assert status == 400


def test_host_parsing_and_the_allowed_hosts() -> None:
    assert hostname_of("Example.COM:80") == "example.com"
    assert hostname_of("[::1]:9091") == "::1" and hostname_of("::1") == "::1"
    assert hostname_of("host:port") is None and hostname_of("[::1") is None and hostname_of("") is None
    assert host_allowed("10.0.0.5", "10.0.0.5", None)  # the configured bind address
    assert host_allowed("10.0.0.7", "0.0.0.0", "10.0.0.7")  # the address the connection arrived on
    assert not host_allowed("10.0.0.8", "0.0.0.0", "10.0.0.7")
    assert not host_allowed("0.0.0.0", "0.0.0.0", "127.0.0.1")  # a wildcard bind is no host
    assert not host_allowed("attacker.example", "0.0.0.0", "127.0.0.1")
    assert refusal({}, "127.0.0.1", "127.0.0.1") == "no Host header"
    assert refusal({"Host": "localhost:1", "Origin": "https://localhost:1"}, "127.0.0.1", None) is None


def test_the_pool_joins_each_workers_index_figures_event_age_and_the_shards_lag() -> None:
    from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
    from epp_extproc.core.load import LoadTracker
    from epp_extproc.debug_pool import pool_document

    reg = EndpointRegistry()
    reg.replace([Endpoint("a", "10.0.0.1:8000", "tcp://10.0.0.1:5557"), Endpoint("b", "10.0.0.2:8000")])
    kv = {"unique_blocks": 7, "predicted_unique_blocks": 1, "tier_unique_blocks": {"gpu": 5, "cpu": 2},
          "workers": {"10.0.0.1:8000": {"blocks_indexed": 7, "predicted": 1, "blocks_by_tier": {"gpu": 5, "cpu": 2},
                                        "stale": False, "silent": False, "garbage": 3,
                                        "kv_endpoints": [{"last_message_monotonic": 98.0},
                                                         {"last_message_monotonic": 99.5}]}},
          "ingest": [{"up": True, "batch_lag_s": {"count": 4, "p50": 0.002, "p99": 0.01, "max": 0.02}},
                     {"up": True, "batch_lag_s": {"count": 6, "p50": 0.001, "p99": 0.03, "max": 0.03}},
                     {"shard": 2, "up": False, "error": "down"}]}
    doc = pool_document(reg, LoadTracker(), kv, now=100.0)
    a, b = doc["workers"]
    assert a["kv"] == {"blocks_indexed": 7, "predicted": 1, "blocks_by_tier": {"gpu": 5, "cpu": 2},
                       "stale": False, "silent": False, "last_event_age_s": 0.5}  # the newest of its streams
    assert a["kv_events"] and not b["kv_events"] and b["kv"] is None
    assert doc["kv"]["batch_lag_s"] == {"count": 10, "p50": 0.002, "p99": 0.03, "max": 0.03}  # worst shard
    assert doc["kv"]["tier_unique_blocks"] == {"gpu": 5, "cpu": 2}
    assert pool_document(reg, LoadTracker(), {"workers": {}}, now=1.0)["kv"]["batch_lag_s"] is None  # in-process
