"""`single-profile-handler` (llm-d's name): one profile picks the destination; no prefill leg."""

from __future__ import annotations

from collections.abc import Sequence

from epp_extproc.core.scheduling.profile import Profile
from epp_extproc.core.scheduling.result import SchedulingResult
from epp_extproc.core.scheduling.table import SchedulingRequest


class SingleProfileHandler:
    name = "single-profile-handler"

    def __init__(self, profile: Profile) -> None:
        self.primary = profile

    def candidates(self, req: SchedulingRequest) -> Sequence[str]:
        return self.primary.candidates(req)

    def schedule(self, req: SchedulingRequest, addresses: Sequence[str]) -> SchedulingResult:
        return SchedulingResult(self.primary.run(req, addresses))
