"""The Mooncake trace as this machine can replay it: sampling, scaling, prompt synthesis, AIPerf inputs, oracle.

How the trace is reduced (every choice is a parameter of :class:`TraceScale`, recorded in the results):

* **Sessions, not a time window.** Reuse in the trace comes from conversations that come back minutes later
  (its first 400 requests reuse 5% of their blocks, the whole trace 64%), so a prefix of the file would
  measure nothing. Instead every request whose FIRST hash id falls in a deterministic 1-in-``sample_every``
  sample is kept: whole prefix trees, with their original timestamps. 1 in 10 keeps 407 requests (0.40 req/s
  over the trace's 1,022 s) whose infinite-cache token reuse (65%) matches the full trace's (64% of blocks).
* **Lengths.** One hash id (a 512-token block) becomes ``block_tokens`` = 32 mock tokens, exactly one mock KV
  block: input lengths are divided by 16 (``512 / block_tokens``). The mock's step costs per prompt and
  context token are multiplied by the same 16, so a scaled prompt costs what the real one would. Output
  lengths are divided by ``output_divisor`` (each output token is one SSE chunk through Envoy and AIPerf,
  the CPU bill of this 2-core machine), and decode tokens keep their real per-token cost.
* **Time.** Timestamps are divided by ``time_divisor`` (the load multiplier: 25 = the sample's 0.40 req/s
  replayed at 10 req/s) and by the mock's ``speedup`` (wall-clock compression of simulated time; the mock
  divides every step by it, so the ratio of arrival gaps to service times is unchanged).

Prompt text: hash id ``h`` always becomes the same 32 words ``w<k>`` (one mock token each) and a prompt is
the concatenation of its blocks' words cut to the scaled length, so equal hash-id prefixes give equal token
prefixes. The first block has 2 words fewer: the chat template puts ``<|im_start|>user`` in front of the
content, and the 2 template tokens plus 30 words fill the first KV block, so trace blocks and mock KV blocks
line up exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.prefix_oracle import block_chain, cached_tokens, lru_store

TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_synthetic_trace.jsonl"  # source: traces/README.md
TRACE_BLOCK = 512  # tokens per hash id in the Mooncake release
TEMPLATE_PREFIX_TOKENS = 2  # <|im_start|> and "user" in front of the first content word (trtllm_mock template)
VOCAB_WORDS = 20000


@dataclass(frozen=True)
class TraceScale:
    sample_every: int = 10
    block_tokens: int = 32
    output_divisor: int = 4
    max_requests: int | None = None  # cap on the sampled requests (the --quick smoke test)

    @property
    def length_divisor(self) -> float:
        return TRACE_BLOCK / self.block_tokens

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "length_divisor": self.length_divisor}


def find_trace() -> Path:
    """``$EPP_TRACE`` if set (another trace in the same format), else the copy kept in ``bench/traces/``."""
    import os

    if os.environ.get("EPP_TRACE"):
        return Path(os.environ["EPP_TRACE"])
    if not TRACE.exists():
        raise FileNotFoundError(f"Mooncake trace not found at {TRACE} (set EPP_TRACE)")
    return TRACE


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _u64(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def sample(rows: Sequence[dict[str, Any]], s: TraceScale, residue: int = 0) -> list[dict[str, Any]]:
    """Whole prefix trees (requests grouped by their first hash id), 1 in ``sample_every``, in trace order.
    ``residue`` picks which 1 in ``sample_every`` (0: the sample every recording so far replayed; another
    residue is another set of whole trees, bench/workloads.py's Mooncake seeds)."""
    out = [r for r in rows if r["hash_ids"]
           and _u64("root", r["hash_ids"][0]) % s.sample_every == residue % s.sample_every]
    return out[: s.max_requests] if s.max_requests else out


def block_words(hash_id: int, first: bool, s: TraceScale) -> list[str]:
    n = s.block_tokens - (TEMPLATE_PREFIX_TOKENS if first else 0)
    return [f"w{_u64('blk', hash_id, j) % VOCAB_WORDS}" for j in range(n)]


def prompt_text(row: dict[str, Any], s: TraceScale) -> str:
    """The request's content: its blocks' words, cut to the scaled input length (template tokens included)."""
    want = max(1, round(row["input_length"] / s.length_divisor) - TEMPLATE_PREFIX_TOKENS)
    words: list[str] = []
    for i, h in enumerate(row["hash_ids"]):
        words += block_words(h, i == 0, s)
        if len(words) >= want:
            break
    return " ".join(words[:want])


def jitter(rows: Sequence[dict[str, Any]], seed: int, amplitude_ms: float) -> list[dict[str, Any]]:
    """The rows with each timestamp shifted by a seeded uniform jitter in +-``amplitude_ms`` (trace time).

    Seed 0 is the trace as recorded. Repeats jitter arrivals rather than draw other subsamples so that every
    repeat replays the SAME requests (same prompts, same oracle and clairvoyant figures, same cache demand):
    what differs between repeats is only timing, i.e. the noise a comparison must rise above. Timestamps
    are then made non-decreasing, so arrival order (and with it every later turn after its predecessor)
    is kept."""
    if seed == 0 or amplitude_ms <= 0:
        return [dict(r) for r in rows]
    import random

    rng = random.Random(seed)
    out, last = [], -math.inf
    for r in rows:
        t = max(last, r["timestamp"] + rng.uniform(-amplitude_ms, amplitude_ms))
        out.append({**r, "timestamp": t})
        last = t
    return out


def mean_gap_ms(rows: Sequence[dict[str, Any]]) -> float:
    """Mean time between consecutive arrivals, in trace milliseconds (the unit the jitter is sized in)."""
    return (rows[-1]["timestamp"] - rows[0]["timestamp"]) / max(1, len(rows) - 1)


def working_set_blocks(prompts: Sequence[Sequence[int]], bs: int) -> int:
    """Distinct full KV blocks over all prompts: what a cache must hold to never miss a reusable block."""
    seen: set[int] = set()
    for toks in prompts:
        seen.update(block_chain(toks, bs))
    return len(seen)


def output_tokens(row: dict[str, Any], s: TraceScale) -> int:
    return max(1, round(row["output_length"] / s.output_divisor))


def aiperf_records(rows: Sequence[dict[str, Any]], s: TraceScale, wall_divisor: float) -> list[dict[str, Any]]:
    """AIPerf's ``mooncake_trace`` records with literal prompts (``text_input``) and wall-clock timestamps (ms
    from the first row's arrival)."""
    t0 = rows[0]["timestamp"]
    return [{"timestamp": round((r["timestamp"] - t0) / wall_divisor, 3), "text_input": prompt_text(r, s),
             "output_length": output_tokens(r, s)} for r in rows]


def write_jsonl(records: Sequence[dict[str, Any]], path: Path) -> Path:
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def write_aiperf_input(rows: Sequence[dict[str, Any]], s: TraceScale, wall_divisor: float, path: Path) -> Path:
    """AIPerf's ``mooncake_trace`` format with literal prompts (``text_input``) and wall-clock timestamps."""
    return write_jsonl(aiperf_records(rows, s, wall_divisor), path)


def build_tokenizer(folder: Path) -> Path:
    """A small BPE (``tokenizers``) trained on the prompt and answer vocabulary, saved as a Hugging Face
    folder: AIPerf needs a tokenizer for its dataset step, and this one never touches the network."""
    if (folder / "tokenizer.json").exists():
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from trtllm_mock.tokenizer import _OUTPUT_WORDS

    corpus = [f"w{i}" for i in range(VOCAB_WORDS)] + [w.strip() for w in _OUTPUT_WORDS]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([" ".join(corpus)], trainer=trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["[UNK]", "<|endoftext|>"], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|endoftext|>").save_pretrained(
        str(folder))
    return folder


# ----------------------------------------------------------------------------- oracle
def prompt_ids(text: str) -> list[int]:
    """Token ids the mock computes for AIPerf's chat request carrying ``text`` as the one user message."""
    from trtllm_mock.tokenizer import prompt_ids_for_chat

    return prompt_ids_for_chat({"messages": [{"role": "user", "content": text}]})


def oracle(prompts: Sequence[Sequence[int]], *, workers: int, capacity: int, bs: int) -> dict[str, float]:
    """Cached-token ratio bounds for the prompts in arrival order, with the mock's reuse rules (full blocks
    within ``prompt[:-1]``): ``infinite`` = one cache holding every earlier prompt; ``pooled_lru`` = one LRU
    cache with the capacity of all workers together (perfect placement, no block stored twice)."""
    seen: set[int] = set()
    pooled: OrderedDict[int, None] = OrderedDict()
    total = inf_c = lru_c = 0
    for toks in prompts:
        chain = block_chain(toks, bs)
        total += len(toks)
        inf_c += cached_tokens(toks, chain, seen, bs)
        seen.update(chain)
        lru_c += cached_tokens(toks, chain, pooled, bs)
        lru_store(pooled, chain, workers * capacity)
    return {"infinite": inf_c / total if total else 0.0, "pooled_lru": lru_c / total if total else 0.0,
            "prompt_tokens": total}


def offered_rate(rows: Sequence[dict[str, Any]], time_divisor: float) -> float:
    """Requests per simulated second when the trace is replayed ``time_divisor`` times faster."""
    span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000.0
    return len(rows) / span * time_divisor if span > 0 else math.inf


def write_real_engine_input(rows: Sequence[dict[str, Any]], time_divisor: float, path: Path) -> Path:
    """The sampled trace for a REAL model: lengths and hash ids untouched (AIPerf synthesises one text per
    hash id with the model's own tokenizer), only the timestamps divided by ``time_divisor``."""
    t0 = rows[0]["timestamp"]
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps({**r, "timestamp": round((r["timestamp"] - t0) / time_divisor, 3)}) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.trace_workload OUT.jsonl``: write an AIPerf input from the Mooncake trace."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--divisor", type=float, default=1.0, help="replay the trace this many times faster")
    ap.add_argument("--sample-every", type=int, default=1, help="keep 1 in N prefix trees (1 = all requests)")
    ap.add_argument("--mock", action="store_true",
                    help="scaled literal prompts for trtllm_mock (as bench_trace does) instead of hash ids")
    ap.add_argument("--speedup", type=float, default=1.0, help="with --mock: the mock's --speedup")
    a = ap.parse_args(argv)
    s = TraceScale(sample_every=a.sample_every)
    rows = sample(load(find_trace()), s)
    if a.mock:
        write_aiperf_input(rows, s, a.divisor * a.speedup, a.out)
    else:
        write_real_engine_input(rows, a.divisor, a.out)
    print(f"{a.out}: {len(rows)} requests, {offered_rate(rows, a.divisor):.2f} req/s offered")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
