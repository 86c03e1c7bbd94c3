"""Configuration from flags and Dynamo env names; static endpoints from a flag or a watched file."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest

from epp_extproc.adapters import discovery_static
from epp_extproc.adapters.discovery_static import EndpointSpecError, FileDiscovery, parse_flag
from epp_extproc.cli import load
from epp_extproc.config import OPTIONS, Config, load_config
from epp_extproc.core.endpoints import EndpointRegistry, split_host_port


def test_dynamo_env_names_are_read() -> None:
    cfg = load_config([], {"DYN_KV_CACHE_BLOCK_SIZE": "64", "DYN_ROUTER_TEMPERATURE": "0.5",
                           "DYN_EPP_MAX_INFLIGHT_REQUESTS": "7"})
    assert (cfg.kv_cache_block_size, cfg.router_temperature, cfg.max_inflight_requests) == (64, 0.5, 7)


def test_flag_wins_over_env() -> None:
    assert load_config(["--kv-cache-block-size", "16"], {"DYN_KV_CACHE_BLOCK_SIZE": "64"}).kv_cache_block_size == 16


def test_bad_env_value_stops_startup_naming_the_variable() -> None:
    with pytest.raises(SystemExit, match="DYN_KV_CACHE_BLOCK_SIZE"):
        load_config([], {"DYN_KV_CACHE_BLOCK_SIZE": "many"})


def test_render_protocol_needs_an_absolute_http_url() -> None:
    with pytest.raises(SystemExit, match="DYN_EPP_TOKENIZER_SERVICE_URL"):
        load_config([], {"DYN_EPP_TOKENIZER_PROTOCOL": "trtllm-render", "DYN_EPP_TOKENIZER_SERVICE_URL": "r:9"})


def test_config_defaults_match_the_option_table() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    for o in OPTIONS:
        assert defaults[o.dest] == o.default, o.flag


def test_flag_endpoints_with_derived_and_explicit_kv_addresses() -> None:
    eps = parse_flag("w0=10.0.0.1:8000, w1=10.0.0.2:8000;kv=tcp://10.0.0.2:6000;replay=tcp://10.0.0.2:6001",
                     kv_event_port=5557, replay_port=None)
    assert eps[0].kv_events == "tcp://10.0.0.1:5557" and eps[0].replay is None
    assert eps[1].kv_events == "tcp://10.0.0.2:6000" and eps[1].replay == "tcp://10.0.0.2:6001"


def test_ipv6_endpoints_are_bracketed() -> None:
    assert split_host_port("[fd00::1]:8000") == ("fd00::1", 8000)
    ep = parse_flag("[fd00::1]:8000", kv_event_port=5557, replay_port=5558)[0]
    assert ep.kv_events == "tcp://[fd00::1]:5557" and ep.replay == "tcp://[fd00::1]:5558"


@pytest.mark.parametrize("bad", ["w0=nohost", "w0=1.2.3.4:0", "1.2.3.4:99999", "w=1.2.3.4:80;zz=1"])
def test_bad_endpoint_specs_are_refused(bad: str) -> None:
    with pytest.raises(EndpointSpecError):
        parse_flag(bad, kv_event_port=5557, replay_port=None)


async def test_endpoints_file_is_reloaded_when_it_changes(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "eps.yaml"
    path.write_text("endpoints:\n  - name: a\n    address: 127.0.0.1:1\n")
    reg = EndpointRegistry()
    fd = FileDiscovery(reg, str(path), kv_event_port=5557, replay_port=None)
    await fd.load_once()
    assert [e.name for e in reg.all()] == ["a"]
    path.write_text(json.dumps({"endpoints": [{"name": "b", "address": "127.0.0.1:2"}]}))
    os.utime(path, (1, 1))  # force a different mtime even within the same clock tick
    await fd.load_once()
    assert [e.name for e in reg.all()] == ["b"]


async def test_broken_endpoints_file_keeps_the_previous_set(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "eps.yaml"
    path.write_text("- 127.0.0.1:1\n- 127.0.0.1:2\n")
    reg = EndpointRegistry()
    fd = FileDiscovery(reg, str(path), kv_event_port=5557, replay_port=None)
    await fd.load_once()
    path.write_text("endpoints: [ {address: ")
    os.utime(path, (2, 2))
    await fd.load_once()
    assert len(reg) == 2


def test_registry_tells_listeners_what_changed() -> None:
    reg = EndpointRegistry()
    seen = []
    reg.subscribe(lambda added, removed: seen.append(([e.name for e in added], [e.name for e in removed])))
    eps = parse_flag("a=127.0.0.1:1,b=127.0.0.1:2", kv_event_port=5557, replay_port=None)
    reg.replace(eps)
    reg.replace(eps[1:])
    assert seen == [(["a", "b"], []), ([], ["a"])]


def test_readme_configuration_table_is_the_one_generated_from_the_options() -> None:
    from epp_extproc.dev.readme_config import README, render

    text = README.read_text()
    assert render(text) == text, "README.md's configuration table is stale: run `make readme`"


def test_a_bad_endpoints_value_stops_start_up_with_one_line_naming_it() -> None:
    with pytest.raises(SystemExit) as e:
        load(["--endpoints", "w0=not-an-address"], env={})
    msg = str(e.value)
    assert msg.startswith("epp-extproc: --endpoints (DYN_EPP_ENDPOINTS):") and "\n" not in msg


def test_policies_are_enums_whether_given_as_flags_or_plain_strings() -> None:
    from epp_extproc.config import RenderPolicy, SaltPolicy, TokenizerProtocol

    cfg = load_config(["--render-failure-policy", "fail"], env={"DYN_EPP_CACHE_SALT_POLICY": "load-only"})
    assert cfg.render_failure_policy is RenderPolicy.FAIL and cfg.cache_salt_policy is SaltPolicy.LOAD_ONLY
    assert Config(tokenizer_protocol="vllm-render").tokenizer_protocol is TokenizerProtocol.VLLM


def test_every_config_default_comes_from_the_options_table() -> None:
    from dataclasses import fields

    defaults = {o.dest: o.default for o in OPTIONS}
    assert {f.name: f.default for f in fields(Config)} == defaults


def test_readme_documents_every_flag_and_env_name() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    missing = [o.flag for o in OPTIONS if f"`{o.flag}`" not in readme or (o.env and f"`{o.env}`" not in readme)]
    assert missing == []


def test_config_imports_nothing_from_adapters_or_envoy() -> None:
    """Validation is about values; reading files and adapter grammars belong to start-up (`cli.load`)."""
    import ast
    from pathlib import Path

    import epp_extproc.config as config

    tree = ast.parse(Path(config.__file__).read_text())
    names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert [m for m in names if m.startswith(("epp_extproc.adapters", "epp_extproc.envoy"))] == []


def _endpoints_json(n: int) -> str:
    return json.dumps({"endpoints": [{"name": f"w{i}", "address": f"127.0.{i // 250}.{1 + i % 250}:8000"}
                                     for i in range(n)]})


async def test_a_file_over_the_endpoint_cap_is_refused_naming_the_setting_that_raises_it(
        tmp_path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    """A 10,000-worker pool was refused with only "exceed the cap of 4096": no setting could raise it."""
    n = discovery_static.MAX_ENDPOINTS + 1
    path = tmp_path / "eps.json"
    path.write_text(_endpoints_json(n))
    reg = EndpointRegistry()
    with caplog.at_level(logging.ERROR):
        await FileDiscovery(reg, str(path), kv_event_port=5557, replay_port=None).load_once()
    assert len(reg) == 0
    assert f"{n} endpoints exceed the cap of {discovery_static.MAX_ENDPOINTS}" in caplog.text
    assert "--max-endpoints (DYN_EPP_MAX_ENDPOINTS)" in caplog.text
    await FileDiscovery(reg, str(path), kv_event_port=5557, replay_port=None, max_endpoints=n).load_once()
    assert len(reg) == n


async def test_a_raised_endpoint_cap_raises_the_file_byte_cap_with_it(tmp_path) -> None:  # noqa: ANN001
    n = 8000  # the verbose YAML form of 8,000 endpoints is over the default 1 MiB
    path = tmp_path / "eps.yaml"
    path.write_text("endpoints:\n" + "".join(
        f"  - name: worker-{i:05d}-of-a-pool-with-a-long-name\n    address: 127.0.{i // 250}.{1 + i % 250}:8000\n"
        f"    kv_events: tcp://127.0.{i // 250}.{1 + i % 250}:5557\n    role: decode\n" for i in range(n)))
    assert path.stat().st_size > discovery_static.MAX_FILE_BYTES
    reg = EndpointRegistry()
    await FileDiscovery(reg, str(path), kv_event_port=5557, replay_port=None, max_endpoints=n).load_once()
    assert len(reg) == n


async def test_the_picker_reads_its_endpoints_file_under_max_endpoints(tmp_path) -> None:  # noqa: ANN001
    from epp_extproc.app import PickerApp

    n = discovery_static.MAX_ENDPOINTS + 10
    path = tmp_path / "eps.json"
    path.write_text(_endpoints_json(n))
    app = PickerApp(Config(endpoints_file=str(path), max_endpoints=n, endpoint_probe_interval_ms=0))
    try:
        await app._start_discovery()
        assert len(app.registry) == n
    finally:
        for t in app._tasks:
            t.cancel()


def test_max_endpoints_defaults_to_the_discovery_cap() -> None:
    assert Config().max_endpoints == discovery_static.MAX_ENDPOINTS
    with pytest.raises(SystemExit, match="--max-endpoints"):
        load_config(["--max-endpoints", "0"])
