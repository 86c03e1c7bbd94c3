"""bench/workloads.py (issue 42's suite): each workload is reproducible from its seed, has the property that
defines it, and is accepted by the trace replay exactly as the Mooncake records are."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench import bench_trace as BT
from bench import trace_workload as T
from bench import workloads as W

GENERATED = [n for n in W.WORKLOADS if n != "mooncake"]


def _ids(rows: list[dict[str, Any]]) -> Counter[int]:
    return Counter(h for r in rows for h in r["hash_ids"])


@pytest.mark.parametrize("name", list(W.WORKLOADS))
def test_a_workload_is_the_same_for_a_seed_and_differs_across_seeds(name: str) -> None:
    assert W.generate(name, 1, 120) == W.generate(name, 1, 120)
    assert W.generate(name, 1, 120) != W.generate(name, 2, 120)


@pytest.mark.parametrize("name", list(W.WORKLOADS))
def test_records_have_the_mooncake_shape_the_replay_reads(name: str) -> None:
    rows = W.generate(name, 3, 200)
    assert rows and all(set(r) == {"timestamp", "input_length", "output_length", "hash_ids"} for r in rows)
    assert all(a["timestamp"] <= b["timestamp"] for a, b in zip(rows, rows[1:], strict=False))
    for r in rows:  # as in the trace: the ids cover the prompt, the last block possibly partial
        assert (len(r["hash_ids"]) - 1) * W.BLOCK < r["input_length"] <= len(r["hash_ids"]) * W.BLOCK
        assert r["output_length"] >= 1


def test_the_replay_loader_turns_generated_records_into_prompts_whose_shared_blocks_are_shared_tokens(
        tmp_path: Path) -> None:
    plan = BT.Plan(workload="system-prompt", workload_seed=4, requests=30)
    wl = BT.workload(plan)
    assert len(wl.rows) == len(wl.prompts) == 30 and wl.working_set > 0 and wl.largest_request > 0
    s = len(wl.rows[0]["hash_ids"]) - len(set(wl.rows[0]["hash_ids"]) - set(wl.rows[1]["hash_ids"]))
    assert all(p[:s * BT.BS] == wl.prompts[0][:s * BT.BS] for p in wl.prompts)  # the prefix, token for token
    assert len({tuple(p[s * BT.BS:(s + 1) * BT.BS]) for p in wl.prompts}) == len(wl.prompts)  # then unique
    f = T.write_aiperf_input(wl.rows, plan.scale, 10.0, tmp_path / "in.jsonl")
    assert len(f.read_text().splitlines()) == 30


def test_the_trace_at_seed_0_is_the_sample_every_recording_replayed() -> None:
    assert W.generate("mooncake") == T.sample(T.load(T.find_trace()), T.TraceScale())
    assert BT.workload(BT.Plan(scale=T.TraceScale(max_requests=5))).rows == W.generate("mooncake", 0, 5)


@pytest.mark.parametrize("name", GENERATED)
def test_the_rate_only_rescales_the_schedule(name: str) -> None:
    slow, fast = W.generate(name, 5, 150, rate=5.0), W.generate(name, 5, 150, rate=20.0)
    assert T.offered_rate(slow, 1.0) == pytest.approx(5.0, rel=1e-3)
    assert T.offered_rate(fast, 1.0) == pytest.approx(20.0, rel=1e-3)
    drop = [{k: v for k, v in r.items() if k != "timestamp"} for r in slow]
    assert drop == [{k: v for k, v in r.items() if k != "timestamp"} for r in fast]


def test_system_prompt_shares_1_to_4_blocks_and_nothing_else() -> None:
    lengths = set()
    for seed in range(20):
        rows = W.generate("system-prompt", seed, 300)
        ids = _ids(rows)
        shared = [h for h, c in ids.items() if c > 1]
        assert all(ids[h] == len(rows) for h in shared)  # what is shared is shared by every request
        assert 1 <= len(shared) <= 4 and all(r["hash_ids"][:len(shared)] == shared for r in rows)
        lengths.add(len(shared))
    assert lengths == {1, 2, 3, 4}  # the seed draws the prompt's length


def test_multi_turn_re_sends_each_turn_as_the_next_ones_prefix_after_a_think_time() -> None:
    sessions = W.sessions("multi-turn", 6, 400)
    multi = [s for s in sessions if len(s) > 1]
    assert len(multi) > len(sessions) / 2
    for s in multi:
        for a, b in zip(s, s[1:], strict=False):
            assert b["hash_ids"][:len(a["hash_ids"])] == a["hash_ids"]  # the whole previous turn, then more
            assert b["input_length"] > a["input_length"] + a["output_length"]  # its answer and a new message
            assert b["timestamp"] - a["timestamp"] >= W.answer_s(a["output_length"]) * 1000  # + think time
    firsts = Counter(s[0]["hash_ids"][0] for s in sessions)
    assert max(firsts.values()) == 1  # sessions share nothing with each other
    gaps = sorted((b["timestamp"] - a["timestamp"]) / 1000 - W.answer_s(a["output_length"])
                  for s in multi for a, b in zip(s, s[1:], strict=False))
    assert 5.0 < gaps[len(gaps) // 2] < 10.0  # median think time ~7.2 s (at the reference load)


def test_rag_documents_are_2k_to_8k_tokens_and_popularity_is_zipf_shaped() -> None:
    rows = W.generate("rag", 7, 6000)
    docs = Counter(r["hash_ids"][0] for r in rows)
    assert len(docs) <= W.RAG_DOCS
    lengths = [length for length, _ in W.rag_documents(random.Random(1), W._Ids())]
    assert all(2048 <= x <= 8192 for x in lengths) and len(lengths) == W.RAG_DOCS
    ranked = [c for _, c in docs.most_common(10)]
    xs, ys = [math.log(i + 1) for i in range(10)], [math.log(c) for c in ranked]
    mx, my = sum(xs) / 10, sum(ys) / 10
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    assert -1.3 < slope < -0.7  # log frequency against log rank: Zipf with s = 1
    shared = {h for h, c in _ids(rows).items() if c > 1}
    assert all(r["hash_ids"][-1] not in shared for r in rows)  # every question is unique


def test_rag_shares_only_full_document_blocks() -> None:
    rows = W.generate("rag", 8, 500)
    by_doc: dict[int, set[int]] = {}
    for r in rows:
        by_doc.setdefault(r["hash_ids"][0], set()).add(len(r["hash_ids"]))
    ids = _ids(rows)
    for r in rows:
        shared = [h for h in r["hash_ids"] if ids[h] > 1]
        assert r["hash_ids"][:len(shared)] == shared and 4 <= len(shared) <= 16  # 2,048..8,192 tokens / 512


def test_no_reuse_shares_no_block() -> None:
    rows = W.generate("no-reuse", 9, 500)
    assert max(_ids(rows).values()) == 1
    assert W.describe(rows)["repeated_block_share"] == 0.0


def test_agents_are_few_sessions_with_long_prefixes_that_grow_slowly() -> None:
    sessions = W.sessions("agents", 10, 400)
    assert len(sessions) == W.AGENT_SESSIONS
    growth = []
    for s in sessions:
        assert s[0]["input_length"] >= W.AGENT_START_TOKENS[0]
        for a, b in zip(s, s[1:], strict=False):
            assert b["hash_ids"][:len(a["hash_ids"])] == a["hash_ids"]
            growth.append((b["input_length"] - a["input_length"]) / a["input_length"])
    growth.sort()
    assert 0 < growth[len(growth) // 2] < 0.05  # a step adds a few percent to a very long prefix
    rows = W.generate("agents", 10, 400)
    assert sum(r["input_length"] for r in rows) / len(rows) > 20000
    assert len({r["hash_ids"][0] for r in rows}) == W.AGENT_SESSIONS


def test_the_heterogeneous_pool_runs_one_worker_of_four_at_half_speed() -> None:
    assert W.WORKLOADS["hetero"].worker_speeds == (0.5, 1.0, 1.0, 1.0)
    # the same records (at the same load; its own loads are lower, the pool having 3.5 workers' speed)
    assert W.generate("hetero", 3, rate=10.0) == W.generate("multi-turn", 3, rate=10.0)
    plan = BT.Plan(worker_speeds=(0.5, 1.0, 1.0, 1.0))
    slow, full = plan.mock_args(100, plan.speed(0)), plan.mock_args(100, plan.speed(1))
    for flag in ("--step-base-ms", "--step-prefill-ms-per-token", "--step-decode-ms-per-token",
                 "--step-kv-read-ms-per-token"):
        assert float(slow[slow.index(flag) + 1]) == pytest.approx(2 * float(full[full.index(flag) + 1]), rel=1e-4)
    assert full == BT.Plan().mock_args(100)  # a full-speed worker's flags are what they always were


def test_every_workload_has_three_rising_loads_per_capacity_and_the_table_is_its_derivation() -> None:
    for name in W.WORKLOADS:
        for cap in ("ample", "75", "scarce", "h100"):
            below, at, past = W.rates(name, cap)
            assert 0 < below < at < past
    assert W.rates("mooncake", "75") == (10.0, 17.5, 25.0)  # the calibration point: the trace's loads
    assert W.rate_table() == W.RATES  # `python -m bench.workloads rates` reproduces the table


def test_a_plan_with_a_workload_judges_each_capacity_at_its_own_loads() -> None:
    plan = BT.Plan(rates_by_capacity={"75": (1.0, 2.0, 3.0)})
    assert plan.rates_for("75") == (1.0, 2.0, 3.0)
    assert plan.rates_for("scarce") == BT.Plan().rates  # no entry: the plan's loads, as before


def test_the_suite_runs_each_workload_once_and_resumes_past_those_recorded(tmp_path: Path) -> None:
    from bench import bench_suite as SU

    (tmp_path / "rag").mkdir()
    (tmp_path / "rag" / "trace.json").write_text("{}")
    assert SU.pending(tmp_path, list(W.WORKLOADS), force=False) == [n for n in W.WORKLOADS if n != "rag"]
    assert SU.pending(tmp_path, ["rag"], force=True) == ["rag"]
    cmd = SU.command("agents", tmp_path, quick=False, capacities="75,scarce", configs="c,b,e,a", repeats=5, seed=2)
    assert cmd[1:] == ["-m", "bench.bench_trace", "--workload", "agents", "--seed", "2", "--out",
                       str(tmp_path / "agents"), "--capacities", "75,scarce", "--only", "c,b,e,a", "--repeats", "5"]
    assert SU.main(["--out", str(tmp_path), "--dry-run"]) == 0 and not (tmp_path / "suite.jsonl").exists()
