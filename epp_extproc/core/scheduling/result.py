"""What a profile handler answers: the destination's profile result and, for a disaggregated pool, the
prefill leg (`PdChoice`). A leaf module, so the Director, the debug view and the handlers share it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from epp_extproc.core.scheduling.profile import ProfileResult


class PdPath(StrEnum):
    """Where a request's prompt is prefilled (the `path` label of `epp_pd_decisions`)."""

    AGGREGATED = "aggregated"  # a pool without prefill workers: today's decision
    DISAGGREGATED = "disaggregated"  # a prefill worker computes the prompt, the decode worker generates
    LOCAL_PREFILL = "local_prefill"  # a disaggregated pool, but the decode worker prefills this one itself


class PdReason(StrEnum):
    """Why the decider chose its path (the `reason` label: a closed set, so the metric stays bounded)."""

    NO_PREFILL_WORKERS = "no_prefill_workers"
    LONG_UNCACHED_SUFFIX = "long_uncached_suffix"
    SHORT_UNCACHED_SUFFIX = "short_uncached_suffix"
    DISABLED = "disabled"  # threshold 0 (--pd-min-uncached-tokens 0)
    NOT_INFERENCE = "not_inference"  # no prompt to prefill (body-less request, another path)
    NO_PREFILL_AVAILABLE = "no_prefill_available"  # every prefill worker unhealthy or outside the subset


@dataclass(frozen=True, slots=True)
class PdChoice:
    """The decider's verdict and, when it disaggregates, the prefill profile's result with what its leg books."""

    path: PdPath
    reason: PdReason
    uncached_tokens: int | None = None  # the prompt's uncached suffix on the decode worker
    prefill: ProfileResult | None = None
    prefill_blocks: float = 0.0  # what the prefill leg books: blocks it must compute

    @property
    def address(self) -> str | None:
        """The prefill worker's `ip:port` (what `x-prefiller-host-port` carries); None = no prefill leg."""
        return self.prefill.address if self.prefill is not None else None


AGGREGATED = PdChoice(PdPath.AGGREGATED, PdReason.NO_PREFILL_WORKERS)


@dataclass(frozen=True, slots=True)
class SchedulingResult:
    primary: ProfileResult  # the destination (decode or aggregated worker)
    pd: PdChoice = AGGREGATED

    @property
    def address(self) -> str:
        return self.primary.address
