"""Ingest CPU alone (issue 32): CPU-seconds per 1,000 batches an ingest shard applies, for two checkouts.

    python -m bench.bench_ingest_cpu OLD_CHECKOUT NEW_CHECKOUT [--sizes 256,1000] [--repeats 3] [--seconds 15]
        [--pin] [--out bench/results/ingest_apart-cpu.json]
    python -m bench.bench_ingest_cpu --profile cprofile|none --workers N [--seconds S]   (this checkout only)

`bench_ingest_apart`'s scale part charges the shard with the lookups it answers as well as with ingest, and
runs the decision path beside it; this measures ingest and nothing else, so a change to the ingest path shows
in its own figure. The recorded event files of `bench_ingest_apart` are replayed (the same bytes for both
checkouts, made once per pool size in `--events`) by its player process; the shard (`IngestShard`, each
checkout's own code, started in the measuring child process so its CPU is that process's) subscribes every
simulated worker, applies the warm section, then the steady section (10 batches/s per worker) is played for
`--seconds`; the figure is the child's CPU time over the batches applied in that window (from the steady
section's start to 0.3 s after its end). Lag p99 (publish `ts` -> applied) is reported beside it: a shard that
does not keep up applies fewer batches than were offered, and the figure is then per batch *applied*.

Rounds alternate the order of the checkouts, so a busy machine weighs on both alike. With `--pin`, the shard
is on CPU 1 and the player on CPU 0. Each checkout needs its own `.venv` (`make install` there); the child runs
with that checkout first on `sys.path`, so its `epp_extproc` and `kvindex` are the ones measured (the player
and the recording come from `bench.bench_ingest_apart`, unchanged between the two).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TAIL_S = 0.3


async def _measure(n: int, path: Path, seconds: float, pin: bool, profile: str | None,
                   profile_out: str | None, hold_s: float = 0.0) -> dict[str, Any]:
    """In this process: a shard over `n` simulated workers, the steady section played for `seconds`."""
    import tempfile

    from bench.bench_ingest_apart import Player, _pin, read_sections
    from epp_extproc.ingest.pacing import LagSamples
    from epp_extproc.ingest.server import IngestShard

    sys.setswitchinterval(0.0005)  # as `python -m epp_extproc.ingest` does
    if pin:
        _pin(os.getpid(), 1)
    player = Player(path, n, False)
    if pin:
        _pin(player.proc.pid, 0)
    shard = IngestShard(tempfile.mkdtemp(prefix="epp-ingest-cpu-"), block_size=32, max_blocks_per_worker=1_000_000,
                        worker_cpu_share=0.1)
    addrs = [f"127.0.0.1:{20000 + i}" for i in range(n)]
    try:
        await shard.start()
        await shard.want("bench", {a: ((ep, None, None),) for a, ep in zip(addrs, player.endpoints, strict=True)})
        idx = shard.index

        def batches() -> int:
            return sum(idx.stats(a).batches for a in addrs)

        deadline = time.monotonic() + 30 + n * 0.05
        while sum(1 for a in addrs if idx.stats(a).batches > 0) < n:  # every SUB registered (heartbeats in)
            if time.monotonic() > deadline:
                raise TimeoutError("subscribers connected")
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        expected = len(read_sections(path)[0]) + batches()
        player.cmd("warm", answer=True)
        t_warm = time.monotonic()
        while batches() < expected:
            if time.monotonic() - t_warm > 120:
                raise TimeoutError("warm section not applied")
            await asyncio.sleep(0.1)
        warm_s = time.monotonic() - t_warm
        if hold_s:  # time to attach a sampling profiler to this pid for the steady section alone
            print(f"STEADY {os.getpid()}", flush=True)
            await asyncio.sleep(hold_s)
        idx.batch_lag = LagSamples(65536)
        b0 = batches()
        prof = None
        if profile == "cprofile":
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        cpu0, t0 = time.process_time(), time.perf_counter()
        player.cmd(f"steady {seconds}")
        await asyncio.sleep(seconds + TAIL_S)
        cpu, el = time.process_time() - cpu0, time.perf_counter() - t0
        if prof is not None:
            prof.disable()
            prof.dump_stats(profile_out or "/tmp/ingest.prof")
        applied = batches() - b0
        lag = idx.batch_lag.summary()
        return {"workers": n, "batches": applied, "offered_per_s": round(n * 10.0, 1),
                "batches_per_s": round(applied / el, 1), "cpu_s": round(cpu, 3),
                "cpu_s_per_1000_batches": round(cpu / max(applied, 1) * 1000, 4),
                "cpu_share": round(cpu / el, 3), "lag_p50_ms": round(lag.get("p50", 0) * 1000, 2),
                "lag_p99_ms": round(lag.get("p99", 0) * 1000, 2), "warm_s": round(warm_s, 2),
                "blocks_indexed": sum(idx.blocks_indexed(a) for a in addrs),
                "gaps": sum(d.get("gaps", 0) for d in shard.subscribers.stats_snapshot().values()),
                "throttled": sum(d.get("ingest_throttled", 0) for d in shard.pacer.snapshot().values())}
    finally:
        await shard.close()
        player.stop()


def _events(n: int, seconds: float, events: Path) -> Path:
    """The recorded file `bench_ingest_apart` would use for `n` workers at `seconds` (recorded if absent)."""
    from bench.bench_ingest_apart import record

    events.mkdir(parents=True, exist_ok=True)
    f = events / f"ingest-{n}w-{int(seconds)}s.bin"
    if not f.exists():
        tmp = f.with_suffix(".tmp")
        record(n, tmp, seconds + 2, flood=(n == 8))
        tmp.rename(f)
    return f


def _child(tree: Path, n: int, path: Path, seconds: float, pin: bool) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    p = subprocess.run([str(tree / ".venv" / "bin" / "python"), str(Path(__file__).resolve()), "--child",
                        "--workers", str(n), "--file", str(path), "--seconds", str(seconds)] + (["--pin"] if pin else []),
                       cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{tree}: no result\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return json.loads(line[7:])


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path, nargs="?")
    ap.add_argument("new", type=Path, nargs="?")
    ap.add_argument("--sizes", default="256,1000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--events", default="/tmp/epp-ingest-events")
    ap.add_argument("--pin", action="store_true", help="shard on CPU 1, player on CPU 0")
    ap.add_argument("--out", default="bench/results/ingest_apart-cpu.json")
    ap.add_argument("--profile", choices=("cprofile", "none"), help="one run in this process (this checkout)")
    ap.add_argument("--profile-out", default=None)
    ap.add_argument("--hold", type=float, default=0.0,
                    help="print `STEADY pid` after the warm section and wait this long (to attach py-spy)")
    ap.add_argument("--workers", type=int)
    ap.add_argument("--file", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child or a.profile:
        if a.child:
            sys.path.insert(0, os.getcwd())  # the checkout measured, before this script's own directory
        path = a.file or _events(a.workers, a.seconds, Path(a.events))
        res = asyncio.run(_measure(a.workers, path, a.seconds, a.pin, a.profile, a.profile_out, a.hold))
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    if a.old is None or a.new is None:
        ap.error("two checkouts to compare (or --profile)")
    sizes = [int(x) for x in a.sizes.split(",")]
    files = {n: _events(n, a.seconds, Path(a.events)) for n in sizes}
    out: dict[str, Any] = {"bench": "ingest_cpu", "old": str(a.old), "new": str(a.new), "seconds": a.seconds,
                           "pinned": a.pin, "cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg(),
                           "commits": {k: subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"],
                                                         capture_output=True, text=True).stdout.strip()
                                       for k, t in (("old", a.old), ("new", a.new))},
                           "runs": {str(n): {"old": [], "new": []} for n in sizes}}
    t = time.monotonic()
    for r in range(a.repeats):
        for n in sizes:
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                res = _child(a.old if name == "old" else a.new, n, files[n], a.seconds, a.pin)
                out["runs"][str(n)][name].append(res)
                print(f"round {r + 1} {n} workers {name}: {json.dumps(res)}", flush=True)
    summary: dict[str, Any] = {}
    for n in sizes:
        runs = out["runs"][str(n)]
        summary[str(n)] = {k: {name: _spread([x[k] for x in runs[name]]) for name in ("old", "new")}
                           for k in ("cpu_s_per_1000_batches", "batches_per_s", "lag_p99_ms", "cpu_share")}
        o, nw = (statistics.median(x["cpu_s_per_1000_batches"] for x in runs[k]) for k in ("old", "new"))
        summary[str(n)]["old_over_new"] = round(o / nw, 2)
    out["summary"] = summary
    out["load_avg_at_end"] = os.getloadavg()
    out["wall_s"] = round(time.monotonic() - t, 1)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
