"""The listening side: bind, accept (up to `max_connections`), register servicers, drain on stop.

grpc.aio.Server's shape where a caller uses it: the generated `add_*Servicer_to_server` functions register
servicers here unchanged (`add_registered_method_handlers`), then `bind`, `start`, `stop(grace)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl
import time
from collections.abc import Callable, Iterable
from typing import Any

from h2grpc import hpack_decode
from h2grpc.connection import Connection
from h2grpc.limits import DEFAULT, Limits


class _Throttled:
    """One warning line per key per `interval_s`: a flood of refused connections must not flood the log."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}  # key -> (last logged at, suppressed since)

    def warning(self, key: str, msg: str, *args: object) -> bool:
        now = time.monotonic()
        seen = self._last.get(key)
        if seen is not None and now - seen[0] < self.interval_s:
            self._last[key] = (seen[0], seen[1] + 1)
            return False
        if seen is not None and seen[1]:
            msg += " (%d similar messages suppressed in the last %.0fs)"
            args = (*args, seen[1], self.interval_s)
        if len(self._last) >= 64 and key not in self._last:
            self._last.pop(next(iter(self._last)))
        self._last[key] = (now, 0)
        self.logger.warning(msg, *args)
        return True


class H2GrpcServer:
    """grpc.aio.Server's shape where the picker uses it: register servicers, listen, start, stop(grace)."""

    def __init__(self, *, max_concurrent_rpcs: int, max_receive_message_length: int = 4 << 20,
                 max_send_message_length: int = 4 << 20,
                 max_streams_per_connection: int | None = None, keepalive_time_s: float | None = None,
                 keepalive_timeout_s: float | None = None, max_connections: int | None = None,
                 max_partial_bytes: int | None = None, held_elsewhere: Callable[[], int] | None = None,
                 limits: Limits = DEFAULT, logger: logging.Logger | None = None) -> None:
        # the keyword bounds are grpcio's names (and the picker's flags); they override `limits`
        given = {k: v for k, v in (("max_streams_per_connection", max_streams_per_connection),
                                   ("keepalive_time_s", keepalive_time_s),
                                   ("keepalive_timeout_s", keepalive_timeout_s),
                                   ("max_connections", max_connections)) if v is not None}
        self.limits = dataclasses.replace(limits, **given) if given else limits
        self.log = logger if logger is not None else logging.getLogger("h2grpc")
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.max_receive_message_length = max_receive_message_length
        self.max_send_message_length = max_send_message_length
        self.max_streams_per_connection = self.limits.max_streams_per_connection  # the server cap answers beyond
        self.keepalive_time_s = self.limits.keepalive_time_s
        self.keepalive_timeout_s = self.limits.keepalive_timeout_s
        self.max_connections = self.limits.max_connections  # more are closed as they arrive
        # bytes of messages still arriving, all calls together: past it the call that grows them ends
        self.max_partial_bytes = max_receive_message_length if max_partial_bytes is None else max_partial_bytes
        self.partial_bytes = 0
        # bytes the application still holds of messages it was given, counted against the same bound (the
        # picker's buffered bodies: a body's bytes count once, whether still arriving here or taken)
        self.held_elsewhere = held_elsewhere
        self.refused_connections = 0
        self.goaways: dict[int, int] = {}  # GOAWAY error code -> connections closed with it (not NO_ERROR)
        self.refusal_log = _Throttled(self.log)
        self.methods: dict[str, Any] = {}
        self.connections: set[Connection] = set()
        self.active = 0
        self._servers: list[asyncio.AbstractServer] = []

    def partial_room(self) -> int:
        """What messages still arriving may add before they pass `max_partial_bytes` (negative: past it)."""
        f = self.held_elsewhere
        return self.max_partial_bytes - self.partial_bytes - (0 if f is None else f())

    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        """The generated code registers each service twice; the registered form below is the one used."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        for name, h in handlers.items():
            self.methods[f"/{service}/{name}"] = h

    async def bind(self, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None,
                   reuse_port: bool = False) -> int:
        """Bind now (a taken port fails here, as grpcio's add_*_port does); serve from `start()`."""
        loop = asyncio.get_running_loop()
        h: str | None = host.strip("[]") or None
        if h in ("0.0.0.0", "::"):
            h = None  # every address of both families, as grpcio binds them
        try:
            srv = await loop.create_server(lambda: Connection(self), h, port, ssl=ssl_context,
                                           reuse_port=reuse_port or None, start_serving=False)
        except OSError as e:  # grpcio raises RuntimeError for this too
            raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
        self._servers.append(srv)
        return int(srv.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Serve. The pure-Python HPACK Huffman tables, where that path runs, are built first (15-30 ms, once per
        process): not on the first request that carries a Huffman-coded header."""
        hpack_decode.warm()
        for srv in self._servers:
            await srv.start_serving()

    async def stop(self, grace: float | None) -> None:
        """No new connections or streams; open calls get `grace` seconds, then they are cancelled."""
        for srv in self._servers:
            srv.close()
        for c in list(self.connections):
            c.start_goaway()
        deadline = time.monotonic() + (grace or 0)
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        tasks = [call.task for c in list(self.connections) for call in list(c.calls.values())
                 if call.task is not None and not call.task.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.close()
        for srv in self._servers:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await srv.wait_closed()
        self._servers.clear()
