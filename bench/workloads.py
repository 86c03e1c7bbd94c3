"""The workload suite of issue 42: every routing default is judged on all of these, not on one trace.

Why a suite: the bounded-load affinity default was tuned on the Mooncake trace and one shared-prefix benchmark,
and on a shared-system-prompt trace nobody here had shaped it left one worker of four idle. A default must
hold on the shapes production traffic really has, so each shape below is generated from a seed into the
**same record shape the Mooncake replay consumes** (``{"timestamp": ms, "input_length": tokens,
"output_length": tokens, "hash_ids": [...]}``, one hash id per 512-token block, equal ids at the same
position = a reusable prefix). ``bench_trace`` then reduces, replays and judges every workload exactly as it
does the trace (``trace_workload``: one hash id = 32 mock tokens = one mock KV block, outputs / 4, a
fixed-schedule AIPerf replay, capacities derived from the workload's own working set).

Lengths below are in REAL tokens (what the workload stands for); the bench divides them by 16 like the trace.

================  =====================================================================================
name              what real traffic it stands for (source)
================  =====================================================================================
``mooncake``      the public Mooncake FAST'25 synthetic trace, 1 in 10 prefix trees (as before; seed k
                  keeps the trees whose root hashes to residue k mod 10, seed 0 = the recorded sample).
                  Source: kvcache-ai/Mooncake ``FAST25-release/traces`` (bench/traces/README.md).
``system-prompt`` one shared system prompt of 1-4 blocks (512-2,048 tokens; drawn per seed) in front of
                  single-turn requests whose rest is unique (median 1,500 tokens). The most common shape
                  of production chat: providers tell users to put static instructions first because their
                  caches match exact prefixes only, from 1,024 tokens (OpenAI, "Prompt caching" guide,
                  developers.openai.com/api/docs/guides/prompt-caching; Anthropic's minimum cacheable
                  prefix is 1,024 tokens, 4 cache breakpoints).
``multi-turn``    chat sessions re-sending their whole history each turn: turns 1 + geometric (mean 4,
                  at most 12; 73% of ShareGPT conversations are multi-turn, CachedAttention, Gao et al.,
                  USENIX ATC'24, arXiv 2403.19708), a first message of median 1,000 tokens, later
                  messages of median 150 and answers of median 250 (LMSYS-Chat-1M reports 69.5 tokens
                  per prompt and 214.5 per response, Zheng et al., arXiv 2309.11998; the first message
                  is longer here because pasted context is what makes the history worth caching), and a
                  think time after each answer drawn log-normal with median 7.2 s and p90 15 s (the
                  inter-turn gap from the end of an answer to the next turn, measured on 42k gaps of a
                  production qwen3-max chatbot trace: p50 7.18 s, p90 15.0 s; gahow/agentic-kvc,
                  commit 876d09db). The replay is a fixed schedule, so each gap also carries the
                  answer's nominal time (0.25 s + 20 ms per output token).
``rag``           32 shared documents of 2,048-8,192 tokens (uniform), picked with Zipf popularity
                  (s = 1.0 over a seeded ranking), each followed by a unique question (median 60 tokens):
                  retrieval-augmented QA, where a few documents take most retrievals (RAGCache, Jin et
                  al., arXiv 2404.12457, measured a skewed document-access pattern and caches document
                  KV for it). A document's last partial block merges with the question, so only its
                  full blocks are shared, as in a real engine.
``agents``        16 concurrent tool-calling sessions: a starting context of 16k-32k tokens (system prompt,
                  tool definitions, task, files), each step appending a tool result (median 400 tokens)
                  and the previous short answer (median 120): very long prefixes growing slowly
                  (Claude Code-style loops re-send the whole trajectory each step and reach ~92% prompt
                  cache hits, Anthropic engineering via the LMCache write-up "Context Engineering & Reuse
                  Pattern Under the Hood of Claude Code"; trajectories grow with every tool call, Xiao et
                  al., "Reducing Cost of LLM Agents with Trajectory Reduction", arXiv 2509.23586).
                  Sessions are few by design, so each one's step gap is the load's (sessions / rate,
                  log-normal sigma 0.5); past saturation a step may arrive before its previous answer
                  ends, which a real agent would not do (a fixed schedule cannot wait).
``no-reuse``      unique prompts only (median 2,000 tokens): nothing to gain from the cache, so a KV-aware
                  router must equal the load-only picker here (issue 42).
``hetero``        the ``multi-turn`` records on a heterogeneous pool, one worker of four at half speed
                  (its step costs doubled, ``--worker-speeds 0.5,1,1,1``): session affinity pulls
                  follow-ups to a worker whatever its speed, so a router must weigh the queue it joins.
                  Mixed GPU generations in one pool are common (a pool property, not a record property).
================  =====================================================================================

Answers are log-normal (sigma 0.7, clipped to 16..2,048 tokens) with median 250 tokens in ``multi-turn`` and
200 in the single-turn workloads (LMSYS-Chat-1M's 214.5 per response); an agent's are shorter (median 120,
sigma 0.8, at most 1,024: tool calls).

**Rates.** Every generator draws its schedule at a reference load (:data:`RATES`, "at" for capacity 75)
and :func:`generate` rescales it so that ``len / span`` is exactly the rate asked for; ``bench_trace``
compresses or stretches that schedule to each load as it does the trace's (the same requests in the same
order at every load: only the pace differs, think times included). :data:`RATES` gives three loads per
workload and capacity, below / at / past saturation, from :func:`saturation_rps` (a calibrated estimate,
see there); ``python -m bench.workloads rates`` recomputes the table.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench import trace_workload as T

BLOCK = T.TRACE_BLOCK  # real tokens per hash id, as in the Mooncake release
Record = dict[str, Any]
Session = list[Record]


class _Ids:
    """Fresh hash ids: every generated block is new unless a generator deliberately re-uses one."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """A log-normal draw clipped to [lo, hi]: token lengths are skewed with a long tail, never 0."""
    return int(min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, sigma))))))


def _output(rng: random.Random, median: float = 250.0) -> int:
    return _lognormal(rng, median, 0.7, 16, 2048)


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def _poisson(rng: random.Random, n: int, rate: float) -> list[float]:
    """``n`` Poisson arrival times in ms at ``rate`` req/s (the open-loop arrivals of independent users)."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) * 1000.0
    return out


def _record(t_ms: float, input_length: int, output_length: int, hash_ids: list[int]) -> Record:
    return {"timestamp": t_ms, "input_length": input_length, "output_length": output_length,
            "hash_ids": hash_ids}


# ----------------------------------------------------------------------------- generators
# Each returns sessions (lists of records in their order); single-request workloads return sessions of one.
def gen_system_prompt(rng: random.Random, n: int, rate: float, prefix_blocks: int | None = None) -> list[Session]:
    """A shared system prompt of 1-4 full blocks, then a unique rest (median 1,500 tokens)."""
    ids = _Ids()
    s = prefix_blocks if prefix_blocks is not None else rng.randint(1, 4)
    prefix = ids.take(s)
    out = []
    for t in _poisson(rng, n, rate):
        rest = _lognormal(rng, 1500, 0.8, 64, 8192)
        out.append([_record(t, s * BLOCK + rest, _output(rng, 200), prefix + ids.take(_blocks(rest)))])
    return out


THINK_MEDIAN_S, THINK_P90_S = 7.18, 15.0  # chatbot inter-turn gap, end of answer to next turn (module doc)
THINK_SIGMA = math.log(THINK_P90_S / THINK_MEDIAN_S) / 1.2816  # log-normal through the median and p90
MEAN_TURNS, MAX_TURNS = 4, 12


def answer_s(output_tokens: int) -> float:
    """The nominal time an answer takes to stream, added to the think time: the replay is a fixed schedule."""
    return 0.25 + 0.02 * output_tokens


def gen_multi_turn(rng: random.Random, n: int, rate: float) -> list[Session]:
    """Sessions re-sending a growing history: turn k+1's blocks start with all of turn k's blocks."""
    ids = _Ids()
    sessions: list[Session] = []
    total, t0 = 0, 0.0
    while total < n:  # sessions start as a Poisson process at rate / mean turns
        t0 += rng.expovariate(rate / MEAN_TURNS) * 1000.0
        turns = min(MAX_TURNS, 1 + _geometric(rng, MEAN_TURNS - 1))
        blocks: list[int] = []
        length, t, sess = 0, t0, []
        for k in range(turns):
            length += _lognormal(rng, 1000, 0.9, 32, 16384) if k == 0 else _lognormal(rng, 150, 1.0, 8, 4096)
            blocks += ids.take(_blocks(length) - len(blocks))
            out = _output(rng)
            sess.append(_record(t, length, out, list(blocks)))
            length += out  # the answer is part of the history the next turn re-sends
            t += (answer_s(out) + THINK_MEDIAN_S * math.exp(rng.gauss(0.0, THINK_SIGMA))) * 1000.0
        sessions.append(sess)
        total += turns
    return sessions


def _geometric(rng: random.Random, mean: float) -> int:
    """Failures before the first success, with the given mean (0, 1, 2, ...)."""
    p = 1.0 / (1.0 + mean)
    return int(math.log(1.0 - rng.random()) / math.log(1.0 - p))


RAG_DOCS, RAG_ZIPF_S, RAG_DOC_TOKENS = 32, 1.0, (2048, 8192)


def rag_documents(rng: random.Random, ids: _Ids, docs: int = RAG_DOCS) -> list[tuple[int, list[int]]]:
    """(length in tokens, ids of its FULL blocks) per document; the partial tail is the question's block."""
    out = []
    for _ in range(docs):
        length = rng.randint(*RAG_DOC_TOKENS)
        out.append((length, ids.take(length // BLOCK)))
    return out


def gen_rag(rng: random.Random, n: int, rate: float, docs: int = RAG_DOCS, s: float = RAG_ZIPF_S) -> list[Session]:
    """One document per request, Zipf popularity over a seeded ranking, a unique question after it."""
    ids = _Ids()
    corpus = rag_documents(rng, ids, docs)
    ranking = list(range(docs))
    rng.shuffle(ranking)  # which document is the most popular differs per seed
    weights = [1.0 / (r + 1) ** s for r in range(docs)]
    out = []
    for t in _poisson(rng, n, rate):
        length, full = corpus[ranking[rng.choices(range(docs), weights)[0]]]
        q = _lognormal(rng, 60, 0.6, 8, 512)
        tail = length - len(full) * BLOCK + q
        out.append([_record(t, length + q, _output(rng, 200), full + ids.take(_blocks(tail)))])
    return out


AGENT_SESSIONS, AGENT_START_TOKENS = 16, (16384, 32768)  # 16: so 75 and scarce put it under cache pressure


def gen_agents(rng: random.Random, n: int, rate: float, sessions: int = AGENT_SESSIONS) -> list[Session]:
    """Few sessions, each re-sending its whole trajectory every step: long prefixes that grow slowly."""
    ids = _Ids()
    gap_ms = sessions / rate * 1000.0  # together the sessions offer ``rate``
    out: list[Session] = []
    steps = -(-n // sessions)
    for _ in range(sessions):
        length = rng.randint(*AGENT_START_TOKENS)
        blocks = ids.take(_blocks(length))
        t = rng.uniform(0.0, gap_ms)
        sess = []
        for _ in range(steps):
            answer = _lognormal(rng, 120, 0.8, 16, 1024)
            sess.append(_record(t, length, answer, list(blocks)))
            length += answer + _lognormal(rng, 400, 0.8, 32, 4096)  # its tool call, then the tool's result
            blocks += ids.take(_blocks(length) - len(blocks))
            t += gap_ms * math.exp(rng.gauss(-0.125, 0.5))  # mean gap_ms (log-normal mean = e^(mu+s^2/2))
        out.append(sess)
    return out


def gen_no_reuse(rng: random.Random, n: int, rate: float) -> list[Session]:
    """Unique prompts only: no block id appears twice."""
    ids = _Ids()
    out = []
    for t in _poisson(rng, n, rate):
        length = _lognormal(rng, 2000, 0.8, 64, 16384)
        out.append([_record(t, length, _output(rng, 200), ids.take(_blocks(length)))])
    return out


def mooncake_rows(seed: int, n: int | None = None) -> list[Record]:
    """The public trace as bench_trace has always sampled it (seed 0), or another 1-in-10 set of trees."""
    return T.sample(T.load(T.find_trace()), T.TraceScale(max_requests=n), residue=seed % 10)


# ----------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class Spec:
    """One workload: its generator, what it stands for, and the pool it runs on."""

    name: str
    summary: str
    generate: Callable[[random.Random, int, float], list[Session]] | None  # None: the Mooncake trace
    worker_speeds: tuple[float, ...] | None = None  # relative speed per worker (None: all at full speed)
    records_of: str | None = None  # another workload's records, seed for seed (the pool is what differs)
    # the wall-clock compression bench_trace replays it at (None: its default 2.5, the trace's recordings).
    # The generated workloads saturate the modelled pool only at 40-100 req/s of simulated time; at 2.5x that
    # is 100-250 requests per wall second, where this 2-core machine queues first (the picker's mean render
    # call rose from 1.5 ms to 4-60 ms at 64 req/s x 2.5, and load-only, which renders nothing, looked best
    # for that reason alone): they replay in real time.
    speedup: float | None = None


WORKLOADS: dict[str, Spec] = {s.name: s for s in (
    Spec("mooncake", "the public Mooncake FAST'25 trace, 1 in 10 prefix trees", None),
    Spec("system-prompt", "shared system prompt of 1-4 blocks, unique rest", gen_system_prompt, speedup=1.0),
    Spec("multi-turn", "chat sessions re-sending a growing history, 7 s think time", gen_multi_turn, speedup=1.0),
    Spec("rag", "32 documents of 2k-8k tokens, Zipf popularity, unique questions", gen_rag, speedup=1.0),
    Spec("agents", "16 tool-calling sessions, 16k-32k token prefixes growing slowly", gen_agents, speedup=1.0),
    Spec("no-reuse", "unique prompts only", gen_no_reuse, speedup=1.0),
    Spec("hetero", "multi-turn records on a pool with one worker of four at half speed", gen_multi_turn,
         (0.5, 1.0, 1.0, 1.0), records_of="multi-turn", speedup=1.0),
)}
DEFAULT_REQUESTS = 400  # about the Mooncake sample's 407: a generated workload costs what the trace costs

# Three loads per workload and capacity: (below, at, past) saturation in req/s of simulated time, from
# saturation_rps (`python -m bench.workloads rates` prints how each was derived). The "at" load is an
# estimate calibrated on the one point measured here (Mooncake at capacity 75: round-robin's TTFT p90 tripled
# at 17.5 req/s); the judging run should confirm it with a round-robin sweep (bench_trace.saturating_rate).
RATES: dict[str, dict[str, tuple[float, float, float]]] = {
    "mooncake": {"ample": (10.0, 17.5, 25.0), "75": (10.0, 17.5, 25.0), "scarce": (9.5, 16.0, 23.0)},
    "system-prompt": {"ample": (9.5, 16.5, 24.0), "75": (9.5, 16.5, 24.0), "scarce": (9.5, 16.5, 24.0)},
    "multi-turn": {"ample": (8.0, 14.5, 20.5), "75": (8.0, 14.5, 20.5), "scarce": (8.0, 14.0, 20.0)},
    "rag": {"ample": (10.0, 18.0, 25.5), "75": (10.0, 17.0, 24.5), "scarce": (9.5, 17.0, 24.5)},
    "agents": {"ample": (12.0, 21.0, 30.0), "75": (8.5, 15.5, 22.0), "scarce": (6.5, 11.5, 16.5)},
    "no-reuse": {"ample": (9.5, 16.0, 23.0), "75": (9.5, 16.0, 23.0), "scarce": (9.5, 16.0, 23.0)},
    "hetero": {"ample": (7.0, 12.5, 18.0), "75": (7.0, 12.5, 18.0), "scarce": (7.0, 12.0, 17.5)},
}
LOAD_FACTORS = (4 / 7, 1.0, 10 / 7)  # below / at / past: the trace's 10 / 17.5 / 25 req/s around 17.5

# Loads measured here, replacing the estimate where a sweep disagreed with it (issue 42's judging run,
# 2026-12-05, 75 capacity, in real time: see each workload's speedup). The estimate prices every output token
# as if decoded alone and so puts these workloads' saturation 3-4x too low: load-only's TTFT p90 was flat
# (72-95 ms) up to 32 req/s on multi-turn and tenfold at 48; on system-prompt and no-reuse it rose 1.2x by 64
# and 2x by 96 req/s, the most this machine replays without queueing itself; on rag it went from 132 ms at 24
# to 1,629 ms at 40. The rest (agents, hetero) are still estimates.
MEASURED_RATES: dict[str, tuple[float, float, float]] = {
    "system-prompt": (40.0, 64.0, 96.0),
    "no-reuse": (40.0, 64.0, 96.0),
    "multi-turn": (20.0, 36.0, 48.0),
    "rag": (24.0, 32.0, 40.0),  # load-only: 132 ms at 24, 1,629 ms at 40
    # stop 50's sweeps (load-only, 75, one run each): hetero 106 / 465 / 1,029 ms TTFT p90 at 24 / 32 / 40;
    # agents 3,425 ms already at 8 (its cache-blind placement reuses 0.2 of the prompts), 733-786 ms at 6
    # in the judging run; agents' "below" (4) is placed under that, not swept
    "hetero": (24.0, 32.0, 40.0),
    "agents": (4.0, 6.0, 10.0),
}


def rates(name: str, capacity: str) -> tuple[float, float, float]:
    """The three loads to judge ``name`` at ``capacity``: measured where a sweep has been recorded
    (:data:`MEASURED_RATES`), else the estimate (the "75" row where the table has no such column)."""
    if name in MEASURED_RATES:
        return MEASURED_RATES[name]
    row = RATES[name]
    return row.get(capacity, row["75"])


def generate(name: str, seed: int = 0, n: int | None = None, rate: float | None = None) -> list[Record]:
    """The records of workload ``name`` for ``seed`` in arrival order, offered at exactly ``rate`` req/s
    (``len / span``; default: the workload's "at saturation" load at capacity 75). ``n``: how many requests
    (default DEFAULT_REQUESTS; for ``mooncake`` the whole 1-in-10 sample). Same seed, same records;
    the rate only rescales the timestamps. ``mooncake`` keeps the trace's own timestamps unless a rate is
    given, so its default is the sample bench_trace has always replayed."""
    rows = sorted((r for s in sessions(name, seed, n, rate) for r in s), key=lambda r: r["timestamp"])
    rows = rows[:n or (None if name == "mooncake" else DEFAULT_REQUESTS)]
    if (name == "mooncake" and rate is None) or len(rows) < 2:
        return rows  # sorted() is stable: a session's turns, and the trace's equal timestamps, keep their order
    want = rate or rates(name, "75")[1]
    t0 = rows[0]["timestamp"]
    span = rows[-1]["timestamp"] - t0
    scale = len(rows) / want * 1000.0 / span if span > 0 else 1.0
    return [{**r, "timestamp": round((r["timestamp"] - t0) * scale, 3)} for r in rows]


def sessions(name: str, seed: int = 0, n: int | None = None, rate: float | None = None) -> list[Session]:
    """The workload before flattening: each session's records in order (the tests check histories with it)."""
    spec = WORKLOADS[name]
    if spec.generate is None:
        return [[r] for r in mooncake_rows(seed, n)]
    base = spec.records_of or name
    rng = random.Random(f"{base}/{seed}")  # a string seed: stable across Python versions and processes
    # drawn at the reference load whatever the rate asked for: generate() rescales, so the order never changes
    return spec.generate(rng, n or DEFAULT_REQUESTS, rates(base, "75")[1])


# ----------------------------------------------------------------------------- the rate table
# The mock's step costs per MOCK token (trtllm_mock LLAMA_8B_H100, prompt and context tokens x 16).
PREFILL_MS_PER_MOCK_TOKEN = 0.0142 * 16
KV_READ_MS_PER_MOCK_TOKEN = 2.55e-5 * 16
CALIBRATION = ("mooncake", "75", 17.5)  # the measured saturating load (bench/README.md, trace section 5)


def _mock_sizes(r: Record, scale: T.TraceScale) -> tuple[int, int]:
    return round(r["input_length"] / scale.length_divisor), T.output_tokens(r, scale)


def pooled_reuse(rows: Sequence[Record], pool_blocks: int) -> float:
    """Share of prompt blocks an LRU cache of ``pool_blocks`` hash-id blocks serves, in arrival order (the
    pooled LRU figure of ``trace_workload.oracle`` on hash ids; equal id prefixes are equal prefixes)."""
    cache: OrderedDict[tuple[int, ...], None] = OrderedDict()
    hit = total = 0
    for r in rows:
        chain = [tuple(r["hash_ids"][:i + 1]) for i in range(len(r["hash_ids"]))]
        full = r["input_length"] // BLOCK  # only full blocks can be reused
        k = 0
        while k < min(full, len(chain)) and chain[k] in cache:
            cache.move_to_end(chain[k])
            k += 1
        hit += k
        total += len(chain)
        for c in chain:
            cache[c] = None
            cache.move_to_end(c)
        while len(cache) > pool_blocks:
            cache.popitem(last=False)
    return hit / total if total else 0.0


def capacity_for(rows: Sequence[Record], capacity: str, workers: int = 4,
                 scale: T.TraceScale | None = None) -> int:
    """bench_trace's blocks per worker for these records (one hash id = one mock block)."""
    from bench.bench_trace import BS, capacity_blocks

    s = scale or T.TraceScale()
    ws = len({tuple(r["hash_ids"][:i + 1]) for r in rows for i in range(r["input_length"] // BLOCK)})
    largest = max(-(-(_mock_sizes(r, s)[0] + _mock_sizes(r, s)[1]) // BS) for r in rows)
    return capacity_blocks(capacity, ws, workers, largest)


def work_ms(rows: Sequence[Record], reuse: float, decode_ms: float, scale: T.TraceScale | None = None) -> float:
    """Mean simulated engine ms one request costs a worker: the prefill of its uncached prompt tokens, and per
    output token ``decode_ms`` (step share and decode, the one calibrated constant) plus the KV read of its
    context."""
    s = scale or T.TraceScale()
    tot = 0.0
    for r in rows:
        p, o = _mock_sizes(r, s)
        tot += p * (1 - reuse) * PREFILL_MS_PER_MOCK_TOKEN + o * (decode_ms + p * KV_READ_MS_PER_MOCK_TOKEN)
    return tot / len(rows)


def _reuse(rows: Sequence[Record], capacity: str, workers: int) -> float:
    return pooled_reuse(rows, capacity_for(rows, capacity, workers) * workers)


def calibrated_decode_ms(workers: int = 4) -> float:
    """The per-output-token cost that puts the Mooncake sample's saturation at the measured 17.5 req/s at 75."""
    name, cap, sat = CALIBRATION
    rows = generate(name)
    s = T.TraceScale()
    budget = workers * 1000.0 / sat  # engine ms per request the pool has at that load
    prefill = sum(_mock_sizes(r, s)[0] for r in rows) / len(rows) * (1 - _reuse(rows, cap, workers)) * \
        PREFILL_MS_PER_MOCK_TOKEN
    kv = sum(_mock_sizes(r, s)[1] * _mock_sizes(r, s)[0] for r in rows) / len(rows) * KV_READ_MS_PER_MOCK_TOKEN
    out = sum(_mock_sizes(r, s)[1] for r in rows) / len(rows)
    return (budget - prefill - kv) / out


def saturation_rps(name: str, capacity: str, decode_ms: float, workers: int = 4, seed: int = 0) -> dict[str, float]:
    """Estimated load (req/s of simulated time) at which the pool is busy all the time: the pool's engine ms
    per second (workers x their speeds x 1000) over :func:`work_ms`, with the pooled LRU reuse at that
    capacity. An estimate, not a measurement: it ignores batching's shape and queueing, and is pinned to the
    one measured point by ``decode_ms``."""
    rows = generate(name, seed)
    speeds = WORKLOADS[name].worker_speeds or (1.0,) * workers
    reuse = _reuse(rows, capacity, workers)
    w = work_ms(rows, reuse, decode_ms)
    return {"reuse": reuse, "work_ms": w, "saturation_rps": sum(speeds) * 1000.0 / w}


def rate_table(capacities: Sequence[str] = ("ample", "75", "scarce")) -> dict[str, dict[str, tuple[float, ...]]]:
    """:data:`RATES` recomputed: each saturation estimate times LOAD_FACTORS, rounded to 0.5 req/s."""
    d = calibrated_decode_ms()
    return {name: {cap: tuple(max(0.5, round(saturation_rps(name, cap, d)["saturation_rps"] * f * 2) / 2)
                              for f in LOAD_FACTORS) for cap in capacities} for name in WORKLOADS}


def describe(rows: Sequence[Record]) -> dict[str, Any]:
    """Summary figures of a workload's records (recorded with each result). ``rate_rps`` is the load the
    records were drawn at; bench_trace replays them at each of its loads by rescaling that schedule."""
    n = len(rows)
    seen: set[tuple[int, ...]] = set()
    shared = total = 0
    for r in rows:
        for i in range(len(r["hash_ids"])):
            key = tuple(r["hash_ids"][:i + 1])
            total += 1
            shared += key in seen
            seen.add(key)
    return {"requests": n, "rate_rps": T.offered_rate(rows, 1.0) if n > 1 else None,
            "mean_input_tokens": sum(r["input_length"] for r in rows) / n if n else 0,
            "mean_output_tokens": sum(r["output_length"] for r in rows) / n if n else 0,
            "repeated_block_share": shared / total if total else 0.0}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.workloads rates`` (the rate table and its derivation) or ``... show NAME``."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("rates", help="recompute RATES from the saturation estimate")
    sh = sub.add_parser("show", help="summary of one workload's records, or write them as JSONL")
    sh.add_argument("name", choices=sorted(WORKLOADS))
    sh.add_argument("--seed", type=int, default=0)
    sh.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    sh.add_argument("--rate", type=float)
    sh.add_argument("--out", help="write the records here (the Mooncake trace format)")
    a = ap.parse_args(argv)
    if a.cmd == "rates":
        d = calibrated_decode_ms()
        print(f"calibration: {CALIBRATION[0]} at {CALIBRATION[1]} saturates at {CALIBRATION[2]} req/s -> "
              f"{d:.3f} engine ms per output token besides its KV read")
        for name in WORKLOADS:
            for cap in ("ample", "75", "scarce"):
                e = saturation_rps(name, cap, d)
                loads = tuple(max(0.5, round(e["saturation_rps"] * f * 2) / 2) for f in LOAD_FACTORS)
                print(f"{name:>14} {cap:>6}: reuse {e['reuse']:.3f}, {e['work_ms']:.1f} ms/request, saturation "
                      f"{e['saturation_rps']:.1f} req/s -> {loads}")
        return 0
    rows = generate(a.name, a.seed, a.requests, a.rate)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(json.dumps(describe(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
