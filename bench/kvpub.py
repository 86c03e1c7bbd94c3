"""Many simulated TensorRT-LLM workers publishing KV events over real ZMQ PUB sockets, in one process.

    python -m bench.kvpub --workers 64 --rate 10 [--doc-blocks 1024] [--cap 4096] [--new-blocks 8]
        [--heartbeat-s 0.2] [--ipc-dir DIR]

A light stand-in for hundreds of `trtllm-mock` processes: each worker binds its own PUB socket and sends the
exact wire form (three frames: topic, 8-byte big-endian seq, msgpack ``[ts, events, rank]``) with
msgpack. Protocol on stdin/stdout, one JSON line per answer:

* at start: ``{"endpoints": [...]}``, then an empty heartbeat batch per worker every 0.2 s (``--heartbeat-s``; so the
  subscribers can connect before anything that matters is sent);
* ``go``: every worker stores a prefix of one shared document (worker 0 all of it, the others a random
  length between half and all: a shared system prompt that each worker partly holds), answers
  ``{"warm": [blocks per worker]}``, then publishes ``--rate`` batches per second per worker: each batch a
  ``BlockStored`` chain of 1..2*new_blocks-1 fresh blocks hanging off a random block of the shared prefix
  (a request's uncached tail, stored after its prefill), plus a ``BlockRemoved`` of the oldest fresh
  blocks once a worker holds more than ``--cap`` (LRU eviction, published with the admission as the
  mock does);
* ``flood [RATE]`` / ``calm``: worker 0 also sends fresh 64-block chains, RATE batches/s (as fast as this
  process can without one): a flooding publisher, the hostile issue's case; answers ``{"flooding": true}``;
  ``calm`` stops it and answers ``{"flooded": batches}``;
* ``beat``: one empty batch from every worker now (answers ``{"beat": workers}``): with a long
  ``--heartbeat-s`` a caller checks the subscriptions and then has the workers silent;
* ``stats``: ``{"published": batches, "rate": achieved batches/s, "behind_s": how late the schedule ran}``;
* ``stop``: answers and exits.

The ``ts`` of every batch is taken just before it is sent, so a consumer can measure publish -> applied lag.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import struct
import sys
import threading
import time
from collections import deque

import msgpack
import zmq

BS = 32
FLOOD_BLOCKS = 64  # blocks per flood batch (bench_ingest_apart's flood uses the same)


def make_doc(blocks: int, seed: int) -> list[int]:
    """The shared document (token ids in the mock's vocabulary) every bench derives prompts from."""
    rng = random.Random(seed)
    return [rng.randrange(100, 32000) for _ in range(blocks * BS + 1)]


def _send(sock: zmq.Socket, seq: int, events: list) -> None:
    payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
    sock.send_multipart([b"", struct.pack(">Q", seq), payload], copy=False)


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--rate", type=float, default=10.0, help="batches per second per worker after 'go'")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--doc-blocks", type=int, default=1024)
    ap.add_argument("--cap", type=int, default=4096, help="fresh blocks a worker holds before evicting")
    ap.add_argument("--new-blocks", type=int, default=8, help="mean fresh blocks per stored batch")
    ap.add_argument("--max-seconds", type=float, default=3600, help="exit on its own after this long")
    ap.add_argument("--heartbeat-s", type=float, default=0.2,
                    help="seconds between the empty batches sent to every worker before 'go'")
    ap.add_argument("--ipc-dir", default=None,
                    help="bind ipc://DIR/wN instead of a tcp port per worker (no ports used up)")
    a = ap.parse_args(argv)
    ctx = zmq.Context()
    # a PUB holds its mailbox, its listener and its subscriber's connection: libzmq's 1,023 sockets per context
    # stop near 1,000 workers; the descriptors (3 per worker) are the limit after that
    ctx.set(zmq.MAX_SOCKETS, min(ctx.get(zmq.SOCKET_LIMIT), max(1023, a.workers + 64)))
    socks, eps = [], []
    for i in range(a.workers):
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.bind(f"ipc://{a.ipc_dir}/w{i}" if a.ipc_dir else "tcp://127.0.0.1:*")
        socks.append(s)
        eps.append(s.getsockopt_string(zmq.LAST_ENDPOINT))
    print(json.dumps({"endpoints": eps}), flush=True)

    cmds: queue.Queue[str] = queue.Queue()

    def reader() -> None:
        for line in sys.stdin:
            cmds.put(line.strip())
        cmds.put("stop")

    threading.Thread(target=reader, daemon=True).start()
    rng = random.Random(a.seed + 1)
    seq = [0] * a.workers
    doc = make_doc(a.doc_blocks, a.seed)
    pool = [rng.randrange(100, 32000) for _ in range(65536)]
    warm = [0] * a.workers
    fresh: list[deque[int]] = [deque() for _ in range(a.workers)]
    counter = [1 << 30] * a.workers
    started = time.monotonic()
    steady = False
    published = 0
    t_go = 0.0
    next_t = 0.0
    behind = 0.0
    w = 0
    interval = 1.0 / (a.rate * a.workers) if a.rate > 0 else None
    last_hb = 0.0
    flooding = False
    flooded = 0
    flood_at = 0
    flood_every = 0.0  # seconds between flood batches (0: no pause)
    flood_next = 0.0

    def answer(doc_: dict) -> None:
        print(json.dumps(doc_), flush=True)

    while time.monotonic() - started < a.max_seconds:
        try:
            cmd = cmds.get_nowait()
        except queue.Empty:
            cmd = None
        if cmd == "stop":
            answer({"stopped": True, "published": published})
            break
        if cmd == "stats":
            el = time.monotonic() - t_go if steady else 0.0
            answer({"published": published, "rate": published / el if el > 0 else 0.0, "behind_s": behind})
        elif cmd is not None and cmd.split()[0] == "flood":
            rate = float(cmd.split()[1]) if len(cmd.split()) > 1 else 0.0
            flooding, flooded = True, 0
            flood_every, flood_next = (1.0 / rate if rate > 0 else 0.0), time.monotonic()
            answer({"flooding": True})
        elif cmd == "beat":
            for i, s in enumerate(socks):
                _send(s, seq[i], [])
                seq[i] += 1
            answer({"beat": a.workers})
        elif cmd == "calm":
            flooding = False
            answer({"flooded": flooded})
        elif cmd == "go":
            for i, s in enumerate(socks):
                k = a.doc_blocks if i == 0 else rng.randint(a.doc_blocks // 2, a.doc_blocks)
                warm[i] = k
                parent = None
                for start in range(0, k, 64):
                    end = min(k, start + 64)
                    hs = [(i << 40) + j for j in range(start, end)]
                    _send(s, seq[i], [_stored(hs, parent, doc[start * BS:end * BS])])
                    seq[i] += 1
                    parent = hs[-1]
            steady = True
            t_go = time.monotonic()
            next_t = t_go
            published = 0
            answer({"warm": warm})
        now = time.monotonic()
        if not steady or interval is None:
            if now - last_hb > a.heartbeat_s:
                last_hb = now
                for i, s in enumerate(socks):
                    _send(s, seq[i], [])
                    seq[i] += 1
            time.sleep(0.01)
            continue
        if flooding:  # worker 0's flood between the steady schedule's due batches, at its rate if it has one
            for _ in range(20):
                if flood_every and flood_next > time.monotonic():
                    break
                flood_next += flood_every
                hs = [(1 << 50) + flood_at + j for j in range(FLOOD_BLOCKS)]
                flood_at += FLOOD_BLOCKS
                off = (flood_at * 7) % (len(pool) - FLOOD_BLOCKS * BS)
                _send(socks[0], seq[0], [_stored(hs, None, pool[off:off + FLOOD_BLOCKS * BS])])
                seq[0] += 1
                flooded += 1
            if now < next_t:
                wait = min(0.0005, next_t - now, flood_next - time.monotonic()) if flood_every else 0.0
                if wait > 0:  # (re-read: the clock moved since the check above)
                    time.sleep(wait)
                continue
        elif now < next_t:
            time.sleep(min(0.005, next_t - now))
            continue
        behind = max(behind, now - next_t)
        # every due batch, round-robin over the workers
        while next_t <= now:
            nb = rng.randint(1, 2 * a.new_blocks - 1)
            base = counter[w]
            counter[w] += nb
            hs = [(w << 40) + base + j for j in range(nb)]
            off = rng.randrange(0, len(pool) - nb * BS)
            events = [_stored(hs, (w << 40) + rng.randrange(warm[w]), pool[off:off + nb * BS])]
            fw = fresh[w]
            fw.extend(hs)
            if len(fw) > a.cap:
                events.append({"type": "BlockRemoved", "block_hashes": [fw.popleft() for _ in
                                                                        range(len(fw) - a.cap)],
                               "medium": "GPU"})
            _send(socks[w], seq[w], events)
            seq[w] += 1
            published += 1
            w = (w + 1) % a.workers
            next_t += interval
    for s in socks:
        s.close(0)
    ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
