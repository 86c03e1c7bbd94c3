"""A replica sync link stops when asked, even when a cancel is swallowed on its way."""

from __future__ import annotations

import asyncio

from epp_extproc.adapters import replica_sync
from epp_extproc.adapters.replica_sync import PeerLink, ReplicaSync
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.load import LoadTracker


async def test_a_link_whose_cancel_turned_into_a_timeout_still_stops(monkeypatch) -> None:  # noqa: ANN001
    """Python 3.11's `asyncio.timeout` turns a cancel that lands as its own deadline fires into TimeoutError;
    the link then took it for a failed stream and reconnected, and `stop` waited for it forever."""
    sessions = 0

    async def session_that_swallows_the_cancel(self: PeerLink, session: object) -> None:
        nonlocal sessions
        sessions += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise TimeoutError from None  # what the race makes of the cancel

    monkeypatch.setattr(PeerLink, "_session", session_that_swallows_the_cancel)
    monkeypatch.setattr(replica_sync, "STOP_RECANCEL_S", 0.2, raising=False)
    link = PeerLink(ReplicaSync(LoadTracker(), EndpointRegistry(), replica_id="a"), "127.0.0.1:1")
    link.start()
    while sessions == 0:
        await asyncio.sleep(0.01)
    async with asyncio.timeout(10):
        await link.stop()
    await asyncio.sleep(0.3)  # a link that went on would open a new session here
    assert sessions == 1
