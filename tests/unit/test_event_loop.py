"""`--event-loop`: which loop the picker process runs on."""

from __future__ import annotations

import asyncio
import sys

import pytest

from epp_extproc.cli import run
from epp_extproc.config import load_config


async def _loop_module() -> int:
    return 1 if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else 0


def test_auto_runs_the_picker_on_uvloop_when_it_is_installed() -> None:
    pytest.importorskip("uvloop")
    assert run(_loop_module(), "auto") == 1


def test_asyncio_runs_the_picker_on_the_standard_loop() -> None:
    assert run(_loop_module(), "asyncio") == 0


def test_auto_falls_back_to_the_standard_loop_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    assert run(_loop_module(), "auto") == 0


def test_asking_for_uvloop_without_it_stops_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)
    with pytest.raises(SystemExit) as e:
        run(_loop_module(), "uvloop")
    assert "uvloop is not installed" in str(e.value)


def test_the_event_loop_is_set_by_flag_or_dynamo_style_env_and_checked() -> None:
    assert load_config([], env={}).event_loop == "auto"
    assert load_config([], env={"DYN_EPP_EVENT_LOOP": "asyncio"}).event_loop == "asyncio"
    with pytest.raises(SystemExit):
        load_config(["--event-loop", "trio"], env={})
