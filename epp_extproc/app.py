"""Wiring: one picker instance = discovery + load + the decision (core/assemble.py) + the three listeners.

`PickerApp` is what the CLI runs and what tests start in-process; nothing here decides anything.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import web

from epp_extproc.adapters.discovery_static import FileDiscovery, parse_flag
from epp_extproc.adapters.endpoint_probe import EndpointProber
from epp_extproc.adapters.metrics_share import MetricsShare
from epp_extproc.adapters.model_rewrites import ModelRewriteCrdPoller, ModelRewritesFile
from epp_extproc.adapters.objectives import ObjectiveCrdPoller, ObjectivesFile
from epp_extproc.adapters.render_client import RenderClient
from epp_extproc.adapters.render_fingerprint import FingerprintWatcher
from epp_extproc.adapters.replica_sync import ReplicaSync, SyncTls
from epp_extproc.adapters.session_keys import SessionKeysFile, read_keys_file
from epp_extproc.adapters.worker_metrics import WorkerMetricsScraper
from epp_extproc.admin import build_admin_app, build_metrics_app, debug_score
from epp_extproc.config import Config, ProcessSlot
from epp_extproc.core.admission import BodyBudget, InflightGate
from epp_extproc.core.assemble import assemble
from epp_extproc.core.director import Admission
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.flow_objectives import ObjectiveTable
from epp_extproc.core.flow_queue import FlowController
from epp_extproc.core.lean import LeanSignals
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.model_rewrite import ModelRewriter, RewriteTable
from epp_extproc.core.picker import Picker
from epp_extproc.core.saturation import SaturationDetector, Thresholds
from epp_extproc.core.scheduling.config_file import SchedulingSpec, load_config_file, report_lines
from epp_extproc.core.session import SessionTokens
from epp_extproc.envoy.access_log import AccessLogServicer, als_pb2_grpc
from epp_extproc.envoy.extproc import ExtProcServicer, pb_grpc
from epp_extproc.envoy.health import HEALTH_SERVER_OPTIONS, Health
from epp_extproc.envoy.tls import CertSource, ServerCert
from epp_extproc.ingest.launcher import IngestGroup
from epp_extproc.ingest.setup import KvBackend, build_kv
from epp_extproc.metrics import PickerMetrics, PromFlowMetrics
from epp_extproc.tracing import from_env as tracing_from_env
from h2grpc import H2GrpcServer
from kvindex.aio import cancel_and_wait

if TYPE_CHECKING:
    from epp_extproc.adapters.replica_sync_nats import NatsReplicaSync

log = logging.getLogger(__name__)

WARMUP_WAIT_S = 5.0  # readiness waits this long at most for every worker's first KV batch (replayed index)


async def _serve(runner: web.AppRunner, host: str, port: int) -> int:
    """Start `runner` on host:port; the port actually bound (port 0 = any free one)."""
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner.addresses[0][1]


class PickerApp:
    def __init__(self, config: Config, slot: ProcessSlot | None = None, spec: SchedulingSpec | None = None) -> None:
        """`spec`: the scheduler from a config file (--config-file, read and checked by the CLI); None: the
        flags' default profiles."""
        self.config = config
        self.slot = slot or ProcessSlot()
        self.metrics = PickerMetrics()
        self.registry = EndpointRegistry()
        self.load = LoadTracker(self.metrics.endpoint_inflight)
        self.renderer: RenderClient | None = None
        self.kv: KvBackend | None = None
        self.ingest: IngestGroup | None = None  # --kv-ingest apart, run by this process (not a supervisor)
        self.ingest_dir: str | None = None  # the private socket directory of its own shards (removed at stop)
        if config.tokenizer_protocol != "none":
            assert config.tokenizer_service_url is not None  # validated by Config
            self.renderer = RenderClient(config.tokenizer_protocol, config.tokenizer_service_url,
                                         timeout_ms=config.tokenization_timeout_ms,
                                         max_response_bytes=config.tokenizer_max_response_bytes,
                                         metrics=self.metrics,
                                         breaker_failures=config.render_circuit_failures,
                                         breaker_open_ms=config.render_circuit_open_ms)
            self.kv, self.ingest, self.ingest_dir = build_kv(config.sections.kv, self.slot, self.registry,
                                                              self.metrics.registry, log_level=config.log_level)
            if config.prediction_lifetime == "queue":
                # predictions follow their bookings (docs/predictions.md); Config refuses it with ingest apart
                follow = self.kv.use_queue_lifetime(config.prediction_grace_s, config.prediction_max_lifetime_s)
                if follow is not None:
                    self.load.add_listener(follow)
        self.fingerprints: FingerprintWatcher | None = None
        if config.tokenizer_protocol == "trtllm-render" and config.prompt_passthrough != "off":
            self.fingerprints = FingerprintWatcher(self.registry, self.metrics,
                                                   refresh_s=config.render_fingerprint_refresh_ms / 1000)
        admission = self._setup_flow_control()
        self.rewrites = RewriteTable()  # filled by _start_tables (file or CRD); empty = no rewrite
        self.sessions: SessionTokens | None = None
        self.session_keys: SessionKeysFile | None = None
        if config.session_affinity_keys_file:  # checked at start-up (cli.check_inputs): a bad file stops it
            self.sessions = SessionTokens(read_keys_file(config.session_affinity_keys_file),
                                          config.session_affinity_ttl_s)
            self.session_keys = SessionKeysFile(self.sessions, config.session_affinity_keys_file)
        # OTEL_* variables: None (and no OpenTelemetry SDK imported) unless an OTLP endpoint is configured
        self.tracing = tracing_from_env(os.environ, self.metrics.registry)
        plane = getattr(self.kv, "subscribers", None)
        if self.tracing is not None and hasattr(plane, "tracing"):  # the KV event plane's dumps (NATS)
            plane.tracing = self.tracing  # type: ignore[union-attr]
        detector, objectives = self.detector, self.objectives
        if spec is None and config.config_file:
            spec = load_config_file(config.config_file)  # checked at start-up (cli.with_config_file)
        self.decision = assemble(
            config, self.registry, self.load, self.metrics, spec=spec, renderer=self.renderer, kv=self.kv,
            fingerprint_of=self.fingerprints.get if self.fingerprints else None, admission=admission,
            rewriter=ModelRewriter(self.rewrites, session_header=config.model_rewrite_session_header),
            sessions=self.sessions, saturated=lambda address: detector.state(address).saturated,
            sheddable=lambda ctx: objectives.flow_key(ctx.headers).priority < 0,
            churn=self.kv.churn_window() if self.kv is not None else None,
            usage=self._kv_usage, tracing=self.tracing)
        self.director = self.decision.director
        self._report_scheduling()
        self.picker = Picker(
            self.director, gate=InflightGate(config.max_inflight_requests, self.metrics.picker_inflight),
            arriving=InflightGate(config.max_incomplete_requests, self.metrics.incomplete_requests),
            bodies=BodyBudget(config.max_body_bytes, config.max_buffered_body_bytes, self.metrics.buffered_bytes),
            lean=LeanSignals(self.load, self.metrics))
        self.sync: ReplicaSync | NatsReplicaSync | None = None
        if config.replica_sync_plane == "nats":  # issue 47: replicas meet on NATS subjects, no peer list
            from epp_extproc.adapters.replica_sync_nats import NatsReplicaSync  # nats-py only when used

            self.sync = NatsReplicaSync(self.load, self.registry, index=self.kv.index if self.kv else None,
                                        servers=[u.strip() for u in config.nats_url.split(",") if u.strip()],
                                        pool=config.kv_plane_pool, heartbeat_s=config.peer_timeout_ms / 4000,
                                        peer_timeout_s=config.peer_timeout_ms / 1000,
                                        expiry_s=config.peer_expiry_ms / 1000,
                                        linger_s=config.replica_sync_linger_ms / 1000,
                                        metrics_registry=self.metrics.registry, tracing=self.tracing)
            if self.kv is not None and self.slot.ingest_dir is None:
                self.kv.facts.predict_listeners.append(self.sync.on_predict)
        elif config.sync_enabled() or self.slot.sync_listen:
            tls = SyncTls.load(config.replica_sync_tls_path, config.replica_sync_server_name) \
                if config.replica_sync_tls_path else None
            self.sync = ReplicaSync(self.load, self.registry, index=self.kv.index if self.kv else None,
                                    heartbeat_s=config.peer_timeout_ms / 4000,
                                    peer_timeout_s=config.peer_timeout_ms / 1000,
                                    expiry_s=config.peer_expiry_ms / 1000, metrics_registry=self.metrics.registry,
                                    tls=tls, tracing=self.tracing, linger_s=config.replica_sync_linger_ms / 1000)
            if self.kv is not None and self.slot.ingest_dir is None:  # siblings sharing an ingest see them there
                self.kv.facts.predict_listeners.append(self.sync.on_predict)
        self.metrics_share: MetricsShare | None = None
        if self.sync is not None and self.scraper is not None and config.replica_sync_share_metrics:
            # samples wait up to half an interval for a batch that goes out anyway, then go alone
            share = self.metrics_share = MetricsShare(self.sync, max_delay_s=self.scraper.interval_s / 2,
                                                      registry=self.metrics.registry)
            self.scraper.share_with(share)
            self.sync.on_loads = share.receive
        self._started_at = time.monotonic()
        self.draining = False
        self.health = Health()
        self.servicer = ExtProcServicer(self.picker, allowed_modes=config.body_modes(),
                                        body_timeout_s=config.request_body_timeout_ms / 1000,
                                        tracing=self.tracing)
        self.access_log = AccessLogServicer(self.picker)
        self._grpc: grpc.aio.Server | H2GrpcServer | None = None
        self._health_server: grpc.aio.Server | None = None
        self._admin: web.AppRunner | None = None
        self._metrics_http: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.grpc_port = config.grpc_port
        self.health_port = config.health_port
        self.metrics_port = config.metrics_port
        self.admin_port = config.admin_port
        self.registry.subscribe(self._on_endpoints)
        self.cert_source: CertSource | None = None
        self.prober: EndpointProber | None = None
        if config.endpoint_probe_interval_ms > 0:
            self.prober = EndpointProber(self.registry, interval_s=config.endpoint_probe_interval_ms / 1000,
                                         path=config.endpoint_probe_path,
                                         max_rate=config.endpoint_probe_max_rate, on_lost=self._on_lost,
                                         on_change=self.flow.dispatch if self.flow is not None else None)

    def _report_scheduling(self) -> None:
        """Start-up says how the scheduler was built: a config file's whole report (what mapped, what was
        ignored and why), or the flags' warnings (a setting that does not apply)."""
        spec = self.decision.spec
        if self.config.config_file:
            for line in report_lines(spec):
                log.info("%s", line)
            return
        for n in spec.notes:
            if n.status == "warning":
                log.warning("%s: %s", n.entry, n.detail)
            elif n.entry == "tiered_credit":  # what tier credit needs of the engines (issue 44)
                log.info("%s: %s", n.entry, n.detail)

    def _kv_usage(self, address: str) -> float | None:
        """A worker's KV usage gauge from a fresh scrape (the eviction scorer's pinned blocks), else None."""
        s = self.detector.fresh(address)
        return s.kv_utilization if s is not None else None

    def _on_lost(self, address: str) -> None:
        """A worker's process is gone: its KV cache (and perhaps its rendering configuration) with it."""
        if self.kv is not None:
            self.kv.resync(address)
        if self.fingerprints is not None:
            self.fingerprints.lost(address)

    def _setup_flow_control(self) -> Admission | None:
        """Worker metrics feed saturation and the cost; the flow controller admits proposals (Director.admit):
        its admission call is returned for the Director (None: flow control is off)."""
        cfg = self.config
        self.objectives = ObjectiveTable()
        self.detector = SaturationDetector(
            Thresholds(queue_depth=cfg.queue_depth_threshold, kv_utilization=cfg.kv_cache_util_threshold,
                       prefill_tokens=cfg.max_num_batched_tokens,
                       staleness_s=cfg.worker_metrics_staleness_ms / 1000),
            self.load.loads, cfg.kv_cache_block_size)
        self.flow: FlowController | None = None
        if cfg.flow_control:
            flow = self.flow = FlowController(
                # the destinations only: a disaggregated pool is saturated when its decode workers are
                self.detector, lambda: list(self.registry.destinations()),
                ttl_s=cfg.flow_control_queue_ttl_s, max_queued=cfg.flow_control_max_queued_requests,
                metrics=PromFlowMetrics(self.metrics))
            self.load.on_release(flow.dispatch)
        self.scraper: WorkerMetricsScraper | None = None
        if cfg.worker_metrics_interval_ms > 0:
            errors = self.metrics.worker_scrape_errors
            self.scraper = WorkerMetricsScraper(
                self.registry, self.load, self.detector, interval_s=cfg.worker_metrics_interval_ms / 1000,
                path=cfg.worker_metrics_path, on_sample=self.flow.dispatch if self.flow else None,
                on_error=lambda address, _why: errors.labels(address).inc(),
                idle_interval_s=cfg.worker_metrics_idle_interval_ms / 1000, max_rate=cfg.worker_metrics_max_rate)
        if self.flow is None:
            return None
        flow, objectives = self.flow, self.objectives
        return lambda ctx: flow.admit(objectives.flow_key(ctx.headers), ctx.subset)

    def flow_snapshot(self) -> dict[str, object]:
        """GET /debug/flow: the queue and what the detector thinks of each worker."""
        workers = {}
        share = self.metrics_share
        for ep in self.registry.all():
            st = self.detector.state(ep.address)
            s = self.detector.fresh(ep.address)
            workers[ep.address] = {"saturated": st.saturated, "headroom": min(st.headroom, 1 << 20),
                                   "why": st.why, "waiting_est": st.waiting_est,
                                   "scraped": None if s is None else {"waiting": s.waiting, "running": s.running,
                                                                      "kv_utilization": s.kv_utilization},
                                   "unbooked_blocks": round(self.load.load(ep.address).unbooked_blocks, 3),
                                   # --replica-sync-share-metrics: whose reads these are ("here": this replica's)
                                   "metrics_read_by": "here" if share is None or share.owns(ep.address) else "a peer"}
        return {"enabled": self.flow is not None, "queue": self.flow.snapshot() if self.flow else None,
                "objectives": self.objectives.snapshot(), "workers": workers}

    def _on_endpoints(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        for ep in removed:
            if self.registry.get(ep.address) is None:
                self.load.forget(ep.address)
                self.detector.forget(ep.address)
                if self.decision.time_model is not None:
                    self.decision.time_model.forget(ep.address)
        if added and self.flow is not None:
            self.flow.dispatch()
        self.metrics.endpoints.set(len(self.registry))
        for role, n in self.registry.role_counts().items():
            self.metrics.endpoint_roles.labels(role).set(n)
        self._spawn(self.health.set_ready(self.ready()))

    def ready(self) -> bool:
        """Has its endpoints, its index is warm (every worker's first KV batch, replay included, is in, or
        WARMUP_WAIT_S passed) and it synced with every reachable peer; never while draining."""
        if self.draining or not self.registry.synced or len(self.registry) == 0:
            return False
        if self.sync is not None and not self.sync.settled():
            return False
        if self.kv is not None and time.monotonic() - self._started_at < WARMUP_WAIT_S:
            warm = self.kv.warm
            if any(ep.kv_events and not warm(ep.address) for ep in self.registry.all()):
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
        try:
            await self._start()
        except BaseException:
            if self.cert_source is not None:  # e.g. a port in use: leave no certificate folder behind
                self.cert_source.close()
            raise

    async def _start(self) -> None:
        cfg = self.config
        await self.health.start()
        # One BUFFERED body arrives as one message: let any body up to the whole buffer budget reach the
        # picker, so one just over --max-body-bytes gets the documented 413 rather than a gRPC error (500).
        msg_limit = cfg.max_buffered_body_bytes + 1024 * 1024
        # Streams over the picker's caps get a 503 from the picker itself (an ImmediateResponse; a gRPC error
        # would be Envoy's 500), read within a second. Only beyond twice both caps together does the server
        # refuse streams, so a flood of streams that send nothing cannot grow memory without bound.
        max_calls = 2 * (self.picker.arriving.limit + self.picker.gate.limit)
        if cfg.extproc_transport == "h2":
            # One budget for the bytes of request bodies, wherever they are: in messages still arriving (the
            # transport's count) or taken by the exchanges (BodyBudget's); each bound counts the other's bytes.
            bodies = self.picker.bodies
            h2 = H2GrpcServer(max_concurrent_rpcs=max_calls, max_receive_message_length=msg_limit,
                              max_send_message_length=msg_limit, keepalive_time_s=cfg.extproc_keepalive_s,
                              max_connections=cfg.extproc_max_connections, max_partial_bytes=msg_limit,
                              held_elsewhere=lambda: bodies.used,
                              logger=logging.getLogger("epp_extproc.envoy.h2server"))
            bodies.in_transit = lambda: h2.partial_bytes
            self._grpc = h2
        else:
            self._grpc = grpc.aio.server(options=[
                ("grpc.max_receive_message_length", msg_limit), ("grpc.max_send_message_length", msg_limit),
                ("grpc.so_reuseport", 1 if self.slot.share_port else 0)],  # 0: a second picker fails loudly
                maximum_concurrent_rpcs=max_calls)
        pb_grpc.add_ExternalProcessorServicer_to_server(self.servicer, self._grpc)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self.access_log, self._grpc)
        # GAIE's Envoy health-checks the ext_proc cluster on the ext_proc port itself (gRPC health,
        # service envoy.service.ext_proc.v3.ExternalProcessor); the health port serves the same servicer.
        self.health.add_to(self._grpc)
        if cfg.secure_serving:
            self.cert_source = CertSource(cfg.cert_path)
        address = f"{cfg.bind}:{cfg.grpc_port}"
        if isinstance(self._grpc, H2GrpcServer):
            self.grpc_port = await self._grpc.bind(
                cfg.bind, cfg.grpc_port, reuse_port=self.slot.share_port,
                ssl_context=self.cert_source.ssl_context() if self.cert_source else None)
        elif self.cert_source is not None:
            self.grpc_port = self._grpc.add_secure_port(address, self.cert_source.credentials())
        else:
            self.grpc_port = self._grpc.add_insecure_port(address)
        if self.cert_source is not None:
            tls = self.cert_source.current
            log.info("ext_proc serves TLS with a %s certificate (%s, sha256 %s)%s",
                     "self-signed" if tls.self_signed else "provided", tls.cert_file, tls.fingerprint(),
                     "" if tls.self_signed else "; reloaded when the files change")
            if cfg.cert_path:
                self._tasks.append(asyncio.create_task(self.cert_source.run()))
        self._health_server = grpc.aio.server(options=HEALTH_SERVER_OPTIONS)
        self.health.add_to(self._health_server)
        self.health_port = self._health_server.add_insecure_port(f"{cfg.bind}:{cfg.health_port}")
        admin = build_admin_app(self.registry, self.load, self.metrics,
                                kv_snapshot=self.kv.snapshot if self.kv else None,
                                score=self.debug_score, flow_snapshot=self.flow_snapshot,
                                decisions=self.decision.decisions, bind=cfg.admin_bind)
        shared = (cfg.admin_bind, cfg.admin_port) == (cfg.bind, cfg.metrics_port) and cfg.admin_port != 0
        self._admin = web.AppRunner(admin, access_log=None)
        self.admin_port = await _serve(self._admin, cfg.admin_bind, cfg.admin_port)
        if shared:  # the operator asked for one listener: /debug on the metrics address
            self.metrics_port = self.admin_port
        else:
            self._metrics_http = web.AppRunner(build_metrics_app(self.metrics), access_log=None)
            self.metrics_port = await _serve(self._metrics_http, cfg.bind, cfg.metrics_port)
        if self.ingest is not None:
            self.ingest.start()
            self._tasks.append(asyncio.create_task(self.ingest.run()))
        if self.kv is not None:
            self.kv.start()
        await self._start_discovery()
        if self.sync is not None:
            await self._start_sync()
        self._tasks.append(asyncio.create_task(self._readiness_loop()))
        if self.prober is not None:
            self._tasks.append(asyncio.create_task(self.prober.run()))
        if self.fingerprints is not None:
            self._tasks.append(asyncio.create_task(self.fingerprints.run()))
        if self.scraper is not None:
            self._tasks.append(asyncio.create_task(self.scraper.run()))
        self._start_tables()
        if self.session_keys is not None:
            self._tasks.append(asyncio.create_task(self.session_keys.run()))
        self._warn_if_load_only()
        await self._grpc.start()
        await self._health_server.start()
        log.info("picker listening: ext_proc %s:%d, health %s:%d, metrics http://%s:%d/metrics, "
                 "admin http://%s:%d/debug/page", cfg.bind, self.grpc_port, cfg.bind, self.health_port, cfg.bind,
                 self.metrics_port, cfg.admin_bind, self.admin_port)

    def _warn_if_load_only(self) -> None:
        """KV-aware routing is the product's point: say so at start-up when requests will be routed by load
        only, and which flags turn it on."""
        if self.renderer is None:
            log.warning("no renderer configured: every request is routed by load only. KV-aware routing needs "
                        "--tokenizer-protocol (e.g. trtllm-render) and --tokenizer-service-url (a worker's or "
                        "render server's http://HOST:PORT)")
            return
        renderer = self.renderer

        async def check() -> None:
            why = await renderer.unreachable()
            if why is not None:
                log.warning("renderer %s is not reachable (%s): requests are routed by load only until it "
                            "answers; check --tokenizer-service-url", renderer.base_url, why)
        self._spawn(check())

    async def debug_score(self, payload: dict[str, Any]) -> dict[str, Any]:
        """`/debug/score`: a proposal that is never committed, and whose render is not counted as traffic."""
        return await debug_score(self.director, self.decision.debug, payload)

    async def _drain(self, grace: float) -> None:
        """No new streams; the requests in flight get up to `grace` s; the long-lived service streams (Envoy's
        access log, health watches) are not requests and end as soon as the requests have, so a picker behind
        an idle Envoy stops at once."""
        assert self._grpc is not None
        picker = self.picker
        inflight = picker.open_requests
        if inflight:
            log.info("draining: %d requests in flight, waiting up to %.1fs", inflight, grace)
        stopping = asyncio.get_running_loop().create_task(self._grpc.stop(grace))
        while picker.open_requests and not stopping.done():
            await asyncio.sleep(0.02)
        self.access_log.streams.end_all()
        self.health.servicer.streams.end_all()
        if isinstance(self._grpc, grpc.aio.Server) and not stopping.done():
            await self._grpc.stop(0)  # grpcio's drain still counts the cancelled handlers: cut them now
        await stopping
        cut = picker.open_requests
        (log.warning if cut else log.info)("drained: %d requests finished, %d cut", inflight - cut, cut)

    @property
    def tls(self) -> ServerCert | None:
        """The certificate the ext_proc port serves now (None = plaintext h2c)."""
        return self.cert_source.current if self.cert_source is not None else None

    async def _start_discovery(self) -> None:
        cfg = self.config
        replay = cfg.kv_event_replay_port
        if cfg.endpoints:
            self.registry.replace(parse_flag(cfg.endpoints, kv_event_port=cfg.kv_event_port, replay_port=replay))
        elif cfg.endpoints_file:
            fd = FileDiscovery(self.registry, cfg.endpoints_file, kv_event_port=cfg.kv_event_port,
                               replay_port=replay, max_endpoints=cfg.max_endpoints)
            await fd.load_once()
            self._tasks.append(asyncio.create_task(fd.run()))
        elif cfg.inference_pool_name:
            from epp_extproc.adapters.discovery_k8s import InferencePoolDiscovery

            d = InferencePoolDiscovery(self.registry, cfg.inference_pool_name, cfg.namespace,
                                       kv_event_port=cfg.kv_event_port, replay_port=replay,
                                       kubeconfig=cfg.kubeconfig, role_label=cfg.role_label)
            self._tasks.append(asyncio.create_task(d.run()))
        else:
            log.warning("no endpoint source configured (--endpoints, --endpoints-file or "
                        "--inference-pool-name): every request will get 503")
            self.registry.replace([])

    def _start_tables(self) -> None:
        """Objectives and model rewrites: from their CRDs when discovery is Kubernetes, else from their files
        (read once now, then followed)."""
        cfg = self.config
        if cfg.inference_pool_name:
            from epp_extproc.adapters.discovery_k8s import default_namespace

            ns, pool = cfg.namespace or default_namespace(), cfg.inference_pool_name
            for poller in (ObjectiveCrdPoller(self.objectives, pool, ns, kubeconfig=cfg.kubeconfig),
                           ModelRewriteCrdPoller(self.rewrites, pool, ns, kubeconfig=cfg.kubeconfig)):
                self._tasks.append(asyncio.create_task(poller.run()))
            return
        files: list[ObjectivesFile | ModelRewritesFile] = []
        if cfg.inference_objectives_file:
            files.append(ObjectivesFile(self.objectives, cfg.inference_objectives_file))
        if cfg.model_rewrites_file:
            files.append(ModelRewritesFile(self.rewrites, cfg.model_rewrites_file))
        for f in files:
            f.load_once()
            self._tasks.append(asyncio.create_task(f.run()))

    async def _start_sync(self) -> None:
        cfg = self.config
        assert self.sync is not None
        if cfg.replica_sync_plane == "nats":
            await self.sync.start([])
            return
        await self.sync.start(self.slot.sync_listen or [f"{cfg.bind}:{cfg.replica_sync_port}"])
        if self.sync.tls is not None:
            self._tasks.append(asyncio.create_task(self.sync.tls.run()))
        if cfg.peer_service:
            from epp_extproc.adapters.discovery_peers import PeerServiceDiscovery

            d = PeerServiceDiscovery(self.sync.set_peers, cfg.peer_service, cfg.namespace, pod_ip=cfg.pod_ip,
                                     kubeconfig=cfg.kubeconfig)
            self._tasks.append(asyncio.create_task(d.run()))
        else:
            self.sync.set_peers(cfg.peer_list())

    async def announce_shutdown(self) -> None:
        """First step of a SIGTERM: readiness, the ext_proc service's health and "" say NOT_SERVING now, while
        every listener keeps serving (liveness stays SERVING). A gateway learns a host is unhealthy only from
        its next health check (Envoy: within one interval) and Kubernetes removes the endpoint a
        moment later: streams it opens meanwhile must still be served, or each is a request lost (Envoy does
        not retry a failed ext_proc stream open). `stop` follows after the grace period."""
        self.draining = True
        await self.health.set_ready(False)

    async def stop(self, grace: float = 1.0) -> None:
        """Drain: not ready, no new ext_proc streams, up to `grace` s for those in flight; then the frees
        they made reach the peers before the sync links close. Streams still open at the deadline are
        cancelled (their bookings freed) and logged, never dropped silently."""
        self.draining = True
        await self.health.shutdown()
        if self.flow is not None:
            self.flow.close()  # queued requests get 503 now rather than a reset stream later
        await cancel_and_wait(list(self._tasks))
        if self._grpc is not None:
            await self._drain(grace)
        if self.metrics_share is not None:
            self.metrics_share.close()
        if self.sync is not None:
            await self.sync.close()
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self.cert_source is not None:
            self.cert_source.close()
        if self._admin is not None:
            await self._admin.cleanup()
        if self._metrics_http is not None:
            await self._metrics_http.cleanup()
        if self.kv is not None:
            await self.kv.close()
        if self.ingest is not None:
            await self.ingest.astop()
        if self.ingest_dir is not None:
            shutil.rmtree(self.ingest_dir, ignore_errors=True)
        if self.renderer is not None:
            await self.renderer.close()
        if self.tracing is not None:  # the last spans go out (bounded by the exporter's timeout), off the loop
            await asyncio.to_thread(self.tracing.shutdown)
