"""``epp-pd-sidecar``: flags (with ``DYN_PD_*`` environment defaults) into a SidecarConfig, then serve."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from aiohttp import web

from .allowlist import parse_pool_ref
from .server import Sidecar, SidecarConfig
from .target import parse_allowed


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    d = SidecarConfig()
    p = argparse.ArgumentParser(prog="epp-pd-sidecar", description="Decode-side P/D sidecar: runs the prefill "
                                "leg on the worker named in x-prefiller-host-port, the decode leg locally.")
    a = p.add_argument
    a("--host", default=env("DYN_PD_HOST", "0.0.0.0"))
    a("--port", type=int, default=int(env("DYN_PD_PORT", "8000")))
    a("--decode-url", default=env("DYN_PD_DECODE_URL", d.decode_url), help="the local decode worker")
    a("--engine", choices=["trtllm", "vllm"], default=env("DYN_PD_ENGINE", d.engine))
    a("--allowed-prefillers", default=env("DYN_PD_ALLOWED_PREFILLERS", ""),
      help="ip:port,ip:port of the prefill workers this sidecar may call (also DYN_PD_ALLOWED_PREFILLERS); "
           "united with --inference-pool's prefill pods when both are given; with neither, every named "
           "prefiller is refused (403) and requests are served locally only if unnamed")
    a("--inference-pool", default=env("DYN_PD_INFERENCE_POOL") or None, metavar="[NAMESPACE/]NAME",
      help="also allow the Ready prefill pods (role label) of this InferencePool on its target ports, kept "
           "current by a watch (needs get/list/watch on inferencepools and pods); namespace: the pod's own")
    a("--role-label", default=env("DYN_PD_ROLE_LABEL", d.role_label),
      help="the pod label whose value says prefill (the picker's --role-label)")
    a("--kubeconfig", default=env("KUBECONFIG") or None,
      help="kubeconfig for --inference-pool outside a cluster (default: the pod's service account)")
    a("--max-allowed-prefillers", type=int,
      default=int(env("DYN_PD_MAX_ALLOWED_PREFILLERS", str(d.max_allowed_prefillers))),
      help="at most this many ip:port entries from the pool (past it, by pod name: refused and counted)")
    a("--max-body-bytes", type=int, default=int(env("DYN_PD_MAX_BODY_BYTES", str(d.max_body_bytes))),
      help="largest request body accepted (413 beyond) and largest prefill answer read")
    a("--prefill-timeout-s", type=float, default=float(env("DYN_PD_PREFILL_TIMEOUT_S", str(d.prefill_timeout_s))))
    a("--connect-timeout-s", type=float, default=float(env("DYN_PD_CONNECT_TIMEOUT_S", str(d.connect_timeout_s))))
    a("--trtllm-ctx-usage", action=argparse.BooleanOptionalAction,
      default=env("DYN_PD_TRTLLM_CTX_USAGE", "1") not in ("0", "false", "False"),
      help="send ctx_usage on the TensorRT-LLM generation leg (--no-trtllm-ctx-usage for a release whose "
           "DisaggregatedParams has no ctx_usage field)")
    a("--log-level", default=env("DYN_PD_LOG_LEVEL", "INFO"))
    return p


def config_from_args(argv: Sequence[str] | None = None) -> tuple[SidecarConfig, argparse.Namespace]:
    ns = build_parser().parse_args(argv)
    cfg = SidecarConfig(decode_url=ns.decode_url, engine=ns.engine,
                        allowed_prefillers=parse_allowed(ns.allowed_prefillers), max_body_bytes=ns.max_body_bytes,
                        prefill_timeout_s=ns.prefill_timeout_s, connect_timeout_s=ns.connect_timeout_s,
                        trtllm_ctx_usage=ns.trtllm_ctx_usage, inference_pool=ns.inference_pool,
                        role_label=ns.role_label, kubeconfig=ns.kubeconfig,
                        max_allowed_prefillers=ns.max_allowed_prefillers)
    if cfg.inference_pool is not None:
        parse_pool_ref(cfg.inference_pool)  # a malformed reference is a start-up error, not a silent 403
    if cfg.max_allowed_prefillers < 1:
        raise ValueError(f"--max-allowed-prefillers must be at least 1, got {cfg.max_allowed_prefillers}")
    return cfg, ns


async def serve(cfg: SidecarConfig, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM. ``handler_cancellation``: a client that goes away cancels its handler, and
    with it both legs' upstream requests."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    sidecar = Sidecar(cfg)
    runner = web.AppRunner(sidecar.app, handle_signals=False, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    print(f"epp-pd-sidecar ({cfg.engine}) listening on {host}:{port}, decode worker {cfg.decode_url}, "
          f"{len(cfg.allowed_prefillers)} allowed prefill workers"
          + (f" plus the prefill pods of InferencePool {cfg.inference_pool}" if cfg.inference_pool else ""),
          flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point."""
    try:
        cfg, ns = config_from_args(argv)
    except ValueError as e:
        print(f"epp-pd-sidecar: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(cfg, ns.host, ns.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
