"""CPU of one live KV batch on the subscriber's plain path, driven directly (issue 45; stop 61).

    python -m bench.bench_wake_path [--batches 3000] [--repeats 7]

One PUB socket and one `SubscriberManager` + `KvIndex` in this process. The subscription's descriptors are
taken off the event loop and its descriptor callback (`SubscriberManager._wake`: the readiness reads, the
receive, `split_live_frames`, decode, `KvIndex.apply_batch`, pacing) is called by hand once per batch, after
the batch has reached the SUB: the thread CPU time of that call is the figure, the publishing and the wait
are outside it. Each batch is one TensorRT-LLM `BlockStored` of 8 fresh 32-token blocks (the average of the
recorded fleet in `bench_ingest_apart`). Run it pinned (`taskset -c 1`), each tree with its own PYTHONPATH,
alternating: `bench_batch_wake` times the same path through the loop, where a busy VM's noise is larger than
a few microseconds."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import zmq
import zmq.asyncio

from epp_extproc.dev.kvwire import pack_batch, stored_event
from kvindex.decode import encode_seq
from kvindex.index import KvIndex
from kvindex.subscriber import SubscriberManager

BS = 32


def _payload(i: int) -> bytes:
    h = 10_000 + i * 8
    return pack_batch([stored_event(list(range(h, h + 8)), None, list(range(8 * BS)), BS)], rank=0, envelope="map")


async def run(batches: int, repeats: int) -> list[float]:
    ctx = zmq.asyncio.Context()
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='epp-wake-')}/pub"
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    mgr = SubscriberManager(KvIndex(default_block_size=BS), zmq_context=ctx)
    await mgr.add("w", endpoint)
    seq = 0
    while mgr.stats("w").messages == 0:  # until the SUB has joined (a PUB drops what it sends before)
        await pub.send_multipart([b"", encode_seq(seq), _payload(seq)])
        seq += 1
        await asyncio.sleep(0.05)
    (sub,) = mgr._subs["w"]
    loop = asyncio.get_running_loop()
    for fd in sub.fds:  # this bench calls the callback itself
        loop.remove_reader(fd)
    out = []
    for _ in range(repeats):
        spent = 0.0
        for _ in range(batches):
            await pub.send_multipart([b"", encode_seq(seq), _payload(seq)])
            seq += 1
            while not sub.rx.get(zmq.EVENTS) & zmq.POLLIN:
                time.sleep(0)
            t = time.thread_time()
            mgr._wake(sub)
            spent += time.thread_time() - t
        if mgr.stats("w").last_seq != seq - 1:
            raise SystemExit(f"batch {seq - 1} was not applied on the plain path")
        out.append(spent / batches * 1e6)
    await mgr.close()
    pub.close(linger=0)
    ctx.term()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    res = asyncio.run(run(a.batches, a.repeats))
    print(f"us per batch (thread CPU in _wake): {[round(x, 1) for x in res]} min {min(res):.1f} "
          f"median {statistics.median(res):.1f}")


if __name__ == "__main__":
    main()
