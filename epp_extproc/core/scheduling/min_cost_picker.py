"""`min-cost-picker` (llm-d's `max-score-picker` means the same: its scores rise where our costs fall): the
least cost, exact ties at random."""

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
class MinCostPicker:
    rng: random.Random | None = None  # seeded in tests; None: the module's generator
    name: str = "min-cost-picker"

    @classmethod
    def create(cls, params: Mapping[str, Any], deps: SchedulingDeps) -> MinCostPicker:
        return cls()

    def pick(self, req: SchedulingRequest, table: CandidateTable, pool: Sequence[int]) -> int:
        return least_cost(table.cost, pool, 0.0, self.rng)
