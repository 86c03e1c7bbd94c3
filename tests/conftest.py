"""Suite-wide switches.

`EPP_TEST_EXTPROC_TRANSPORT=grpcio` runs the tests on the other ext_proc server (`make test` runs the files
marked `transport` that way after the main run; `make test-transports` runs every integration test that way):
pickers the tests start in-process get that transport unless a test chose one itself, and picker processes
inherit it through DYN_EPP_EXTPROC_TRANSPORT.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator, Iterator

import pytest
import zmq.asyncio

TRANSPORT = os.environ.get("EPP_TEST_EXTPROC_TRANSPORT") or None
if TRANSPORT:
    os.environ["DYN_EPP_EXTPROC_TRANSPORT"] = TRANSPORT


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "transport: also run on --extproc-transport grpcio by `make test`")
    config.addinivalue_line("markers", "slow: a benchmark's smoke run or a CPU measurement (over 15 s each): "
                            "`make test-slow`, not `make test`")


@pytest.fixture(autouse=True)
def _extproc_transport(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if TRANSPORT is None:
        yield
        return
    from epp_extproc.app import PickerApp
    from epp_extproc.config import Config

    default = Config().extproc_transport
    original = PickerApp.__init__

    def init(self: PickerApp, config: Config, *args: object, **kwargs: object) -> None:
        if config.extproc_transport == default:  # a test that chose its transport keeps it
            config = dataclasses.replace(config, extproc_transport=TRANSPORT)
        original(self, config, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(PickerApp, "__init__", init)
    yield


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """A ZeroMQ context for the tests that run real publishers and subscribers (the kv-events suites)."""
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)  # a socket a failed test left open must not hang the whole run in term()
