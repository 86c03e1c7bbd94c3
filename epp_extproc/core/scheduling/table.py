"""The candidate table: one decision's workers as columns, what every scheduling plugin reads and writes.

Filters narrow the addresses a profile considers; the table is then built once over the survivors (their load,
this prompt in their block size, their cached prefix) and scorers return one number per row, summed into
`cost`; a picker returns a row. Columns are plain lists today, indexed by row, so a plugin never holds a
per-worker object: the thousand-worker work can turn them into arrays without touching a plugin's contract.
Only what `/debug/score` shows becomes a record (`Candidate`), and only when it is asked for.

`credited` is the overlap a scorer may rely on: the index's leading blocks (`overlap`) less what a preparing
plugin discounts (blocks likely evicted before the request is admitted, core/scheduling/eviction_scorer.py);
every plugin that prices a cached prefix reads `credited`, so an adjustment reaches all of them at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from epp_extproc.core.contract import PromptKey
from epp_extproc.core.load import EndpointLoad
from epp_extproc.core.request import RequestContext

EMPTY_LOAD = EndpointLoad()


@dataclass(slots=True)
class Candidate:
    """One row of a table as a record: what `/debug/score`, a commit hook or the P/D decider reads of it."""

    address: str
    load: EndpointLoad
    prompt_blocks: float = 0.0  # this prompt in the candidate's block size
    overlap_blocks: int = 0
    cost: float = 0.0
    credited: float = 0.0


@dataclass(slots=True)
class SchedulingRequest:
    """What the plugins see of one request: its headers and hints, and the prompt as the index keys it."""

    ctx: RequestContext
    prompt: PromptKey | None = None  # None: the prompt is unknown (not rendered), routed by load
    prompt_tokens: int = 0  # the prompt's length in tokens (the whole prompt, media included)
    rendered_tokens: int | None = None  # tokens the render returned (None: not rendered)
    est_tokens: int = 0  # the body-size estimate, for a prompt that was not rendered
    inference: bool = False  # an inference request with a body (P/D: there is a prompt to prefill)
    temperature: float | None = None  # `/debug/score`'s override of every picker's temperature
    sheddable: Callable[[RequestContext], bool] | None = None  # may the request be dropped (priority < 0)?
    load_reason: str | None = None  # why the prompt is not scored (core/plan.Plan.load_reason); traces say it


class CandidateTable:
    """The columns of one profile's candidates (see the module docstring)."""

    __slots__ = ("addresses", "loads", "prompt_blocks", "overlap", "credited", "cost", "notes")

    def __init__(self, addresses: Sequence[str], loads: Sequence[EndpointLoad]) -> None:
        n = len(addresses)
        self.addresses = addresses
        self.loads = loads
        self.prompt_blocks: list[float] = [0.0] * n
        self.overlap: list[int] = [0] * n
        self.credited: list[float] = [0.0] * n
        self.cost: list[float] = [0.0] * n
        # per plugin (by name), one value per row, for `/debug/score` and commit hooks (predicted times,
        # eviction figures); absent when the plugin did not run
        self.notes: dict[str, list[Any]] = {}

    def __len__(self) -> int:
        return len(self.addresses)

    def row(self, address: str) -> int | None:
        try:
            return self.addresses.index(address)
        except ValueError:
            return None

    def candidate(self, i: int) -> Candidate:
        return Candidate(self.addresses[i], self.loads[i], self.prompt_blocks[i], self.overlap[i], self.cost[i],
                         self.credited[i])

    def note(self, plugin: str, i: int) -> Any:
        col = self.notes.get(plugin)
        return None if col is None else col[i]
