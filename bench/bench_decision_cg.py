"""What one decision costs in instructions, stage by stage, for callgrind (figures that repeat on a busy machine).

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=functools_reduce \\
        --callgrind-out-file=/tmp/cg.out python -m bench.bench_decision_cg STAGE [--n 1000] [--reps 200] [--shard]
    callgrind_annotate /tmp/cg.out | grep "PROGRAM TOTALS"        # divided by --reps: instructions per call

Only the measured loop is collected: it runs inside `functools.reduce`, which nothing else calls, so
`--toggle-collect=functools_reduce` leaves start-up, imports and the set-up out (PYTHONHASHSEED=0 makes the
figures repeat to the instruction). The pool is `--n` workers (`Endpoint`s of no KV stream) under the product's
defaults (`assemble(Config())`), in `apart` mode (`RemoteKv`); the prompt is bench_ingest_apart's 32k-token
one. Stages of the deciding process:

  decide    Director.propose(tokens=...) + commit + free, as bench_ingest_apart's decision loop (needs --shard)
  propose   propose alone (needs --shard)
  schedule  Director.schedule over the pool, the lookup's answer fixed (no shard)
  run       the decode profile's run (table, scorers, picker), the lookup fixed
  table     TableSource.table, the lookup fixed
  score     the profile's scorers over one table
  pick      the profile's picker over one scored table
  commit    Director.commit + free of one proposal (the booking, the prediction, the metrics)
  prompt    packing the token list (RemoteKv.prompt)
  hashes    packing and hashing the prompt
  lookup    RemoteKv.overlap_array, the prompt's hashes already made (needs --shard)

and of the shard: `answer` (IngestShard.answer of one lookup over a static index of `--n` workers holding
part of the document, as bench_ingest_apart's channel part builds it; in this process, no socket).
`--shard` starts that static index in a child process (bench_ingest_apart --channel-server), which valgrind
does not trace: the deciding process's own instructions are counted, the shard's not. Results:
bench/README.md, "dec45".
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from bench.bench_ingest_apart import BS, DOC_BLOCKS, _doc_batches, make_doc, prompts_for

DECIDER_STAGES = ("decide", "propose", "schedule", "run", "table", "score", "pick", "commit", "prompt", "hashes",
                  "lookup")


def _drive(coro: Any) -> None:
    """A coroutine that never suspends (a decision without a render), run to its end without a loop."""
    try:
        coro.send(None)
    except StopIteration:
        return
    raise RuntimeError("the decision suspended: it needs a loop")


async def decider(stage: str, n: int, reps: int, shard: bool) -> None:
    from epp_extproc.adapters.kv_remote import RemoteKv
    from epp_extproc.config import Config
    from epp_extproc.core.assemble import assemble
    from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
    from epp_extproc.core.load import LoadTracker
    from epp_extproc.core.plan import Plan
    from epp_extproc.core.request import RequestContext
    from epp_extproc.metrics import PickerMetrics

    proc = None
    directory = tempfile.mkdtemp(prefix="epp-cg-")
    if shard:
        proc = subprocess.Popen([sys.executable, "-m", "bench.bench_ingest_apart", "--channel-server", str(n),
                                 "--play-dir", directory], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        proc.stdout.readline()
    try:
        reg = EndpointRegistry()
        kv = RemoteKv(reg, directory=directory, shards=1, block_size=BS, prediction_ttl_s=2.0, lookup_timeout_s=5.0,
                      ask_server_info=False)
        eps = [Endpoint(f"w{i}", f"127.0.0.1:{20000 + i}", f"ipc:///nonexistent/{i}") for i in range(n)]
        metrics = PickerMetrics()
        load = LoadTracker(metrics.endpoint_inflight)
        director = assemble(Config(), reg, load, metrics, kv=kv).director
        reg.replace(eps)
        rng = random.Random(3)
        addresses = [e.address for e in eps]
        if not shard:  # the lookup's answer fixed: the scheduling alone
            fixed = {a: rng.randint(DOC_BLOCKS // 2, DOC_BLOCKS) for a in addresses}
            as_array = np.array([fixed[a] for a in addresses], np.int64)
            kv.overlap = lambda p, w, **k: fixed  # type: ignore[method-assign]
            kv.overlap_array = lambda p, w: as_array  # type: ignore[method-assign]
        for _ in range(min(n, 50)):
            load.book(addresses[rng.randrange(n)], rng.randint(1, 100))
        prompts = prompts_for()
        tokens = prompts[0]
        ctx = RequestContext(method="POST", path="/v1/completions")
        plan = Plan(tokens=tokens)
        director.planner.key(plan)
        req = director.scheduling_request(ctx, plan)
        pool = director._addresses(req)
        profile = director.scheduler.primary  # type: ignore[attr-defined]
        table = profile.run(req, pool).table
        rows = range(len(table))
        prompt = plan.prompt
        assert prompt is not None

        async def decide(i: int) -> None:
            p = await director.propose(ctx, tokens=prompts[i % len(prompts)])
            director.commit(p).booking.free()

        async def propose(i: int) -> None:
            await director.propose(ctx, tokens=tokens)

        def commit(i: int) -> None:
            director.commit(proposal).booking.free()

        proposal = await director.propose(ctx, tokens=tokens)
        stages: dict[str, Any] = {
            "decide": lambda i: _drive(decide(i)),
            "propose": lambda i: _drive(propose(i)),
            "schedule": lambda i: director.schedule(req),
            "run": lambda i: profile.run(req, pool),
            "table": lambda i: profile.source.table(req, pool),
            "score": lambda i: [s.score(req, table) for s, _ in profile.scorers],
            "pick": lambda i: profile.picker.pick(req, table, rows),
            "commit": commit,
            "prompt": lambda i: kv.prompt(tokens),
            "hashes": lambda i: kv.prompt(tokens).hashes(BS),
            "lookup": lambda i: kv.overlap_array(prompt, pool),
        }
        f = stages[stage]
        for i in range(200):  # warm: caches, memos, the shard's table
            f(i)
        functools.reduce(lambda acc, i: f(i), range(reps), None)
        await kv.close()
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


async def shard_answer(n: int, reps: int) -> None:
    from epp_extproc.adapters.worker_facts import Prompt
    from epp_extproc.ingest import wire
    from epp_extproc.ingest.server import IngestShard

    shard = IngestShard(tempfile.mkdtemp(prefix="epp-cg-"), 0, 1, block_size=BS)
    doc = make_doc()
    await shard.want("bench", dict.fromkeys((f"127.0.0.1:{20000 + w}" for w in range(n)), ()))
    for address, batch in _doc_batches(n, doc, False):
        shard.index.apply_batch(address, batch)
    shard._refresh_meta()
    p = Prompt(prompts_for()[0], None)
    buf = wire.pack_lookup(1, shard.meta_version, True, [(BS, p.hashes(BS))])
    for _ in range(50):
        shard.answer(buf)
    functools.reduce(lambda acc, i: shard.answer(buf), range(reps), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=(*DECIDER_STAGES, "answer"))
    ap.add_argument("--n", type=int, default=1000, help="workers")
    ap.add_argument("--reps", type=int, default=200, help="calls inside the collected loop")
    ap.add_argument("--shard", action="store_true", help="a static-index shard in a child process (the lookup)")
    a = ap.parse_args(argv)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    if a.stage == "answer":
        asyncio.run(shard_answer(a.n, a.reps))
    else:
        asyncio.run(decider(a.stage, a.n, a.reps, a.shard))
    return 0


if __name__ == "__main__":
    sys.exit(main())
