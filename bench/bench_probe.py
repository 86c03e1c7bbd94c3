"""Endpoint-prober cost for a large pool: CPU of the picker process per second of probing.

N endpoints are N listening sockets of one helper process (a minimal HTTP/1.1 responder, so its own CPU is
not counted); the prober runs in this process and we measure this process's CPU time over a window.
Baseline, same run: the same prober without the rate cap (every endpoint every interval, as before the cap).

    python -m bench.bench_probe [--endpoints 1000] [--seconds 6] [--interval-ms 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

from epp_extproc.adapters.endpoint_probe import DEFAULT_MAX_RATE, EndpointProber
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry

SERVER = r"""
import asyncio, socket, sys
N = int(sys.argv[1])
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
class P(asyncio.Protocol):
    def connection_made(self, t): self.t = t
    def data_received(self, d):
        if b"\r\n\r\n" in d: self.t.write(OK)
async def main():
    loop = asyncio.get_running_loop()
    ports = []
    for _ in range(N):
        srv = await loop.create_server(P, "127.0.0.1", 0, backlog=64)
        ports.append(srv.sockets[0].getsockname()[1])
    print(" ".join(map(str, ports)), flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def measure(addresses: list[str], seconds: float, interval_s: float, max_rate: float,
                  max_concurrency: int) -> tuple[float, float]:
    """(CPU share of one core, probes per second) of one prober over `seconds` after a warm-up round."""
    reg = EndpointRegistry()
    reg.replace([Endpoint(f"w{i}", a) for i, a in enumerate(addresses)])
    prober = EndpointProber(reg, interval_s=interval_s, max_rate=max_rate, max_concurrency=max_concurrency)
    probes = 0
    judge = prober._verdict

    def counting(address: str, ok: bool, refused: bool, why: str) -> None:
        nonlocal probes
        probes += 1
        judge(address, ok, refused, why)

    prober._verdict = counting  # type: ignore[method-assign]
    task = asyncio.create_task(prober.run())
    await asyncio.sleep(min(seconds / 3, 2.0))  # warm-up
    probes, cpu0, wall0 = 0, time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    cpu, wall, n = time.process_time() - cpu0, time.perf_counter() - wall0, probes
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    unhealthy = sum(1 for a in addresses if not reg.healthy(a))
    assert unhealthy == 0, f"{unhealthy} endpoints judged unhealthy: the benchmark server is overloaded"
    return cpu / wall, n / wall


async def amain(args: argparse.Namespace) -> None:
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(args.endpoints)], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        ports = server.stdout.readline().split()
        addresses = [f"127.0.0.1:{int(p)}" for p in ports]
        interval = args.interval_ms / 1000
        base_cpu, base_rate = await measure(addresses, args.seconds, interval, 1e12, 1 << 30)
        cpu, rate = await measure(addresses, args.seconds, interval, DEFAULT_MAX_RATE, 32)
    finally:
        server.kill()
        server.wait()
    print(f"prober, {args.endpoints} endpoints, interval {args.interval_ms} ms ({args.seconds}s windows)")
    print(f"  baseline (no rate cap):        {base_rate:7.1f} probes/s  CPU {base_cpu:6.1%} of a core")
    print(f"  default (cap {DEFAULT_MAX_RATE:.0f}/s, 32 in flight): {rate:7.1f} probes/s  CPU {cpu:6.1%} of a core"
          f"  ratio {cpu / base_cpu:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--endpoints", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--interval-ms", type=int, default=1000)
    asyncio.run(amain(p.parse_args()))


if __name__ == "__main__":
    main()
