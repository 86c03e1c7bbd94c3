"""One config file: llm-d EndpointPickerConfig -> SchedulingSpec (epp_extproc/core/scheduling/config_file.py).

The samples under tests/fixtures/epp_config/ are llm-d-router's own (commit in each file's header), verbatim."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp_extproc.config import Config, load_config
from epp_extproc.core.scheduling.config_file import (
    RULES,
    ConfigFileError,
    SchedulingSpec,
    load_config_file,
    parse_config,
    report_lines,
    spec_from_config,
    spec_to_yaml,
)

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures" / "epp_config"


def sample(name: str) -> SchedulingSpec:
    return load_config_file(str(FIXTURES / name))


def doc(plugins: list[dict[str, Any]], profiles: list[dict[str, Any]] | None = None, **top: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig", "plugins": plugins}
    if profiles is not None:
        d["schedulingProfiles"] = profiles
    d.update(top)
    return d


def one_profile(*refs: str | tuple[str, float], name: str = "default") -> list[dict[str, Any]]:
    out = []
    for r in refs:
        out.append({"pluginRef": r[0], "weight": r[1]} if isinstance(r, tuple) else {"pluginRef": r})
    return [{"name": name, "plugins": out}]


def chain(spec: SchedulingSpec, profile: str) -> list[str]:
    p = spec.profiles[profile]
    return [f.type for f in p.filters] + [f"{s.type}*{w:g}" for s, w in p.scorers] + [p.picker.type]


def notes(spec: SchedulingSpec, status: str) -> dict[str, str]:
    return {n.entry: n.detail for n in spec.notes if n.status == status}


def error(d: Any) -> str:
    with pytest.raises(ConfigFileError) as e:
        parse_config(d)
    return str(e.value)


# --- llm-d's samples


def test_every_fixture_names_the_llm_d_commit_it_was_copied_from() -> None:
    for f in FIXTURES.glob("*.yaml"):
        assert "github.com/llm-d/llm-d-router@" in f.read_text().splitlines()[0], f.name


def test_precise_prefix_cache_sample_compiles_to_one_block_cost_profile_with_its_block_size() -> None:
    spec = sample("epp-precise-prefix-cache-config.yaml")
    assert spec.handler.type == "single-profile-handler"
    assert chain(spec, "default") == ["decode-filter", "kv-block-cost-scorer*1", "min-cost-picker"]
    cost = spec.profiles["default"].scorers[0][0]
    assert cost.source_type == "prefix-cache-scorer,kv-cache-utilization-scorer,queue-scorer"
    assert dict(cost.parameters) == {"overlapCredit": 2.0, "prefillLoadScale": 8.0}
    assert spec.profiles["default"].picker.source_type == "max-score-picker"
    assert dict(spec.settings) == {"kv_cache_block_size": 64}
    ignored = notes(spec, "ignored")
    assert "plugins[token-producer]" in ignored and "plugins[endpoint-notification-source]" in ignored


def test_pd_sample_compiles_to_the_pd_handler_with_the_deciders_threshold() -> None:
    spec = sample("pd-epp-config.yaml")
    assert spec.handler.type == "pd-profile-handler" and spec.handler.source_type == "disagg-profile-handler"
    assert dict(spec.handler.parameters) == {"threshold": 16}
    assert chain(spec, "decode") == ["decode-filter", "kv-block-cost-scorer*1", "min-cost-picker"]
    assert chain(spec, "prefill") == ["prefill-filter", "kv-block-cost-scorer*1", "min-cost-picker"]
    assert dict(spec.settings) == {}  # the approx producer's LRU and match caps have no equivalent


def test_plain_sample_compiles_its_prefix_scorer_to_the_block_cost() -> None:
    spec = sample("epp-config.yaml")
    assert chain(spec, "default") == ["decode-filter", "kv-block-cost-scorer*1", "min-cost-picker"]


def test_estimate_sample_folds_the_load_aware_scorer_too() -> None:
    spec = sample("epp-estimate-prefix-cache-config.yaml")
    assert spec.profiles["default"].scorers[0][0].source_type == "prefix-cache-scorer,load-aware-scorer"


def test_kvcache_sample_maps_the_block_size_and_ignores_the_central_zmq_endpoint() -> None:
    spec = sample("sim-epp-kvcache-config.yaml")
    assert dict(spec.settings) == {"kv_cache_block_size": 16}
    assert "kvEventsConfig.zmqEndpoint" in " ".join(notes(spec, "ignored"))


def test_sim_pd_sample_takes_the_block_size_from_the_approx_producer() -> None:
    spec = sample("sim-pd-epp-config.yaml")
    assert spec.handler.type == "pd-profile-handler" and dict(spec.settings) == {"kv_cache_block_size": 16}


def test_deprecated_api_version_loads_with_a_warning() -> None:
    spec = sample("legacy-pd-epp-config.yaml")
    assert "deprecated" in notes(spec, "warning")["apiVersion"]
    assert spec.handler.type == "pd-profile-handler" and set(spec.profiles) == {"decode", "prefill"}


def test_legacy_pd_profile_handler_without_a_decider_takes_the_default_threshold() -> None:
    spec = sample("legacy-pd-epp-config.yaml")
    assert dict(spec.handler.parameters) == {"threshold": 16}
    assert "plugins[prefill-header-handler]" in notes(spec, "ignored")


def test_a_wrong_api_version_is_an_error() -> None:
    assert error(doc([], apiVersion="v1")).startswith("apiVersion:")


# --- errors name the entry and the field


def test_unknown_type_error_names_the_entry() -> None:
    msg = error(doc([{"type": "magic-scorer", "name": "m"}]))
    assert msg.startswith("plugins[m].type:") and "magic-scorer" in msg


def test_a_known_llm_d_type_we_lack_is_ignored_with_its_reason() -> None:
    spec = parse_config(doc([{"type": "lora-affinity-scorer"}, {"type": "queue-scorer"}],
                            one_profile(("lora-affinity-scorer", 3), "queue-scorer")))
    assert "LoRA" in notes(spec, "ignored")["plugins[lora-affinity-scorer]"]
    assert "weight 3 dropped" in notes(spec, "ignored")["schedulingProfiles[default].plugins[lora-affinity-scorer]"]
    assert chain(spec, "default") == ["kv-block-cost-scorer*1", "min-cost-picker"]


def test_bad_parameter_error_names_the_entry_and_the_field() -> None:
    msg = error(doc([{"type": "kv-block-cost-scorer", "name": "cost", "parameters": {"overlapCredit": -1}}]))
    assert msg.startswith("plugins[cost].parameters.overlapCredit:") and ">= 0" in msg and "-1" in msg


def test_unknown_parameter_of_our_type_is_an_error() -> None:
    msg = error(doc([{"type": "softmax-picker", "parameters": {"temperature": 1, "temp": 2}}]))
    assert msg.startswith("plugins[softmax-picker].parameters.temp:")


def test_unknown_parameter_of_a_mapped_llm_d_type_is_an_error_as_in_llm_d() -> None:
    assert error(doc([{"type": "queue-scorer", "parameters": {"depth": 1}}])).startswith(
        "plugins[queue-scorer].parameters.depth:")


def test_a_missing_required_parameter_is_an_error() -> None:
    assert error(doc([{"type": "softmax-picker"}])).startswith("plugins[softmax-picker].parameters.temperature:")


def test_a_plugin_without_a_type_is_an_error() -> None:
    assert error(doc([{"name": "x"}])).startswith("plugins[x].type:")


def test_a_duplicate_plugin_name_is_an_error() -> None:
    assert error(doc([{"type": "queue-scorer"}, {"type": "queue-scorer"}])).startswith("plugins[queue-scorer].name:")


def test_a_plugin_ref_to_an_undefined_plugin_names_the_profile_and_the_ref() -> None:
    msg = error(doc([{"type": "queue-scorer"}], one_profile("queue-scorer", "nope")))
    assert msg.startswith("schedulingProfiles[default].plugins[nope].pluginRef:")


def test_two_pickers_in_one_profile_is_an_error() -> None:
    msg = error(doc([{"type": "max-score-picker"}, {"type": "random-picker"}],
                    one_profile("max-score-picker", "random-picker")))
    assert msg.startswith("schedulingProfiles[default].plugins[random-picker]:") and "second picker" in msg


def test_a_non_number_weight_is_an_error() -> None:
    assert error(doc([{"type": "queue-scorer"}], one_profile(("queue-scorer", "high")))).startswith(
        "schedulingProfiles[default].plugins[queue-scorer].weight:")


def test_an_unknown_top_level_field_is_an_error() -> None:
    assert error(doc([], scheduler={})).startswith("scheduler:")


def test_an_unknown_feature_gate_is_an_error() -> None:
    assert error(doc([], featureGates=["warpDrive"])).startswith("featureGates[warpDrive]:")


def test_single_profile_handler_with_two_profiles_is_an_error() -> None:
    profiles = one_profile("max-score-picker", name="a") + one_profile("max-score-picker", name="b")
    msg = error(doc([{"type": "single-profile-handler"}, {"type": "max-score-picker"}], profiles))
    assert msg.startswith("plugins[single-profile-handler]:")


def test_pd_handler_without_a_prefill_profile_is_an_error() -> None:
    msg = error(doc([{"type": "pd-profile-handler", "parameters": {"threshold": 8}}, {"type": "decode-filter"}],
                    one_profile("decode-filter", name="decode")))
    assert msg.startswith("schedulingProfiles[prefill]:")


def test_a_file_over_one_mib_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    with pytest.raises(ConfigFileError, match="larger than"):
        load_config_file(str(big))


def test_a_load_error_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "epp.yaml"
    f.write_text(yaml.safe_dump(doc([{"type": "magic"}])))
    with pytest.raises(ConfigFileError, match=rf"^{f}: plugins\[magic\]\.type:"):
        load_config_file(str(f))


# --- mapping rules


def test_every_dropped_weight_is_named_with_its_entry_and_weight() -> None:
    spec = parse_config(doc([{"type": "prefix-cache-scorer"}, {"type": "queue-scorer", "name": "q"},
                             {"type": "kv-cache-utilization-scorer"}],
                            one_profile(("prefix-cache-scorer", 3), ("q", 2), "kv-cache-utilization-scorer")))
    warned = notes(spec, "warning")
    assert "weight 3 is dropped" in warned["schedulingProfiles[default].plugins[prefix-cache-scorer]"]
    assert "weight 2 is dropped" in warned["schedulingProfiles[default].plugins[q]"]
    assert "weight 1 (llm-d's default) is dropped" in warned[
        "schedulingProfiles[default].plugins[kv-cache-utilization-scorer]"]


def test_folded_scorers_join_the_profiles_own_block_cost_scorer_and_keep_its_parameters() -> None:
    spec = parse_config(doc([{"type": "kv-block-cost-scorer", "name": "cost", "parameters": {"overlapCredit": 1.5}},
                             {"type": "queue-scorer"}], one_profile(("cost", 2), "queue-scorer")))
    ((cost, weight),) = spec.profiles["default"].scorers
    assert (cost.name, cost.parameters["overlapCredit"], weight) == ("cost", 1.5, 2.0)
    assert cost.source_type == "kv-block-cost-scorer,queue-scorer"


def test_our_scorers_keep_their_weights() -> None:
    spec = parse_config(doc([{"type": "kv-block-cost-scorer"}, {"type": "eviction-scorer"}],
                            one_profile(("kv-block-cost-scorer", 1), ("eviction-scorer", 0.5))))
    assert chain(spec, "default") == ["kv-block-cost-scorer*1", "eviction-scorer*0.5", "min-cost-picker"]


def test_a_profile_without_a_picker_gets_the_first_picker_plugin_as_llm_d_does() -> None:
    spec = parse_config(doc([{"type": "queue-scorer"}, {"type": "random-picker"}], one_profile("queue-scorer")))
    assert spec.profiles["default"].picker.type == "random-picker"


def test_a_profile_without_any_picker_plugin_gets_min_cost_picker() -> None:
    spec = parse_config(doc([{"type": "queue-scorer"}], one_profile("queue-scorer")))
    assert spec.profiles["default"].picker.type == "min-cost-picker"


def test_no_handler_and_one_profile_means_single_profile_handler() -> None:
    spec = parse_config(doc([{"type": "queue-scorer"}], one_profile("queue-scorer", name="only")))
    assert spec.handler.type == "single-profile-handler" and set(spec.profiles) == {"only"}


def test_no_profiles_builds_one_default_profile_of_every_filter_scorer_and_picker() -> None:
    spec = parse_config(doc([{"type": "decode-filter"}, {"type": "queue-scorer"}, {"type": "random-picker"}]))
    assert chain(spec, "default") == ["decode-filter", "kv-block-cost-scorer*1", "random-picker"]


def test_disagg_handler_without_a_prefill_decider_runs_its_decode_profile_alone() -> None:
    spec = parse_config(doc([{"type": "disagg-profile-handler"}, {"type": "decode-filter"}],
                            one_profile("decode-filter", name="decode")))
    assert spec.handler.type == "single-profile-handler" and set(spec.profiles) == {"decode"}


def test_disagg_handler_with_renamed_profiles_maps_them_to_their_roles() -> None:
    plugins = [{"type": "disagg-profile-handler", "parameters": {
        "profiles": {"decode": "d", "prefill": "p"}, "deciders": {"prefill": "always-disagg-pd-decider"}}},
        {"type": "always-disagg-pd-decider"}, {"type": "decode-filter"}, {"type": "prefill-filter"}]
    profiles = one_profile("decode-filter", name="d") + one_profile("prefill-filter", name="p")
    spec = parse_config(doc(plugins, profiles))
    assert dict(spec.handler.parameters) == {"threshold": 1}
    assert chain(spec, "decode")[0] == "decode-filter" and chain(spec, "prefill")[0] == "prefill-filter"


def test_flow_control_gate_sets_flow_control_and_its_section_maps() -> None:
    spec = parse_config(doc([], featureGates=["flowControl"],
                            flowControl={"maxRequests": "1k", "defaultRequestTTL": "1m30s", "maxBytes": "1Gi"}))
    assert dict(spec.settings) == {"flow_control": True, "flow_control_max_queued_requests": 1000,
                                   "flow_control_queue_ttl_s": 90.0}
    assert "flowControl.maxBytes" in notes(spec, "ignored")


def test_flow_control_settings_without_the_gate_are_ignored_with_a_warning() -> None:
    spec = parse_config(doc([], flowControl={"maxRequests": 10}))
    assert "flow_control_max_queued_requests" not in spec.settings and "flowControl" in notes(spec, "warning")


def test_the_saturation_detectors_thresholds_map_to_settings() -> None:
    spec = parse_config(doc([{"type": "utilization-detector", "name": "sat", "parameters": {
        "queueDepthThreshold": 3, "kvCacheUtilThreshold": 0.9, "metricsStalenessThreshold": "250ms"}}],
        flowControl={"saturationDetector": {"pluginRef": "sat"}}))
    assert dict(spec.settings) == {"queue_depth_threshold": 3, "kv_cache_util_threshold": 0.9,
                                   "worker_metrics_staleness_ms": 250}


def test_precise_producer_port_topic_and_ttl_map_to_settings() -> None:
    spec = parse_config(doc([{"type": "precise-prefix-cache-producer", "parameters": {
        "tokenProcessorConfig": {"blockSizeTokens": 32},
        "kvEventsConfig": {"topicFilter": "kv@", "discoverPods": True, "podDiscoveryConfig": {"socketPort": 5556}},
        "speculativeIndexing": True, "speculativeTTL": "3s"}}]))
    assert dict(spec.settings) == {"kv_cache_block_size": 32, "kv_event_topic": "kv@", "kv_event_port": 5556,
                                   "prediction_ttl_s": 3.0}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.a}+{r.b}")
def test_each_combination_rule_is_refused_naming_both(rule: Any) -> None:
    params = {"bounded-load-picker": {"bound": 0.5}}
    plugins = [{"type": t, "parameters": params.get(t, {})} for t in (rule.a, rule.b)]
    msg = error(doc(plugins, one_profile(rule.a, rule.b)))
    assert msg.startswith("schedulingProfiles[default]:") and rule.a in msg and rule.b in msg


def test_eviction_scorer_joins_the_block_cost() -> None:
    cost = "kv-block-cost-scorer"
    spec = parse_config(doc([{"type": cost}, {"type": "eviction-scorer"}], one_profile(cost, "eviction-scorer")))
    assert [s.type for s, _ in spec.profiles["default"].scorers] == [cost, "eviction-scorer"]


def test_eviction_scorer_with_the_time_cost_is_refused_naming_both() -> None:
    cost = "predicted-time-scorer"
    with pytest.raises(ConfigFileError, match="eviction-scorer.*predicted-time-scorer|predicted-time-scorer.*eviction"):
        parse_config(doc([{"type": cost}, {"type": "eviction-scorer"}], one_profile(cost, "eviction-scorer")))


# --- today's flags, the round trip and the report


def test_defaults_compile_to_the_expected_profiles() -> None:
    spec = spec_from_config(Config())
    assert spec.handler.type == "pd-profile-handler" and dict(spec.handler.parameters) == {"threshold": 16}
    assert chain(spec, "decode") == ["decode-filter", "kv-block-cost-scorer*1", "bounded-load-picker"]
    # the prefill leg picks without the bound: it has no answer whose cache affinity the bound keeps
    assert chain(spec, "prefill") == ["prefill-filter", "kv-block-cost-scorer*1", "min-cost-picker"]
    assert dict(spec.profiles["decode"].scorers[0][0].parameters) == {"overlapCredit": 2.0, "prefillLoadScale": 8.0}
    assert dict(spec.profiles["decode"].picker.parameters) == {"bound": 0.5, "temperature": 0.0, "rule": "weighed"}


@pytest.mark.parametrize("flags", [
    {}, {"affinity_load_bound": 0.0}, {"affinity_load_bound": 0.0, "router_temperature": 0.7},
    {"affinity_load_bound": 0.25, "router_temperature": 0.3}, {"eviction_aware": True},
    {"cost_model": "time"}, {"kv_overlap_score_credit": 1.0, "prefill_load_scale": 0.5, "pd_min_uncached_tokens": 0},
    {"tiered_credit": True}, {"tiered_credit": True, "affinity_load_bound": 1.0},
], ids=str)
def test_each_flag_combination_round_trips_through_the_yaml(flags: dict[str, Any]) -> None:
    spec = spec_from_config(replace(Config(), **flags))
    assert parse_config(spec_to_yaml(spec)) == spec


def test_tier_credit_flags_give_the_bounded_picker_a_tiered_bound_unless_a_bound_is_set() -> None:
    def params(**flags: Any) -> dict[str, Any]:
        return dict(spec_from_config(replace(Config(), **flags)).profiles["decode"].picker.parameters)

    assert params(tiered_credit=True) == {"bound": 0.5, "temperature": 0.0, "rule": "weighed", "tieredBound": 2.0}
    assert "tieredBound" not in params(tiered_credit=True, affinity_load_bound=0.5)
    assert "tieredBound" not in params()


def test_a_config_file_s_tiered_bound_is_checked_like_the_bound() -> None:
    def picker(tiered: Any) -> dict[str, Any]:
        return doc([{"type": "bounded-load-picker", "parameters": {"bound": 0.5, "tieredBound": tiered}}],
                   one_profile("bounded-load-picker"))

    spec = parse_config(picker(2.0))
    assert dict(spec.profiles["default"].picker.parameters)["tieredBound"] == 2.0
    assert "tieredBound" in error(picker(-1))


def test_flag_combinations_pick_the_picker_the_flags_name() -> None:
    def picker(**flags: Any) -> str:
        return spec_from_config(replace(Config(), **flags)).profiles["decode"].picker.type

    assert picker(affinity_load_bound=0.0) == "min-cost-picker"
    assert picker(affinity_load_bound=0.0, router_temperature=0.5) == "softmax-picker"
    assert picker(cost_model="time") == "min-cost-picker"


def test_time_cost_flags_take_the_temperature_and_name_a_bound_they_ignore() -> None:
    spec = spec_from_config(replace(Config(), cost_model="time", router_temperature=0.5, affinity_load_bound=0.25))
    assert chain(spec, "decode") == ["decode-filter", "predicted-time-scorer*1", "softmax-picker"]
    assert chain(spec, "prefill") == ["prefill-filter", "kv-block-cost-scorer*1", "softmax-picker"]
    assert set(notes(spec, "warning")) == {"affinity_load_bound"}


def test_time_cost_with_the_default_bound_warns_nothing() -> None:
    spec = spec_from_config(replace(Config(), cost_model="time"))
    assert chain(spec, "decode") == ["decode-filter", "predicted-time-scorer*1", "min-cost-picker"]
    assert notes(spec, "warning") == {}


def test_settings_round_trip_through_the_yaml() -> None:
    base = spec_from_config(Config())
    settings = {"kv_cache_block_size": 16, "kv_event_port": 5556, "kv_event_topic": "kv@", "prediction_ttl_s": 1.5,
                "flow_control": True, "flow_control_max_queued_requests": 100, "flow_control_queue_ttl_s": 20.0,
                "queue_depth_threshold": 2, "kv_cache_util_threshold": 0.75, "worker_metrics_staleness_ms": 300}
    spec = replace(base, settings=settings)
    assert parse_config(spec_to_yaml(spec)) == spec


def test_the_readme_shows_the_file_the_defaults_compile_to() -> None:
    assert spec_to_yaml(spec_from_config(Config())) in (ROOT / "README.md").read_text()


def test_report_lines_show_each_profile_and_every_note() -> None:
    spec = sample("pd-epp-config.yaml")
    lines = report_lines(spec)
    assert lines[0] == "scheduling: pd-profile-handler (threshold=16) from disagg-profile-handler"
    assert "  profile decode: decode-filter -> kv-block-cost-scorer x1 -> min-cost-picker" in lines
    assert len(lines) == 1 + len(spec.profiles) + len(spec.settings) + len(spec.notes)


def test_config_file_flag_and_env_set_config_file() -> None:
    assert load_config(["--config-file", "a.yaml"], env={}).config_file == "a.yaml"
    assert load_config(["--config", "b.yaml"], env={}).config_file == "b.yaml"  # argparse's unique prefix
    assert load_config([], env={"DYN_EPP_CONFIG_FILE": "c.yaml"}).config_file == "c.yaml"


def test_the_module_imports_nothing_heavy() -> None:
    code = ("import sys, epp_extproc.core.scheduling.config_file\n"
            "heavy = [m for m in ('yaml', 'epp_extproc.core.director', 'epp_extproc.config', 'grpc', 'zmq') "
            "if m in sys.modules]\n"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_a_bad_parameter_is_an_error_even_on_a_plugin_no_profile_uses() -> None:
    msg = error(doc([{"type": "bounded-load-picker", "parameters": {"bound": 0}}, {"type": "queue-scorer"}],
                    one_profile("queue-scorer")))
    assert msg.startswith("plugins[bounded-load-picker].parameters.bound:")


def test_text_that_is_not_yaml_is_one_line_naming_where() -> None:
    msg = error("plugins: [\n")
    assert msg.startswith("not YAML (line 2, column 1):") and "\n" not in msg


def test_flow_control_values_are_checked_even_with_the_gate_off() -> None:
    assert error(doc([], flowControl={"maxRequests": "lots"})).startswith("flowControl.maxRequests:")
