"""Wiring: one picker instance = discovery + load + pipeline + the three listeners.

`PickerApp` is what the CLI runs and what tests start in-process; nothing here decides anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from aiohttp import web

from epp_extproc.adapters.discovery_static import FileDiscovery, parse_flag
from epp_extproc.adapters.endpoint_probe import EndpointProber
from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.adapters.render_client import RenderClient
from epp_extproc.adapters.replica_sync import ReplicaSync
from epp_extproc.admin import build_admin_app
from epp_extproc.config import Config
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.pipeline import Pipeline
from epp_extproc.core.usage import ModelLabels, UsageObserver
from epp_extproc.envoy.extproc import ExtProcServicer, pb_grpc
from epp_extproc.envoy.health import Health
from epp_extproc.envoy.tls import ServerCert, server_cert
from epp_extproc.metrics import PickerMetrics

log = logging.getLogger(__name__)

WARMUP_WAIT_S = 5.0  # readiness waits this long at most for every worker's first KV batch (replayed index)


class PickerApp:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = PickerMetrics()
        self.registry = EndpointRegistry()
        self.load = LoadTracker(self.metrics.endpoint_inflight)
        self.renderer: RenderClient | None = None
        self.kv: KvRouting | None = None
        if config.tokenizer_protocol != "none":
            assert config.tokenizer_service_url is not None  # validated by Config
            self.renderer = RenderClient(config.tokenizer_protocol, config.tokenizer_service_url,
                                         timeout_ms=config.tokenization_timeout_ms,
                                         max_response_bytes=config.tokenizer_max_response_bytes,
                                         metrics=self.metrics)
            self.kv = KvRouting(self.registry, block_size=config.kv_cache_block_size,
                                max_blocks_per_worker=config.max_index_blocks_per_worker,
                                topic=config.kv_event_topic, prediction_ttl_s=config.prediction_ttl_s,
                                metrics_registry=self.metrics.registry)
        self.pipeline = Pipeline(config, self.registry, self.load, self.metrics, renderer=self.renderer,
                                 kv=self.kv)
        self.sync: ReplicaSync | None = None
        if config.sync_enabled():
            self.sync = ReplicaSync(self.load, self.registry, index=self.kv.index if self.kv else None,
                                    heartbeat_s=config.peer_timeout_ms / 4000,
                                    peer_timeout_s=config.peer_timeout_ms / 1000,
                                    expiry_s=config.peer_expiry_ms / 1000, metrics_registry=self.metrics.registry)
            if self.kv is not None:
                self.kv.predict_listeners.append(self.sync.on_predict)
        self._started_at = time.monotonic()
        self.draining = False
        self.health = Health()
        labels = ModelLabels()
        self.servicer = ExtProcServicer(self.pipeline, allowed_modes=config.body_modes(),
                                        observer_factory=lambda d: UsageObserver(d, self.metrics, labels))
        self._grpc: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._admin: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.grpc_port = config.grpc_port
        self.health_port = config.health_port
        self.metrics_port = config.metrics_port
        self.registry.subscribe(self._on_endpoints)
        self.tls: ServerCert | None = None
        self.prober: EndpointProber | None = None
        if config.endpoint_probe_interval_ms > 0:
            kv = self.kv
            self.prober = EndpointProber(self.registry, interval_s=config.endpoint_probe_interval_ms / 1000,
                                         path=config.endpoint_probe_path,
                                         on_lost=kv.resync if kv is not None else None)

    def _on_endpoints(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        for ep in removed:
            if self.registry.get(ep.address) is None:
                self.load.forget(ep.address)
        self.metrics.endpoints.set(len(self.registry))
        self._spawn(self.health.set_ready(self.ready()))

    def ready(self) -> bool:
        """Has its endpoints, its index is warm (every worker's first KV batch, replay included, is in, or
        WARMUP_WAIT_S passed) and it synced with every reachable peer; never while draining."""
        if self.draining or not self.registry.synced or len(self.registry) == 0:
            return False
        if self.sync is not None and not self.sync.settled():
            return False
        if self.kv is not None and time.monotonic() - self._started_at < WARMUP_WAIT_S:
            idx = self.kv.index
            if any(ep.kv_events and idx.stats(ep.address).batches == 0 for ep in self.registry.all()):
                return False
        return True

    async def _readiness_loop(self) -> None:
        while True:
            await self.health.set_ready(self.ready())
            await asyncio.sleep(0.1)

    def _spawn(self, coro) -> None:  # noqa: ANN001
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def start(self) -> None:
        cfg = self.config
        await self.health.start()
        msg_limit = cfg.max_body_bytes + 1024 * 1024
        opts = [("grpc.max_receive_message_length", msg_limit), ("grpc.max_send_message_length", msg_limit),
                ("grpc.so_reuseport", 1 if cfg.share_port else 0)]  # 0: a second picker fails loudly
        self._grpc = grpc.aio.server(options=opts)
        pb_grpc.add_ExternalProcessorServicer_to_server(self.servicer, self._grpc)
        if cfg.secure_serving:
            self.tls = server_cert(cfg.cert_path)
            creds = grpc.ssl_server_credentials([(self.tls.key_pem, self.tls.cert_pem)])
            self.grpc_port = self._grpc.add_secure_port(f"{cfg.bind}:{cfg.grpc_port}", creds)
            log.info("ext_proc serves TLS with a %s certificate (%s, sha256 %s)",
                     "self-signed" if self.tls.self_signed else "provided", self.tls.cert_file,
                     self.tls.fingerprint())
        else:
            self.grpc_port = self._grpc.add_insecure_port(f"{cfg.bind}:{cfg.grpc_port}")
        self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        self.health.add_to(self._health_server)
        self.health_port = self._health_server.add_insecure_port(f"{cfg.bind}:{cfg.health_port}")
        admin = build_admin_app(self.registry, self.load, self.metrics,
                                kv_snapshot=self.kv.snapshot if self.kv else None,
                                score=self.pipeline.score_only)
        self._admin = web.AppRunner(admin, access_log=None)
        await self._admin.setup()
        site = web.TCPSite(self._admin, cfg.bind, cfg.metrics_port)
        await site.start()
        self.metrics_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        await self._start_discovery()
        if self.sync is not None:
            await self._start_sync()
        self._tasks.append(asyncio.create_task(self._readiness_loop()))
        if self.prober is not None:
            self._tasks.append(asyncio.create_task(self.prober.run()))
        await self._grpc.start()
        await self._health_server.start()
        log.info("picker listening: ext_proc %s:%d, health %s:%d, metrics http://%s:%d/metrics",
                 cfg.bind, self.grpc_port, cfg.bind, self.health_port, cfg.bind, self.metrics_port)

    async def _start_discovery(self) -> None:
        cfg = self.config
        replay = cfg.kv_event_replay_port
        if cfg.endpoints:
            self.registry.replace(parse_flag(cfg.endpoints, kv_event_port=cfg.kv_event_port, replay_port=replay))
        elif cfg.endpoints_file:
            fd = FileDiscovery(self.registry, cfg.endpoints_file, kv_event_port=cfg.kv_event_port,
                               replay_port=replay)
            fd.load_once()
            self._tasks.append(asyncio.create_task(fd.run()))
        elif cfg.inference_pool_name:
            from epp_extproc.adapters.discovery_k8s import InferencePoolDiscovery

            d = InferencePoolDiscovery(self.registry, cfg.inference_pool_name, cfg.namespace,
                                       kv_event_port=cfg.kv_event_port, replay_port=replay,
                                       kubeconfig=cfg.kubeconfig)
            self._tasks.append(asyncio.create_task(d.run()))
        else:
            log.warning("no endpoint source configured (--endpoints, --endpoints-file or "
                        "--inference-pool-name): every request will get 503")
            self.registry.replace([])

    async def _start_sync(self) -> None:
        cfg = self.config
        assert self.sync is not None
        await self.sync.start(cfg.replica_sync_listen or [f"{cfg.bind}:{cfg.replica_sync_port}"])
        if cfg.peer_service:
            from epp_extproc.adapters.discovery_peers import PeerServiceDiscovery

            d = PeerServiceDiscovery(self.sync.set_peers, cfg.peer_service, cfg.namespace, pod_ip=cfg.pod_ip,
                                     kubeconfig=cfg.kubeconfig)
            self._tasks.append(asyncio.create_task(d.run()))
        else:
            self.sync.set_peers(cfg.peer_list())

    async def stop(self, grace: float = 1.0) -> None:
        """Drain: not ready, no new ext_proc streams, up to `grace` s for those in flight; then the frees
        they made reach the peers before the sync links close. Streams still open at the deadline are
        cancelled (their bookings freed) and logged, never dropped silently."""
        self.draining = True
        await self.health.shutdown()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._grpc is not None:
            inflight = self.servicer.active
            if inflight:
                log.info("draining: %d ext_proc streams in flight, waiting up to %.1fs", inflight, grace)
            await self._grpc.stop(grace)
            if inflight:
                cut = self.servicer.active
                (log.warning if cut else log.info)("drained: %d of %d streams finished, %d cut at the deadline",
                                                   inflight - cut, inflight, cut)
        if self.sync is not None:
            await self.sync.close()
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._admin is not None:
            await self._admin.cleanup()
        if self.kv is not None:
            await self.kv.close()
        if self.renderer is not None:
            await self.renderer.close()
