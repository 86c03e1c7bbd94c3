"""The picker's CPU for one KV lookup over 10,000 workers and 4 ingest shards: the dict path against the
overlap array (`RemoteKv.overlap_array`), with the shards' answers served by threads of this process.

    python -m bench.tenk_lookup [--workers 10000] [--shards 4]

Each fake shard answers every lookup with one u32 per row of its table and sends its table once (as a real
shard does until its table changes). Timed: the calling thread's CPU (`time.thread_time`), median of 30, so the
fake shards' own work is left out; "dict + column" also lays the dict out in the workers' order, as a
columnar table needs it.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from array import array
from collections.abc import Callable

import numpy as np

from epp_extproc.adapters.kv_remote import RemoteKv
from epp_extproc.core.contract import PromptIdentity
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.ingest import wire


def fake_shard(path: str, done: threading.Event, counts: list[int], meta: bytes) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        conn.settimeout(0.05)
        first = True
        while not done.is_set():
            try:
                buf = conn.recv(1 << 20)
            except TimeoutError:
                continue
            if not buf:
                break
            req = wire.unpack_lookup(buf)
            conn.send(wire.pack_answer(req.req_id, 7, meta if first else None, array("I", counts)))
            first = False

    threading.Thread(target=run, daemon=True).start()


def cpu_ms(f: Callable[[], object], reps: int = 30) -> float:
    f()
    xs = []
    for _ in range(reps):
        t = time.thread_time()
        f()
        xs.append(time.thread_time() - t)
    return 1000 * sorted(xs)[len(xs) // 2]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=10000)
    ap.add_argument("--shards", type=int, default=4)
    a = ap.parse_args(argv)
    n, s = a.workers, a.shards
    names = [f"127.0.{i // 40000}.1:{20000 + i % 40000}" for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="epp-t-") as d:
        done = threading.Event()
        for k in range(s):
            ws = [w for w in names if wire.shard_of(w, s) == k]
            fake_shard(wire.lookup_socket(d, k), done, [i % 100 for i in range(len(ws))],
                       wire.encode_meta([(w, 32, True, None) for w in ws], [32]))
        kv = RemoteKv(EndpointRegistry(), directory=d, shards=s, block_size=32, prediction_ttl_s=0.0,
                      lookup_timeout_s=2.0, ask_server_info=False)
        prompt = kv.prompt(list(range(4096)), PromptIdentity())
        workers = tuple(names)

        def column() -> np.ndarray:
            o = kv.overlap(prompt, workers)
            return np.fromiter((o.get(w, 0) for w in workers), np.int64, n)

        got = kv.overlap_array(prompt, workers)
        assert got is not None and got.tolist() == column().tolist()
        print(f"{n} workers, {s} shards, 4k-token prompt, picker thread CPU (median of 30): "
              f"dict {cpu_ms(lambda: kv.overlap(prompt, workers)):.2f} ms, dict + column {cpu_ms(column):.2f} ms, "
              f"overlap_array {cpu_ms(lambda: kv.overlap_array(prompt, workers)):.2f} ms")
        done.set()


if __name__ == "__main__":
    main()
