"""KV ingest in the picker's process against ingest apart (issue 32), on pre-recorded event files.

    python -m bench.bench_ingest_apart [--quick] [--out bench/results/ingest_apart.json] [--events DIR]

Events are recorded once per pool size into `--events` (default /tmp/epp-ingest-events; re-used when present:
the same bytes every run) and replayed by a player process (`--play`, one PUB socket per simulated worker
over ipc://), so the measured processes never pay for generating them. Each simulated worker first stores
part of one shared 32k-token document (1,024 blocks of 32: between half and all of it, so the lookup walks up
to 1,024 blocks), then publishes 10 batches/s: a fresh chain of 1..15 blocks off a random block of the
document, plus the LRU removals of its oldest fresh blocks past 4,096.

For each pool size (8, 256, 1,000 workers) and each mode (`inprocess`: `KvRouting` in the measuring process;
`apart`: `RemoteKv` plus one ingest shard process) the measuring process runs the real decision without the
render hop (`Director.propose(tokens=...)` + `commit` + free) every 5 ms on a 32k-token prompt sharing the
document, for `--seconds`, and reports:

* lookup p50/p99 (`KvLookup.overlap` as the decision calls it, with the prompt's block hashes already made:
  hashes in, per-worker overlap out, what Dynamo's `find_matches` p99 times), the hashing apart
  (`hashing_*`: the decision process's own work, the same in both modes) and their sum
  (`lookup_with_hashing_*`, what earlier runs called the lookup); decision p50/p99 from the moment the decision
  was due (a loop busy with ingest delays it: that wait is what ingest costs the decisions; once a loop
  falls behind the 5 ms schedule the delays add up), and `decision_run` p50/p99 from when it started;
* ingest lag p99 (the batch's publish `ts` -> applied to the index), batches applied;
* CPU-seconds per 1,000 batches ingested (the ingesting process: the measuring process in `inprocess`, the
  shard in `apart`) and per decision (the measuring process), RSS per worker (index memory over pool size).

The flood: 8 workers, decisions back to back for `--seconds` (throughput and p99), unflooded and while worker
0 replays a recorded flood as fast as the player can send; ratio flooded / unflooded, per mode.

The channel: the lookup call itself, in the same process, for the same prompt: the in-process index walk,
the SEQPACKET round trip the adapter uses, and a ZeroMQ REQ/REP over ipc:// to the same index walk; at
1k and 32k tokens against 8, 256 and 1,000 workers: where the channel costs more than the walk it replaces.

Pinning: nothing is pinned by default; `--pin` puts the measuring process on CPU 0 and the ingest shard and
the player on CPU 1 (what helps on a 2-core box: the decision's core is never shared with ingest), the player
at SCHED_IDLE (`--player-policy`). The player stands in for workers on other machines, so wherever it runs it
takes CPU a real host would not lose; `--player-cpu 0` puts it beside the decisions instead, which sleep
between two decisions and so preempt it at once, while the shard, busy with ingest most of the time, was kept
waiting behind it on CPU 1 (stop 61: the lookup p99 at 1,000 workers 0.73-0.91 ms in 9 of 10 rounds with
the player on CPU 0, 0.99-2.05 in 3 on CPU 1, and the 8-worker decision p99 the same on either;
bench/README.md). The issue 45 rounds since stop 61 use `--player-cpu 0` for `apart`; `inprocess` keeps CPU 1
for it (its CPU 0 ingests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgpack
import zmq

BS = 32
DOC_BLOCKS = 1024  # 32k tokens
RATE = 10.0
CAP = 4096
FLOOD_BATCHES = 20_000
FLOOD_BLOCKS = 64
_REC = struct.Struct("<IQI")  # worker, seq, payload length
PLAYER_NICE = 19  # --pin --player-policy nice: the player yields its CPU (see `_yield_cpu`)
PLAYER_POLICY = ["idle"]  # --pin: how the player yields its CPU (--player-policy; see `_yield_cpu`)
PLAYER_CPU = [1]  # --pin: the player's CPU (--player-cpu): with the shard by default
_TS_OFFSET = 2  # msgpack [ts, events, rank]: 0x93, 0xcb, then ts as big-endian float64


# ------------------------------------------------------------------ recording
def make_doc(seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 32000) for _ in range(DOC_BLOCKS * BS + 1)]


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}


def _payload(events: list[Any]) -> bytes:
    b = msgpack.packb([0.0, events, 0], use_bin_type=True)
    assert b[1] == 0xCB  # float64 ts at a fixed offset, stamped when sent
    return b


def record(n: int, path: Path, seconds: float, flood: bool) -> None:
    """warm section (every worker's share of the document), steady section (`seconds` at RATE), flood section."""
    rng = random.Random(n)
    doc = make_doc()
    pool = [rng.randrange(100, 32000) for _ in range(65536)]
    seq = [0] * n
    held = [0] * n
    fresh: list[deque[int]] = [deque() for _ in range(n)]
    counter = [1 << 30] * n
    with path.open("wb") as f:
        def put(w: int, events: list[Any]) -> None:
            p = _payload(events)
            f.write(_REC.pack(w, seq[w], len(p)))
            f.write(p)
            seq[w] += 1

        for w in range(n):
            k = DOC_BLOCKS if w == 0 else rng.randint(DOC_BLOCKS // 2, DOC_BLOCKS)
            held[w] = k
            parent = None
            for start in range(0, k, 128):
                end = min(k, start + 128)
                hs = [(w << 40) + j for j in range(start, end)]
                put(w, [_stored(hs, parent, doc[start * BS:end * BS])])
                parent = hs[-1]
        f.write(_REC.pack(0xFFFFFFFF, 0, 0))  # end of the warm section
        for _ in range(int(seconds * RATE)):
            for w in range(n):
                k = rng.randint(1, 15)
                at = rng.randrange(held[w])
                hs = list(range(counter[w], counter[w] + k))
                counter[w] += k
                off = rng.randrange(0, 65536 - k * BS)
                events: list[Any] = [_stored(hs, (w << 40) + at, pool[off:off + k * BS])]
                fresh[w].extend(hs)
                if len(fresh[w]) > CAP:
                    gone = [fresh[w].popleft() for _ in range(len(fresh[w]) - CAP)]
                    events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"})
                put(w, events)
        f.write(_REC.pack(0xFFFFFFFF, 0, 0))  # end of the steady section
        if flood:
            for i in range(FLOOD_BATCHES):
                hs = list(range(counter[0], counter[0] + FLOOD_BLOCKS))
                counter[0] += FLOOD_BLOCKS
                off = (i * 977) % (65536 - FLOOD_BLOCKS * BS)
                put(0, [_stored(hs, None, pool[off:off + FLOOD_BLOCKS * BS])])
        f.write(_REC.pack(0xFFFFFFFF, 0, 0))


def read_sections(path: Path) -> list[list[tuple[int, int, bytes]]]:
    data = path.read_bytes()
    out: list[list[tuple[int, int, bytes]]] = [[]]
    off = 0
    while off < len(data):
        w, seq, n = _REC.unpack_from(data, off)
        off += _REC.size
        if w == 0xFFFFFFFF:
            out.append([])
            continue
        out[-1].append((w, seq, data[off:off + n]))
        off += n
    return [s for s in out[:3]]


# ------------------------------------------------------------------ the player (its own process)
def play(path: Path, n: int, sock_dir: str) -> None:
    """stdin commands: `warm`, `steady SECONDS`, `flood`, `stop`; heartbeats until `warm`."""
    warm, steady, flood = read_sections(path)
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 16384)
    socks = []
    for w in range(n):
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 1_000_000)
        s.bind(f"ipc://{sock_dir}/w{w}")
        socks.append(s)
    next_seq = [0] * n  # the player numbers every worker's batches itself: heartbeats, warm, steady, flood
    print(json.dumps({"endpoints": [f"ipc://{sock_dir}/w{w}" for w in range(n)]}), flush=True)
    os.set_blocking(sys.stdin.fileno(), False)
    buf = b""

    def send(w: int, _recorded_seq: int, payload: bytes, stamp: bool = True) -> None:
        b = bytearray(payload)
        if stamp:  # the warm section stays unstamped (ts 0): its backlog is not ingest lag
            struct.pack_into(">d", b, _TS_OFFSET, time.time())
        socks[w].send_multipart([b"", struct.pack(">Q", next_seq[w]), bytes(b)], copy=False)
        next_seq[w] += 1

    def commands() -> list[str]:
        nonlocal buf
        try:
            chunk = os.read(sys.stdin.fileno(), 65536)
        except BlockingIOError:
            return []
        if not chunk:
            return ["stop"]
        buf += chunk
        *lines, buf = buf.split(b"\n")
        return [x.decode().strip() for x in lines]

    steady_pos = 0
    steady_end = 0.0
    steady_t0 = 0.0
    flooding = False
    flood_pos = 0
    last_hb = 0.0
    heartbeating = True
    sent = 0
    while True:
        for cmd in commands():
            if cmd == "stop":
                print(json.dumps({"sent": sent}), flush=True)
                return
            if cmd == "warm":
                heartbeating = False
                for w, seq, p in warm:
                    send(w, seq, p, stamp=False)
                print(json.dumps({"warm": len(warm)}), flush=True)
            elif cmd.startswith("steady"):
                steady_t0 = time.monotonic()
                steady_end = steady_t0 + float(cmd.split()[1])
                steady_pos = 0
            elif cmd == "flood":
                flooding = True
        now = time.monotonic()
        if heartbeating and now - last_hb > max(0.2, n / 1000):  # 1,000 workers: 1,000 heartbeats/s
            last_hb = now
            for w in range(n):
                send(w, 0, _payload([]), stamp=False)
        did = False
        if steady_end and now < steady_end and steady_pos < len(steady):
            due = int((now - steady_t0) * RATE * n)
            while steady_pos < min(due, len(steady)):
                w, seq, p = steady[steady_pos]
                send(w, seq, p)
                steady_pos += 1
                sent += 1
                did = True
        if flooding and flood_pos < len(flood):
            for _ in range(50):
                if flood_pos >= len(flood):
                    break
                w, seq, p = flood[flood_pos]
                send(w, seq, p)
                flood_pos += 1
                sent += 1
            did = True
        if not did:
            time.sleep(0.001)


class Player:
    def __init__(self, path: Path, n: int, pin: bool) -> None:
        self.dir = tempfile.mkdtemp(prefix="epp-play-")
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.bench_ingest_apart", "--play", str(path),
                                      "--workers", str(n), "--play-dir", self.dir],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        if pin:
            _pin(self.proc.pid, PLAYER_CPU[0])
        self.endpoints: list[str] = self._line()["endpoints"]
        if pin:  # its threads exist now: pin them all, and let the shard have CPU 1 whenever it wants it (the
            # player stands in for workers on other machines: on a real host it takes nothing from the picker)
            _pin(self.proc.pid, PLAYER_CPU[0])
            _yield_cpu(self.proc.pid, PLAYER_POLICY[0])

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        return json.loads(self.proc.stdout.readline())

    def cmd(self, c: str, answer: bool = False) -> dict[str, Any] | None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((c + "\n").encode())
        self.proc.stdin.flush()
        return self._line() if answer else None

    def stop(self) -> None:
        try:
            self.cmd("stop", answer=True)
        except (OSError, ValueError):
            pass
        self.proc.kill()
        self.proc.wait()


def _threads(pid: int) -> list[int]:
    """Every thread of `pid`: a call on the pid alone reaches its main thread only, and libzmq's I/O threads and
    a shard's lookup threads would stay as they were."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _pin(pid: int, cpu: int) -> None:
    """Every thread of `pid` on `cpu`."""
    if cpu >= (os.cpu_count() or 1):
        return
    for tid in _threads(pid):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, {cpu})


def _yield_cpu(pid: int, policy: str) -> None:
    """Make every thread of `pid` (the player) give its CPU up to the measured processes.

    ``nice``: nice 19, what every run before stop 61 used. ``idle`` (default): SCHED_IDLE, which a normal
    task's wake-up preempts at once (`check_preempt_wakeup_fair`). On this VM's kernel (6.18, EEVDF) nice 19
    did not keep the player out of the shard's way: with the player on CPU 1 beside the shard, the lookup
    p99 at 1,000 workers was 2.2-2.5 ms with nice 19 and 1.6 ms with SCHED_IDLE (same session, 2 rounds each,
    `results/ingest_apart-stop61/policy/`). Even SCHED_IDLE leaves a share of the waits there: after preempting
    the player's main thread the scheduler may run the player's libzmq I/O thread before the shard it just woke
    (`results/ingest_apart-stop61/diagnosis/`); `--player-cpu 0` keeps the player off the shard's CPU."""
    for tid in _threads(pid):
        with contextlib.suppress(OSError):
            if policy == "idle":
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, tid, PLAYER_NICE)


# ------------------------------------------------------------------ measuring
def cpu_s(pid: int | None = None) -> float:
    with open(f"/proc/{pid or os.getpid()}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int | None = None) -> float:
    with open(f"/proc/{pid or os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


class Setup:
    """A pool of `n` simulated workers, the KV view of `mode` over it, and the real decision (core/assemble.py)."""

    def __init__(self, mode: str, player: Any, pin: bool, shared_dir: str | None = None) -> None:
        """`player`: anything with the workers' `endpoints`; `shared_dir`: the sockets of shards another
        process started (a second picker process of `--processes 2`), instead of starting its own."""
        from epp_extproc.adapters.kv_remote import RemoteKv
        from epp_extproc.adapters.kv_routing import KvRouting
        from epp_extproc.config import Config
        from epp_extproc.core.assemble import assemble
        from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
        from epp_extproc.core.load import LoadTracker
        from epp_extproc.ingest.launcher import IngestGroup, shard_argv
        from epp_extproc.ingest.pacing import LagSamples
        from epp_extproc.metrics import PickerMetrics

        self.mode = mode
        self.eps = [Endpoint(f"w{i}", f"127.0.0.1:{20000 + i}", e) for i, e in enumerate(player.endpoints)]
        self.addresses = [e.address for e in self.eps]
        self.registry = EndpointRegistry()
        self.group: Any = None
        self.lag = LagSamples(65536)
        self.dir = tempfile.mkdtemp(prefix="epp-bench-ingest-")
        self.apart = mode.startswith("apart")
        # apart variants: "apart-thread" answers lookups on the shard's threads, "apart" (the product's default,
        # also "apart-loop") on its loop between batches;
        # "apart-2shards" runs two shards (both on CPU 1 when pinned: two cores hold no third one)
        shards = 2 if "2shards" in mode else 1
        lookups = "thread" if "thread" in mode else "loop"  # the product's default is loop
        if self.apart and shared_dir is not None:
            self.dir = shared_dir
        elif self.apart:
            self.group = IngestGroup([shard_argv(self.dir, k, shards, block_size=BS, max_blocks_per_worker=1_000_000,
                                                 topic="", worker_cpu_share=0.1, log_level="WARNING", lookups=lookups)
                                      for k in range(shards)])
            self.group.start()
            if pin:
                for pid in self.group.pids():
                    _pin(pid, 1)
        if self.apart:
            self.kv: Any = RemoteKv(self.registry, directory=self.dir, shards=shards, block_size=BS,
                                    prediction_ttl_s=2.0, lookup_timeout_s=0.05, ask_server_info=False)
        else:
            # `inprocess` as the product builds it (each worker's events paced to --kv-ingest-worker-cpu-share);
            # `inprocess-unpaced`: no per-worker budget (before stop 50)
            share = None if "unpaced" in mode else Config().kv_ingest_worker_cpu_share
            self.kv = KvRouting(self.registry, block_size=BS, max_blocks_per_worker=1_000_000, topic="",
                                prediction_ttl_s=2.0, metrics_registry=None, ask_server_info=False,
                                worker_cpu_share=share)
            idx, lag = self.kv.index, self.lag
            orig = idx.apply_batch

            def apply_batch(worker_id: str, batch: Any, rank: int | None = None) -> None:  # timing probe
                orig(worker_id, batch, rank)
                if batch.ts > 1e9:
                    lag.add(time.time() - batch.ts)
            idx.apply_batch = apply_batch
        metrics = PickerMetrics()
        self.load = LoadTracker(metrics.endpoint_inflight)
        self.director = assemble(Config(), self.registry, self.load, metrics, kv=self.kv).director
        self.lookups: list[float] = []
        self.hashing: list[float] = []
        looks, hashing = self.lookups, self.hashing

        def probe(orig: Any) -> Any:
            def timed(prompt: Any, workers: Any, **kw: Any) -> Any:  # timing probe
                # the prompt's chain first, timed apart (it is the decision process's work in both modes, ~0.3
                # ms at 32k tokens whatever the pool): the lookup is then what Dynamo's `find_matches` times,
                # block hashes in, per-worker overlap out; `lookup_with_hashing_*` is the sum, the figure of
                # earlier runs
                t = time.perf_counter()
                prompt.hashes(BS)
                t1 = time.perf_counter()
                r = orig(prompt, workers, **kw)
                t2 = time.perf_counter()
                hashing.append(t1 - t)
                looks.append(t2 - t1)
                return r
            return timed

        self.kv.overlap = probe(self.kv.overlap)
        # a columnar table (issue 45: pools of COLUMNAR_MIN workers or more) asks for the overlap as one array
        if hasattr(self.kv, "overlap_array"):  # (absent before issue 45: the bench runs on either tree)
            self.kv.overlap_array = probe(self.kv.overlap_array)

    def owns_ingest(self) -> bool:
        return not self.apart or self.group is not None

    def ingest_pids(self) -> list[int]:
        return self.group.pids() if self.group is not None else [os.getpid()]

    async def start(self) -> None:
        if self.apart:
            self.kv.start()
        self.registry.replace(self.eps)

    def warm_count(self) -> int:
        if self.apart:
            return sum(1 for a in self.addresses if self.kv.warm(a))
        return sum(1 for a in self.addresses if self.kv.index.stats(a).batches > 0)

    def blocks(self) -> int:
        if self.apart:
            return -1
        return sum(self.kv.index.blocks_indexed(a) for a in self.addresses)

    async def ingest_stats(self) -> dict[str, Any]:
        if self.apart:
            snap = await self.kv.snapshot(timeout_s=60)  # 1,000 workers' counters on a busy machine
            for ing in snap["ingest"]:
                if not ing.get("up"):
                    raise RuntimeError(f"ingest snapshot failed: {ing}")
            lags = [ing.get("batch_lag_s", {}) for ing in snap["ingest"]]
            lag = {q: max((x.get(q) or 0.0) for x in lags) for q in ("p50", "p99")}  # the worse shard's
            answer = {q: max((ing.get("answer_s", {}).get(q) or 0.0) for ing in snap["ingest"]) for q in ("p50", "p99")}
            return {"lag": lag, "answer": answer, "batches": sum(w.get("batches", 0)
                                                                      for w in snap["workers"].values()),
                    "blocks": sum(w.get("blocks_indexed", 0) for w in snap["workers"].values())}
        return {"lag": self.lag.summary(), "batches": sum(self.kv.index.stats(a).batches for a in self.addresses),
                "blocks": self.blocks()}

    async def close(self) -> None:
        await self.kv.close()
        if self.group is not None:
            await self.group.astop()


async def decide(setup: Setup, tokens: list[int]) -> None:
    from epp_extproc.core.request import RequestContext

    p = await setup.director.propose(RequestContext(method="POST", path="/v1/completions"), tokens=tokens)
    d = setup.director.commit(p)
    d.booking.free()


async def decision_loop(setup: Setup, prompts: list[list[int]], seconds: float, period: float | None
                        ) -> dict[str, Any]:
    """Decisions every `period` s (None: back to back); latency counted from when each was due."""
    from epp_extproc.heap import freeze_startup_heap

    freeze_startup_heap()  # set up: as a picker does once started (epp_extproc/heap.py)
    lat: list[float] = []
    run: list[float] = []
    dues: list[float] = []
    waits: list[float] = []  # the run-queue wait of this thread since the previous decision ended
    runqueue_wait = _RunqueueWait()
    waited = runqueue_wait()
    setup.lookups.clear()
    setup.hashing.clear()
    cpu0, t0 = cpu_s(), time.perf_counter()
    due = t0
    i = 0
    while time.perf_counter() - t0 < seconds:
        if period is not None:
            due += period
            delay = due - time.perf_counter()
            await asyncio.sleep(max(delay, 0))
            start = due
        else:
            await asyncio.sleep(0)
            start = time.perf_counter()
        begun = time.perf_counter()
        dues.append(start - t0)
        await decide(setup, prompts[i % len(prompts)])
        end = time.perf_counter()
        lat.append(end - start)
        run.append(end - begun)
        now_waited = runqueue_wait()
        waits.append(now_waited - waited)
        waited = now_waited
        i += 1
    el = time.perf_counter() - t0
    cpu = cpu_s() - cpu0
    runqueue_wait.close()
    both = [a + b for a, b in zip(setup.lookups, setup.hashing, strict=True)]
    return {"decisions": i, "per_s": round(i / el, 1), "decision_p50_ms": _ms(pct(lat, 0.5)),
            "decision_p99_ms": _ms(pct(lat, 0.99)), "decision_run_p50_ms": _ms(pct(run, 0.5)),
            "decision_run_p99_ms": _ms(pct(run, 0.99)),
            # the worst five from when due, with when each was due (s into the run) and how long of it this
            # thread was runnable but another task had the CPU (see _RunqueueWait): one stall shows as a run
            "decision_worst_ms": [[_ms(x), round(t, 2), _ms(w)]
                                  for x, t, w in sorted(zip(lat, dues, waits, strict=True))[-5:]],
            # the same decisions less that wait: what is left is this process's (and the shard's) own doing
            "decision_less_runqueue_p99_ms": _ms(pct([max(x - w, 0.0) for x, w in zip(lat, waits, strict=True)],
                                                     0.99)),
            "runqueue_wait_ms_total": _ms(sum(waits)),
            "decisions_runqueue_wait_over_1ms": sum(1 for w in waits if w > 0.001),
            "lookup_p50_ms": _ms(pct(setup.lookups, 0.5)),
            "lookup_p99_ms": _ms(pct(setup.lookups, 0.99)),
            "hashing_p50_ms": _ms(pct(setup.hashing, 0.5)), "hashing_p99_ms": _ms(pct(setup.hashing, 0.99)),
            "lookup_with_hashing_p50_ms": _ms(pct(both, 0.5)), "lookup_with_hashing_p99_ms": _ms(pct(both, 0.99)),
            "process_cpu_s": round(cpu, 3),
            "elapsed_s": round(el, 2)}


class _RunqueueWait:
    """Seconds this thread has spent runnable but waiting for its CPU (the kernel's schedstat run_delay): on
    the pinned CPU 0 that is another task running, e.g. this VM's agent, which runs at nice -10 outside any
    session's autogroup and took CPU 0 for 7-17 ms every ~3 s in issue 45's 1,000-worker rounds. 0.0 where
    the kernel does not say. Read with one pread of a file kept open (under a microsecond a decision)."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def __call__(self) -> float:
        if self._fd is None:
            return 0.0
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 3)


async def wait_for(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


def prompts_for(k: int = 16) -> list[list[int]]:
    doc = make_doc()
    rng = random.Random(7)
    return [doc[: DOC_BLOCKS * BS - rng.randrange(0, 64)] + [rng.randrange(100, 32000) for _ in range(8)]
            for _ in range(k)]


async def run_scale(mode: str, n: int, path: Path, seconds: float, pin: bool) -> dict[str, Any]:
    player = Player(path, n, pin)
    setup = Setup(mode, player, pin)
    row: dict[str, Any] = {"mode": mode, "workers": n}
    try:
        await setup.start()
        await wait_for(lambda: setup.warm_count() == n, 20 + n * 0.02, "subscribers connected")
        await asyncio.sleep(0.5)  # the last heartbeats in
        expected = len(read_sections(path)[0]) + (await setup.ingest_stats())["batches"]
        rss0 = sum(rss_mb(p) for p in setup.ingest_pids())  # subscribed, nothing indexed: what follows is the index
        player.cmd("warm", answer=True)
        t_warm = time.monotonic()

        async def warm_done() -> bool:
            return (await setup.ingest_stats())["batches"] >= expected
        while not await warm_done():
            if time.monotonic() - t_warm > 120:
                raise TimeoutError("warm section not applied")
            await asyncio.sleep(0.2)
        row["warm_s"] = round(time.monotonic() - t_warm, 2)
        stats0 = await setup.ingest_stats()
        ipids = setup.ingest_pids()
        icpu0 = sum(cpu_s(p) for p in ipids)
        player.cmd(f"steady {seconds}")
        res = await decision_loop(setup, prompts_for(), seconds, 0.005)
        await asyncio.sleep(0.3)  # the tail of the steady section
        stats1 = await setup.ingest_stats()
        icpu = sum(cpu_s(p) for p in ipids) - icpu0
        batches = stats1["batches"] - stats0["batches"]
        row.update(res)
        row["batches_ingested"] = batches
        row["batches_per_s"] = round(batches / (res["elapsed_s"] + 0.3), 1)
        row["ingest_lag_p99_ms"] = _ms(stats1["lag"].get("p99"))
        row["ingest_lag_p50_ms"] = _ms(stats1["lag"].get("p50"))
        if "answer" in stats1:  # the shard's own service time per lookup (its last 4,096): the rest is the channel
            row["shard_answer_p50_ms"] = _ms(stats1["answer"]["p50"])
            row["shard_answer_p99_ms"] = _ms(stats1["answer"]["p99"])
        if setup.apart:
            row["ingest_cpu_s_per_1000_batches"] = round(icpu / max(batches, 1) * 1000, 3)
            row["cpu_ms_per_decision"] = round(res["process_cpu_s"] / max(res["decisions"], 1) * 1000, 3)
            row["index_rss_mb"] = round(sum(rss_mb(p) for p in ipids) - rss0, 1)
        else:  # one process does both: ingest CPU is what is left after the decisions (their cost measured apart)
            row["process_cpu_s_per_1000_batches"] = round(res["process_cpu_s"] / max(batches, 1) * 1000, 3)
            row["index_rss_mb"] = round(rss_mb() - rss0, 1)
        row["rss_kb_per_worker"] = round(row["index_rss_mb"] * 1024 / n, 1)
        row["blocks_indexed"] = stats1["blocks"]
        if setup.apart:
            row["lookups_unanswered"] = setup.kv.counts["unavailable"] + setup.kv.counts["timeout"]
    except Exception as e:  # a mode that cannot run a size says so in the results rather than aborting all
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        await setup.close()
        player.stop()
    return row


async def run_flood(mode: str, path: Path, seconds: float, pin: bool) -> dict[str, Any]:
    player = Player(path, 8, pin)
    setup = Setup(mode, player, pin)
    row: dict[str, Any] = {"mode": mode, "workers": 8}
    try:
        await setup.start()
        await wait_for(lambda: setup.warm_count() == 8, 30, "subscribers connected")
        player.cmd("warm", answer=True)
        await asyncio.sleep(1.0)
        prompts = prompts_for()
        base = await decision_loop(setup, prompts, seconds, None)
        ipids = setup.ingest_pids()
        s0 = await setup.ingest_stats()
        icpu0 = sum(cpu_s(p) for p in ipids)
        player.cmd("flood")
        await asyncio.sleep(0.3)
        flooded = await decision_loop(setup, prompts, seconds, None)
        s1 = await setup.ingest_stats()
        row["unflooded"] = base
        row["flooded"] = flooded
        row["flood_batches_ingested"] = s1["batches"] - s0["batches"]
        row["flood_ingest_cpu_s"] = round(sum(cpu_s(p) for p in ipids) - icpu0, 2)
        row["throughput_ratio"] = round(flooded["per_s"] / base["per_s"], 3)
        if base["decision_p99_ms"] and flooded["decision_p99_ms"]:
            row["p99_ratio"] = round(flooded["decision_p99_ms"] / base["decision_p99_ms"], 2)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        await setup.close()
        player.stop()
    return row


# ------------------------------------------------------------------ --processes N: a second picker process
def decider(mode: str, endpoints_file: str, shard_dir: str, seconds: float, period: float) -> None:
    """A child: one more picker process over the same pool (its own KV view in `inprocess`, the parent's
    shards in `apart`). Prints `ready` once every worker is subscribed/warm, runs its decisions on `go`,
    prints its row."""
    class _Pool:
        endpoints = json.loads(Path(endpoints_file).read_text())

    async def main() -> None:
        setup = Setup(mode, _Pool, False, shared_dir=shard_dir or None)
        n = len(_Pool.endpoints)
        await setup.start()
        await wait_for(lambda: setup.warm_count() == n, 20 + n * 0.02, "subscribers connected")
        print(json.dumps({"ready": True}), flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)
        res = await decision_loop(setup, prompts_for(), seconds, period)
        res["cpu_ms_per_decision"] = round(res["process_cpu_s"] / max(res["decisions"], 1) * 1000, 3)
        print(json.dumps(res), flush=True)
        await setup.close()

    asyncio.run(main())


async def run_processes(mode: str, n: int, procs: int, path: Path, seconds: float, period: float,
                        pin: bool) -> dict[str, Any]:
    """`procs` picker processes deciding over one pool of `n` workers at one decision every `period` s each:
    CPU per decision in each, and what ingest costs per process (`inprocess`: each ingests every worker;
    `apart`: one shard for all). On two shared cores the throughput of N processes cannot be measured
    (they compete with the shard and the player for the same two cores): only CPU is reported."""
    player = Player(path, n, pin)
    setup = Setup(mode, player, pin)
    row: dict[str, Any] = {"mode": mode, "workers": n, "processes": procs, "decisions_per_s_each": round(1 / period)}
    children: list[subprocess.Popen[bytes]] = []
    efile = Path(tempfile.mkdtemp(prefix="epp-bench-eps-")) / "endpoints.json"
    efile.write_text(json.dumps(player.endpoints))
    try:
        await setup.start()
        await wait_for(lambda: setup.warm_count() == n, 20 + n * 0.02, "subscribers connected")
        for _ in range(procs - 1):
            c = subprocess.Popen([sys.executable, "-m", "bench.bench_ingest_apart", "--decider", mode,
                                  "--endpoints-file", str(efile), "--play-dir", setup.dir if setup.apart else "",
                                  "--decider-seconds", str(seconds), "--decider-period", str(period)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            if pin:
                _pin(c.pid, 0)
            children.append(c)
        for c in children:
            assert c.stdout is not None
            line = await asyncio.get_running_loop().run_in_executor(None, c.stdout.readline)
            if not line:
                raise RuntimeError("a second picker process failed to start")
        player.cmd("warm", answer=True)
        await asyncio.sleep(2.0)  # the warm section applied everywhere
        ipids = setup.ingest_pids() if setup.apart else []
        icpu0 = sum(cpu_s(p) for p in ipids)
        s0 = (await setup.ingest_stats())["batches"]
        player.cmd(f"steady {seconds}")
        for c in children:
            assert c.stdin is not None
            c.stdin.write(b"go\n")
            c.stdin.flush()
        mine = await decision_loop(setup, prompts_for(), seconds, period)
        mine["cpu_ms_per_decision"] = round(mine["process_cpu_s"] / max(mine["decisions"], 1) * 1000, 3)
        rows = [mine]
        for c in children:
            assert c.stdout is not None
            line = await asyncio.get_running_loop().run_in_executor(None, c.stdout.readline)
            rows.append(json.loads(line))
        await asyncio.sleep(0.3)
        batches = (await setup.ingest_stats())["batches"] - s0
        row["batches_ingested"] = batches
        row["per_process"] = [{k: r[k] for k in ("decisions", "per_s", "decision_run_p50_ms", "decision_run_p99_ms",
                                                 "lookup_p50_ms", "process_cpu_s", "cpu_ms_per_decision")}
                              for r in rows]
        row["picker_cpu_s_total"] = round(sum(r["process_cpu_s"] for r in rows), 2)
        if setup.apart:
            icpu = sum(cpu_s(p) for p in ipids) - icpu0
            row["ingest_cpu_s_shared"] = round(icpu, 2)
            row["ingest_cpu_s_per_process"] = round(icpu / procs, 2)
            row["ingest_cpu_s_per_1000_batches"] = round(icpu / max(batches, 1) * 1000, 3)
        else:  # each process ingests every batch itself: its CPU beyond its decisions is its own ingest
            row["ingest_cpu_s_per_process"] = "in each process_cpu_s (every process ingests every batch)"
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        for c in children:
            c.kill()
            c.wait()
        await setup.close()
        player.stop()
    return row


# ------------------------------------------------------------------ the channel itself
def _doc_batches(n: int, doc: list[int], tiers: bool) -> list[tuple[str, Any]]:
    """Per simulated worker, the batch that stores its part of the document on the GPU (worker 0 all of it,
    the others between half and all); with `tiers`, every other worker also holds the whole document in host
    memory (vLLM's `CPU` medium, issue 44): its prefix goes on past its GPU part there."""
    from kvindex.events import BlockStored, DecodedBatch
    from kvindex.hashing import pack_tokens
    from kvindex.tiers import TIER_CPU

    out = []
    for w in range(n):
        k = DOC_BLOCKS if w == 0 else random.Random(w).randint(DOC_BLOCKS // 2, DOC_BLOCKS)
        evs: list[Any] = [BlockStored([(w << 40) + j for j in range(k)], None, pack_tokens(doc[:k * BS]), BS)]
        if tiers and w % 2:
            evs.append(BlockStored([(w << 40) + j for j in range(DOC_BLOCKS)], None, pack_tokens(doc), BS,
                                   tier=TIER_CPU))
        out.append((f"127.0.0.1:{20000 + w}", DecodedBatch(events=evs, raw_event_count=len(evs))))
    return out


def channel_server(n: int, sock_dir: str, tiers: bool = False) -> None:
    """A child process: one index of `n` workers holding the document, answering the same lookup over a
    SEQPACKET socket (the product's answer code) and over a ZeroMQ REP on ipc://; with `tiers`, half of them
    also hold it in host memory (`_doc_batches`)."""
    from epp_extproc.ingest.server import IngestShard

    shard = IngestShard(sock_dir, 0, 1, block_size=BS)
    doc = make_doc()

    async def serve() -> None:
        addresses = [f"127.0.0.1:{20000 + w}" for w in range(n)]
        await shard.want("bench", dict.fromkeys(addresses, ()))  # known workers, no subscriptions
        for addr, batch in _doc_batches(n, doc, tiers):
            shard.index.apply_batch(addr, batch)
        await shard.start()
        zctx = zmq.asyncio.Context()
        rep = zctx.socket(zmq.REP)
        rep.bind(f"ipc://{sock_dir}/rep")
        print("ready", flush=True)
        while True:
            msg = await rep.recv()
            await rep.send(shard.answer(msg))

    import zmq.asyncio
    asyncio.run(serve())


async def run_channel(ns: list[int], lengths: list[int], reps: int) -> list[dict[str, Any]]:
    from epp_extproc.adapters.kv_remote import RemoteKv
    from epp_extproc.adapters.worker_facts import Prompt
    from epp_extproc.core.endpoints import EndpointRegistry
    from epp_extproc.ingest import wire
    from kvindex.events import BlockStored, DecodedBatch
    from kvindex.hashing import pack_tokens
    from kvindex.index import KvIndex

    doc = make_doc()
    rows = []
    for n in ns:
        d = tempfile.mkdtemp(prefix="epp-chan-")
        proc = subprocess.Popen([sys.executable, "-m", "bench.bench_ingest_apart", "--channel-server", str(n),
                                 "--play-dir", d], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        proc.stdout.readline()
        local = KvIndex(BS, 1_000_000)
        for w in range(n):
            k = DOC_BLOCKS if w == 0 else random.Random(w).randint(DOC_BLOCKS // 2, DOC_BLOCKS)
            ev = BlockStored([(w << 40) + j for j in range(k)], None, pack_tokens(doc[:k * BS]), BS)
            local.apply_batch(f"127.0.0.1:{20000 + w}", DecodedBatch(events=[ev], raw_event_count=1))
        addresses = [f"127.0.0.1:{20000 + w}" for w in range(n)]
        kv = RemoteKv(EndpointRegistry(), directory=d, shards=1, block_size=BS, prediction_ttl_s=0.0,
                      lookup_timeout_s=1.0, ask_server_info=False)
        zctx = zmq.Context()
        req = zctx.socket(zmq.REQ)
        req.connect(f"ipc://{d}/rep")
        for length in lengths:
            prompt = Prompt(doc[:length], None)
            hashes = prompt.hashes(BS)
            want = local.overlap_hashes(hashes, BS, addresses)
            assert kv.overlap(prompt, addresses) == want  # the same answer over the channel
            req.send(wire.pack_lookup(1, 0, True, [(BS, hashes)]))
            version = wire.unpack_answer(req.recv())[1]  # the worker table once, as the adapter holds it
            t_local, t_seq, t_zmq = [], [], []
            for _ in range(reps):
                t = time.perf_counter()
                local.overlap_hashes(hashes, BS, addresses)
                t_local.append(time.perf_counter() - t)
                t = time.perf_counter()
                kv.overlap(prompt, addresses)
                t_seq.append(time.perf_counter() - t)
                t = time.perf_counter()
                req.send(wire.pack_lookup(1, version, True, [(BS, hashes)]))
                req.recv()
                t_zmq.append(time.perf_counter() - t)
            rows.append({"workers": n, "prompt_tokens": length,
                         "in_process_walk_p50_ms": _ms(statistics.median(t_local)),
                         "in_process_walk_p99_ms": _ms(pct(t_local, 0.99)),
                         "seqpacket_p50_ms": _ms(statistics.median(t_seq)), "seqpacket_p99_ms": _ms(pct(t_seq, 0.99)),
                         "zmq_ipc_p50_ms": _ms(statistics.median(t_zmq)), "zmq_ipc_p99_ms": _ms(pct(t_zmq, 0.99))})
        req.close(0)
        zctx.term()
        proc.kill()
        proc.wait()
    return rows


async def run_tiers(ns: list[int], lengths: list[int], reps: int) -> list[dict[str, Any]]:
    """What tier credit adds to a decision under `apart` (issue 44): while a shard holds blocks off the GPU,
    `TieredCreditScorer.prepare` sends a second lookup (`RemoteKv.tiers`) after the overlap one
    (`RemoteKv.overlap_array`). Per pool size and prompt length, both calls timed alternately against the
    same shard (half its workers hold the document in host memory too), next to the in-process walks they
    replace (`KvIndex.overlap_array`, `KvIndex.overlap_tiers`)."""
    from epp_extproc.adapters.kv_remote import RemoteKv
    from epp_extproc.adapters.worker_facts import Prompt
    from epp_extproc.core.endpoints import EndpointRegistry
    from kvindex.index import KvIndex

    doc = make_doc()
    rows = []
    for n in ns:
        d = tempfile.mkdtemp(prefix="epp-tiers-")
        proc = subprocess.Popen([sys.executable, "-m", "bench.bench_ingest_apart", "--channel-server", str(n),
                                 "--channel-tiers", "--play-dir", d], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        proc.stdout.readline()
        local = KvIndex(BS, 1_000_000)
        for addr, batch in _doc_batches(n, doc, True):
            local.apply_batch(addr, batch)
        addresses = tuple(f"127.0.0.1:{20000 + w}" for w in range(n))
        kv = RemoteKv(EndpointRegistry(), directory=d, shards=1, block_size=BS, prediction_ttl_s=0.0,
                      lookup_timeout_s=1.0, ask_server_info=False)
        for _ in range(200):  # the shard pushes its table (and its off-GPU flag) on its own schedule
            kv.overlap_array(Prompt(doc[:BS], None), addresses)
            if kv.has_tiers():
                break
            await asyncio.sleep(0.05)
        assert kv.has_tiers() and local.has_tiers()
        for length in lengths:
            prompt = Prompt(doc[:length], None)
            hashes = prompt.hashes(BS)
            want = local.overlap_tiers(hashes, BS, addresses)
            assert kv.tiers(prompt, addresses) == want  # the same runs over the channel
            t_ov, t_ti, t_lov, t_lti = [], [], [], []
            for _ in range(reps):
                t = time.perf_counter()
                kv.overlap_array(prompt, addresses)
                t_ov.append(time.perf_counter() - t)
                t = time.perf_counter()
                kv.tiers(prompt, addresses)
                t_ti.append(time.perf_counter() - t)
                t = time.perf_counter()
                local.overlap_array(hashes, BS, addresses)
                t_lov.append(time.perf_counter() - t)
                t = time.perf_counter()
                local.overlap_tiers(hashes, BS, addresses)
                t_lti.append(time.perf_counter() - t)
            row: dict[str, Any] = {"workers": n, "prompt_tokens": length}
            for name, xs in (("overlap", t_ov), ("tiers", t_ti), ("in_process_overlap", t_lov),
                             ("in_process_tiers", t_lti)):
                row[f"{name}_p50_ms"] = _ms(statistics.median(xs))
                row[f"{name}_p99_ms"] = _ms(pct(xs, 0.99))
            row["tiers_over_overlap_p50"] = round(statistics.median(t_ti) / statistics.median(t_ov), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        proc.kill()
        proc.wait()
    return rows


# ------------------------------------------------------------------ scraping and probing at scale
_METRICS_BODY = ("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\"} 0.0\n"
                 "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 0.0\n"
                 "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.1\n"
                 + "# filler\n" * 200).encode()


def fake_workers(port: int) -> None:
    """A child process: every 127.x.y.z:port is a worker answering GET /metrics and /health (keep-alive)."""
    served = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                body = _METRICS_BODY if b" /metrics" in head[:64] else b"ok"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                served += 1
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            writer.close()

    async def serve() -> None:
        server = await asyncio.start_server(handle, "0.0.0.0", port, backlog=4096)
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)
        print(json.dumps({"served": served}), flush=True)
        server.close()

    asyncio.run(serve())


async def run_scrape(n: int, seconds: float, max_rate: float | None = None) -> dict[str, Any]:
    """The picker's metric scraper and health prober, as `PickerApp` configures them by default (the scrape
    budget `max_rate` aside: None = the default, `--worker-metrics-max-rate`), against `n` fake workers: CPU
    of the picker's process per second and per worker."""
    from epp_extproc.adapters.endpoint_probe import EndpointProber
    from epp_extproc.adapters.worker_metrics import WorkerMetricsScraper
    from epp_extproc.config import Config
    from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
    from epp_extproc.core.load import LoadTracker
    from epp_extproc.core.saturation import SaturationDetector, Thresholds
    from epp_extproc.metrics import PickerMetrics

    cfg = Config()
    port = 31000 + random.randrange(1000)
    proc = subprocess.Popen([sys.executable, "-m", "bench.bench_ingest_apart", "--fake-workers", str(port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdout.readline()
    registry = EndpointRegistry()
    registry.replace([Endpoint(f"w{i}", f"127.0.{i // 250}.{i % 250 + 1}:{port}") for i in range(n)])
    load = LoadTracker(PickerMetrics().endpoint_inflight)
    detector = SaturationDetector(Thresholds(queue_depth=cfg.queue_depth_threshold,
                                             kv_utilization=cfg.kv_cache_util_threshold,
                                             prefill_tokens=cfg.max_num_batched_tokens,
                                             staleness_s=cfg.worker_metrics_staleness_ms / 1000),
                                  load.loads, cfg.kv_cache_block_size)
    errors: list[str] = []
    scraper = WorkerMetricsScraper(registry, load, detector, interval_s=cfg.worker_metrics_interval_ms / 1000,
                                   idle_interval_s=cfg.worker_metrics_idle_interval_ms / 1000,
                                   on_error=lambda _address, why: errors.append(why),
                                   max_rate=cfg.worker_metrics_max_rate if max_rate is None else max_rate)
    prober = EndpointProber(registry, interval_s=cfg.endpoint_probe_interval_ms / 1000,
                            max_rate=cfg.endpoint_probe_max_rate)
    tasks = [asyncio.create_task(scraper.run()), asyncio.create_task(prober.run())]
    await asyncio.sleep(min(3.0, seconds))  # past the first rounds and into the idle intervals
    c0, t0 = cpu_s(), time.perf_counter()
    await asyncio.sleep(seconds)
    cpu, el = cpu_s() - c0, time.perf_counter() - t0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    proc.stdin.write(b"stop\n")
    proc.stdin.flush()
    served = json.loads(proc.stdout.readline())["served"]
    proc.wait()
    return {"workers": n, "scrape_max_rate": scraper.max_rate, "scrapes_per_s": round(scraper.scrapes / (el + 3), 1),
            "scrape_round_s": round(scraper.round_s, 2), "seconds": round(el, 1), "picker_cpu_fraction": round(cpu / el, 4),
            "picker_cpu_us_per_worker_per_s": round(cpu / el / n * 1e6, 1),
            "requests_served_total": served, "scrape_errors": len(errors),
            "scrape_error_kinds": sorted(set(errors))[:5], "scrape_interval_s": cfg.worker_metrics_interval_ms / 1000,
            "idle_interval_s": cfg.worker_metrics_idle_interval_ms / 1000,
            "probe_interval_s": cfg.endpoint_probe_interval_ms / 1000, "probe_max_rate": cfg.endpoint_probe_max_rate}


# ------------------------------------------------------------------ main
async def amain(a: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(x) for x in a.sizes.split(",")]
    if 8 not in sizes:
        sizes.insert(0, 8)  # the flood and the baseline run on 8
    seconds = 4.0 if a.quick else 15.0
    events = Path(a.events)
    events.mkdir(parents=True, exist_ok=True)
    files = {}
    replays = bool({"scale", "flood", "processes"} & set(a.parts.split(",")))  # the parts that play recordings
    for n in sizes:
        f = events / f"ingest-{n}w-{int(seconds)}s.bin"
        if replays and not f.exists():
            record(n, f, seconds + 2, flood=(n == 8))
        files[n] = f
    out: dict[str, Any] = {"bench": "ingest_apart", "quick": a.quick, "seconds": seconds, "pinned": a.pin, "player_cpu": a.player_cpu if a.pin else None,
                           "player_policy": a.player_policy if a.pin else None,
                           "cpus": os.cpu_count(), "python": sys.version.split()[0],
                           "load_avg_at_start": os.getloadavg(), "events": {str(n): str(f) for n, f in files.items()}}
    parts = a.parts.split(",")
    if "channel" in parts:
        out["channel"] = await run_channel([8, 256, 1000], [1024, DOC_BLOCKS * BS], 200 if a.quick else 2000)
        print(json.dumps(out["channel"], indent=1), flush=True)
    if "tiers" in parts:
        out["tiers"] = await run_tiers([8, 256, 1000], [1024, DOC_BLOCKS * BS], 200 if a.quick else 1000)
    out["scale"] = []
    modes = a.modes.split(",")
    for n in sizes if "scale" in parts else []:
        for mode in modes:
            row = await run_scale(mode, n, files[n], seconds, a.pin)
            print(json.dumps(row), flush=True)
            out["scale"].append(row)
    out["flood"] = []
    for mode in modes if "flood" in parts else ():
        row = await run_flood(mode, files[8], seconds / 2, a.pin)
        print(json.dumps(row), flush=True)
        out["flood"].append(row)
    out["scrape"] = []
    for n in sizes if "scrape" in parts else []:
        for rate in a.scrape_rates.split(","):  # "default" (the flag's default), "off" (no budget) or a rate
            r = None if rate == "default" else 1e9 if rate == "off" else float(rate)
            row = await run_scrape(n, 5.0 if a.quick else 15.0, r)
            print(json.dumps(row), flush=True)
            out["scrape"].append(row)
    out["processes"] = []
    for n in [int(x) for x in a.process_sizes.split(",")] if "processes" in parts else []:
        for mode in a.process_modes.split(","):
            for procs in (1, 2):
                row = await run_processes(mode, n, procs, files[n], seconds, 0.02, a.pin)
                print(json.dumps(row), flush=True)
                out["processes"].append(row)
    out["load_avg_at_end"] = os.getloadavg()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 s per measurement, 200 channel reps (under 3 min)")
    ap.add_argument("--out", default="bench/results/ingest_apart.json")
    ap.add_argument("--events", default="/tmp/epp-ingest-events", help="recorded event files (made if absent)")
    ap.add_argument("--sizes", default="8,256,1000", help="simulated pool sizes")
    ap.add_argument("--parts", default="channel,scale,flood,scrape,processes", help="which measurements (also: tiers, the second lookup tier credit adds under apart)")
    ap.add_argument("--modes", default="inprocess,apart",
                    help="scale/flood variants: inprocess (the default), inprocess-unpaced (no per-worker CPU "
                         "budget), apart (lookups on the shard's loop), "
                         "apart-thread (on its threads), apart-2shards, apart-thread-2shards")
    ap.add_argument("--scrape-rates", default="default",
                    help="scrape budgets to compare: default, off (none), or scrapes/s, comma-separated")
    ap.add_argument("--pin", action="store_true", help="measuring process on CPU 0, ingest and player on CPU 1")
    ap.add_argument("--player-cpu", type=int, default=1,
                    help="with --pin: the player's CPU (0: beside the decisions, leaving CPU 1 to the shard)")
    ap.add_argument("--player-policy", choices=("idle", "nice"), default="idle",
                    help="--pin: how the player yields its CPU: SCHED_IDLE (default) or nice 19 (runs before stop 61)")
    ap.add_argument("--process-modes", default="inprocess,apart", help="modes of the processes part")
    ap.add_argument("--process-sizes", default="256", help="pool sizes of the processes part (must be in --sizes)")
    ap.add_argument("--play", help=argparse.SUPPRESS)
    ap.add_argument("--decider", help=argparse.SUPPRESS)
    ap.add_argument("--endpoints-file", help=argparse.SUPPRESS)
    ap.add_argument("--decider-seconds", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--decider-period", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--play-dir", help=argparse.SUPPRESS)
    ap.add_argument("--channel-server", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--channel-tiers", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fake-workers", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.play:
        play(Path(a.play), a.workers, a.play_dir)
        return 0
    if a.decider:
        decider(a.decider, a.endpoints_file, a.play_dir, a.decider_seconds, a.decider_period)
        return 0
    if a.fake_workers:
        fake_workers(a.fake_workers)
        return 0
    if a.channel_server:
        channel_server(a.channel_server, a.play_dir, a.channel_tiers)
        return 0
    if a.pin:
        _pin(os.getpid(), 0)
        PLAYER_CPU[0] = a.player_cpu
        PLAYER_POLICY[0] = a.player_policy
    t = time.monotonic()
    out = asyncio.run(amain(a))
    out["wall_s"] = round(time.monotonic() - t, 1)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out} in {out['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

