"""Repeated runs of one benchmark cell, summarised as median and spread, and the rule for claiming a ratio.

One run of a (config, load) cell on a shared 2-core machine is one sample of a noisy figure: the trace
benchmark's single-run tables could not tell a 1.01x difference from noise. Each cell is therefore run
several times (different arrival-jitter seeds) and reported as its median with the spread min..max.

The claim rule is deliberately blunt: a ratio between two configurations is claimed only when their spreads
do not overlap (every run of one is better than every run of the other), and then it is the ratio of the
medians. Under "no difference" (all runs exchangeable) the chance that 3 runs of one lie wholly above 3 of the
other is 1/20 (1/10 for either direction); with 2 runs each it is 1/6 (1/3), which is why --quick results
never support a claim in the README.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

MIN_RUNS_TO_CLAIM = 2  # a single run has no spread: nothing can be said about its noise


@dataclass(frozen=True)
class Spread:
    """The median of a cell's runs and the range they covered."""

    median: float
    min: float
    max: float
    n: int

    def overlaps(self, other: Spread) -> bool:
        """True when the two ranges share any value (touching ends count as overlapping)."""
        return not (self.max < other.min or other.max < self.min)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def spread(values: Sequence[float | None]) -> Spread | None:
    """Median and min..max of the runs that produced the figure; None if none did (a failed metric)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    return Spread(statistics.median(xs), min(xs), max(xs), len(xs))


def claim(num_runs: Sequence[float | None], den_runs: Sequence[float | None]) -> float | None:
    """median(num) / median(den) when the two sets of runs do not overlap, else None (no claim).

    Both sides need at least ``MIN_RUNS_TO_CLAIM`` runs, and a zero median denominator claims nothing.
    Direction is the caller's: for latencies pass the baseline as ``num`` (> 1 = the other is faster).
    """
    a, b = spread(num_runs), spread(den_runs)
    if a is None or b is None or a.n < MIN_RUNS_TO_CLAIM or b.n < MIN_RUNS_TO_CLAIM:
        return None
    if a.overlaps(b) or b.median == 0:
        return None
    return a.median / b.median


def summarize(runs: Sequence[Mapping[str, Any]], metrics: Sequence[str]) -> dict[str, dict[str, Any] | None]:
    """Per metric, the spread of its values over ``runs`` (as plain dicts, for the JSON document)."""
    out: dict[str, dict[str, Any] | None] = {}
    for m in metrics:
        s = spread([r.get(m) for r in runs])
        out[m] = s.as_dict() if s else None
    return out


def fmt_spread(s: Mapping[str, Any] | None, spec: str = ".0f") -> str:
    """``median [min..max]`` for the report table; ``-`` when the metric is missing."""
    if not s:
        return "-"
    return f"{s['median']:{spec}} [{s['min']:{spec}}..{s['max']:{spec}}]"


def window_cached_ratio(arrivals_s: Sequence[float], usage: Mapping[int, tuple[int, int] | None], start_s: float,
                        max_s: float = 60.0) -> dict[str, Any]:
    """The cached-token ratio of the requests SCHEDULED to arrive in a window of the run (issue 47's "the
    minute after the restart"): from ``start_s`` for at most ``max_s`` seconds or until the last arrival.

    ``arrivals_s`` is each request's scheduled arrival (seconds from the first), indexed as the schedule;
    ``usage`` maps a served request's index to its (prompt tokens, cached tokens), and a request with no entry
    (or None) failed. Windowing by the schedule, not by when a request was served, gives every configuration
    of one seed the same requests in its window. Failed requests are counted, not averaged in (they have no
    cached tokens to count): ``cached_ratio`` is that of the served ones, None when none was served."""
    end = min(start_s + max_s, max(arrivals_s, default=start_s))
    inside = [i for i, t in enumerate(arrivals_s) if start_s <= t <= end]
    served = [usage[i] for i in inside if usage.get(i) is not None]
    prompt = sum(u[0] for u in served if u is not None)
    cached = sum(u[1] for u in served if u is not None)
    return {"start_s": start_s, "length_s": max(0.0, end - start_s), "requests": len(inside), "served": len(served),
            "failed": len(inside) - len(served), "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_ratio": cached / prompt if prompt else None}


def cached_ratio_over(usage: Mapping[int, tuple[int, int] | None], ids: Iterable[int]) -> float | None:
    """The cached-token ratio of the served requests among ``ids`` (``usage`` as for window_cached_ratio):
    one run's figure over another run's set of requests, e.g. an unrestarted picker's over the requests a
    restarted one served (the ones that arrived while it was away failed there and are not in that set)."""
    served = [u for i in ids if (u := usage.get(i)) is not None]
    prompt = sum(u[0] for u in served)
    return sum(u[1] for u in served) / prompt if prompt else None
