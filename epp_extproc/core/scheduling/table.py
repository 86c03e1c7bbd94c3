"""The candidate table: one decision's workers as columns, what every scheduling plugin reads and writes.

Filters narrow the addresses a profile considers; the table is then built once over the survivors (their load,
this prompt in their block size, their cached prefix) and scorers return one number per row, summed into
`cost`; a picker returns a row. Columns are indexed by row, so a plugin never holds a per-worker object.

Two representations, one contract (issue 45). A small pool's table (fewer than `COLUMNAR_MIN` rows) keeps
plain lists: a columnar decision makes some thirty NumPy calls of a microsecond or so each, more than Python
loops over a few dozen candidates cost. A large pool's table is columnar: `prompt_blocks`, `overlap`,
`credited` and `cost` are NumPy arrays, and the candidates' load is gathered into three more (`prefill_load`,
`decode_load`, `unbooked_load`) from the load tracker's columns (core/load.LoadColumns), so the shipped
scorer and pickers decide with a few vector operations instead of a thousand interpreted iterations. A plugin
written against the list contract keeps working on either: `table.cost[i]`, `len(table.credited)`,
`zip(table.loads, ...)` all read the same figures (as NumPy scalars in a columnar table; `plain()` or
`float()` them where a plain Python number matters, e.g. for JSON or a per-row Python loop). `table.columnar`
says which one a table is; `table.loads` is a sequence of `EndpointLoad` either way (looked up per row only
when a plugin reads it).
Only what `/debug/score` shows becomes a record (`Candidate`), and only when it is asked for.

`credited` is the overlap a scorer may rely on: the index's leading blocks (`overlap`) less what a preparing
plugin discounts (blocks likely evicted before the request is admitted, core/scheduling/eviction_scorer.py);
every plugin that prices a cached prefix reads `credited`, so an adjustment reaches all of them at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from epp_extproc.core.contract import PromptKey
from epp_extproc.core.load import EndpointLoad
from epp_extproc.core.request import RequestContext

EMPTY_LOAD = EndpointLoad()

# Tables of at least this many rows are columnar (NumPy arrays). Measured on the repo's in-process bench
# (bench/bench_overhead._inproc, 8k-token prompts, scoring p50, lists / columnar): 8 workers 0.058 / 0.093 ms,
# 64: 0.093 / 0.095, 128: 0.130-0.149 / 0.108-0.120, 1,000: 0.77 / 0.22; the crossover lies between 64 and 128.
COLUMNAR_MIN = 96


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


class LoadRows(Sequence[EndpointLoad]):
    """`table.loads` of a columnar table: each row's `EndpointLoad` looked up only when a plugin reads it (the
    shipped plugins read the gathered columns instead, so a thousand-row decision builds no list of them).

    A row whose address held no load when the table was built (its column row is 0, core/load.LoadColumns)
    reads `EMPTY_LOAD` for the table's whole life, as a list table's captured entry does: a commit hook that
    reads the chosen row after the booking must see what the scorers saw, not the booking it just made."""

    __slots__ = ("_loads", "_addresses", "_rows")

    def __init__(self, loads: Mapping[str, EndpointLoad], addresses: Sequence[str], rows: np.ndarray) -> None:
        self._loads = loads
        self._addresses = addresses
        self._rows = rows

    def __len__(self) -> int:
        return len(self._addresses)

    @overload
    def __getitem__(self, i: int) -> EndpointLoad: ...

    @overload
    def __getitem__(self, i: slice) -> list[EndpointLoad]: ...

    def __getitem__(self, i: int | slice) -> EndpointLoad | list[EndpointLoad]:
        if isinstance(i, slice):
            return [self[k] for k in range(len(self._addresses))[i]]
        return EMPTY_LOAD if self._rows[i] == 0 else self._loads.get(self._addresses[i], EMPTY_LOAD)

    def __iter__(self) -> Iterator[EndpointLoad]:
        get = self._loads.get
        return (EMPTY_LOAD if r == 0 else get(a, EMPTY_LOAD) for a, r in zip(self._addresses, self._rows.tolist(),
                                                                              strict=True))


class CandidateTable:
    """The columns of one profile's candidates (see the module docstring)."""

    __slots__ = ("addresses", "loads", "prompt_blocks", "overlap", "credited", "cost", "notes", "columnar",
                 "prefill_load", "decode_load", "unbooked_load")

    prompt_blocks: Any  # list[float] | np.ndarray (float64): Any, so plugins index either without casts
    overlap: Any  # list[int] | np.ndarray (int64)
    credited: Any  # list[float] | np.ndarray (float64)
    cost: Any  # list[float] | np.ndarray (float64)

    def __init__(self, addresses: Sequence[str], loads: Sequence[EndpointLoad]) -> None:
        n = len(addresses)
        self.addresses = addresses
        self.loads = loads
        self.prompt_blocks = [0.0] * n
        self.overlap = [0] * n
        self.credited = [0.0] * n
        self.cost = [0.0] * n
        # per plugin, under the key it shows as in `/debug/score` rows, one value per row: None or an object
        # with `explain() -> dict` (eviction figures, credit per tier); the predicted-time scorer's (ttft, tpot)
        # pairs are flattened into the rows instead. Absent when the plugin did not run.
        self.notes: dict[str, list[Any]] = {}
        self.columnar = False
        # a columnar table's candidates' load, gathered (None in a list table: read `loads` there)
        self.prefill_load: np.ndarray | None = None
        self.decode_load: np.ndarray | None = None
        self.unbooked_load: np.ndarray | None = None

    @classmethod
    def of_columns(cls, addresses: Sequence[str], loads: Mapping[str, EndpointLoad], rows: np.ndarray,
                   prefill: np.ndarray, decode: np.ndarray, unbooked: np.ndarray,
                   prompt: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> CandidateTable:
        """A columnar table (see the module docstring): the load columns as gathered at `rows` (the
        tracker's row of each address, 0: no load); `prompt`: (prompt_blocks, overlap, credited), else zero;
        the cost zero."""
        t = cls.__new__(cls)
        n = len(addresses)
        t.addresses = addresses
        t.loads = LoadRows(loads, addresses, rows)
        if prompt is None:
            t.prompt_blocks = np.zeros(n, np.float64)
            t.overlap = np.zeros(n, np.int64)
            t.credited = np.zeros(n, np.float64)
        else:
            t.prompt_blocks, t.overlap, t.credited = prompt
        t.cost = np.zeros(n, np.float64)
        t.notes = {}
        t.columnar = True
        t.prefill_load, t.decode_load, t.unbooked_load = prefill, decode, unbooked
        return t

    def __len__(self) -> int:
        return len(self.addresses)

    def row(self, address: str) -> int | None:
        try:
            return self.addresses.index(address)
        except ValueError:
            return None

    def candidate(self, i: int) -> Candidate:
        """Row `i` as a record, in plain Python numbers whichever representation the table has."""
        if not self.columnar:
            return Candidate(self.addresses[i], self.loads[i], self.prompt_blocks[i], self.overlap[i],
                             self.cost[i], self.credited[i])
        return Candidate(self.addresses[i], self.loads[i], float(self.prompt_blocks[i]), int(self.overlap[i]),
                         float(self.cost[i]), float(self.credited[i]))

    def note(self, plugin: str, i: int) -> Any:
        col = self.notes.get(plugin)
        return None if col is None else col[i]


def plain(*columns: Any) -> list[Any]:
    """Columns as Python lists (a columnar table's arrays through `tolist()`): for a plugin that loops over
    rows in Python, so it computes on Python numbers, exactly as over a list table, and fast."""
    return [c.tolist() if isinstance(c, np.ndarray) else c for c in columns]
