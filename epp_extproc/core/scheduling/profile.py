"""A scheduling profile: filters, then scorers over one candidate table, then a picker (and pins).

The plugin interfaces are declared here, where they are consumed (as llm-d's scheduler declares its
`Filter`, `Scorer` and `Picker`). A profile runs them in a fixed order:

1. filters narrow the addresses (None going in = the whole pool: a filter answers from the registry's cached
   tuples then, so an unfiltered decision over a thousand workers copies nothing);
2. the table is filled over the survivors (their load, this prompt's blocks, the index's overlap);
3. every scorer's `prepare` (a plugin that adjusts `credited` does it here, before anyone prices it), then
   every scorer's `score`, summed into `cost` with the profile's weights;
4. scorers that narrow (`admissible`, e.g. a latency objective) say which rows may be picked;
5. the picker returns a row; pins (session affinity) may send the request elsewhere.

Nothing here changes state: a profile run is part of a proposal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from epp_extproc.core.contract import KvLookup
from epp_extproc.core.load import EndpointLoad, LoadColumns
from epp_extproc.core.scheduling.table import COLUMNAR_MIN, EMPTY_LOAD, CandidateTable, SchedulingRequest


class Filter(Protocol):
    name: str

    def filter(self, req: SchedulingRequest, addresses: Sequence[str] | None) -> Sequence[str]:
        """The addresses that may take the request (`addresses` None: the whole routable pool)."""
        ...


class Scorer(Protocol):
    name: str

    def prepare(self, req: SchedulingRequest, table: CandidateTable) -> None:
        """Adjust shared columns (`credited`) before any scorer prices them; most scorers do nothing."""
        ...

    def score(self, req: SchedulingRequest, table: CandidateTable) -> list[float]:
        """One cost per row, lower is better, in the profile's unit (blocks, or seconds); a new list the
        profile may keep as the table's cost column."""
        ...

    def admissible(self, req: SchedulingRequest, table: CandidateTable,
                   outcome: dict[str, Any]) -> list[int] | None:
        """The rows that may be picked (None: all); may raise PickError; writes its outcome for commit."""
        ...


class Picker(Protocol):
    name: str

    def pick(self, req: SchedulingRequest, table: CandidateTable, pool: Sequence[int]) -> int: ...


class Pin(Protocol):
    name: str

    def pin(self, req: SchedulingRequest, table: CandidateTable, chosen: int,
            outcome: dict[str, Any]) -> int:
        """The row the request goes to after all (`chosen` unless the request is pinned elsewhere)."""
        ...


@dataclass(slots=True)
class ProfileResult:
    """A profile's answer: the table it scored, the chosen row, and what plugins said (SLO, session)."""

    table: CandidateTable
    chosen: int
    outcome: dict[str, Any] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.table.addresses[self.chosen]


class TableSource:
    """Fills a table: the load tracker's loads and the index's overlaps (llm-d's prefix-cache producer).

    With the tracker's `columns` (core/load.LoadColumns), a pool of `COLUMNAR_MIN` candidates or more gets a
    columnar table (table.py): its load gathered by row numbers, its overlap as one array when the lookup can
    answer so (`overlap_array`, adapters/kv_routing.py), its block sizes as one array (`block_sizes_of`). The
    row numbers of the last tuple of addresses are kept until the columns' generation changes: every decision
    over the whole pool passes the registry's same tuple (`EndpointRegistry.destinations`).
    """

    def __init__(self, loads: Callable[[], dict[str, EndpointLoad]], kv: KvLookup | None,
                 columns: LoadColumns | None = None) -> None:
        self._loads = loads
        self.kv = kv
        self.columns = columns
        self._rows_memo: tuple[Sequence[str], int, np.ndarray] | None = None

    def _rows(self, columns: LoadColumns, addresses: Sequence[str]) -> np.ndarray:
        memo = self._rows_memo
        if memo is not None and memo[0] is addresses and memo[1] == columns.generation:
            return memo[2]
        rows = columns.rows_of(addresses)
        if isinstance(addresses, tuple):
            self._rows_memo = (addresses, columns.generation, rows)
        return rows

    def table(self, req: SchedulingRequest, addresses: Sequence[str]) -> CandidateTable:
        columns = self.columns
        if columns is not None and len(addresses) >= COLUMNAR_MIN:
            return self._columnar(req, addresses, columns)
        loads = self._loads()
        table = CandidateTable(addresses, [loads.get(a, EMPTY_LOAD) for a in addresses])
        if req.prompt is None or self.kv is None:
            return table
        overlaps = self.kv.overlap(req.prompt, addresses)
        n = req.prompt_tokens
        block_size, overlap = self.kv.block_size, overlaps.get  # once per row: a thousand in a large pool
        pb, ov, cr = table.prompt_blocks, table.overlap, table.credited
        for i, a in enumerate(addresses):
            pb[i] = n / block_size(a)
            o = ov[i] = overlap(a, 0)
            cr[i] = o - 0.0
        return table

    def _columnar(self, req: SchedulingRequest, addresses: Sequence[str], columns: LoadColumns) -> CandidateTable:
        """The same figures as the list path, as arrays (the same operations per row: `n / block size` is one
        IEEE division either way, so every figure is bit for bit the list path's)."""
        rows = self._rows(columns, addresses)
        kv = self.kv
        prompt = None
        if req.prompt is not None and kv is not None:  # the prompt's columns first, so no zeros are made for them
            sizes_of = getattr(kv, "block_sizes_of", None)
            if sizes_of is not None:
                sizes = sizes_of(addresses)
            else:
                size = kv.block_size
                sizes = np.fromiter((size(a) for a in addresses), np.int64, len(addresses))
            overlap_array = getattr(kv, "overlap_array", None)
            ov = overlap_array(req.prompt, addresses) if overlap_array is not None else None
            if ov is None:
                get = kv.overlap(req.prompt, addresses).get
                ov = np.fromiter((get(a, 0) for a in addresses), np.int64, len(addresses))
            prompt = (req.prompt_tokens / sizes, ov, ov.astype(np.float64))
        return CandidateTable.of_columns(addresses, self._loads(), rows, columns.prefill[rows], columns.decode[rows],
                                         columns.unbooked[rows], prompt)


@dataclass(slots=True)
class Profile:
    name: str
    filters: Sequence[Filter]
    scorers: Sequence[tuple[Scorer, float]]
    picker: Picker
    source: TableSource
    pins: Sequence[Pin] = ()

    def candidates(self, req: SchedulingRequest) -> Sequence[str]:
        """The addresses this profile may choose from (its filters in order)."""
        addresses: Sequence[str] | None = None
        for f in self.filters:
            addresses = f.filter(req, addresses)
        return () if addresses is None else addresses

    def run(self, req: SchedulingRequest, addresses: Sequence[str]) -> ProfileResult:
        """Score `addresses` (not empty: what `candidates` returned) and choose one."""
        table = self.source.table(req, addresses)
        for s, _ in self.scorers:
            s.prepare(req, table)
        first = True
        columnar = table.columnar
        for s, weight in self.scorers:
            values = s.score(req, table)
            if weight != 1.0:
                values = weight * np.asarray(values, np.float64) if columnar else [weight * v for v in values]
            if first:  # the first scorer's answer is the column (a scorer hands over a fresh list or array)
                table.cost = np.asarray(values, np.float64) if columnar else values
                first = False
            elif columnar:
                table.cost += np.asarray(values, np.float64)  # elementwise cost[i] + v, as the loop below
            else:
                cost = table.cost
                for i, v in enumerate(values):
                    cost[i] += v
        outcome: dict[str, Any] = {}
        pool: Sequence[int] | None = None
        for s, _ in self.scorers:
            allowed = s.admissible(req, table, outcome)
            if allowed is not None:
                if pool is None:
                    pool = allowed
                else:
                    keep = set(allowed)
                    pool = [i for i in pool if i in keep]
        chosen = self.picker.pick(req, table, range(len(table)) if pool is None else pool)
        for p in self.pins:
            chosen = p.pin(req, table, chosen, outcome)
        return ProfileResult(table, chosen, outcome)


class NoScore:
    """Default `prepare` / `admissible` for scorers that only score (mixin)."""

    def prepare(self, req: SchedulingRequest, table: CandidateTable) -> None:
        return None

    def admissible(self, req: SchedulingRequest, table: CandidateTable,
                   outcome: dict[str, Any]) -> list[int] | None:
        return None
