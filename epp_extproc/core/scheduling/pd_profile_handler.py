"""`pd-profile-handler` (llm-d's `disagg-profile-handler`, and its legacy `pd-profile-handler`): the decode
profile picks the destination, then a prefix-based decider says whether a prefill worker computes the prompt,
and the prefill profile picks that worker with the same machinery (filters, scorers, its own picker).

The order is llm-d's (decode first, then its prefix-based decider, llm-d-inference-scheduler
pkg/epp/framework/plugins/scheduling/profilehandler/disagg/prefix_based_pd_decider.go @520af47):

1. the decode worker is chosen by the decode profile over the workers that may be a destination (role decode
   or both): its load and its own cached prefix;
2. the decider: the prompt's uncached suffix on that worker (prompt tokens - its overlap blocks x its block
   size) is compared with the threshold (`--pd-min-uncached-tokens`). At least that many: disaggregate;
   fewer: the decode worker prefills locally (a short suffix costs less than a KV transfer). 0 turns
   disaggregation off, as llm-d's `nonCachedTokens: 0` does; llm-d's shipped P/D configs use 16, the default;
3. the prefill worker is chosen by the prefill profile over the prefill workers: their own index overlap (KV
   they hold) and their prefill bookings.

A request whose prompt is unknown (no renderer, render failed: routed by load) is judged by the body-size
estimate with no overlap, as llm-d estimates characters / 4. A pool with no prefill worker is aggregated:
the decode profile's answer alone. Nothing here changes state: the Director books and predicts at commit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.scheduling.profile import Profile, ProfileResult
from epp_extproc.core.scheduling.result import AGGREGATED, PdChoice, PdPath, PdReason, SchedulingResult
from epp_extproc.core.scheduling.table import SchedulingRequest


def uncached_suffix(overlap_blocks: int, prompt_tokens: int, block_size: int | None) -> int:
    """Prompt tokens the decode worker would have to compute itself (its overlap is 0 without an index)."""
    cached = overlap_blocks * block_size if block_size else 0
    return max(prompt_tokens - cached, 0)


class PdProfileHandler:
    name = "pd-profile-handler"

    def __init__(self, decode: Profile, prefill: Profile, registry: EndpointRegistry, *, threshold: int,
                 block_size: Callable[[str], int] | None, default_block_size: int) -> None:
        self.primary = decode
        self.prefill = prefill
        self._registry = registry
        self.threshold = threshold
        self._block_size = block_size  # the KV index's per-worker block size; None without an index
        self._default_block_size = default_block_size  # an unrendered prompt's estimate is cut in these

    def candidates(self, req: SchedulingRequest) -> Sequence[str]:
        return self.primary.candidates(req)

    def schedule(self, req: SchedulingRequest, addresses: Sequence[str]) -> SchedulingResult:
        decode = self.primary.run(req, addresses)
        if not self._registry.has_prefill():
            return SchedulingResult(decode)
        return SchedulingResult(decode, self.decide(req, decode))

    def decide(self, req: SchedulingRequest, decode: ProfileResult) -> PdChoice:
        if req.rendered_tokens is not None:
            tokens: int | None = req.rendered_tokens
        else:
            tokens = req.est_tokens if req.inference else None
        if tokens is None:
            return PdChoice(PdPath.LOCAL_PREFILL, PdReason.NOT_INFERENCE)
        bs = self._block_size(decode.address) if self._block_size is not None else None
        uncached = uncached_suffix(int(decode.table.overlap[decode.chosen]), tokens, bs)
        if self.threshold <= 0:
            return PdChoice(PdPath.LOCAL_PREFILL, PdReason.DISABLED, uncached)
        if uncached < self.threshold:
            return PdChoice(PdPath.LOCAL_PREFILL, PdReason.SHORT_UNCACHED_SUFFIX, uncached)
        addresses = self.prefill.candidates(req)
        if not addresses:
            return PdChoice(PdPath.LOCAL_PREFILL, PdReason.NO_PREFILL_AVAILABLE, uncached)
        chosen = self.prefill.run(req, addresses)
        pb, ov = chosen.table.prompt_blocks[chosen.chosen], chosen.table.overlap[chosen.chosen]
        if chosen.table.columnar:  # NumPy scalars: the booking and the answer carry plain numbers
            pb, ov = float(pb), int(ov)
        blocks = max(pb - ov, 1.0) if pb else max(req.est_tokens / self._default_block_size, 1.0)
        return PdChoice(PdPath.DISAGGREGATED, PdReason.LONG_UNCACHED_SUFFIX, uncached, chosen, blocks)


__all__ = ["AGGREGATED", "PdProfileHandler", "uncached_suffix"]
