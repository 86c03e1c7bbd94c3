"""The whole P/D chain when the sidecar is installed: real Envoy -> picker -> epp-pd-sidecar -> decode mock, with
the context leg on a prefill mock. The picker's side (the pair, the header, the bookings) is what this checks;
the sidecar's own paths are its package's tests. Skipped where `epp-pd-sidecar` is not installed."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest

from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from epp_extproc.dev import envoy_config, procs
from tests.gateway_client import request
from tests.harness import BackgroundLoop, EnvoyProcess
from tests.stack import MockProc
from tests.waiting import until

pytestmark = pytest.mark.skipif(not Path(procs.PD_SIDECAR).exists(), reason="epp-pd-sidecar is not installed")

LONG = "tell me a long story about the sea and the ships that sail on it " * 20


@pytest.fixture(scope="module")
def chain():  # noqa: ANN201
    d = Path(tempfile.mkdtemp(prefix="epp-pd-chain-"))
    prefill = MockProc.of(procs.mock_worker("prefill-0", d))
    decode = MockProc.of(procs.mock_worker("decode-0", d))
    renderer = MockProc.of(procs.mock_renderer(d))
    sidecar = procs.pd_sidecar(d, decode_url=decode.url, allowed_prefillers=[prefill.address])
    bg = BackgroundLoop()
    app = envoy = None
    try:
        for p in (prefill, decode, renderer, sidecar):
            p.start()
        spec = (f"prefill-0={prefill.address};kv=tcp://127.0.0.1:{prefill.kv_port};role=prefill,"
                f"decode-0={sidecar.address};kv=tcp://127.0.0.1:{decode.kv_port};role=decode")
        cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1", endpoints=spec,
                     tokenizer_protocol="trtllm-render", tokenizer_service_url=renderer.url,
                     worker_metrics_interval_ms=0)
        cfg.validate()
        app = PickerApp(cfg)
        bg.run(app.start())
        envoy = EnvoyProcess(envoy_config.EnvoyOptions(picker_port=app.grpc_port)).start()
        yield app, envoy, prefill, decode
    finally:
        if envoy is not None:
            envoy.stop()
        if app is not None:
            bg.run(app.stop())
        for p in (sidecar, renderer, decode, prefill):
            p.stop()
        bg.close()


def _chat(envoy: EnvoyProcess, content: str, stream: bool = False):  # noqa: ANN202
    body = {"model": "mock-model", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return request(envoy.url, body=json.dumps(body).encode())


def _no_booking(app: PickerApp) -> None:
    until(lambda: app.load.total_inflight() == 0
          and all(ld.inflight == 0 and ld.prefill_blocks == 0 for ld in app.load.loads().values()),
          "no booking left behind", 10, 0.02)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
def test_a_long_prompt_is_prefilled_on_the_prefill_worker_and_answered_by_the_decode_worker(chain, stream) -> None:
    app, envoy, prefill, decode = chain
    r = _chat(envoy, LONG + str(stream), stream)
    assert r.status == 200, r.body[:500]
    if stream:
        usage = [json.loads(m)["usage"] for m in re.findall(rb"^data: (\{.*\})$", r.body, re.M)
                 if json.loads(m).get("usage")]
        assert usage and usage[-1]["completion_tokens"] == 4
    else:
        assert r.json()["usage"]["completion_tokens"] == 4
    assert prefill.get("/mock/last-request")["disaggregated_params"]["request_type"] == "context_only"
    assert decode.get("/mock/last-request")["disaggregated_params"]["request_type"] == "generation_only"
    _no_booking(app)


def test_a_short_prompt_never_reaches_the_prefill_worker(chain) -> None:
    app, envoy, prefill, _ = chain
    before = prefill.get("/mock/last-request")
    r = _chat(envoy, "hi")
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert prefill.get("/mock/last-request") == before
    _no_booking(app)
