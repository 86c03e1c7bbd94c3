"""The sidecar's decisions without processes: which prefiller a header names, the legs' bodies (compared with
wire samples built from TensorRT-LLM's and vLLM's classes, tests/fixtures/pd/), usage, SSE."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from epp_extproc.core.endpoints import Endpoint, parse_role
from epp_extproc.pd_sidecar import trtllm, vllm
from epp_extproc.pd_sidecar.allowlist import Allowlist, parse_pool_ref
from epp_extproc.pd_sidecar.sse import answer_as_sse
from epp_extproc.pd_sidecar.target import TargetRefused, canonical, parse_allowed, prefill_target
from epp_extproc.pd_sidecar.usage import SseUsageRewriter, cached_tokens, rewrite_json

FIX = Path(__file__).parents[1] / "fixtures" / "pd"
TRT = json.loads((FIX / "trtllm_chat.json").read_text())
VLLM = json.loads((FIX / "vllm_chat.json").read_text())
ALLOWED = parse_allowed("10.0.0.1:8000,[fd00::1]:8000")


# ------------------------------------------------------------------------------------------------ target
def test_no_header_is_a_local_request():
    assert prefill_target([], ALLOWED) is None


def test_an_empty_header_is_no_header():
    assert prefill_target([""], ALLOWED) is None


def test_an_allowed_ip_port_is_the_target():
    assert prefill_target(["10.0.0.1:8000"], ALLOWED) == "10.0.0.1:8000"


def test_a_comma_separated_header_uses_its_first_entry():
    assert prefill_target(["10.0.0.1:8000, 10.0.0.2:8000"], ALLOWED) == "10.0.0.1:8000"


def test_repeated_headers_use_the_first_copy():
    assert prefill_target(["10.0.0.1:8000", "10.0.0.9:8000"], ALLOWED) == "10.0.0.1:8000"


def test_an_ipv6_literal_is_canonicalised_before_the_allow_check():
    assert prefill_target(["[fd00:0::1]:8000"], ALLOWED) == "[fd00::1]:8000"


@pytest.mark.parametrize("value", ["prefill.svc:8000", "10.0.0.1", "10.0.0.1:0", "10.0.0.1:70000",
                                   "fd00::1:8000", "10.0.0.1:80x", "http://10.0.0.1:8000", "x" * 2000])
def test_anything_but_one_ip_port_literal_is_a_502(value: str):
    with pytest.raises(TargetRefused) as e:
        prefill_target([value], ALLOWED)
    assert e.value.status == 502 and e.value.reason == "bad_header"


def test_a_literal_outside_the_allowed_list_is_a_403():
    with pytest.raises(TargetRefused) as e:
        prefill_target(["10.0.0.2:8000"], ALLOWED)
    assert e.value.status == 403 and e.value.reason == "not_allowed"


def test_an_empty_allowed_list_refuses_every_prefiller():
    with pytest.raises(TargetRefused):
        prefill_target(["10.0.0.1:8000"], parse_allowed(""))


def test_the_allowed_list_refuses_host_names():
    with pytest.raises(ValueError):
        parse_allowed("10.0.0.1:8000,prefill-0:8000")


def test_canonical_strips_leading_zeros_in_ipv6_only_as_ipaddress_does():
    assert canonical(" 10.0.0.1:8000 ") == "10.0.0.1:8000"


# ---------------------------------------------------------------------------------------------- TensorRT-LLM
def test_trtllm_context_leg_matches_the_orchestrators_request():
    body = copy.deepcopy(TRT["client_request"])
    assert trtllm.context_request(body, TRT["disagg_request_id"]) == TRT["context_request"]
    assert body == TRT["client_request"]  # the client's request is not mutated


def test_trtllm_generation_leg_matches_the_orchestrators_request():
    gen = trtllm.generation_request(TRT["client_request"], "/v1/chat/completions", TRT["context_answer"],
                                    TRT["disagg_request_id"])
    assert gen == TRT["generation_request"]


def test_trtllm_generation_leg_sends_only_disaggregated_params_fields_of_the_pinned_model():
    gen = trtllm.generation_request(TRT["client_request"], "/v1/chat/completions", TRT["context_answer"], 5)
    assert set(gen["disaggregated_params"]) <= set(TRT["disaggregated_params_fields"])
    ctx = trtllm.context_request(TRT["client_request"], 5)
    assert set(ctx["disaggregated_params"]) <= set(TRT["disaggregated_params_fields"])


def test_trtllm_completions_generation_leg_replaces_the_prompt_with_token_ids():
    body = {"model": "m", "prompt": "Hello", "max_tokens": 4}
    gen = trtllm.generation_request(body, "/v1/completions", TRT["context_answer"], 5)
    assert gen["prompt"] == TRT["context_answer"]["prompt_token_ids"] and "prompt_token_ids" not in gen


def test_trtllm_context_answer_without_handoff_is_refused():
    bad = copy.deepcopy(TRT["context_answer"])
    del bad["choices"][0]["disaggregated_params"]
    with pytest.raises(trtllm.BadContextAnswer):
        trtllm.generation_request(TRT["client_request"], "/v1/chat/completions", bad, 5)


@pytest.mark.parametrize(("finish", "final"), [("length", False), ("not_finished", False), ("stop", True),
                                               (None, True)])
def test_trtllm_a_context_answer_is_final_unless_length_or_not_finished(finish: str | None, final: bool):
    doc = copy.deepcopy(TRT["context_answer"])
    doc["choices"][0]["finish_reason"] = finish
    assert trtllm.is_final(doc) is final


def test_trtllm_a_final_context_answer_loses_its_handoff_fields():
    out = trtllm.final_answer(TRT["final_context_answer"])
    assert "disaggregated_params" not in out["choices"][0] and "prompt_token_ids" not in out
    assert out["usage"] == TRT["final_context_answer"]["usage"]


def test_trtllm_disagg_request_ids_are_positive_int64_in_the_global_range_and_distinct():
    got = {trtllm.new_disagg_request_id() for _ in range(1000)}
    assert len(got) == 1000 and all(trtllm.MIN_GLOBAL_ID <= x < 1 << 63 for x in got)


def test_trtllm_image_requests_stay_local():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert trtllm.local_reason("/v1/chat/completions", body) == "image"


def test_trtllm_text_parts_are_not_images():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
    assert trtllm.local_reason("/v1/chat/completions", body) is None


def test_trtllm_several_completion_prompts_stay_local():
    assert trtllm.local_reason("/v1/completions", {"prompt": ["a", "b"]}) == "multi_prompt"


def test_trtllm_a_clients_own_disaggregated_params_stay_local():
    body = {"messages": [], "disaggregated_params": {"request_type": "generation_only"}}
    assert trtllm.local_reason("/v1/chat/completions", body) == "client_disaggregated_params"


# ---------------------------------------------------------------------------------------------------- vLLM
def test_vllm_prefill_leg_matches_the_validated_sample():
    assert vllm.prefill_request(VLLM["client_request"]) == VLLM["prefill_request"]


def test_vllm_decode_leg_matches_the_validated_sample():
    assert vllm.decode_request(VLLM["client_request"], VLLM["prefill_answer"]) == VLLM["decode_request"]


def test_vllm_prefill_leg_overrides_a_clients_kv_transfer_params():
    body = {**VLLM["client_request"], "kv_transfer_params": {"do_remote_prefill": True}}
    assert vllm.prefill_request(body)["kv_transfer_params"]["do_remote_decode"] is True


# --------------------------------------------------------------------------------------------------- usage
def test_cached_tokens_of_null_details_is_zero():
    assert cached_tokens({"usage": {"prompt_tokens_details": None}}) == 0


def test_rewrite_json_sets_cached_tokens():
    out = json.loads(rewrite_json(json.dumps(TRT["context_answer"]).encode(), 7))
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 7


def test_rewrite_json_leaves_a_body_without_usage_as_it_was():
    raw = b'{"error":  "x"}'
    assert rewrite_json(raw, 7) == raw


def test_sse_rewriter_rewrites_a_usage_line_split_across_chunks():
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
    stream = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n' + usage + b"data: [DONE]\n\n"
    rw = SseUsageRewriter(1)
    out = b"".join(rw.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + rw.flush()
    lines = [json.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: {")]
    assert lines[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 1
    assert out.startswith(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n') and out.endswith(b"data: [DONE]\n\n")


def test_sse_rewriter_passes_lines_without_usage_byte_for_byte():
    chunk = b'data: {"choices": [ {"delta": {"content": "b"}} ]}\n\n'
    assert SseUsageRewriter(3).feed(chunk) == chunk


# ----------------------------------------------------------------------------------------------------- SSE
def test_a_final_answer_as_sse_has_role_content_usage_and_done():
    text = answer_as_sse(trtllm.final_answer(TRT["final_context_answer"]), chat=True, include_usage=True).decode()
    frames = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert frames[0]["choices"][0]["delta"]["role"] == "assistant"
    assert frames[1]["choices"][0]["finish_reason"] == "stop" and frames[-1]["usage"]["completion_tokens"] == 1
    assert all(f["object"] == "chat.completion.chunk" for f in frames) and text.endswith("data: [DONE]\n\n")


def test_a_final_answer_as_sse_omits_usage_unless_asked():
    text = answer_as_sse(trtllm.final_answer(TRT["final_context_answer"]), chat=True, include_usage=False)
    assert b'"usage"' not in text


def test_trtllm_generation_leg_can_leave_out_ctx_usage_for_older_releases():
    gen = trtllm.generation_request(TRT["client_request"], "/v1/chat/completions", TRT["context_answer"], 5,
                                    ctx_usage=False)
    assert "ctx_usage" not in gen["disaggregated_params"]


def test_cli_reads_the_allowed_prefillers_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    from epp_extproc.pd_sidecar.cli import config_from_args
    monkeypatch.setenv("DYN_PD_ALLOWED_PREFILLERS", "10.1.1.1:8000,10.1.1.2:8000")
    cfg, ns = config_from_args([])
    assert cfg.allowed_prefillers == {"10.1.1.1:8000", "10.1.1.2:8000"}
    assert (ns.host, ns.port, cfg.decode_url, cfg.engine) == ("0.0.0.0", 8000, "http://127.0.0.1:8200", "trtllm")


# ------------------------------------------------------------------------------------------- the pool allowlist
def _ep(name: str, address: str, role: str) -> Endpoint:
    return Endpoint(name=name, address=address, role=parse_role(role))


def test_pool_reference_is_name_or_namespace_slash_name():
    assert parse_pool_ref("llm-pool") == (None, "llm-pool")
    assert parse_pool_ref("llm/llm-pool") == ("llm", "llm-pool")
    for bad in ("", "/llm-pool", "llm/", "a/b/c"):
        with pytest.raises(ValueError):
            parse_pool_ref(bad)


def test_the_pool_allowlist_keeps_only_prefill_endpoints():
    al = Allowlist(from_pool=True)
    al.replace([_ep("d", "10.0.0.1:8000", "decode"), _ep("b", "10.0.0.2:8000", "both"),
                _ep("p", "10.0.0.3:8000", "prefill"), _ep("ep", "10.0.0.4:8000", "encode-prefill")])
    assert al.current == {"10.0.0.3:8000", "10.0.0.4:8000"}


def test_pool_entries_are_canonical_like_the_header_they_are_checked_against():
    al = Allowlist(from_pool=True)
    al.replace([_ep("p", "[fd00:0:0::7]:8000", "prefill")])
    assert prefill_target(["[fd00::7]:8000"], al.current) == "[fd00::7]:8000"


def test_the_pool_part_is_capped_in_the_order_discovery_gives_and_counts_the_rest():
    from epp_extproc.pd_sidecar.metrics import SidecarMetrics

    m = SidecarMetrics()
    al = Allowlist(frozenset({"10.9.9.9:1"}), cap=2, metrics=m, from_pool=True)
    al.replace([_ep(f"p{i}", f"10.0.0.{i}:8000", "prefill") for i in range(5)])
    assert al.current == {"10.9.9.9:1", "10.0.0.0:8000", "10.0.0.1:8000"}  # the static entry is not capped
    assert m.registry.get_sample_value("pd_sidecar_allowlist_over_cap") == 3


def test_without_a_pool_the_allowlist_is_the_static_list_and_ready_at_once():
    al = Allowlist(ALLOWED)
    assert al.synced and al.current == ALLOWED


def test_with_a_pool_the_allowlist_is_not_synced_until_the_first_publish():
    al = Allowlist(ALLOWED, from_pool=True)
    assert not al.synced and al.current == ALLOWED
    al.replace([])
    assert al.synced


def test_cli_reads_the_pool_options(monkeypatch: pytest.MonkeyPatch):
    from epp_extproc.pd_sidecar.cli import config_from_args

    monkeypatch.setenv("DYN_PD_INFERENCE_POOL", "llm/llm-pool")
    monkeypatch.setenv("KUBECONFIG", "/tmp/kc")
    cfg, _ = config_from_args(["--role-label", "role", "--max-allowed-prefillers", "64"])
    assert (cfg.inference_pool, cfg.role_label, cfg.kubeconfig, cfg.max_allowed_prefillers) == (
        "llm/llm-pool", "role", "/tmp/kc", 64)
    assert config_from_args([])[0].allowed_prefillers == frozenset()


@pytest.mark.parametrize("argv", [["--inference-pool", "a/b/c"], ["--max-allowed-prefillers", "0"]])
def test_cli_refuses_a_bad_pool_option_at_start(argv: list[str], capsys: pytest.CaptureFixture[str]):
    from epp_extproc.pd_sidecar.cli import main

    assert main(argv) == 2
    assert "epp-pd-sidecar:" in capsys.readouterr().err
