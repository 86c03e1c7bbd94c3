"""Choosing a worker: the Dynamo KV-router cost over the candidates, on plain Python values.

cost = prefill_load_scale * max(prefill blocks in flight + this prompt's blocks - credit * overlap, 0)
       + decode blocks in flight + unbooked blocks

"Unbooked blocks" is load on the worker that this picker did not book: requests from other gateways,
other picker replicas or clients talking to the worker directly. It comes from the worker's own scraped
metrics (adapters/worker_metrics.py: requests the engine reports minus the ones this picker had booked on
it, each weighed like an average booking of this picker) and is priced like decode load, because whether
those requests are still prefilling is unknown. It is 0 when worker metrics are off or stale.

`--affinity-load-bound EPS` (> 0; `choose_bounded`) puts the cache first within a load bound, after
consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018): a worker may take the
request only if its held load is within (1 + EPS) x the pool's average plus the request's own blocks; among
those the one with the longest cached prefix wins, ties by the cost. Under the cost alone a cached prefix is
worth at most its own blocks while load differences grow with the load, so at saturation a prefix is copied
onto whichever worker is momentarily lighter, evicting others there; the bound lets affinity scale with the
load instead. The clairvoyant bench router (bench/clairvoyant.py) places the same way: the most reusable
blocks among the workers that can admit now.

Temperature 0 picks the argmin with exact ties broken at random; temperature T > 0 samples from a softmax
over range-normalised costs. With no prompt information (no render, body-less request) every booking
weighs one block, so the rule degrades to "fewest requests in flight, random among ties".
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epp_extproc.core.load import EndpointLoad


@dataclass(frozen=True, slots=True)
class CostParams:
    overlap_credit: float = 1.0
    prefill_load_scale: float = 1.0
    temperature: float = 0.0


@dataclass(slots=True)
class Candidate:
    address: str
    load: EndpointLoad
    prompt_blocks: float = 0.0  # this prompt in the candidate's block size
    overlap_blocks: int = 0
    cost: float = 0.0
    ttft_s: float | None = None  # --cost-model time: predicted seconds to first token (core/time_cost.py)
    tpot_s: float | None = None  # --cost-model time: predicted seconds per output token
    # --eviction-aware (core/eviction.py): overlap blocks likely evicted before this request is admitted, and
    # the price of the other prefixes its new blocks would flush; both 0 when the flag is off
    overlap_discount: float = 0.0
    eviction_penalty: float = 0.0
    eviction: Any = None  # core/eviction.EvictionFigures, for /debug/score


def compute_cost(c: Candidate, p: CostParams) -> float:
    load = c.load
    prefill = load.prefill_blocks + c.prompt_blocks - p.overlap_credit * (c.overlap_blocks - c.overlap_discount)
    return (p.prefill_load_scale * (prefill if prefill > 0.0 else 0.0) + load.decode_blocks + load.unbooked_blocks
            + c.eviction_penalty)


def choose(candidates: Sequence[Candidate], params: CostParams, rng: random.Random | None = None) -> Candidate:
    """Fill in each candidate's cost and return the chosen one. `candidates` must not be empty."""
    for c in candidates:
        c.cost = compute_cost(c, params)
    return _least_cost(candidates, params, rng)


def _least_cost(candidates: Sequence[Candidate], params: CostParams, rng: random.Random | None) -> Candidate:
    """`choose` on candidates whose cost is already filled in (choose_bounded computes each cost once)."""
    rng = rng or random
    if params.temperature <= 0 or len(candidates) == 1:
        best = min(c.cost for c in candidates)
        ties = [c for c in candidates if c.cost == best]
        return ties[0] if len(ties) == 1 else rng.choice(ties)
    lo = min(c.cost for c in candidates)
    hi = max(c.cost for c in candidates)
    if hi == lo:
        return rng.choice(list(candidates))
    weights = [math.exp(-(c.cost - lo) / ((hi - lo) * params.temperature)) for c in candidates]
    return rng.choices(list(candidates), weights=weights, k=1)[0]


def held_load(c: Candidate) -> float:
    """The blocks of work a worker holds, as the load bound weighs it: its bookings and its unbooked load."""
    return c.load.decode_blocks + c.load.unbooked_blocks


def choose_bounded(candidates: Sequence[Candidate], params: CostParams, bound: float,
                   rng: random.Random | None = None) -> Candidate:
    """The longest effective cached prefix among the workers whose held load is within (1 + bound) x the pool's
    average plus this request's own blocks (the slack that lets an idle or lightly loaded pool keep affinity,
    as the ceiling does in the unit-load rule); ties, and a request no such worker holds any of, by the cost
    (`choose`). The least-loaded worker is never above the average, so the bound always leaves a choice.
    Fills in every candidate's cost, as `choose` does, for /debug/score."""
    # two passes over the candidates and nothing else per candidate: a large pool has a thousand of them
    held = []
    for c in candidates:
        c.cost = compute_cost(c, params)
        held.append(held_load(c))
    ceiling = (1.0 + bound) * sum(held) / len(candidates)
    best = 0.0
    ties: list[Candidate] = []
    for c, h in zip(candidates, held, strict=True):
        slack = c.prompt_blocks if c.prompt_blocks > 1.0 else 1.0
        if h <= ceiling + slack:
            effective = c.overlap_blocks - c.overlap_discount
            if effective > best:
                best, ties = effective, [c]
            elif effective == best and best > 0:
                ties.append(c)
    if best <= 0:
        return _least_cost(candidates, params, rng)
    return _least_cost(ties, params, rng)


def eligible(addresses: Sequence[str], subset: Sequence[str] | None) -> list[str]:
    """Endpoints the picker may name: the discovered ones, narrowed (never widened) by the subset hint."""
    if subset is None:
        return list(addresses)
    allowed = set(subset)
    return [a for a in addresses if a in allowed]


def loads_for(addresses: Sequence[str], loads: Mapping[str, EndpointLoad]) -> list[Candidate]:
    empty = EndpointLoad()
    return [Candidate(a, loads.get(a, empty)) for a in addresses]
