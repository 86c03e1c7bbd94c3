"""The configuration in sections (`config.sections`): each option in exactly one, carrying what its flag or env
set, frozen, and built alone from defaults."""

from __future__ import annotations

import dataclasses

import pytest

from epp_extproc.config import (
    GROUPS,
    OPTIONS,
    SECTION_CLASSES,
    SECTIONS,
    Config,
    KvSection,
    RendererSection,
    Sections,
    TokenizerProtocol,
    load_config,
)


def test_every_config_field_belongs_to_exactly_one_section() -> None:
    placed = [f.name for cls in SECTION_CLASSES.values() for f in dataclasses.fields(cls)]
    assert sorted(placed) == sorted(f.name for f in dataclasses.fields(Config))
    assert len(placed) == len(set(placed))


def test_the_sections_and_the_help_groups_come_from_one_table() -> None:
    assert [f.name for f in dataclasses.fields(Sections)] == [name for name, _ in SECTIONS] == list(SECTION_CLASSES)
    for name, groups in SECTIONS:
        assert [f.name for f in dataclasses.fields(SECTION_CLASSES[name])] == [d for _, ds in groups for d in ds]
    assert GROUPS == tuple(g for _, groups in SECTIONS for g in groups)


def test_a_section_field_has_its_options_type_and_default() -> None:
    by_dest = {o.dest: o for o in OPTIONS}
    config_types = {f.name: f.type for f in dataclasses.fields(Config)}
    for cls in SECTION_CLASSES.values():
        for f in dataclasses.fields(cls):
            assert f.default == by_dest[f.name].default and f.type == config_types[f.name]


@pytest.mark.parametrize("argv, env, section, dest, value", [
    (["--kv-ingest-shards", "4"], {}, "kv", "kv_ingest_shards", 4),
    ([], {"DYN_KV_CACHE_BLOCK_SIZE": "16"}, "kv", "kv_cache_block_size", 16),
    (["--router-temperature", "0.5"], {}, "scheduling", "router_temperature", 0.5),
    ([], {"DYN_EPP_FLOW_CONTROL_QUEUE_TTL_S": "12"}, "flow_control", "flow_control_queue_ttl_s", 12.0),
    (["--peers", "a:1"], {}, "replicas", "peers", "a:1"),
    ([], {"DYN_EPP_GRPC_PORT": "9100"}, "serving", "grpc_port", 9100),
    (["--endpoints", "w0=127.0.0.1:8001"], {}, "discovery", "endpoints", "w0=127.0.0.1:8001"),
    ([], {"DYN_EPP_WORKER_METRICS_PATH": "/m"}, "worker_metrics", "worker_metrics_path", "/m"),
    (["--model-rewrite-session-header", "x-conv"], {}, "rewrites", "model_rewrite_session_header", "x-conv"),
])
def test_a_section_carries_the_value_its_flag_or_env_set(argv: list[str], env: dict[str, str], section: str,
                                                          dest: str, value: object) -> None:
    assert getattr(getattr(load_config(argv, env=env).sections, section), dest) == value


def test_a_section_is_a_frozen_copy_of_the_config_now() -> None:
    cfg = Config(kv_ingest_shards=2)
    kv = cfg.sections.kv
    cfg.kv_ingest_shards = 5
    assert kv.kv_ingest_shards == 2 and cfg.sections.kv.kv_ingest_shards == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        kv.kv_ingest_shards = 3  # type: ignore[misc]


def test_a_section_built_alone_takes_plain_strings_for_enums_as_config_does() -> None:
    assert RendererSection(tokenizer_protocol="vllm-render").tokenizer_protocol is TokenizerProtocol.VLLM
    with pytest.raises(ValueError, match="--tokenizer-protocol"):
        RendererSection(tokenizer_protocol="nope")
    assert KvSection(kv_ingest="apart") == Config(kv_ingest="apart").sections.kv


def test_sections_answer_what_config_answers_about_their_values() -> None:
    cfg = Config(peers="a:1, b:2", router_host_cache_hit_weight=0.5, allowed_body_modes="buffered")
    s = cfg.sections
    assert s.replicas.peer_list() == cfg.peer_list() == ["a:1", "b:2"]
    assert s.replicas.sync_enabled() and s.scheduling.tiered_credit_enabled() and cfg.tiered_credit_enabled()
    assert s.serving.body_modes() == cfg.body_modes() == ("BUFFERED",)


def test_assemble_builds_each_components_settings_from_its_sections() -> None:
    from epp_extproc.core.assemble import settings_from
    from epp_extproc.core.director import DirectorSettings
    from epp_extproc.core.forward import ForwardSettings
    from epp_extproc.core.plan import PlanSettings

    s = Config(max_body_bytes=1000, max_buffered_body_bytes=1000, kv_cache_block_size=16, media_credit="text-prefix",
               prompt_passthrough="off").sections
    assert settings_from(DirectorSettings, s.serving, s.kv) == DirectorSettings(1000, 16)
    assert settings_from(ForwardSettings, s.renderer, s.serving) == ForwardSettings("off", 1000)
    assert settings_from(PlanSettings, s.renderer).media_credit == "text-prefix"
    with pytest.raises(TypeError, match="DirectorSettings.kv_cache_block_size"):
        settings_from(DirectorSettings, s.serving)
