"""The in-process ingest's background CPU against the number of subscribed workers (issue 45's 10,000-worker
follow-up: 58% of a core for 667 batches/s at 3,333 subscribed workers).

    python -m bench.bench_ingest_idle [--workers 1000,3000] [--trees .,/work/main] [--idle-s 8]
        [--rate 0.2] [--trickle-s 8] [--repeats 1] [--profile DIR] [--out bench/results/ingest_idle.json]

Per (tree, workers, repeat): `bench.kvpub` processes of at most 2,500 workers each (ipc PUB sockets, as
`bench_tenk`), and the picker of that tree (`python -m epp_extproc.cli` with PYTHONPATH and cwd at the tree,
so the same harness runs the code before and after a change in one session) with the endpoints in a file, the
prober and the metric scraper off, trtllm-render against the mock renderer, nothing asked of it. The workers send one empty batch each
until every subscription has received one (`kvpub`'s ``beat``), then:

* **idle**: nothing is published for `--idle-s`: the picker's CPU over that window (share of one core) is
  what N subscribed, silent workers cost;
* **trickle**: every worker stores a one-batch prefix (``go``), 3 s later each publishes `--rate` batches/s
  (a chain of 1..7 fresh blocks) for `--trickle-s`: CPU over that window, and CPU per batch
  = (trickle CPU - idle CPU rate x window) / batches the picker applied (its `/debug/kv`, read just before
  and after the window: workers refused a socket publish but are not counted).

CPU is also split by thread name (/proc): "python" is the event loop (and the default executor), "ZMQbg/IO/0"
libzmq's I/O thread, which reads every subscribed socket's connection.

`--profile DIR` runs py-spy (``PY_SPY``, default /tmp/spy/bin/py-spy) over each window and writes its collapsed
stacks and the top frames by self time to DIR.
"""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import harness as H
from epp_extproc.dev import procs

PER_PUBLISHER = 2500
PY_SPY = os.environ.get("PY_SPY", "/tmp/spy/bin/py-spy")


def published(pubs: list[procs.Proc]) -> int:
    return sum(H.kvpub_command(p, "stats")["published"] for p in pubs)


def applied(pk: procs.Proc) -> int:
    """Batches the picker's index has applied, all workers (read outside the CPU windows: it costs the picker)."""
    return sum(w.get("batches", 0) for w in H.get_json(H.picker_url(pk) + "/debug/kv", timeout=120)["workers"].values())


def thread_cpu(pid: int) -> collections.Counter[str]:
    """CPU seconds per thread name of `pid` (the event loop is "python", libzmq's I/O thread "ZMQbg/IO/0"),
    and of it in the kernel ("NAME (kernel)")."""
    out: collections.Counter[str] = collections.Counter()
    tck = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            parts = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] += (int(parts[11]) + int(parts[12])) / tck
            out[f"{name} (kernel)"] += int(parts[12]) / tck
        except (OSError, IndexError, ValueError):
            pass
    return out


def top_frames(raw: Path, n: int = 25) -> list[tuple[str, int, float]]:
    """Self time and inclusive time per frame of a py-spy raw (collapsed) file."""
    self_t: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        c = int(count)
        total += c
        frames = stack.split(";")
        self_t[frames[-1]] += c
        for f in set(frames):
            incl[f] += c
    return [(f, c, round(incl[f] / max(total, 1), 3)) for f, c in self_t.most_common(n)]


def window(pid: int, seconds: float, profile: Path | None, tag: str) -> tuple[float, float, dict[str, float]]:
    """CPU seconds of `pid` over a window of `seconds`, the window's length and the CPU per thread name;
    py-spy over it if asked."""
    spy = None
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        spy = subprocess.Popen([PY_SPY, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "100",
                                "--nonblocking", "-f", "raw", "-o", str(profile / f"{tag}.txt")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    th0, c0, t0 = thread_cpu(pid), procs.proc_cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    c1, t1, th1 = procs.proc_cpu_seconds(pid), time.monotonic(), thread_cpu(pid)
    if spy is not None:
        spy.wait(timeout=60)
        out = profile / f"{tag}.txt"
        if out.exists():
            (profile / f"{tag}.top.json").write_text(json.dumps(top_frames(out), indent=1))
    return c1 - c0, t1 - t0, {k: round(th1[k] - th0.get(k, 0.0), 2) for k in th1 if th1[k] - th0.get(k, 0.0) > 0}


def run_one(tree: str, n: int, a: Any, rep: int) -> dict[str, Any]:
    tree = str(Path(tree).resolve())
    row: dict[str, Any] = {"tree": tree, "workers": n, "repeat": rep, "rate_per_worker": a.rate}
    prof = Path(a.profile) / f"{Path(tree).name}-{n}-r{rep}" if a.profile else None
    t0 = time.monotonic()
    with H.Stack(prefix="epp-idle-") as st:
        pubs, endpoints = [], []
        for k in range(math.ceil(n / PER_PUBLISHER)):
            m = min(PER_PUBLISHER, n - k * PER_PUBLISHER)
            d = st.dir / f"p{k}"
            d.mkdir()
            p = H.kv_publisher(st, m, rate=a.rate, doc_blocks=64, cap=64, new_blocks=4, heartbeat_s=1e9,
                               ipc_dir=str(d), name=f"kvpub{k}")
            pubs.append(p)
            endpoints += p.extra["endpoints"]
        addrs = [f"127.0.{i // 40000}.{1 + (i // 40000)}:{20000 + i % 40000}" for i in range(n)]
        eps_file = st.dir / "endpoints.json"
        eps_file.write_text(json.dumps({"endpoints": [{"name": f"sim-{i}", "address": addrs[i], "kv_events": e}
                                                      for i, e in enumerate(endpoints)]}, separators=(",", ":")))
        rend = H.mock_renderer(st)  # a tokenizer: without one the picker keeps no KV index
        pk = procs.picker(st.dir, endpoints_file=eps_file, protocol="trtllm-render", renderer_url=rend.url,
                          argv0=[sys.executable, "-m", "epp_extproc.cli"],
                          args=["--log-level", "WARNING", *H.SIMULATED_WORKER_FLAGS,
                                "--worker-metrics-interval-ms", "0", "--max-endpoints", str(max(4096, n)),
                                *a.picker_args.split()])
        pk.env = {"PYTHONPATH": tree}
        pk.cwd = tree
        t_launch = time.monotonic()
        row["publishers_bound_s"] = round(t_launch - t0, 1)
        st.add(pk, timeout=300)
        row["start_s"] = round(time.monotonic() - t_launch, 1)
        pid = pk.pid
        assert pid is not None
        deadline = time.monotonic() + a.subscribe_timeout
        got = refused = 0
        while time.monotonic() < deadline:
            for p in pubs:
                H.kvpub_command(p, "beat")
            time.sleep(1.0)
            snap = H.get_json(H.picker_url(pk) + "/debug/kv", timeout=120)["workers"]
            got = sum(1 for x in addrs if snap.get(x, {}).get("batches", 0) > 0)
            refused = sum(1 for x in addrs if snap.get(x, {}).get("unsubscribed"))
            if got + refused == n:  # the refused (descriptor limit) wait for a socket that never frees
                break
        row["subscribed"] = got
        row["refused"] = refused
        row["subscribed_s"] = round(time.monotonic() - deadline + a.subscribe_timeout, 1)
        time.sleep(2.0)
        cpu, el, row["idle_thread_cpu_s"] = window(pid, a.idle_s, prof, "idle")
        row["idle_cpu_util"] = round(cpu / el, 4)
        row["idle_window_s"] = round(el, 2)
        for p in pubs:
            H.kvpub_command(p, "go")
        time.sleep(3.0)
        b0, a0 = published(pubs), applied(pk)
        cpu, el, row["trickle_thread_cpu_s"] = window(pid, a.trickle_s, prof, "trickle")
        a1, b1 = applied(pk), published(pubs)
        row["trickle_cpu_util"] = round(cpu / el, 4)
        row["trickle_window_s"] = round(el, 2)
        row["published"] = b1 - b0  # by every worker, subscribed or not
        row["batches"] = a1 - a0  # applied (a little more than the window: the reads bracket it)
        row["batches_per_s"] = round((a1 - a0) / el, 1)
        row["cpu_us_per_batch_raw"] = round(cpu / max(a1 - a0, 1) * 1e6, 1)
        row["cpu_us_per_batch"] = round((cpu - row["idle_cpu_util"] * el) / max(a1 - a0, 1) * 1e6, 1)
        row["rss_mb"] = round(H.prometheus_rss(H.get_text(H.picker_url(pk) + "/metrics")) / 2**20, 1)
        row["loadavg_1m"] = os.getloadavg()[0]
        t_stop = time.monotonic()
    row["stop_s"] = round(time.monotonic() - t_stop, 1)
    print(f"  {Path(tree).name} {n} r{rep}: subscribed {row['subscribed']}, idle {row['idle_cpu_util'] * 100:.1f}% "
          f"of a core, trickle {row['trickle_cpu_util'] * 100:.1f}% for {row['batches_per_s']} batches/s = "
          f"{row['cpu_us_per_batch']} us/batch net ({row['cpu_us_per_batch_raw']} raw)", flush=True)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = H.bench_parser(__doc__, "ingest_idle")
    ap.add_argument("--workers", default="1000,3000")
    ap.add_argument("--trees", default=".", help="comma-separated source trees whose picker runs")
    ap.add_argument("--rate", type=float, default=0.2, help="batches per second per worker in the trickle")
    ap.add_argument("--idle-s", type=float, default=8.0)
    ap.add_argument("--trickle-s", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--profile", default=None, help="directory for py-spy profiles of each window")
    ap.add_argument("--picker-args", default="", help="more picker flags (space-separated)")
    ap.add_argument("--subscribe-timeout", type=float, default=120.0)
    a = ap.parse_args(argv)
    if a.quick:  # a smoke test: a few workers, windows of seconds
        a.workers, a.idle_s, a.trickle_s, a.repeats = "20", 2.0, 2.0, 1
    rows = []
    for rep in range(a.repeats):
        for n in (int(x) for x in a.workers.split(",")):
            for tree in a.trees.split(","):  # trees alternate within a repeat: drift hits both alike
                rows.append(run_one(tree, n, a, rep))
    doc = {"bench": "ingest_idle", **H.meta(a.quick), "argv": sys.argv[1:], "rows": rows}
    out = Path(a.out) if a.out.endswith(".json") else Path(a.out) / "ingest_idle.json"
    H.write_json(out, doc)
    return doc


if __name__ == "__main__":
    main()
