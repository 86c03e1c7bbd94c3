"""Run bench_ingest_apart with every decision's and every slow loop callback's monotonic stamps (issue 45)."""

import asyncio
import asyncio.events
import json
import os
import sys
import time

import bench.bench_ingest_apart as B

LOG = os.environ["P45_DLOG"]
_orig = B.decision_loop
SLOW = []
_hrun = asyncio.events.Handle._run


def _name(h):
    cb = h._callback
    task = getattr(cb, "__self__", None)
    if task is not None and hasattr(task, "get_coro"):
        c = task.get_coro()
        return "task " + getattr(c, "__qualname__", repr(c))[:80]
    return repr(h)[:160]


def _run(self):
    t = time.monotonic()
    c = time.thread_time()
    _hrun(self)
    d = time.monotonic() - t
    if d > 0.0015:
        SLOW.append((t, d * 1000, (time.thread_time() - c) * 1000, _name(self)))


asyncio.events.Handle._run = _run


async def decision_loop(setup, prompts, seconds, period):
    recs = []
    orig_decide = B.decide

    async def decide(setup_, tokens):
        b = time.monotonic()
        await orig_decide(setup_, tokens)
        recs.append((b, time.monotonic()))

    B.decide = decide
    SLOW.clear()
    w0 = time.monotonic()
    try:
        res = await _orig(setup, prompts, seconds, period)
    finally:
        B.decide = orig_decide
    with open(LOG, "a") as f:
        f.write(
            json.dumps(
                {
                    "n": len(setup.eps),
                    "mode": setup.mode,
                    "w0": w0,
                    "pid": os.getpid(),
                    "shard_pids": setup.group.pids() if setup.group else [],
                    "recs": recs,
                    "slow": list(SLOW),
                }
            )
            + "\n"
        )
    return res


B.decision_loop = decision_loop
sys.exit(B.main(sys.argv[1:]))
