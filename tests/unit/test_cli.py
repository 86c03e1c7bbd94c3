"""The `epp-extproc` command line: `--log-format json` writes one JSON object per line for log pipelines."""

from __future__ import annotations

import json
import logging

import pytest

from epp_extproc.cli import setup_logging
from epp_extproc.config import load_config


@pytest.fixture
def restore_root_logging():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_log_format_writes_one_object_per_line(capsys, restore_root_logging) -> None:
    setup_logging("INFO", "json")
    logging.getLogger("epp_extproc.test").warning("endpoint %s is down", "w0")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("epp_extproc.test").exception("failed")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2  # the traceback stays inside its record
    first, second = (json.loads(x) for x in lines)
    assert (first["level"], first["logger"], first["message"]) == ("WARNING", "epp_extproc.test",
                                                                   "endpoint w0 is down")
    assert first["time"] and "ValueError: boom" in second["exc_info"]


def test_text_log_format_is_the_default(capsys, restore_root_logging) -> None:
    cfg = load_config([], env={})
    assert cfg.log_format == "text"
    setup_logging(cfg.log_level, cfg.log_format)
    logging.getLogger("epp_extproc.test").info("hello")
    err = capsys.readouterr().err
    assert "INFO epp_extproc.test: hello" in err and not err.startswith("{")


def test_unknown_log_format_is_refused() -> None:
    with pytest.raises(SystemExit):
        load_config(["--log-format", "xml"], env={})


def test_extproc_keepalive_defaults_to_a_minute_takes_its_env_and_refuses_a_negative() -> None:
    assert load_config([], env={}).extproc_keepalive_s == 60.0
    assert load_config([], env={"DYN_EPP_EXTPROC_KEEPALIVE_S": "0"}).extproc_keepalive_s == 0.0
    with pytest.raises((SystemExit, ValueError), match="KEEPALIVE"):
        load_config(["--extproc-keepalive-s", "-1"], env={})


def test_extproc_max_connections_defaults_to_4096_and_refuses_zero() -> None:
    assert load_config([], env={}).extproc_max_connections == 4096
    with pytest.raises((SystemExit, ValueError), match="MAX_CONNECTIONS"):
        load_config([], env={"DYN_EPP_EXTPROC_MAX_CONNECTIONS": "0"})
