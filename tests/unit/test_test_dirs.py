"""The test harness's processes leave nothing in the temp folder once stopped (a full run used to leave ~500
folders of Envoy configs and logs behind); ``EPP_TEST_KEEP_DIRS=1`` keeps them for reading a failed run."""

from __future__ import annotations

import shutil

import pytest

from epp_extproc.dev import envoy_config
from tests.harness import EnvoyProcess
from tests.netutil import free_port


def envoy() -> EnvoyProcess:
    return EnvoyProcess(envoy_config.EnvoyOptions(picker_port=free_port()))


def test_a_stopped_envoy_removes_its_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EPP_TEST_KEEP_DIRS", raising=False)
    e = envoy()
    assert e.dir.is_dir()
    e.stop()
    assert not e.dir.exists()


def test_the_folder_stays_when_asked_to_keep_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPP_TEST_KEEP_DIRS", "1")
    e = envoy()
    e.stop()
    assert e.dir.is_dir()
    shutil.rmtree(e.dir)
