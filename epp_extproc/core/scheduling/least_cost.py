"""The draw every cost-ranked picker ends with: the least cost (exact ties at random), or a softmax over the
range-normalised costs at temperature T > 0. One function, so that the pickers draw alike and a seeded run
replays (the random stream is consumed the same way whichever picker calls it)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def least_cost(cost: Sequence[float], pool: Sequence[int], temperature: float,
               rng: random.Random | None = None) -> int:
    """A row of `pool` (not empty): argmin of `cost` with ties at random, or sampled at `temperature`."""
    rng = rng or random  # type: ignore[assignment]
    if temperature <= 0 or len(pool) == 1:
        best = min(cost[i] for i in pool)
        ties = [i for i in pool if cost[i] == best]
        return ties[0] if len(ties) == 1 else rng.choice(ties)
    lo = min(cost[i] for i in pool)
    hi = max(cost[i] for i in pool)
    if hi == lo:
        return rng.choice(list(pool))
    weights = [math.exp(-(cost[i] - lo) / ((hi - lo) * temperature)) for i in pool]
    return rng.choices(list(pool), weights=weights, k=1)[0]
