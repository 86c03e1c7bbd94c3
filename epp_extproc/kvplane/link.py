"""One NATS connection that is always being made: the relay's and the picker's link to the plane.

Why not just ``nats.connect``: its reconnect logic only starts once a first connection succeeded, so a picker
started while NATS is down would stay without a plane for good; and the picker must know, within seconds, when
the server stopped or a partition cut it off, to fall back before its index goes stale. So the first connect
is retried here forever (with the house's backoff), the client's own reconnects take over after it, and its
pings run every ``ping_interval_s`` so that a silent partition is noticed after about two intervals.
``on_up``/``on_down`` are called on the loop for every change (the first connect and each reconnect are ups).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import nats
from nats.aio.client import Client

from kvindex.aio import cancel_and_wait
from kvindex.backoff import Backoff

log = logging.getLogger(__name__)


class _Client(Client):
    """nats-py's client with one addition: a subscription registered in ``direct`` has its messages handed to
    a plain function from the client's read loop, as they are parsed.

    Why: nats-py delivers every message through the subscription's queue to a task of its own that awaits the
    callback, so each message costs the picker's loop two more wake-ups (and a ``Msg`` and its headers
    coroutine) than the message itself; at 256 workers (~1,000 batches/s) that is a share of the picker's
    ingest CPU that direct ZeroMQ sockets do not pay. A message with headers, a reply subject or a JetStream
    subscription takes nats-py's own path. ``_process_msg`` is the parser's entry point in nats-py 2.x (checked
    by the tests, which run the plane on a real server)."""

    def __init__(self) -> None:
        super().__init__()
        self.direct: dict[int, Callable[[str, bytes], None]] = {}
        self.direct_errors = 0

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        handler = self.direct.get(sid)
        if handler is None or headers or reply:
            await super()._process_msg(sid, subject, reply, data, headers)
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        try:
            handler(subject.decode(), data)
        except Exception:  # never out of the read loop: nats-py's would stop reading (nats-py logs its cb's too)
            self.direct_errors += 1
            log.exception("NATS message handler on %r failed", subject)


class NatsLink:
    def __init__(self, servers: Sequence[str], name: str, *, on_up: Callable[[], Awaitable[None]],
                 on_down: Callable[[], None], ping_interval_s: int = 1, connect_timeout_s: float = 2.0,
                 reconnect_wait_s: float = 0.5, pending_bytes: int = 8 * 1024 * 1024, no_echo: bool = False) -> None:
        """``pending_bytes``: what the client buffers while disconnected before publishing fails (bounded:
        a publisher counts those as dropped, and the sequence gap tells the subscribers). ``no_echo``: the
        server never delivers this connection's own publishes back to it (for a publisher that also
        subscribes to its own subject and would only drop them: replica sync)."""
        self.servers = list(servers)
        self.name = name
        self.on_up = on_up
        self.on_down = on_down
        self.ping_interval_s = max(1, int(ping_interval_s))
        self.connect_timeout_s = connect_timeout_s
        self.reconnect_wait_s = reconnect_wait_s
        self.pending_bytes = pending_bytes
        self.no_echo = no_echo
        self.nc: _Client | None = None
        self.connects = 0  # first connects and reconnects
        self.disconnects = 0
        self.connect_failures = 0
        self._task: asyncio.Task[None] | None = None
        self._up_tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._first_connect(), name=f"nats-link-{self.name}")

    async def _first_connect(self) -> None:
        backoff = Backoff(0.2, 5.0)
        while True:
            nc = _Client()
            try:
                await nc.connect(
                    self.servers, name=self.name, connect_timeout=self.connect_timeout_s,
                    allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=self.reconnect_wait_s,
                    ping_interval=self.ping_interval_s, max_outstanding_pings=2, pending_size=self.pending_bytes,
                    no_echo=self.no_echo,
                    disconnected_cb=self._disconnected, reconnected_cb=self._reconnected, error_cb=self._error)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await nc.close()
                raise
            except Exception as exc:
                self.connect_failures += 1
                if self.connect_failures == 1:
                    log.warning("NATS %s unreachable (%s): retrying in the background", self.servers, exc)
                with contextlib.suppress(Exception):
                    await nc.close()
                await asyncio.sleep(backoff.failed())
                continue
            self.nc = nc
            self.connects += 1
            log.info("connected to NATS %s as %s", nc.connected_url.netloc if nc.connected_url else "?", self.name)
            await self.on_up()
            return

    async def subscribe_direct(self, subject: str, handler: Callable[[str, bytes], None], **kw: Any) -> Any:
        """Subscribe (connected) with ``handler(subject, data)`` called from the client's read loop, in order,
        for every message (see `_Client`). The few that nats-py may have parsed between the subscribe and the
        handler's registration reach it through an ordinary callback, possibly after later ones (the plane's
        sequence shows that as a gap or an old message: a dump, or nothing). Returns nats-py's subscription."""
        nc = self.nc
        assert nc is not None

        async def queued(msg: Any) -> None:
            handler(msg.subject, msg.data)

        sub = await nc.subscribe(subject, cb=queued, **kw)
        nc.direct[sub._id] = handler
        return sub

    async def _disconnected(self) -> None:
        if self._closing:
            return
        self.disconnects += 1
        log.warning("NATS link %s lost", self.name)
        self.on_down()

    async def _reconnected(self) -> None:
        self.connects += 1
        log.info("NATS link %s back", self.name)
        # not awaited inside the client's callback: on_up may wait on requests the client must read replies for
        t = asyncio.create_task(self.on_up())
        self._up_tasks.add(t)
        t.add_done_callback(self._up_tasks.discard)

    async def _error(self, exc: Exception) -> None:
        log.debug("NATS link %s: %s", self.name, exc)

    async def close(self) -> None:
        self._closing = True
        await cancel_and_wait([self._task, *self._up_tasks])
        nc, self.nc = self.nc, None
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()


__all__ = ["NatsLink", "nats"]
