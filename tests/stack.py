"""A full local gateway for end-to-end tests: real Envoy, the picker, mock renderer and mock workers.

Workers and the renderer are separate `trtllm-mock` processes built by the shared `epp_extproc.dev.procs`
(so a test can kill and restart them); the picker runs in-process on a background loop so tests can look at
its state directly.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from epp_extproc.dev import envoy_config, procs
from epp_extproc.dev.procs import MOCK, Proc
from tests.gateway_client import Reply, request
from tests.harness import BackgroundLoop, EnvoyProcess, remove_test_dir
from tests.waiting import until

__all__ = ["MOCK", "GatewayStack", "MockProc"]


class MockProc(Proc):
    """A `trtllm-mock` process (the shared `procs.Proc`), with the mock's own HTTP endpoints at hand."""

    @classmethod
    def of(cls, p: Proc) -> MockProc:
        """The process a `procs` builder made, as a MockProc."""
        return cls(**{f.name: getattr(p, f.name) for f in fields(Proc)})

    @property
    def kv_port(self) -> int | None:
        return self.extra.get("kv_port")

    @property
    def replay_port(self) -> int | None:
        return self.extra.get("replay_port")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body[:1] in (b"{", b"[") else body.decode()

    def post(self, path: str, doc: Any = None) -> Any:
        data = json.dumps(doc or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body[:1] in (b"{", b"[") else body

    def metric(self, name: str) -> float:
        text = self.get("/metrics")
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total


@dataclass
class GatewayStack:
    workers: int = 2
    worker_args: list[str] = field(default_factory=list)
    picker: dict[str, Any] = field(default_factory=dict)
    body_mode: str = "FULL_DUPLEX_STREAMED"
    tokenizer_protocol: str = "trtllm-render"
    replay: bool = True  # False: the picker is not told the workers' replay endpoints
    envoy_opts: dict[str, Any] = field(default_factory=dict)  # EnvoyOptions overrides

    def __post_init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="epp-stack-"))
        self.mocks: list[MockProc] = [
            MockProc.of(procs.mock_worker(f"worker-{i}", self.dir, replay=True, args=self.worker_args))
            for i in range(self.workers)]
        self.renderer = MockProc.of(procs.mock_renderer(self.dir))
        self.bg = BackgroundLoop()
        self.app: PickerApp | None = None
        self.envoy: EnvoyProcess | None = None

    def endpoints_spec(self) -> str:
        return procs.endpoint_spec(self.mocks, replay=self.replay)

    def start(self) -> GatewayStack:
        try:
            for m in [*self.mocks, self.renderer]:
                m.start()
            self.app = self._new_picker(grpc_port=0)
            self.bg.run(self.app.start())
            self.envoy = EnvoyProcess(self.envoy_options()).start()
            self.wait_subscribed()
        except BaseException:
            self.stop()  # a fixture that fails half-way must not leave worker processes behind
            raise
        return self

    def _new_picker(self, grpc_port: int) -> PickerApp:
        extra = {"tokenization_timeout_ms": 2000, **self.picker}
        cfg = Config(grpc_port=grpc_port, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                     endpoints=self.endpoints_spec(), tokenizer_protocol=self.tokenizer_protocol,
                     tokenizer_service_url=self.renderer.url if self.tokenizer_protocol != "none" else None,
                     **extra)
        cfg.validate()
        return PickerApp(cfg)

    def envoy_options(self) -> envoy_config.EnvoyOptions:
        assert self.app is not None
        return envoy_config.EnvoyOptions(picker_port=self.app.grpc_port, body_mode=self.body_mode, **self.envoy_opts)

    def restart_picker(self, down_s: float = 0.0) -> None:
        """Stop the picker and start a fresh one (empty index, no bookings) on the same ext_proc port."""
        assert self.app is not None
        port = self.app.grpc_port
        self.bg.run(self.app.stop(grace=0.5))
        time.sleep(down_s)
        self.app = self._new_picker(grpc_port=port)
        self.bg.run(self.app.start())

    def restart_envoy(self, down_s: float = 0.0) -> None:
        """Stop Envoy and start a new one listening on the same port."""
        assert self.envoy is not None
        port = self.envoy.opts.listen_port
        self.envoy.stop()
        time.sleep(down_s)
        opts = self.envoy_options()
        opts.listen_port = port
        self.envoy = EnvoyProcess(opts).start()

    def index_mismatches(self, mock: MockProc) -> list[str]:
        """Differences between the picker's index of `mock` and the mock's own view of its cache.

        Checks that the index holds exactly the worker's engine blocks, and that for every cached chain the
        index's overlap for its tokens is the chain's length. Empty list = they agree.
        """
        assert self.app is not None and self.app.kv is not None
        cache = mock.get("/mock/cache")
        by_hash = {b["engine_hash"]: b for b in cache["blocks"]}
        chains: list[tuple[list[int], int]] = []
        for b in cache["blocks"]:
            tokens: list[int] = []
            cur: dict[str, Any] | None = b
            depth = 0
            while cur is not None:
                tokens[:0] = cur["token_ids"]
                depth += 1
                cur = by_hash.get(cur["parent"]) if cur["parent"] is not None else None
            chains.append((tokens + [0], depth))  # one extra token: the last prompt token is never cached
        kv = self.app.kv
        address = mock.address

        async def probe() -> tuple[set[int], list[int]]:
            return kv.index.engine_hashes(address), [
                kv.index.overlap(t, workers=[address]).get(address, 0) for t, _ in chains]

        indexed, overlaps = self.bg.run(probe())
        out = []
        if indexed != set(by_hash):
            out.append(f"{mock.name}: indexed {len(indexed)} blocks, worker holds {len(by_hash)} "
                       f"({len(indexed - set(by_hash))} extra, {len(set(by_hash) - indexed)} missing)")
        for (_, depth), got in zip(chains, overlaps, strict=True):
            if got != depth:
                out.append(f"{mock.name}: a cached chain of {depth} blocks overlaps {got}")
                break
        return out

    def wait_index_matches(self, timeout: float = 10.0) -> None:
        """Until the index agrees with every worker's cache (events are asynchronous), else fail loudly."""
        bad: list[str] = []

        def agree() -> bool:
            nonlocal bad
            bad = [d for m in self.mocks for d in self.index_mismatches(m)]
            return not bad

        until(agree, lambda: f"the index to match the workers' caches: {bad}", timeout, 0.1)

    def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Until every worker's subscriber has received at least one batch (heartbeat or clear)."""
        until(lambda: all(self.kv_snapshot()["workers"].get(m.address, {}).get("batches", 0) > 0
                          for m in self.mocks),
              lambda: f"subscribers to connect: {self.kv_snapshot()}", timeout, 0.05)

    # -- client side
    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    def chat(self, messages: list[dict[str, Any]], headers: dict[str, str] | None = None, **extra: Any) -> Reply:
        body = {"model": "mock-model", "messages": messages, "max_tokens": 4, **extra}
        return request(self.url, body=json.dumps(body).encode(), headers=headers)

    def post_raw(self, body: bytes, headers: dict[str, str] | None = None,
                 path: str = "/v1/chat/completions") -> Reply:
        return request(self.url, body=body, headers=headers, path=path)

    def stream_chat(self, messages: list[dict[str, Any]]) -> tuple[int, str, list[dict[str, Any]]]:
        body = {"model": "mock-model", "messages": messages, "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}}
        r = request(self.url, body=json.dumps(body).encode())
        events = [json.loads(m) for m in re.findall(rb"^data: (\{.*\})$", r.body, re.M)]
        return r.status, r.headers.get("x-trtllm-mock-worker", ""), events

    # -- picker side
    def picker_get(self, path: str) -> Any:
        assert self.app is not None
        port = self.app.admin_port if path.startswith("/debug") else self.app.metrics_port
        r = request(f"http://127.0.0.1:{port}", method="GET", path=path)
        return r.json() if path.startswith("/debug") else r.body.decode()

    def kv_snapshot(self) -> dict[str, Any]:
        return self.picker_get("/debug/kv")

    def picker_metric(self, name: str, labels: str = "") -> float:
        pat = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.M)
        total = 0.0
        for lab, val in pat.findall(self.picker_get("/metrics")):
            if labels in lab:
                total += float(val)
        return total

    def wait_idle(self, timeout: float = 10.0) -> None:
        assert self.app is not None
        app = self.app
        until(lambda: app.load.total_inflight() == 0 and app.picker.open_requests == 0,
              "the picker to have no request in flight", timeout, 0.02)

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        if self.app is not None:
            self.bg.run(self.app.stop())
        for m in [*self.mocks, self.renderer]:
            m.stop()
        self.bg.close()
        remove_test_dir(self.dir)
