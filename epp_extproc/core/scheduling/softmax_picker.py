"""`softmax-picker` (`--router-temperature T`, Dynamo's name): a worker sampled with weight
exp(-(cost - least) / ((most - least) x T)), so near-equal workers share the load; `/debug/score` asks for
the argmin (temperature 0) to show a stable answer."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epp_extproc.core.scheduling.least_cost import least_cost
from epp_extproc.core.scheduling.table import CandidateTable, SchedulingRequest

if TYPE_CHECKING:
    from epp_extproc.core.scheduling.deps import SchedulingDeps


@dataclass(slots=True)
class SoftmaxPicker:
    temperature: float
    rng: random.Random | None = None  # seeded in tests; None: the module's generator
    name: str = "softmax-picker"

    @classmethod
    def create(cls, params: Mapping[str, Any], deps: SchedulingDeps) -> SoftmaxPicker:
        return cls(float(params["temperature"]))

    def pick(self, req: SchedulingRequest, table: CandidateTable, pool: Sequence[int]) -> int:
        t = self.temperature if req.temperature is None else req.temperature
        return least_cost(table.cost, pool, t, self.rng)
