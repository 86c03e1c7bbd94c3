"""The index's ingest (`KvIndex.apply_batch`) at two revisions of `kvindex/index.py`, in one run.

    python -m bench.ab_kvindex_store [--old REV] [--new REV] [--rounds 40] [--blocks 20000]

`kvindex/index.py` is read from git at each revision (`--new` defaults to the checkout's own file) and imported
side by side, the old one twice: the two old copies measure the noise floor (an A/A ratio), the new one the
change. Each round indexes the same pre-decoded batches into a fresh index with every copy, in a shuffled
order: `bench_kvindex`'s TRT batches (events of 1..64 blocks of 32 tokens, most continuing a chain) as text
chains, then the same chains with a media key on every fourth block (the media path). Decoding is left out (the
same code in both).

What is kept of each copy is its least CPU time over the rounds, as ns per block: the process's CPU time, not
the wall clock, which on a shared machine (2 cores among several developers) varied 3x between runs of the
same code; the least, because a busy machine only ever adds. Small indexes (20,000 blocks) keep the
allocator out of it: with 200,000 the index built second in a process ran up to 30% slower whichever code it
was. Written for issue 43 item 6 (whether one insert loop for text and media chains slows ingest).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.bench_kvindex import BS, make_ingest_batches
from kvindex.decode import decode_payload
from kvindex.events import BlockStored, DecodedBatch
from kvindex.hashing import DIALECT_VLLM, mm_pair_key

ROOT = Path(__file__).resolve().parent.parent
WORKTREE = "WORKTREE"  # --new's default: the checkout's own kvindex/index.py, committed or not


def load_index(rev: str, name: str) -> ModuleType:
    """`kvindex/index.py` as of `rev` (or the checkout's file), imported as `kvindex.<name>` (its own imports
    are the checkout's: only the index module differs)."""
    if rev == WORKTREE:
        src = (ROOT / "kvindex" / "index.py").read_text()
    else:
        src = subprocess.run(["git", "show", f"{rev}:kvindex/index.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="ab-kvindex-")) / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"kvindex.{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def ab_parser(doc: str | None, rounds: int) -> argparse.ArgumentParser:
    """The options every A/B of `kvindex/index.py` takes: the two revisions and the rounds."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default="main", help="the git revision whose kvindex/index.py is the baseline")
    ap.add_argument("--new", default=WORKTREE, help="the revision under test (default: the checkout's file)")
    ap.add_argument("--rounds", type=int, default=rounds)
    return ap


def ab_ratios(per_copy: dict[str, float]) -> dict[str, float]:
    """The A/A noise floor and the change, from one figure per copy (old, old_again, new; lower is better)."""
    return {"noise_old_over_old_again": round(per_copy["old"] / per_copy["old_again"], 3),
            "speed_new_over_old": round(min(per_copy["old"], per_copy["old_again"]) / per_copy["new"], 3)}


def with_media(batches: list[DecodedBatch]) -> list[DecodedBatch]:
    """The same chains, each fourth block keyed with one image item: what a vision engine's events carry."""
    key = mm_pair_key([("img-0", 0)])
    out = []
    for b in batches:
        evs = [dataclasses.replace(e, mm=[key if i % 4 == 0 else None for i in range(len(e.block_hashes))],
                                   mm_dialect=DIALECT_VLLM) if type(e) is BlockStored else e for e in b.events]
        out.append(dataclasses.replace(b, events=evs))
    return out


def ingest_cpu(mod: ModuleType, batches: list[DecodedBatch]) -> tuple[float, int]:
    """CPU seconds of one fresh index over every batch, and the blocks it stored."""
    idx = mod.KvIndex(default_block_size=BS, max_blocks_per_worker=10_000_000)
    t0 = time.process_time()
    for b in batches:
        idx.apply_batch("w", b)
    return time.process_time() - t0, idx.stats("w").blocks_stored


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = ab_parser(__doc__, rounds=40)
    ap.add_argument("--blocks", type=int, default=20_000)
    args = ap.parse_args(argv)
    copies = {"old": load_index(args.old, "_ab_old"), "old_again": load_index(args.old, "_ab_old_again"),
              "new": load_index(args.new, "_ab_new")}
    text = [decode_payload(p) for p in make_ingest_batches(args.blocks, random.Random(7))]
    kinds = {"text": text, "media": with_media(text)}
    best = {(c, k): float("inf") for c in copies for k in kinds}
    blocks = 0
    rng = random.Random(1)
    gc.disable()  # collections would land on whichever copy is running; collected between rounds instead
    try:
        for _ in range(args.rounds):
            order = list(copies)
            rng.shuffle(order)
            for kind, batches in kinds.items():
                for c in order:
                    dt, blocks = ingest_cpu(copies[c], batches)
                    best[(c, kind)] = min(best[(c, kind)], dt)
            gc.collect()
    finally:
        gc.enable()
    out: dict[str, Any] = {"old": args.old, "new": args.new, "rounds": args.rounds, "blocks": blocks}
    for kind in kinds:
        ns = {c: best[(c, kind)] / blocks * 1e9 for c in copies}
        out[kind] = {"ns_per_block": {c: round(v, 1) for c, v in ns.items()}, **ab_ratios(ns)}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
