"""`--config-file` at start-up, as users run it (a subprocess): a file that does not compile, or names a plugin
the settings cannot build, stops the picker with one line naming the flag and the entry; a good file's report
(what mapped, what was ignored) is logged, and the picker then decides with the file's profiles."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from epp_extproc.app import PickerApp
from epp_extproc.cli import load
from epp_extproc.config import load_config
from epp_extproc.core.endpoints import Endpoint
from epp_extproc.core.request import RequestContext
from tests.unit.test_startup_errors import FREE_PORTS, epp, one_line_error

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "epp_config"


def test_a_file_that_does_not_compile_is_one_line_naming_the_flag_and_the_entry(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
                   "plugins:\n- type: no-such-scorer\n  name: mine\n")
    msg = one_line_error(epp("--config-file", str(bad), *FREE_PORTS))
    assert msg.startswith("epp-extproc: --config-file:") and "mine" in msg and "no-such-scorer" in msg


def test_a_plugin_the_settings_cannot_build_stops_start_up_with_one_line(tmp_path: Path) -> None:
    # the eviction scorer reads the in-process index's removals: a load-only picker has none
    f = tmp_path / "eviction.yaml"
    f.write_text("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
                 "- type: decode-filter\n- type: kv-block-cost-scorer\n- type: eviction-scorer\n"
                 "- type: min-cost-picker\n")
    msg = one_line_error(epp("--config-file", str(f), "--endpoints", "w0=127.0.0.1:9", *FREE_PORTS))
    assert msg.startswith("epp-extproc: --config-file:") and "eviction-scorer" in msg


def test_the_file_s_settings_replace_the_flags(tmp_path: Path) -> None:
    # llm-d's precise prefix-cache sample sets the block size through its producer
    cfg = load(["--config-file", str(FIXTURES / "epp-precise-prefix-cache-config.yaml")], env={})
    assert cfg.kv_cache_block_size == 64


async def test_the_report_is_logged_and_the_file_s_profile_decides(caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config(["--config-file", str(FIXTURES / "epp-precise-prefix-cache-config.yaml"),
                       "--endpoints", "w0=127.0.0.1:9,w1=127.0.0.1:10"], env={})
    with caplog.at_level(logging.INFO, logger="epp_extproc.app"):
        app = PickerApp(cfg)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("scheduling: single-profile-handler") for line in lines)
    assert any("ignored" in line for line in lines) and any("warning" in line for line in lines)
    app.registry.replace([Endpoint("w0", "127.0.0.1:9"), Endpoint("w1", "127.0.0.1:10")])
    p = await app.director.propose(RequestContext("POST", "/v1/chat/completions", {}, b'{"messages":[]}'))
    assert p.address in {"127.0.0.1:9", "127.0.0.1:10"}
    assert [f.name for f in app.director.scheduler.primary.filters] == ["decode-filter", "subset-filter"]
    await asyncio.sleep(0)


async def test_debug_score_names_the_handler_and_plugins_that_decided() -> None:
    cfg = load_config(["--config-file", str(FIXTURES / "pd-epp-config.yaml"),
                       "--endpoints", "w0=127.0.0.1:9"], env={})
    app = PickerApp(cfg)
    app.registry.replace([Endpoint("w0", "127.0.0.1:9")])
    doc = await app.debug_score({"messages": [{"role": "user", "content": "hi"}]})
    # the file's own entry names, with our type beside a name that differs from it
    assert doc["scheduling"]["handler"].endswith("(pd-profile-handler)")
    assert doc["scheduling"]["profiles"]["prefill"]["filters"] == ["prefill-filter", "subset-filter"]
    assert doc["scheduling"]["profiles"]["decode"]["picker"] == "max-score-picker (min-cost-picker)"
