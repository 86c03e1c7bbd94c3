"""The index's predictions (`KvIndex.predict_hashes`, their expiry) at two revisions of `kvindex/index.py`.

    python -m bench.ab_kvindex_predict [--old REV] [--new REV] [--rounds 30] [--prompts 200] [--blocks 527]

Why: every picker predicts each request's prompt on the worker it picked, and with replica sync every peer
predicts it too (issue 47: the two idle pickers of three spent ~2 ms of CPU per request on the sync), and
each prediction is later confirmed by the worker's stored blocks or expires. On the Mooncake trace a prompt is
527 blocks (16,855 tokens on average), so the per-hash work of predict and expire is paid ~500 times per
request per replica. The copies are loaded as `ab_kvindex_store` loads them (old twice, for the A/A noise
floor). Each round, per copy:

* **expire**: `--prompts` prompts of random hashes predicted, round-robin over 8 workers that each hold one
  stored block (expiry skips workers without slots), then every prediction expired;
* **confirm**: 40 prompts of real tokens predicted on one worker, then the worker's stored events for them
  applied (`apply_batch`), timed: each stored block confirms its prediction. Beside it, the same stores with
  nothing predicted (**store**), so the confirmation's own cost is confirm minus store.

The least process CPU over the rounds is kept: us per prompt (expire), ns per block (confirm, store).
"""

from __future__ import annotations

import gc
import json
import random
import time
from types import ModuleType
from typing import Any

from bench.ab_kvindex_store import ab_parser, ab_ratios, load_index
from epp_extproc.dev.kvwire import pack_batch, stored_event
from kvindex.decode import decode_payload

WORKERS = 8


def predict_and_expire_cpu(mod: ModuleType, prompts: list[list[int]]) -> float:
    """CPU seconds of one fresh index predicting every prompt (1 s ttl, 0.1 s apart) and expiring them all."""
    now = [0.0]
    idx = mod.KvIndex(default_block_size=32, clock=lambda: now[0])
    workers = [f"w{i}" for i in range(WORKERS)]
    seed_block = decode_payload(pack_batch([stored_event([5], None, list(range(1, 33)), 32)]))
    for w in workers:
        idx.add_worker(w)
        idx.apply_batch(w, seed_block)
    t0 = time.process_time()
    for i, hashes in enumerate(prompts):
        idx.predict_hashes(workers[i % WORKERS], hashes, 1.0)
        now[0] += 0.1
    now[0] += 10.0
    idx.predict_hashes(workers[0], [], 1.0)  # expires every one of them
    dt = time.process_time() - t0
    assert sum(idx.stats(w).predictions_expired for w in workers) == sum(len(p) for p in prompts)
    return dt


def confirm_cpu(mod: ModuleType, prompts: list[list[int]], batches: list[Any], predict: bool) -> float:
    """CPU seconds of applying the stored events of `prompts` to one worker, each block predicted first or not."""
    idx = mod.KvIndex(default_block_size=32, max_blocks_per_worker=10_000_000)
    idx.add_worker("w")
    if predict:
        for p in prompts:
            idx.predict("w", p + [0], ttl_s=1000.0)
    t0 = time.process_time()
    for b in batches:
        idx.apply_batch("w", b)
    dt = time.process_time() - t0
    assert idx.stats("w").predictions_confirmed == (sum(len(p) for p in prompts) // 32 if predict else 0)
    return dt


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = ab_parser(__doc__, rounds=30)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=527, help="blocks per prompt (527: the trace's mean)")
    args = ap.parse_args(argv)
    copies = {"old": load_index(args.old, "_abp_old"), "old_again": load_index(args.old, "_abp_old_again"),
              "new": load_index(args.new, "_abp_new")}
    rnd = random.Random(3)
    prompts = [[rnd.getrandbits(64) for _ in range(args.blocks)] for _ in range(args.prompts)]
    token_prompts = [[rnd.randrange(1, 30_000) for _ in range(args.blocks * 32)] for _ in range(40)]
    batches = [decode_payload(pack_batch([stored_event(list(range(1_000 * i + 1, 1_000 * i + 1 + args.blocks)),
                                                       None, p, 32)])) for i, p in enumerate(token_prompts)]
    n_blocks = args.blocks * len(token_prompts)
    best = {(c, k): float("inf") for c in copies for k in ("expire", "confirm", "store")}
    order_rng = random.Random(1)
    gc.disable()
    try:
        for _ in range(args.rounds):
            order = list(copies)
            order_rng.shuffle(order)
            for c in order:
                best[(c, "expire")] = min(best[(c, "expire")], predict_and_expire_cpu(copies[c], prompts))
                for kind, predict in (("confirm", True), ("store", False)):
                    dt = confirm_cpu(copies[c], token_prompts, batches, predict)
                    best[(c, kind)] = min(best[(c, kind)], dt)
            gc.collect()
    finally:
        gc.enable()
    out: dict[str, Any] = {"old": args.old, "new": args.new, "rounds": args.rounds, "prompts": args.prompts,
                           "blocks": args.blocks}
    for kind, per, unit in (("expire", args.prompts, 1e6), ("confirm", n_blocks, 1e9), ("store", n_blocks, 1e9)):
        v = {c: best[(c, kind)] / per * unit for c in copies}
        unit_name = "us_per_prompt" if kind == "expire" else "ns_per_block"
        out[kind] = {unit_name: {c: round(x, 1) for c, x in v.items()}, **ab_ratios(v)}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
