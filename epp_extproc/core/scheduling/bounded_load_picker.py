"""`bounded-load-picker` (`--affinity-load-bound EPS`): the cache first, within a load bound.

After consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018): a worker may take
the request only if its held load is within (1 + EPS) x the pool's average plus the request's own blocks;
among those the one with the longest credited prefix wins, ties by the cost. Under the cost alone a cached
prefix is worth at most its own blocks while load differences grow with the load, so at saturation a prefix
is copied onto whichever worker is momentarily lighter, evicting others there; the bound lets affinity scale
with the load instead. The clairvoyant bench router (bench/clairvoyant.py) places the same way: the most
reusable blocks among the workers that can admit now. A request no admissible worker holds any of goes by the
cost, at the picker's temperature.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from epp_extproc.core.scheduling.least_cost import as_rows, is_whole, least_cost
from epp_extproc.core.scheduling.table import CandidateTable, SchedulingRequest

if TYPE_CHECKING:
    from epp_extproc.core.scheduling.deps import SchedulingDeps


@dataclass(slots=True)
class BoundedLoadPicker:
    bound: float
    temperature: float = 0.0
    rng: random.Random | None = None  # seeded in tests; None: the module's generator
    name: str = "bounded-load-picker"

    @classmethod
    def create(cls, params: Mapping[str, Any], deps: SchedulingDeps) -> BoundedLoadPicker:
        return cls(float(params["bound"]), float(params.get("temperature", 0.0)))

    def pick(self, req: SchedulingRequest, table: CandidateTable, pool: Sequence[int]) -> int:
        t = self.temperature if req.temperature is None else req.temperature
        if table.columnar:
            return self._vector(table, pool, t)
        loads, pb, credited = table.loads, table.prompt_blocks, table.credited
        # the blocks of work a worker holds, as the bound weighs them: its bookings and its unbooked load
        held = [loads[i].decode_blocks + loads[i].unbooked_blocks for i in pool]
        ceiling = (1.0 + self.bound) * sum(held) / len(pool)
        best = 0.0
        ties: list[int] = []
        for i, h in zip(pool, held, strict=True):
            p = pb[i]
            slack = p if p > 1.0 else 1.0
            if h <= ceiling + slack:
                effective = credited[i]
                if effective > best:
                    best, ties = effective, [i]
                elif effective == best and best > 0:
                    ties.append(i)
        return least_cost(table.cost, pool if best <= 0 else ties, t, self.rng)

    def _vector(self, table: CandidateTable, pool: Sequence[int], t: float) -> int:
        """The loop above over a columnar table, in the same order of operations, so the same row is drawn from
        the same random stream: `held` elementwise; its sum by Python's `sum` over the same floats (NumPy's
        adds pairwise and may differ in the last bit, and Python 3.12's `sum` compensates: the list path's
        own function keeps any version's rounding); the ties in pool order."""
        assert table.decode_load is not None and table.unbooked_load is not None
        if is_whole(pool, len(table)):
            held = table.decode_load + table.unbooked_load
            pb, credited = table.prompt_blocks, table.credited
        else:
            rows = as_rows(pool)
            held = table.decode_load[rows] + table.unbooked_load[rows]
            pb, credited = table.prompt_blocks[rows], table.credited[rows]
        ceiling = (1.0 + self.bound) * sum(held.tolist()) / len(held)
        slack = np.maximum(pb, 1.0)  # `p if p > 1.0 else 1.0` (no NaN can arise)
        effective = np.where(held <= ceiling + slack, credited, 0.0)
        best = float(effective.max())
        if best <= 0:
            return least_cost(table.cost, pool, t, self.rng)
        ties = np.flatnonzero(effective == best)  # positions in the pool, in its order
        return least_cost(table.cost, ties if is_whole(pool, len(table)) else as_rows(pool)[ties], t, self.rng)
