"""Columnar candidate tables (issue 45): a large pool's table holds NumPy arrays and its load comes from the
tracker's columns; every figure and every pick must be the list path's, bit for bit, with the random stream
consumed the same way. The list path is today's code, so each test runs both over the same figures."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import numpy as np
import pytest

import epp_extproc.core.scheduling.profile as profile_module
from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.request import RequestContext
from epp_extproc.core.scheduling.block_cost_scorer import BlockCostScorer
from epp_extproc.core.scheduling.bounded_load_picker import BoundedLoadPicker
from epp_extproc.core.scheduling.least_cost import least_cost, ordered_sum
from epp_extproc.core.scheduling.min_cost_picker import MinCostPicker
from epp_extproc.core.scheduling.profile import Profile, TableSource
from epp_extproc.core.scheduling.softmax_picker import SoftmaxPicker
from epp_extproc.core.scheduling.table import EMPTY_LOAD, CandidateTable, SchedulingRequest
from epp_extproc.dev.kvwire import pack_batch, stored_event
from kvindex.decode import decode_payload
from kvindex.hashing import block_hashes
from kvindex.index import KvIndex, _spread
from tests.golden_scheduling import GOLDEN, SCENARIOS, run
from tests.unit.scheduling.test_golden_decisions import _strip as strip_moved


def _random_tracker(rng: random.Random, addresses: list[str]) -> LoadTracker:
    """A tracker after a random history: bookings, prefill ends, moves, frees, peers, unbooked load."""
    t = LoadTracker()
    live = []
    for _ in range(rng.randint(0, 6 * len(addresses))):
        op = rng.random()
        a = rng.choice(addresses)
        if op < 0.45:
            live.append(t.book(a, rng.choice([0.0, 1.0, rng.uniform(0.1, 300.0), rng.randint(1, 9) / 3])))
        elif op < 0.6 and live:
            rng.choice(live).prefill_done()
        elif op < 0.7 and live:
            rng.choice(live).move(rng.choice(addresses))
        elif op < 0.85 and live:
            live.pop(rng.randrange(len(live))).free()
        elif op < 0.95:
            t.set_unbooked(a, rng.choice([0.0, rng.uniform(0.0, 50.0)]))
        else:
            t.forget(a)
    return t


def _tables(rng: random.Random, n: int) -> tuple[CandidateTable, CandidateTable]:
    """The same candidates as a list table and as a columnar one (ties likely: small integer figures)."""
    addresses = tuple(f"10.0.{i // 250}.{i % 250}:8000" for i in range(n))
    tracker = _random_tracker(rng, list(addresses))
    loads = tracker.loads()
    lt = CandidateTable(addresses, [loads.get(a, EMPTY_LOAD) for a in addresses])
    rows = tracker.columns.rows_of(addresses)
    ct = CandidateTable.of_columns(addresses, loads, rows, tracker.columns.prefill[rows],
                                   tracker.columns.decode[rows], tracker.columns.unbooked[rows])
    tokens = rng.randint(0, 40_000)
    sizes = [rng.choice([16, 32, 32, 64]) for _ in addresses]
    for i in range(n):
        pb = tokens / sizes[i]
        ov = rng.choice([0, 0, rng.randint(0, max(int(pb), 0)), int(pb)])
        discount = rng.choice([0.0, 0.0, rng.uniform(0.0, ov)])
        lt.prompt_blocks[i] = ct.prompt_blocks[i] = pb
        lt.overlap[i] = ct.overlap[i] = ov
        lt.credited[i] = ct.credited[i] = ov - discount
    return lt, ct


def _req(temperature: float | None = None) -> SchedulingRequest:
    return SchedulingRequest(RequestContext("POST", "/v1/chat/completions"), temperature=temperature)


def test_the_tracker_columns_follow_every_change_to_the_loads() -> None:
    rng = random.Random(1)
    for _ in range(40):
        addresses = [f"w{i}" for i in range(rng.randint(1, 90))]
        t = _random_tracker(rng, addresses)
        cols = t.columns
        for a in addresses:
            ld = t.loads().get(a)
            r = cols.rows.get(a, 0)
            assert (ld is None) == (r == 0)
            ld = ld or EMPTY_LOAD
            assert (cols.inflight[r], cols.prefill[r], cols.decode[r], cols.unbooked[r]) == \
                (ld.inflight, ld.prefill_blocks, ld.decode_blocks, ld.unbooked_blocks)
        assert not cols.prefill[0] and not cols.decode[0] and not cols.unbooked[0]  # the empty row stays empty


@pytest.mark.parametrize("n", [1, 2, 8, 33, 257, 1000])
def test_the_block_cost_is_the_list_paths_bit_for_bit(n: int) -> None:
    rng = random.Random(n)
    for _ in range(20 if n < 500 else 5):
        lt, ct = _tables(rng, n)
        credit, scale = rng.choice([(1.0, 1.0), (2.0, 1.0), (rng.uniform(0, 3), rng.uniform(0, 3))])
        s = BlockCostScorer(credit, scale)
        listed = s.score(_req(), lt)
        vec = s.score(_req(), ct)
        assert isinstance(vec, np.ndarray)
        assert vec.tolist() == listed  # == on floats: the same bits (no NaN can arise)


@pytest.mark.parametrize("n", [1, 2, 8, 33, 257, 1000])
def test_every_picker_draws_the_same_row_from_the_same_random_stream(n: int) -> None:
    rng = random.Random(100 + n)
    for trial in range(25 if n < 500 else 6):
        lt, ct = _tables(rng, n)
        s = BlockCostScorer(2.0, 1.0)
        lt.cost[:] = s.score(_req(), lt)
        ct.cost[:] = s.score(_req(), ct)
        pool: Any = range(n) if trial % 3 else sorted(rng.sample(range(n), rng.randint(1, n)))
        for make in (lambda r: MinCostPicker(r), lambda r: SoftmaxPicker(rng.choice([0.1, 0.5, 2.0]), r),
                     lambda r: BoundedLoadPicker(rng.choice([0.0, 0.25, 1.0]), rng.choice([0.0, 0.0, 0.7]), r,
                                                 rng.choice(["weighed", "longest"]))):
            seed = rng.random()
            r1, r2 = random.Random(seed), random.Random(seed)
            p1, p2 = make(r1), make(r2)
            if hasattr(p2, "temperature"):
                p2.temperature = p1.temperature
            if isinstance(p1, BoundedLoadPicker):
                p2.bound, p2.rule = p1.bound, p1.rule  # type: ignore[union-attr]
            for _ in range(3):  # several draws: the streams must stay in step
                a, b = p1.pick(_req(), lt, pool), p2.pick(_req(), ct, pool)
                assert a == b and type(b) is int
            assert r1.getstate() == r2.getstate()


def test_the_weighed_bound_masks_the_rows_that_do_not_fit_as_the_list_gathers_them() -> None:
    """The columnar weighed picker prices every row and masks those over the bound (dec45) where it gathered the
    fitting ones: tight bounds (few fit), loose ones (all fit), pools that are not the table, both temperatures."""
    rng = random.Random(45)
    partial = 0
    for trial in range(150):
        n = rng.choice([96, 130, 300])
        lt, ct = _tables(rng, n)
        if trial % 2:
            s = BlockCostScorer(rng.choice([1.0, 2.0]), 1.0)
            lt.cost[:] = s.score(_req(), lt)
        else:  # any cost a scorer may give: a row over the bound may be the cheapest, and must still lose
            lt.cost[:] = [float(rng.randint(0, 5000)) for _ in range(n)]
        ct.cost[:] = lt.cost
        pool: Any = range(n) if trial % 3 else sorted(rng.sample(range(n), rng.randint(1, n)))
        bound, t = rng.choice([0.0, 0.05, 0.25, 4.0]), rng.choice([0.0, 0.0, 0.5])
        held = np.asarray([ld.decode_blocks + ld.unbooked_blocks for ld in lt.loads])
        partial += bool((held > (1.0 + bound) * held.mean() + np.maximum(ct.prompt_blocks, 1.0)).any())
        seed = rng.random()
        r1, r2 = random.Random(seed), random.Random(seed)
        p1, p2 = BoundedLoadPicker(bound, t, r1), BoundedLoadPicker(bound, t, r2)
        for _ in range(3):
            a, b = p1.pick(_req(), lt, pool), p2.pick(_req(), ct, pool)
            assert a == b and type(b) is int
        assert r1.getstate() == r2.getstate()
    assert partial > 20  # the bound left rows out often enough to test the mask


def test_ordered_sum_is_pythons_sum_of_the_list_bit_for_bit() -> None:
    rng = random.Random(46)
    for _ in range(300):
        x = np.array([rng.choice([0.0, -0.0, rng.uniform(0, 1e-3), rng.uniform(0, 1e6), rng.randint(0, 9) / 3, 1e16])
                      for _ in range(rng.randint(1, 400))])
        a, b = ordered_sum(x), sum(x.tolist())
        assert a == b and repr(a) == repr(b)  # repr: -0.0 is not 0.0


def test_least_cost_on_an_array_with_exact_ties_draws_as_the_list() -> None:
    cost = [3.0, 1.0, 2.0, 1.0, 1.0, 5.0] * 40
    for seed in range(30):
        r1, r2 = random.Random(seed), random.Random(seed)
        pool = list(range(0, len(cost), 1 + seed % 3))
        for t in (0.0, 0.3):
            assert least_cost(cost, pool, t, r1) == least_cost(np.array(cost), pool, t, r2)
        assert r1.getstate() == r2.getstate()


def test_profile_sums_weighted_scorers_alike_on_both_tables() -> None:
    rng = random.Random(7)

    class Fixed:
        name = "fixed"

        def __init__(self, values: list[float]) -> None:
            self.values = values

        def prepare(self, req: SchedulingRequest, table: CandidateTable) -> None:
            return None

        def score(self, req: SchedulingRequest, table: CandidateTable) -> list[float]:
            return self.values

        def admissible(self, req: SchedulingRequest, table: CandidateTable, outcome: dict[str, Any]) -> None:
            return None

    for _ in range(10):
        lt, ct = _tables(rng, 300)
        extra = Fixed([rng.uniform(-5, 5) for _ in range(300)])
        picks = []
        for t in (lt, ct):
            source = TableSource(lambda: {}, None)
            source.table = lambda req, addresses, t=t: t  # type: ignore[method-assign]
            p = Profile("p", (), [(BlockCostScorer(2.0, 1.0), 1.0), (extra, 0.37)], MinCostPicker(random.Random(3)),
                        source)
            picks.append(p.run(_req(), lt.addresses).chosen)
        assert ct.cost.tolist() == lt.cost and picks[0] == picks[1]


async def _kv_pool(n: int, rng: random.Random) -> tuple[KvRouting, EndpointRegistry, tuple[str, ...], list[int]]:
    reg = EndpointRegistry()
    kv = KvRouting(reg, block_size=32, max_blocks_per_worker=100_000, topic="", prediction_ttl_s=5.0,
                   metrics_registry=None, ask_server_info=False)
    addresses = [f"127.0.0.1:{20000 + i}" for i in range(n)]
    reg.replace([Endpoint(f"w{i}", a) for i, a in enumerate(addresses)])
    await asyncio.sleep(0.01)
    doc = [rng.randrange(100, 30000) for _ in range(32 * 40 + 1)]
    for i, a in enumerate(addresses):
        if rng.random() < 0.2:
            continue  # holds nothing
        k = rng.randint(1, 40)
        kv.index.apply_batch(a, decode_payload(pack_batch([stored_event([(i << 20) + j for j in range(k)], None,
                                                                        doc[:k * 32], 32)])))
    return kv, reg, reg.destinations(), doc


async def test_the_overlap_array_is_the_overlap_dict_in_order() -> None:
    rng = random.Random(11)
    kv, reg, dest, doc = await _kv_pool(300, rng)
    try:
        for n_tok in (0, 31, 33, 200, 32 * 40 + 1):
            p = kv.prompt(doc[:n_tok])
            d = kv.overlap(p, dest)
            arr = kv.overlap_array(p, dest)
            assert arr is not None and arr.tolist() == [d.get(a, 0) for a in dest]
            sub = [a for a in dest if rng.random() < 0.3] + ["9.9.9.9:1"]  # a list, an unknown worker
            arr = kv.overlap_array(p, sub)
            assert arr is not None and arr.tolist() == [kv.overlap(p, sub).get(a, 0) for a in sub]
        # the kept per-worker arrays follow the pool: a dropped worker, a new block size
        gone = dest[5]
        kv.index.drop_worker(gone)
        kv.index.set_block_size(dest[6], 16)
        p = kv.prompt(doc)
        arr = kv.overlap_array(p, dest)
        assert arr is None or arr.tolist() == [kv.overlap(p, dest).get(a, 0) for a in dest]
        assert kv.block_sizes_of(dest).tolist() == [kv.block_size(a) for a in dest]
    finally:
        await kv.close()


async def test_a_table_over_the_pool_is_the_list_tables_in_every_column(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(12)
    kv, reg, dest, doc = await _kv_pool(120, rng)
    try:
        tracker = _random_tracker(rng, list(dest))
        source = TableSource(tracker.loads, kv, tracker.columns)
        req = SchedulingRequest(RequestContext("POST", "/v1/chat/completions"), prompt=kv.prompt(doc[:900]),
                                prompt_tokens=900)
        monkeypatch.setattr(profile_module, "COLUMNAR_MIN", 10**9)
        lt = source.table(req, dest)
        monkeypatch.setattr(profile_module, "COLUMNAR_MIN", 1)
        ct = source.table(req, dest)
        assert not lt.columnar and ct.columnar
        for col in ("prompt_blocks", "overlap", "credited", "cost"):
            assert getattr(ct, col).tolist() == getattr(lt, col), col
        assert list(ct.loads) == list(lt.loads) and [ct.loads[i] for i in range(len(dest))] == list(lt.loads)
        assert ct.decode_load.tolist() == [ld.decode_blocks for ld in lt.loads]  # type: ignore[union-attr]
        assert ct.candidate(3) == lt.candidate(3)
        json.dumps([[ct.candidate(i).overlap_blocks, ct.candidate(i).cost] for i in range(9)])  # plain numbers
    finally:
        await kv.close()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
async def test_the_golden_decisions_replay_unchanged_on_columnar_tables(scenario: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every recorded decision, `/debug/score` included, with every table columnar (the goldens' pools are
    small: without the override they take the list path, which test_golden_decisions.py replays)."""
    monkeypatch.setattr(profile_module, "COLUMNAR_MIN", 1)
    recorded = json.loads(GOLDEN.read_text())[scenario.name]
    replayed = json.loads(json.dumps(await run(scenario)))
    assert strip_moved(replayed) == strip_moved(recorded)


def test_spread_puts_each_drops_count_on_its_slots() -> None:
    rng = random.Random(13)
    for _ in range(200):
        n = rng.randint(1, 1100)
        slots = list(range(n))
        rng.shuffle(slots)
        cut = sorted(rng.sample(range(n + 1), min(n + 1, rng.randint(1, 40))))
        counts = sorted(rng.sample(range(1, 5000), len(cut)))
        drops, want = [], [0] * n
        for (lo, hi), c in zip(zip(cut, cut[1:], strict=False), counts, strict=False):
            mask = 0
            for s in slots[lo:hi]:
                mask |= 1 << s
                want[s] = c
            if mask:
                drops.append((c, mask))
        assert _spread(drops, n).tolist() == want


def test_the_index_overlap_array_is_its_dict_with_ranks_and_block_sizes() -> None:
    rng = random.Random(14)
    index = KvIndex(32)
    doc = [rng.randrange(100, 30000) for _ in range(32 * 30 + 1)]
    workers = [f"w{i}" for i in range(150)]
    for i, w in enumerate(workers):
        for rank in range(rng.choice([1, 1, 2, 3])):
            k = rng.randint(0, 30)
            if k:
                index.apply_batch(w, decode_payload(pack_batch([stored_event(
                    [(i << 24) + (rank << 16) + j for j in range(k)], None, doc[:k * 32], 32)])), rank=rank)
        if rng.random() < 0.1:
            index.set_block_size(w, 16)  # a second slot in another size: never alive for the 32-token walk
    if rng.random() < 0.5:
        index.drop_worker(workers[3])
    hashes = block_hashes(doc, 32)
    assert len(set(index.overlap_hashes(hashes, 32).values())) > 10  # many distinct drops in the walk
    for ws in (tuple(workers), workers[::3] + ["nobody"], ()):
        for n_blocks in (0, 1, 7, len(hashes)):
            d = index.overlap_hashes(hashes[:n_blocks], 32, ws)
            assert index.overlap_array(hashes[:n_blocks], 32, ws).tolist() == [d.get(w, 0) for w in ws]
