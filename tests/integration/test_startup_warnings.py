"""A picker that will route by load only says so at start-up, and names the flags that turn KV routing on."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from tests.netutil import free_port

ENDPOINTS = "a=127.0.0.1:9;kv=tcp://127.0.0.1:1"


async def started(**kw: Any) -> PickerApp:
    app = PickerApp(Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                           endpoints=ENDPOINTS, endpoint_probe_interval_ms=0, **kw))
    if app.kv is not None:
        app.kv.facts.ask_server_info = False
    await app.start()
    return app


def load_only_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "routed by load only" in r.getMessage()]


async def test_no_renderer_is_a_start_up_warning_naming_the_flags(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "epp_extproc")
    app = await started()
    await app.stop()
    lines = load_only_lines(caplog)
    assert len(lines) == 1
    assert "--tokenizer-protocol" in lines[0] and "--tokenizer-service-url" in lines[0]


async def test_an_unreachable_renderer_is_a_start_up_warning_naming_its_url(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "epp_extproc")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    app = await started(tokenizer_protocol="trtllm-render", tokenizer_service_url=url)
    for _ in range(100):
        if load_only_lines(caplog):
            break
        await asyncio.sleep(0.05)
    await app.stop()
    lines = load_only_lines(caplog)
    assert len(lines) == 1 and url in lines[0] and "--tokenizer-service-url" in lines[0]


async def test_a_reachable_renderer_gives_no_load_only_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "epp_extproc")
    connected = asyncio.Event()

    def accept(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        connected.set()
        w.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    app = await started(tokenizer_protocol="trtllm-render", tokenizer_service_url=f"http://127.0.0.1:{port}")
    async with asyncio.timeout(30):
        await connected.wait()  # the check ran (in the background)
    await asyncio.sleep(0.1)
    await app.stop()
    server.close()
    assert load_only_lines(caplog) == []
