"""Run a test module on both event loops the picker runs on (`--event-loop`): uvloop's transports are not
asyncio's classes, and protocol code must work on either. `from tests.loops import event_loop_policy`."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.EventLoopPolicy()
    return asyncio.DefaultEventLoopPolicy()
