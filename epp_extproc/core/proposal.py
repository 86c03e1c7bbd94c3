"""A proposal: everything a pick needs, computed without side effects (what commit hooks and `/debug/score`
read). A leaf module, so the Director, its hooks and the debug view share it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from epp_extproc.core.body import ParsedBody
from epp_extproc.core.model_rewrite import Rewrite
from epp_extproc.core.passthrough import Verdict
from epp_extproc.core.plan import Plan
from epp_extproc.core.scheduling.profile import ProfileResult
from epp_extproc.core.scheduling.result import PdChoice, SchedulingResult
from epp_extproc.core.scheduling.table import Candidate, SchedulingRequest
from epp_extproc.core.session import SessionOutcome


@dataclass(slots=True)
class Proposal:
    body: bytes | None
    booked_blocks: float
    plan: Plan
    request: SchedulingRequest
    result: SchedulingResult
    model: str | None
    started: float
    score_seconds: float
    predicted_cached_tokens: int | None = None  # what the chosen worker should reuse (KV routing only)
    parsed: ParsedBody | None = None
    passthrough: Verdict | None = None  # whether the forwarded body carries the rendered prompt
    rewrite: Rewrite | None = None  # the model rewrite applied before render and scoring (counted at commit)

    @property
    def address(self) -> str:
        return self.result.address

    @property
    def chosen(self) -> Candidate:
        """The destination's row as a record (logs, tests, `/debug/score`)."""
        r = self.result.primary
        return r.table.candidate(r.chosen)

    @property
    def primary(self) -> ProfileResult:
        return self.result.primary

    @property
    def pd(self) -> PdChoice:
        return self.result.pd

    @property
    def session(self) -> SessionOutcome | None:
        """None: the client did not opt in to session affinity (or affinity is off)."""
        return self.result.primary.outcome.get("session")

    @property
    def slo(self) -> str | None:
        """With a latency objective under the predicted-time scorer: `met` or `best_effort`."""
        return self.result.primary.outcome.get("slo")
