"""Model rewrites from a file: read at start-up (a bad file stops the picker with one line naming the flag,
the file and the problem), reloaded on change, and a bad edit logged while the rules in service stay."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from epp_extproc.adapters.model_rewrites import ModelRewritesFile, read_rewrites_file, rewrites_for_pool
from epp_extproc.core.model_rewrite import RewriteError, RewriteTable
from tests.unit.test_startup_errors import FREE_PORTS, epp, one_line_error

CANARY = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModelRewrite
metadata: {name: llama-canary}
spec:
  poolRef: {name: llm-pool}
  rules:
    - matches: [{model: {type: Exact, value: llama}}]
      targets:
        - {modelRewrite: llama, weight: 90}
        - {modelRewrite: llama-ft-v2, weight: 10}
"""
ALIAS = """\
---
kind: InferenceModelRewrite
metadata: {name: alias}
spec:
  rules:
    - matches: [{model: {value: gpt-4o}}]
      targets: [{modelRewrite: llama}]
"""


def targets(table: RewriteTable, model: str) -> dict[str, int]:
    rule = table.rules.rule_for(model)
    return {t.model: t.weight for t in rule.targets} if rule else {}


def touch(path: Path, text: str, stamp: int) -> None:
    path.write_text(text)
    os.utime(path, (stamp, stamp))  # a different stamp even within one mtime tick


def test_a_yaml_file_with_several_documents_gives_every_rule_in_file_order(tmp_path: Path) -> None:
    f = tmp_path / "rewrites.yaml"
    f.write_text(CANARY + ALIAS)
    rules = read_rewrites_file(str(f))
    assert [r.resource for r in rules.rules] == ["llama-canary", "alias"]
    assert rules.rule_for("gpt-4o").targets[0].model == "llama"  # type: ignore[union-attr]


def test_a_json_file_is_read_too(tmp_path: Path) -> None:
    f = tmp_path / "rewrites.json"
    f.write_text(json.dumps({"kind": "InferenceModelRewrite", "metadata": {"name": "j"},
                             "spec": {"rules": [{"matches": [{"model": {"value": "a"}}],
                                                 "targets": [{"modelRewrite": "b", "weight": 1}]}]}}))
    assert read_rewrites_file(str(f)).rule_for("a").targets[0].model == "b"  # type: ignore[union-attr]


def test_the_file_error_names_the_file_the_resource_and_the_field(tmp_path: Path) -> None:
    f = tmp_path / "rewrites.yaml"
    f.write_text(CANARY.replace("weight: 10", "weight: -10"))
    with pytest.raises(RewriteError) as e:
        read_rewrites_file(str(f))
    assert str(f) in str(e.value) and "'llama-canary'" in str(e.value)
    assert "targets[1].weight must be an integer in [0, 1000000], got -10" in str(e.value)


def test_the_file_is_reloaded_and_a_broken_edit_is_logged_and_keeps_the_rules_in_service(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = tmp_path / "rewrites.yaml"
    touch(f, CANARY, 1)
    table = RewriteTable()
    src = ModelRewritesFile(table, str(f))
    src.load_once()
    assert targets(table, "llama") == {"llama": 90, "llama-ft-v2": 10}
    touch(f, CANARY.replace("weight: 90", "weight: 0").replace("weight: 10", "weight: 0"), 2)
    with caplog.at_level(logging.ERROR, logger="epp_extproc.adapters.model_rewrites"):
        src.load_once()
    assert targets(table, "llama") == {"llama": 90, "llama-ft-v2": 10}
    assert "keeping the 1 rules in service" in caplog.text and "sum to 0" in caplog.text
    touch(f, CANARY.replace("weight: 90", "weight: 50").replace("weight: 10", "weight: 50"), 3)
    src.load_once()
    assert targets(table, "llama") == {"llama": 50, "llama-ft-v2": 50}


def test_only_the_pools_resources_count_and_an_invalid_one_is_skipped_not_the_others() -> None:
    def crd(name: str, pool: str, created: str, target: str, weight: object = 1) -> dict:
        return {"metadata": {"name": name, "creationTimestamp": created},
                "spec": {"poolRef": {"name": pool},
                         "rules": [{"matches": [{"model": {"value": "m"}}],
                                    "targets": [{"modelRewrite": target, "weight": weight}]}]}}

    items = [crd("a-newer", "pool", "2025-02-01T00:00:00Z", "from-newer"),
             crd("b-older", "pool", "2025-01-01T00:00:00Z", "from-older"),
             crd("theirs", "other-pool", "2024-01-01T00:00:00Z", "from-theirs"),
             crd("broken", "pool", "2023-01-01T00:00:00Z", "x", weight="heavy")]
    rules, refused = rewrites_for_pool(items, "pool")
    assert [r.resource for r in rules.rules] == ["b-older", "a-newer"]
    assert rules.rule_for("m").targets[0].model == "from-older"  # type: ignore[union-attr]
    assert len(refused) == 1 and "'broken'" in refused[0]


# ------------------------------------------------------------------------------------------------ start-up
def test_an_invalid_rewrites_file_stops_start_up_with_one_line_naming_the_flag_file_and_problem(
        tmp_path: Path) -> None:
    f = tmp_path / "rewrites.yaml"
    f.write_text(CANARY.replace("modelRewrite: llama-ft-v2", "modelrewrite: llama-ft-v2"))
    msg = one_line_error(epp(*FREE_PORTS, "--model-rewrites-file", str(f)))
    assert msg.startswith("epp-extproc: --model-rewrites-file (DYN_EPP_MODEL_REWRITES_FILE): ")
    assert str(f) in msg and "unknown field(s) modelrewrite" in msg


def test_a_missing_rewrites_file_from_the_env_stops_start_up_naming_the_variable(tmp_path: Path) -> None:
    msg = one_line_error(epp(*FREE_PORTS, env={"DYN_EPP_MODEL_REWRITES_FILE": str(tmp_path / "nope.yaml")}))
    assert "DYN_EPP_MODEL_REWRITES_FILE" in msg and "nope.yaml" in msg and "No such file" in msg


def test_the_session_header_is_a_flag_and_a_dynamo_env_var_defaulting_to_x_session_id() -> None:
    from epp_extproc.config import load_config

    assert load_config([], {}).model_rewrite_session_header == "x-session-id"
    env = {"DYN_EPP_MODEL_REWRITE_SESSION_HEADER": "x-conversation"}
    assert load_config([], env).model_rewrite_session_header == "x-conversation"
    assert load_config(["--model-rewrite-session-header", "x-chat"], env).model_rewrite_session_header == "x-chat"


async def test_the_picker_splits_by_the_configured_session_header() -> None:
    from epp_extproc.app import PickerApp
    from epp_extproc.config import Config

    app = PickerApp(Config(endpoints="a=127.0.0.1:9", model_rewrite_session_header="X-Conversation"))
    assert app.director.rewriter is not None and app.director.rewriter.session_header == "x-conversation"
