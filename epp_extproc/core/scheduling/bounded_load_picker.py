"""`bounded-load-picker` (`--affinity-load-bound EPS`): the cache first, within a load bound, weighed.

After consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018): a worker may take
the request only if its held load is within (1 + EPS) x the pool's average plus the request's own blocks.
Under the cost alone a cached prefix is worth at most its own blocks while load differences grow with the
load, so at saturation a prefix is copied onto whichever worker is momentarily lighter, evicting others there;
the bound lets affinity scale with the load instead.

How much affinity a prefix buys is weighed (`rule: weighed`, the default since issue 42): among the workers
within the bound, each one's block cost is lowered by

    affinity = ((1 + EPS) x the pool's average held load + prompt blocks) x (credited blocks / prompt blocks)

and the least adjusted cost wins. A worker holding the whole prompt is thus worth the bound's whole ceiling
and wins up to it, as every cached prefix did under the earlier rule; a prefix covering a fraction of the
prompt holds the request only that fraction as far; in an idle pool the affinity is the credited blocks
themselves, so the longer prefix still wins where the block cost's own credit is cut off at zero. The earlier rule (`rule: longest`: the longest credited prefix within the bound wins,
ties by the cost) counted any positive overlap as a win however small beside the prompt and however long the
queue it joins: with a shared system prompt, three workers of four held it, could absorb the whole load
within (1 + 0.5) x the average, and the fourth never got a request (issue 42). It stays selectable for a
release (`--affinity-rule longest`), for comparison.

A request no admissible worker holds any of goes by the cost over every candidate, at the picker's
temperature, under either rule.

With tier credit (`tieredBound`; the flags set 2.0 when `--tiered-credit` is on and `--affinity-load-bound` is
not set) the bound widens while any worker holds blocks off the GPU. The 0.5 default was swept on GPU-only
pools, where holding a prefix's worker further past the average makes its GPU evict other prefixes for good;
with a host tier that stores what the GPU computed, an evicted prefix is still loaded at a fraction of its
prefill, so the wider bound keeps more reuse (on the trace at saturation, scarce GPU, host 4x: 0.92 of the
two-tier bound against 0.88; bench/README.md "Tiered KV credit", stop 60). A GPU-only pool decides as without
tier credit: the index holds no tier, the bound stays `bound`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from epp_extproc.core.scheduling.least_cost import as_rows, is_whole, least_cost, ordered_sum
from epp_extproc.core.scheduling.table import CandidateTable, SchedulingRequest

if TYPE_CHECKING:
    from epp_extproc.core.scheduling.deps import SchedulingDeps

RULES = ("weighed", "longest")


@dataclass(slots=True)
class BoundedLoadPicker:
    bound: float
    temperature: float = 0.0
    rng: random.Random | None = None  # seeded in tests; None: the module's generator
    rule: str = "weighed"
    name: str = "bounded-load-picker"
    # `tieredBound`: the bound while any worker holds blocks off the GPU (`has_tiers`, the KV view's answer),
    # where a prefix the GPU evicted is still cheap to load on its worker; None = `bound` always
    tiered_bound: float | None = None
    has_tiers: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"bounded-load-picker rule must be one of {', '.join(RULES)}, not {self.rule!r}")

    @classmethod
    def create(cls, params: Mapping[str, Any], deps: SchedulingDeps) -> BoundedLoadPicker:
        tiered = params.get("tieredBound")
        has_tiers = None
        if tiered is not None:
            kv = deps.kv
            if kv is None or not hasattr(kv, "has_tiers"):
                raise ValueError("bounded-load-picker's tieredBound reads the KV index's tiers: it needs a "
                                 "KV-aware picker (--tokenizer-protocol)")
            has_tiers = kv.has_tiers
        return cls(float(params["bound"]), float(params.get("temperature", 0.0)),
                   rule=str(params.get("rule", "weighed")),
                   tiered_bound=None if tiered is None else float(tiered), has_tiers=has_tiers)

    def current_bound(self) -> float:
        """`tiered_bound` while any worker holds blocks off the GPU, else `bound`."""
        if self.tiered_bound is not None and self.has_tiers is not None and self.has_tiers():
            return self.tiered_bound
        return self.bound

    def pick(self, req: SchedulingRequest, table: CandidateTable, pool: Sequence[int]) -> int:
        t = self.temperature if req.temperature is None else req.temperature
        bound = self.current_bound()
        if table.columnar:
            return self._vector(table, pool, t, bound)
        loads, pb, credited = table.loads, table.prompt_blocks, table.credited
        # the blocks of work a worker holds, as the bound weighs them: its bookings and its unbooked load
        held = [loads[i].decode_blocks + loads[i].unbooked_blocks for i in pool]
        average = sum(held) / len(pool)
        ceiling = (1.0 + bound) * average
        best = 0.0
        fits: list[tuple[int, float]] = []  # (row, its slack: the prompt's blocks, at least 1)
        for i, h in zip(pool, held, strict=True):
            p = pb[i]
            slack = p if p > 1.0 else 1.0
            if h <= ceiling + slack:
                fits.append((i, slack))
                if credited[i] > best:
                    best = credited[i]
        if best <= 0:
            return least_cost(table.cost, pool, t, self.rng)
        if self.rule == "longest":
            return least_cost(table.cost, [i for i, _ in fits if credited[i] == best], t, self.rng)
        adjusted = list(table.cost)
        for i, slack in fits:
            share = credited[i] / slack
            adjusted[i] -= (ceiling + slack) * (share if share < 1.0 else 1.0)
        return least_cost(adjusted, [i for i, _ in fits], t, self.rng)

    def _vector(self, table: CandidateTable, pool: Sequence[int], t: float, bound: float) -> int:
        """The loop above over a columnar table, in the same order of operations, so the same row is drawn from
        the same random stream: `held` elementwise; its sum in the order of Python's `sum` (`ordered_sum`:
        NumPy's `sum` adds pairwise and may differ in the last bit); the candidates in pool order.

        Every figure is computed over the whole pool and masked by `fit` rather than gathered at the fitting
        rows (at 1,000 candidates each gather cost more than the arithmetic): a fitting row's adjusted cost is
        the same subtraction of the same affinity, and the least of them is found with the rows that do not fit
        set to +inf (the cost and the affinity are finite, and at least one row fits once `best` > 0)."""
        assert table.decode_load is not None and table.unbooked_load is not None
        whole = is_whole(pool, len(table))
        rows = None if whole else as_rows(pool)
        if rows is None:
            held = table.decode_load + table.unbooked_load
            pb, credited, cost = table.prompt_blocks, table.credited, table.cost
        else:
            held = table.decode_load[rows] + table.unbooked_load[rows]
            pb, credited, cost = table.prompt_blocks[rows], table.credited[rows], table.cost[rows]
        average = ordered_sum(held) / len(held)
        ceiling = (1.0 + bound) * average
        slack = np.maximum(pb, 1.0)  # `p if p > 1.0 else 1.0` (no NaN can arise)
        fit = held <= ceiling + slack
        effective = np.where(fit, credited, 0.0)
        best = float(effective.max())
        if best <= 0:
            return least_cost(table.cost, pool, t, self.rng)
        if self.rule == "longest":
            ties = np.flatnonzero(effective == best)  # positions in the pool, in its order
            return least_cost(table.cost, ties if rows is None else rows[ties], t, self.rng)
        affinity = (ceiling + slack) * np.minimum(credited / slack, 1.0)  # each fitting row's, as the loop's
        if t > 0 and not fit.all():  # the softmax over the fitting rows alone: their weights, as the loop's
            fits = np.flatnonzero(fit)
            fit_rows = fits if rows is None else rows[fits]
            adjusted = table.cost.copy()
            adjusted[fit_rows] -= affinity[fits]
            return least_cost(adjusted, fit_rows, t, self.rng)
        adjusted = cost - affinity  # `adjusted[i] -= affinity` of each fitting row
        if t > 0:  # every row fits: the pool itself
            k = least_cost(adjusted, range(len(adjusted)), t, self.rng)
            return k if rows is None else int(rows[k])
        adjusted[~fit] = np.inf
        ties = np.flatnonzero(adjusted == adjusted.min())  # positions in the pool, in its order
        if rows is not None:
            ties = rows[ties]
        return int(ties[0]) if len(ties) == 1 else int(self._rng().choice(ties.tolist()))

    def _rng(self) -> random.Random:
        return self.rng or random  # type: ignore[return-value]
