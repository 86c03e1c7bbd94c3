"""kvindex benchmark: ingest rate, lookup latency and memory per entry, each next to a naive baseline.

Run ``python -m bench.bench_kvindex [--quick] [--out PATH]``.  The baseline is what one writes first: a
per-worker dict of prefix hashes (two xxh3 calls per block, Dynamo-style local hash + combine), and a lookup
that scans every worker.  Both are measured in the same process on the same data, so the ratio is meaningful
even on a noisy machine.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import random
import statistics
import struct
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import xxhash

import kvindex.decode as kvindex_decode
import kvindex.hashing as kvindex_hashing
import kvindex.index as kvindex_index
from epp_extproc.dev.kvwire import pack_batch, stored_event
from kvindex.decode import decode_payload
from kvindex.events import BlockStored
from kvindex.hashing import block_hashes, chain_blocks_py, chain_hashes_py, root_seed
from kvindex.index import KvIndex

BS = 32
MASK = 0xFFFFFFFFFFFFFFFF
_xxh = xxhash.xxh3_64_intdigest


# ------------------------------------------------------------------ the naive baseline
class NaiveIndex:
    """Per-worker dict of prefix hashes; lookups scan every worker."""

    def __init__(self) -> None:
        self.workers: dict[str, dict[int, int]] = {}  # prefix hash -> engine hash
        self.engine: dict[str, dict[int, int]] = {}  # engine hash -> prefix hash

    @staticmethod
    def hashes(tokens: list[int], bs: int, parent: int = 0) -> list[int]:
        out = []
        for i in range(len(tokens) // bs):
            local = _xxh(struct.pack(f"<{bs}I", *tokens[i * bs : (i + 1) * bs]), 1337)
            parent = _xxh(struct.pack("<QQ", parent, local), 1337)
            out.append(parent)
        return out

    def ingest(self, worker: str, payload: bytes) -> int:
        _, events, _ = msgpack.unpackb(payload)
        prefixes = self.workers.setdefault(worker, {})
        eng = self.engine.setdefault(worker, {})
        n = 0
        for ev in events:
            if isinstance(ev, list):  # a positional (vLLM <= 0.31) event
                ev = dict(zip(("type", *_VLLM_ARRAY), ev, strict=False))
            if ev["type"] != "BlockStored":
                continue
            par = ev["parent_block_hash"]
            parent = 0 if par is None else eng.get(par & MASK)
            if parent is None:
                continue
            for eh, h in zip(ev["block_hashes"], self.hashes(ev["token_ids"], ev["block_size"], parent), strict=True):
                prefixes[h] = eh & MASK
                eng[eh & MASK] = h
                n += 1
        return n

    def overlap(self, tokens: list[int]) -> dict[str, int]:
        hs = self.hashes(tokens[:-1], BS)
        res = {}
        for w, prefixes in self.workers.items():
            n = 0
            for h in hs:
                if h not in prefixes:
                    break
                n += 1
            if n:
                res[w] = n
        return res


# ----------------------------------------------------------------------------- data
def make_ingest_batches(n_blocks: int, rng: random.Random) -> list[bytes]:
    """Pre-encoded TRT batches (half compact, half all-int64): events of 1..64 blocks of 32 tokens, most
    continuing the previous chain so parents resolve like in a real engine (`_batches`)."""
    return _batches(n_blocks, rng, lambda i: "trtllm-int64" if i % 2 else "trtllm")


def bench_ingest(n_blocks: int, rng: random.Random) -> dict[str, Any]:
    batches = make_ingest_batches(n_blocks, rng)
    idx = KvIndex(default_block_size=BS, max_blocks_per_worker=10_000_000)
    gc.collect()
    t0 = time.perf_counter()
    for p in batches:
        idx.apply_batch("w", decode_payload(p))
    t_new = time.perf_counter() - t0
    stored = idx.stats("w").blocks_stored
    naive = NaiveIndex()
    gc.collect()
    t0 = time.perf_counter()
    n_naive = sum(naive.ingest("w", p) for p in batches)
    t_naive = time.perf_counter() - t0
    return {
        "blocks": stored,
        "blocks_per_s": stored / t_new,
        "baseline_blocks_per_s": n_naive / t_naive,
        "target_blocks_per_s": 1_000_000,
    }


# The engines' wire forms, one stream each (32-token blocks): events of 1..64 blocks, 1..4 per batch, 80% of
# them continuing the previous chain (parents resolve as in a real engine), random u64 engine hashes, token ids
# below 150,000.
#   vllm          vLLM 0.32 (`ZmqEventPublisher`, msgspec): [ts, [event...], rank], each event a tagged map
#                 type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
#                 extra_keys (None for a text chain), group_idx 0 (tests/fixtures/vllm_mm_events.json, made by
#                 vLLM's own code, has these keys), smallest int encodings, u64 hashes as uint64
#   vllm-array    vLLM <= 0.31 / SGLang < 0.5: the same fields as a positional msgspec array_like event
#   trtllm        TensorRT-LLM's Python (msgspec) serializer: its map event, smallest int encodings
#   trtllm-int64  TensorRT-LLM's C++ serializer: the same map, every int as int64 (0xd3), floats as float64
STREAMS = ("vllm", "vllm-array", "trtllm", "trtllm-int64")
_VLLM_ARRAY = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
               "extra_keys")


def _wire_event(dialect: str, hs: list[int], parent: int | None, toks: list[int]) -> Any:
    if dialect.startswith("trtllm"):
        return stored_event(hs, parent, toks, BS)
    ev = stored_event([h & MASK for h in hs], None if parent is None else parent & MASK, toks, BS,
                      extra_keys=None, group_idx=0)
    if dialect == "vllm-array":
        return ["BlockStored", *(ev[f] for f in _VLLM_ARRAY)]
    return ev


def make_stream(dialect: str, n_blocks: int, rng: random.Random) -> list[bytes]:
    return _batches(n_blocks, rng, lambda _i: dialect)


def _batches(n_blocks: int, rng: random.Random, dialect_of: Any) -> list[bytes]:
    """Batches of 1..4 events of 1..64 blocks until `n_blocks`, batch i in the wire form `dialect_of(i)`."""
    batches: list[bytes] = []
    total = 0
    parent = None
    while total < n_blocks:
        dialect = dialect_of(len(batches))
        events = []
        for _ in range(rng.randint(1, 4)):
            k = rng.randint(1, 64)
            hs = [rng.getrandbits(64) - (1 << 63) for _ in range(k)]
            toks = [rng.randrange(150_000) for _ in range(k * BS)]
            if parent is not None and rng.random() < 0.2:
                parent = None
            events.append(_wire_event(dialect, hs, parent, toks))
            parent = hs[-1]
            total += k
        batches.append(pack_batch(events, all_int64=dialect == "trtllm-int64"))
    return batches


def _best(fn: Any, repeats: int) -> float:
    """The least of `repeats` timed calls of `fn` (each on fresh state it builds untimed): the figure the
    machine's noise inflates least."""
    best = float("inf")
    for _ in range(repeats):
        run = fn()
        gc.collect()
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


@contextlib.contextmanager
def _pure_python() -> Iterator[None]:
    """The ingest without the C accelerator (what EPP_KVINDEX_PURE=1 selects at import), for the same run."""
    saved = kvindex_decode._native_decode, kvindex_index.chain_for_index
    kvindex_decode._native_decode, kvindex_index.chain_for_index = None, chain_blocks_py
    try:
        yield
    finally:
        kvindex_decode._native_decode, kvindex_index.chain_for_index = saved


def bench_stages(dialect: str, n_blocks: int, rng: random.Random, repeats: int = 3) -> dict[str, Any]:
    """Ingest of one engine's stream, all together (decode + hashing + insert, what the subscriber does per
    batch) and each stage apart: decode alone (`decode_payload`), hashing alone (the chain hashes of every
    decoded event, as the index computes them), insert alone (`apply_batch` of the decoded batches with the
    hashing answered from a table made beforehand); next to the naive baseline, same run, same bytes.  With
    the C accelerator loaded, the pure-Python path is timed too (`pure_*`), and msgpack's unpack alone (what
    the pure decode starts with: its ceiling)."""
    batches = make_stream(dialect, n_blocks, rng)
    decoded = [decode_payload(p) for p in batches]
    stored = [ev for b in decoded for ev in b.events if type(ev) is BlockStored]
    blocks = sum(len(ev.block_hashes) for ev in stored)
    # every event's chain hashes with the seed the index will give it (its parent's hash, or the root seed)
    ours: dict[int, int] = {}
    pre: dict[int, list[int]] = {}
    for ev in stored:
        seed = root_seed() if ev.parent_block_hash is None else ours[ev.parent_block_hash]
        hs = chain_hashes_py(ev.token_ids, len(ev.token_ids), BS, seed)
        ours.update(zip(ev.block_hashes, hs, strict=True))
        pre[id(ev.token_ids)] = hs

    def total() -> Any:
        idx = KvIndex(default_block_size=BS, max_blocks_per_worker=10_000_000)
        return each(lambda p: idx.apply_batch("w", decode_payload(p)), batches)

    def each(fn: Any, items: list[Any]) -> Any:
        def run() -> None:  # results dropped as they come, as the subscriber drops them
            for x in items:
                fn(x)
        return run

    def decode() -> Any:
        return each(decode_payload, batches)

    def hashing(chain: Any) -> Any:
        seed = root_seed()

        def run() -> None:
            for ev in stored:
                chain(ev.token_ids, len(ev.token_ids), BS, seed)
        return lambda: run

    def insert() -> Any:
        idx = KvIndex(default_block_size=BS, max_blocks_per_worker=10_000_000)
        return each(lambda b: idx.apply_batch("w", b), decoded)

    def unpack() -> Any:
        return each(lambda p: msgpack.unpackb(p, raw=False, strict_map_key=False, use_list=False), batches)

    def naive() -> Any:
        base = NaiveIndex()
        return each(lambda p: base.ingest("w", p), batches)

    native = kvindex_decode._native_decode is not None
    out: dict[str, Any] = {"dialect": dialect, "blocks": blocks, "batches": len(batches),
                           "bytes": sum(map(len, batches)), "native": native}
    out["blocks_per_s"] = blocks / _best(total, repeats)
    out["decode_blocks_per_s"] = blocks / _best(decode, repeats)
    out["hashing_blocks_per_s"] = blocks / _best(hashing(kvindex_hashing.chain_hashes), repeats)
    real_chain = kvindex_index.chain_for_index
    kvindex_index.chain_for_index = lambda packed, n, bs, seed: pre[id(packed)]
    try:
        out["insert_blocks_per_s"] = blocks / _best(insert, repeats)
    finally:
        kvindex_index.chain_for_index = real_chain
    if native:
        with _pure_python():
            out["pure_blocks_per_s"] = blocks / _best(total, repeats)
            out["pure_decode_blocks_per_s"] = blocks / _best(decode, repeats)
        out["pure_hashing_blocks_per_s"] = blocks / _best(hashing(chain_hashes_py), repeats)
    out["msgpack_unpack_blocks_per_s"] = blocks / _best(unpack, repeats)
    out["baseline_blocks_per_s"] = blocks / _best(naive, repeats)
    out["target_blocks_per_s"] = 1_000_000
    return out


def build_shared(n_workers: int, n_blocks: int, rng: random.Random) -> tuple[list[int], KvIndex, NaiveIndex]:
    """Every worker holds a prefix of one long document (at least half of it, worker 0 all of it)."""
    doc = [rng.randrange(150_000) for _ in range(n_blocks * BS + 1)]
    idx = KvIndex(default_block_size=BS, max_blocks_per_worker=10_000_000)
    naive = NaiveIndex()
    ours = block_hashes(doc, BS)
    base = NaiveIndex.hashes(doc, BS)
    for w in range(n_workers):
        k = n_blocks if w == 0 else rng.randint(n_blocks // 2, n_blocks)
        hs = [(w << 40) + i for i in range(k)]
        idx.apply_batch(f"w{w}", decode_payload(pack_batch([stored_event(hs, None, doc[: k * BS], BS)])))
        naive.workers[f"w{w}"] = dict(zip(base[:k], hs, strict=True))
    assert idx.unique_blocks() == n_blocks and ours
    return doc, idx, naive


def _pcts(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s) * 1e3, s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3


def bench_lookup(tokens_list: list[int], workers_list: list[int], reps: int, rng: random.Random) -> list[dict[str, Any]]:
    rows = []
    for n_workers in workers_list:
        max_tokens = max(tokens_list)
        doc, idx, naive = build_shared(n_workers, max_tokens // BS, rng)
        for n_tok in tokens_list:
            prompt = doc[:n_tok]
            r = max(5, reps * 1024 // max(1024, n_tok))
            t_new, t_naive = [], []
            for _ in range(r):
                t0 = time.perf_counter()
                a = idx.overlap(prompt)
                t_new.append(time.perf_counter() - t0)
            for _ in range(max(3, r // 4)):
                t0 = time.perf_counter()
                b = naive.overlap(prompt)
                t_naive.append(time.perf_counter() - t0)
            assert a == b, "index and baseline disagree"
            p50, p99 = _pcts(t_new)
            b50, b99 = _pcts(t_naive)
            rows.append({
                "tokens": n_tok, "workers": n_workers, "p50_ms": p50, "p99_ms": p99,
                "baseline_p50_ms": b50, "baseline_p99_ms": b99,
            })
        del idx, naive
        gc.collect()
    return rows


def bench_memory(n_workers: int, n_blocks: int, rng: random.Random) -> dict[str, Any]:
    doc = [rng.randrange(150_000) for _ in range(n_blocks * BS)]
    prefixes = [rng.randint(n_blocks // 2, n_blocks) for _ in range(n_workers)]
    engine = [[rng.getrandbits(64) for _ in range(k)] for k in prefixes]
    batches = [decode_payload(pack_batch([stored_event(e, None, doc[: k * BS], BS)])) for e, k in zip(engine, prefixes, strict=True)]
    entries = sum(prefixes)
    base = NaiveIndex.hashes(doc, BS)
    gc.collect()
    tracemalloc.start()
    m0 = tracemalloc.get_traced_memory()[0]
    idx = KvIndex(default_block_size=BS, max_blocks_per_worker=10_000_000)
    for w, b in enumerate(batches):
        idx.apply_batch(f"w{w}", b)
    m1 = tracemalloc.get_traced_memory()[0]
    naive = NaiveIndex()
    for w, (e, k) in enumerate(zip(engine, prefixes, strict=True)):
        naive.workers[f"w{w}"] = {h: eh for h, eh in zip(base[:k], e, strict=True)}
        naive.engine[f"w{w}"] = {eh: h for h, eh in zip(base[:k], e, strict=True)}
    m2 = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "workers": n_workers, "entries": entries,
        "bytes_per_entry": (m1 - m0) / entries,
        "baseline_bytes_per_entry": (m2 - m1) / entries,
        "target_bytes_per_entry": 200,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes, a few seconds (used by the smoke test)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kvindex.json"))
    args = ap.parse_args(argv)
    rng = random.Random(7)
    stage_rng = random.Random(45)  # its own: the other sections draw the same data as before it existed
    if args.quick:
        stages = [bench_stages(d, 5_000, stage_rng, repeats=1) for d in STREAMS]
        ingest = bench_ingest(20_000, rng)
        lookup = bench_lookup([1024, 8192], [8, 64], 20, rng)
        memory = bench_memory(16, 512, rng)
    else:
        stages = [bench_stages(d, 200_000, stage_rng) for d in STREAMS]
        ingest = bench_ingest(400_000, rng)
        lookup = bench_lookup([1024, 8192, 32768, 131072], [8, 64, 256], 200, rng)
        memory = bench_memory(64, 4096, rng)
    result = {
        "bench": "kvindex", "quick": args.quick, "python": sys.version.split()[0],
        "machine": platform.machine(), "ingest_stages": stages, "ingest": ingest, "lookup": lookup, "memory": memory,
    }
    print(f"ingest, blocks/s, C accelerator {'on' if stages[0]['native'] else 'off'}; pure = the pure-Python path,"
          " same run")
    print(f"{'stream':>13} {'all':>10} {'decode':>10} {'hashing':>10} {'insert':>10} {'pure all':>10}"
          f" {'pure dec':>10} {'pure hash':>10} {'unpack':>10} {'naive':>10}")
    for r in stages:
        print(f"{r['dialect']:>13} {r['blocks_per_s']:>10,.0f} {r['decode_blocks_per_s']:>10,.0f}"
              f" {r['hashing_blocks_per_s']:>10,.0f} {r['insert_blocks_per_s']:>10,.0f}"
              f" {r.get('pure_blocks_per_s', 0):>10,.0f} {r.get('pure_decode_blocks_per_s', 0):>10,.0f}"
              f" {r.get('pure_hashing_blocks_per_s', 0):>10,.0f} {r['msgpack_unpack_blocks_per_s']:>10,.0f}"
              f" {r['baseline_blocks_per_s']:>10,.0f}")
    print(f"ingest: {ingest['blocks_per_s']:>12,.0f} blocks/s   baseline {ingest['baseline_blocks_per_s']:>10,.0f}"
          f"   target {ingest['target_blocks_per_s']:,}")
    print(f"{'tokens':>8} {'workers':>8} {'p50 ms':>9} {'p99 ms':>9} {'base p50':>10} {'base p99':>10}")
    for r in lookup:
        print(f"{r['tokens']:>8} {r['workers']:>8} {r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f}"
              f" {r['baseline_p50_ms']:>10.3f} {r['baseline_p99_ms']:>10.3f}")
    print(f"memory: {memory['bytes_per_entry']:.0f} B/(block,worker)   baseline {memory['baseline_bytes_per_entry']:.0f}"
          f"   target {memory['target_bytes_per_entry']}   ({memory['entries']:,} entries, {memory['workers']} workers)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
