"""Disaggregated pools: after the decode worker is chosen, whether and where the prompt is prefilled.

The order is llm-d's (decode first, then its prefix-based decider, llm-d-inference-scheduler
pkg/epp/framework/plugins/scheduling/profilehandler/disagg/prefix_based_pd_decider.go @520af47):

1. the decode worker is chosen by today's cost rule over the workers that may be a destination (role decode
   or both): its load and its own cached prefix (core/cost.py);
2. the decider: the prompt's uncached suffix on that worker (prompt tokens - its overlap blocks x its block
   size) is compared with `--pd-min-uncached-tokens`. At least that many: disaggregate; fewer: the decode
   worker prefills locally (a short suffix costs less than a KV transfer). 0 turns disaggregation off, as
   llm-d's `nonCachedTokens: 0` does; llm-d's shipped P/D configs use 16, the default here;
3. the prefill worker is chosen by the same cost rule over the prefill workers: their own index overlap (KV
   they hold) and their prefill bookings.

A request whose prompt is unknown (no renderer, render failed: routed by load) is judged by the body-size
estimate with no overlap, as llm-d estimates characters / 4. A pool with no prefill worker never gets here.

This module decides on plain values and changes nothing: the pipeline books and predicts at commit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from epp_extproc.core.cost import Candidate, CostParams, choose


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
    DISABLED = "disabled"  # --pd-min-uncached-tokens 0
    NOT_INFERENCE = "not_inference"  # no prompt to prefill (body-less request, another path)
    NO_PREFILL_AVAILABLE = "no_prefill_available"  # every prefill worker unhealthy or outside the subset


@dataclass(frozen=True, slots=True)
class PdChoice:
    """The decider's verdict and, when it disaggregates, the prefill worker with what its leg books."""

    path: PdPath
    reason: PdReason
    uncached_tokens: int | None = None  # the prompt's uncached suffix on the decode worker
    prefill: Candidate | None = None
    prefill_candidates: list[Candidate] = field(default_factory=list)
    prefill_blocks: float = 0.0  # what the prefill leg books: blocks it must compute

    @property
    def address(self) -> str | None:
        """The prefill worker's `ip:port` (what `x-prefiller-host-port` carries); None = no prefill leg."""
        return self.prefill.address if self.prefill is not None else None


AGGREGATED = PdChoice(PdPath.AGGREGATED, PdReason.NO_PREFILL_WORKERS)


def uncached_suffix(decode: Candidate, prompt_tokens: int, block_size: int | None) -> int:
    """Prompt tokens the decode worker would have to compute itself (its overlap is 0 without an index)."""
    cached = decode.overlap_blocks * block_size if block_size else 0
    return max(prompt_tokens - cached, 0)


def decide_pair(decode: Candidate, *, prompt_tokens: int | None, block_size: int | None, min_uncached: int,
                prefill_addresses: Sequence[str], score: Callable[[Sequence[str]], list[Candidate]],
                params: CostParams, unknown_prompt_blocks: float = 1.0) -> PdChoice:
    """The decider, then the prefill worker. `prompt_tokens` None: not an inference request with a prompt;
    `score` prices prefill workers as the pipeline prices any candidate (load, overlap, prompt blocks);
    `unknown_prompt_blocks` is the leg's weight when the prompt was not rendered (the body-size estimate)."""
    if prompt_tokens is None:
        return PdChoice(PdPath.LOCAL_PREFILL, PdReason.NOT_INFERENCE)
    uncached = uncached_suffix(decode, prompt_tokens, block_size)
    if min_uncached <= 0:
        return PdChoice(PdPath.LOCAL_PREFILL, PdReason.DISABLED, uncached)
    if uncached < min_uncached:
        return PdChoice(PdPath.LOCAL_PREFILL, PdReason.SHORT_UNCACHED_SUFFIX, uncached)
    if not prefill_addresses:
        return PdChoice(PdPath.LOCAL_PREFILL, PdReason.NO_PREFILL_AVAILABLE, uncached)
    cands = score(prefill_addresses)
    chosen = choose(cands, params)
    blocks = max(chosen.prompt_blocks - chosen.overlap_blocks, 1.0) if chosen.prompt_blocks else \
        max(unknown_prompt_blocks, 1.0)
    return PdChoice(PdPath.DISAGGREGATED, PdReason.LONG_UNCACHED_SUFFIX, uncached, chosen, cands, blocks)
