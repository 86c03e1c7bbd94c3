"""The debug page's ring of recent decisions: bounded, silent unless watched, and it explains what it kept."""

from __future__ import annotations

import json

from epp_extproc.core.recent_decisions import RING_SIZE, TOP_CANDIDATES, RecentDecisions
from epp_extproc.core.scheduling.table import CandidateTable
from tests.scheduling_fakes import ADDRS, chat, decide, make


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def names(address: str) -> str | None:
    return {ADDRS[0]: "w0", ADDRS[1]: "w1"}.get(address)


async def test_the_assembled_decision_feeds_the_ring_once_the_page_watches_it() -> None:
    pipe, _, _ = make()
    ring = pipe.assembled.decisions
    await decide(pipe, chat(b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'))
    assert len(ring) == 0  # nobody watching: nothing kept
    ring.watch()
    await decide(pipe, chat(b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'))
    doc = ring.document(names)
    assert len(doc["decisions"]) == 1
    d = doc["decisions"][0]
    assert d["model"] == "m" and d["route"] == "kv" and d["pick"] in ADDRS
    assert {c["address"] for c in d["candidates"]} == set(ADDRS)
    credited = {c["address"]: c["credited_blocks"] for c in d["candidates"]}
    assert credited[ADDRS[0]] == 2.0  # the fake index holds 2 blocks of every prompt on the first worker
    assert d["reason"].startswith("kv: ")
    json.dumps(doc)  # JSON-able as it is


async def test_the_ring_stays_bounded_at_its_size_however_many_decisions_pass() -> None:
    pipe, _, _ = make()
    ring = pipe.assembled.decisions
    ring.watch()
    for _ in range(RING_SIZE * 3):
        await decide(pipe, chat(b'{"model":"m","messages":[]}'))
    assert len(ring) == RING_SIZE
    doc = ring.document(names)
    seqs = [d["seq"] for d in doc["decisions"]]
    assert len(seqs) == RING_SIZE and seqs == sorted(seqs, reverse=True)  # newest first
    assert seqs[0] == RING_SIZE * 3 and doc["last_seq"] == RING_SIZE * 3
    assert [d["seq"] for d in ring.document(names, since=seqs[0] - 2)["decisions"]] == [seqs[0], seqs[0] - 1]


async def test_the_ring_stops_and_forgets_when_nobody_reads_it_for_its_watch_time() -> None:
    clock = Clock()
    pipe, _, _ = make()
    ring = RecentDecisions(size=4, watch_s=10.0, clock=clock)
    pipe.director.hooks = [*pipe.director.hooks, ring]
    ring.watch()
    await decide(pipe, chat(b'{"messages":[]}'))
    assert len(ring) == 1 and ring.armed
    clock.now += 11.0
    assert not ring.armed
    await decide(pipe, chat(b'{"messages":[]}'))
    assert len(ring) == 0  # dropped at the first decision after the watch ended
    await decide(pipe, chat(b'{"messages":[]}'))
    assert len(ring) == 0


async def test_a_load_only_decision_says_why() -> None:
    pipe, r, _ = make()
    from epp_extproc.core.render import RenderError, RenderFailure

    r.fail = RenderError(RenderFailure.TIMEOUT, "slow")
    ring = pipe.assembled.decisions
    ring.watch()
    await decide(pipe, chat(b'{"messages":[]}'))
    d = ring.document(names)["decisions"][0]
    assert d["route"] == "load" and d["load_reason"] == "render_failed"
    assert d["reason"].startswith("load only (render_failed)")


def test_a_large_pool_shows_the_cheapest_candidates_and_always_the_pick() -> None:
    import numpy as np

    from epp_extproc.core.recent_decisions import _rows

    n = 200
    addrs = [f"10.0.0.{i}:8000" for i in range(n)]
    t = CandidateTable(addrs, [])
    t.cost = np.arange(n, dtype=np.float64)
    t.overlap = np.zeros(n, np.int64)
    t.credited = np.zeros(n, np.float64)
    t.prompt_blocks = np.zeros(n, np.float64)
    rows = _rows(t, 150, lambda a: None)
    assert len(rows) == TOP_CANDIDATES
    assert [r["address"] for r in rows[:-1]] == addrs[:TOP_CANDIDATES - 1]
    assert rows[-1]["address"] == addrs[150] and rows[-1]["chosen"]
