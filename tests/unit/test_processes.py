"""The `--processes` supervisor: a crash-looping child is restarted on the house's backoff and, past a limit
of crashes in a row, the supervisor gives up with exit status 1 instead of spinning."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from epp_extproc.config import Config, ProcessSlot
from epp_extproc.processes import supervise
from kvindex.backoff import Backoff

STARTS_ENV = "EPP_TEST_SUPERVISOR_STARTS"


def exit_at_once(cfg: Config, slot: ProcessSlot) -> None:
    """A child that crashes as soon as it starts (records each start; spawned children inherit the env)."""
    with open(os.environ[STARTS_ENV], "a") as f:
        f.write(f"{slot.index}\n")
    raise SystemExit(3)


@pytest.fixture
def starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "starts"
    path.touch()
    monkeypatch.setenv(STARTS_ENV, str(path))
    saved = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    yield path
    signal.signal(signal.SIGTERM, saved[0])
    signal.signal(signal.SIGINT, saved[1])


def fast() -> Backoff:
    return Backoff(0.01, 0.05)


def test_a_crash_looping_child_stops_the_supervisor_with_status_one(starts: Path) -> None:
    code = supervise(Config(processes=1, drain_timeout_s=1), target=exit_at_once, backoff=fast,
                     max_crashes=3, stable_s=3600)
    assert code == 1
    assert starts.read_text().split() == ["0", "0", "0"]


def test_a_child_that_stayed_up_starts_its_crash_count_over(starts: Path) -> None:
    # stable_s=0: every run counts as stable, so two crashes never reach the limit of 2; SIGTERM ends it once
    # the child has started 3 times (or after 60 s, which the start count then fails)
    done = threading.Event()

    def stop_after_three_starts() -> None:
        while not done.wait(0.05) and len(starts.read_text().split()) < 3:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    give_up = threading.Timer(60, done.set)
    give_up.start()
    watcher = threading.Thread(target=stop_after_three_starts)
    watcher.start()
    try:
        code = supervise(Config(processes=1, drain_timeout_s=1), target=exit_at_once, backoff=fast,
                         max_crashes=2, stable_s=0)
    finally:
        give_up.cancel()
        done.set()
        watcher.join()
    assert code == 0
    assert len(starts.read_text().split()) >= 3
