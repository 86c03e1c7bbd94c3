"""`random-picker` (llm-d's name): any admissible worker, uniformly; for pools where the cost says nothing."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epp_extproc.core.scheduling.table import CandidateTable, SchedulingRequest

if TYPE_CHECKING:
    from epp_extproc.core.scheduling.deps import SchedulingDeps


@dataclass(slots=True)
class RandomPicker:
    rng: random.Random | None = None  # seeded in tests; None: the module's generator
    name: str = "random-picker"

    @classmethod
    def create(cls, params: Mapping[str, Any], deps: SchedulingDeps) -> RandomPicker:
        return cls()

    def pick(self, req: SchedulingRequest, table: CandidateTable, pool: Sequence[int]) -> int:
        return (self.rng or random).choice(list(pool))  # type: ignore[union-attr]
