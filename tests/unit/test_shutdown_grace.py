"""The shutdown grace period's rules (runner.shutdown_grace_period): SIGTERM announces NOT_SERVING and waits
the period; SIGINT (Ctrl-C) and a period of 0 skip it; a second signal cuts it short."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Sequence
from typing import Any

import pytest

from epp_extproc.config import load_config
from epp_extproc.runner import shutdown_grace_period


class FakeApp:
    def __init__(self) -> None:
        self.announced_at: float | None = None

    async def announce_shutdown(self) -> None:
        self.announced_at = time.monotonic()


def _run(first: int, period_s: float, later: Sequence[tuple[float, int]] = ()) -> tuple[FakeApp, float]:
    async def main() -> tuple[FakeApp, float]:
        app = FakeApp()
        signals: asyncio.Queue[int] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for after, sig in later:
            loop.call_later(after, signals.put_nowait, sig)
        t0 = time.monotonic()
        await shutdown_grace_period(app, first, period_s, signals)  # type: ignore[arg-type]
        return app, time.monotonic() - t0
    return asyncio.run(main())


def test_sigterm_announces_at_once_and_waits_the_period() -> None:
    app, took = _run(signal.SIGTERM, 0.3)
    assert app.announced_at is not None
    assert 0.28 <= took < 1.0


@pytest.mark.parametrize(("first", "period_s"), [(signal.SIGINT, 30.0), (signal.SIGTERM, 0.0)])
def test_ctrl_c_or_a_zero_period_skips_it(first: int, period_s: float) -> None:
    app, took = _run(first, period_s)
    assert app.announced_at is None and took < 0.1


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_cuts_it_short(second: int) -> None:
    app, took = _run(signal.SIGTERM, 30.0, [(0.1, second)])
    assert app.announced_at is not None and 0.09 <= took < 1.0


def test_the_setting_defaults_to_five_seconds_and_refuses_negatives() -> None:
    env: dict[str, Any] = {}
    assert load_config([], env).graceful_shutdown_grace_period_s == 5.0
    assert load_config([], {"DYN_EPP_GRACEFUL_SHUTDOWN_GRACE_PERIOD_S": "0"}).graceful_shutdown_grace_period_s == 0
    with pytest.raises(SystemExit, match="graceful-shutdown-grace-period-s"):
        load_config(["--graceful-shutdown-grace-period-s", "-1"], env)
