"""Run one picker in this process: its event loop, its logging, its signals; and the entry point of a
`--processes` child.

It sits apart from `cli.py` so that the supervisor (`processes.py`) can name the child's entry point without
importing the command line that imports the supervisor: data flows cli -> processes -> runner, never back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import re
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from epp_extproc.app import PickerApp
from epp_extproc.config import Config, ProcessSlot
from epp_extproc.heap import freeze_startup_heap, map_large_blocks

# What the three servers say when a bind fails: grpcio "Failed to bind to address 127.0.0.1:9003; ...",
# h2grpc "cannot listen on 127.0.0.1:9002: ...", aiohttp "... bind on address ('127.0.0.1', 9091): ...".
_BIND_FAILURE = re.compile(r"(?:bind to address|listen on) \[?[^\s\]]*\]?:(\d+)|bind on address \('[^']*', (\d+)")


class ListenError(Exception):
    """A port the picker was told to listen on could not be bound; the message names its flag."""


def run_child(cfg: Config, slot: ProcessSlot) -> None:
    """Entry point of one `--processes` child (a spawned interpreter: no state shared with the parent)."""
    setup_logging(cfg.log_level, cfg.log_format)
    for h in logging.getLogger().handlers:  # say which process wrote each line (text format)
        if type(h.formatter) is logging.Formatter:
            h.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [p{slot.index}] %(name)s: "
                                             "%(message)s"))
    try:
        code = run(serve(dataclasses.replace(cfg, processes=1), slot=slot), cfg.event_loop)
    except ListenError as e:
        raise SystemExit(f"epp-extproc: [p{slot.index}] {e}") from None
    raise SystemExit(code)


def run(main: Coroutine[Any, Any, int], event_loop: str) -> int:
    """Run the picker's coroutine on the chosen loop. uvloop halves the loop's own share of each gRPC
    message (the wake-ups and callbacks grpc.aio schedules); `asyncio` remains for platforms without it."""
    if event_loop in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                main.close()
                raise SystemExit("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def setup_logging(level: str, fmt: str) -> None:
    """`text` for a terminal; `json` = one object per line (time, level, logger, message, exc_info)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                                           rename_fields={"asctime": "time", "levelname": "level",
                                                          "name": "logger"}))
        from epp_extproc.tracing.logs import TraceIds

        handler.addFilter(TraceIds())  # trace_id / span_id while a request's span is current
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


async def serve(cfg: Config, prepare: Callable[[PickerApp], None] | None = None,
                slot: ProcessSlot | None = None) -> int:
    """Run one picker until SIGINT/SIGTERM; `prepare` may instrument the app before it starts (benchmarks)."""
    map_large_blocks()  # before the first body: its blocks must not raise glibc's threshold (heap.py)
    app = PickerApp(cfg, slot)
    if prepare is not None:
        prepare(app)
    signals: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before start: a SIGTERM during start-up still cleans up
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    try:
        await app.start()
    except (OSError, RuntimeError) as e:
        reason = listen_failure(cfg, e)
        if reason is None:
            raise
        raise ListenError(reason) from None
    frozen = freeze_startup_heap()
    logging.getLogger("epp_extproc").debug("start-up heap frozen: %d objects out of the collector's walks", frozen)
    first = await signals.get()
    await shutdown_grace_period(app, first, cfg.graceful_shutdown_grace_period_s, signals)
    logging.getLogger("epp_extproc").info("shutting down: draining for up to %.1fs", cfg.drain_timeout_s)
    await app.stop(cfg.drain_timeout_s)
    return 0


async def shutdown_grace_period(app: PickerApp, first: int, period_s: float, signals: asyncio.Queue[int]) -> None:
    """After a SIGTERM (an orchestrator's stop): NOT_SERVING at once, new ext_proc streams still served for
    `period_s` or until a second signal, so the gateway moves traffic to other replicas before the drain
    refuses streams. SIGINT (Ctrl-C: someone at a terminal, `make run`) skips it: nobody is waiting to
    route elsewhere, and a stop must not take seconds."""
    if first != signal.SIGTERM or period_s <= 0:
        return
    log = logging.getLogger("epp_extproc")
    log.info("shutting down: NOT_SERVING now, still serving new ext_proc streams for %.1fs (a second signal "
             "skips this), then draining", period_s)
    await app.announce_shutdown()
    try:
        async with asyncio.timeout(period_s):
            await signals.get()
        log.info("second signal: grace period cut short")
    except TimeoutError:
        pass


def listen_failure(cfg: Config, exc: BaseException) -> str | None:
    """The one line for a port that could not be bound, naming the flag that chose it; None when `exc` is
    not a bind failure. The servers' own errors name only an address (grpcio's not even why), so the port
    is matched to the flags and, for the reason, bound once more here."""
    m = _BIND_FAILURE.search(str(exc))
    if m is None:
        return None
    port = int(m.group(1) or m.group(2))
    shared = (cfg.admin_bind, cfg.admin_port) == (cfg.bind, cfg.metrics_port)  # one listener, on purpose
    ports = [("grpc_port", "--grpc-port", "DYN_EPP_GRPC_PORT", cfg.bind, cfg.grpc_port),
             ("health_port", "--health-port", "DYN_EPP_HEALTH_PORT", cfg.bind, cfg.health_port),
             ("admin_port", "--admin-port", "DYN_EPP_ADMIN_PORT", cfg.admin_bind, cfg.admin_port)]
    if not shared:
        ports.append(("metrics_port", "--metrics-port", "DYN_EPP_METRICS_PORT", cfg.bind, cfg.metrics_port))
    named = [(flag, env, host) for _, flag, env, host, p in ports if p == port]
    if not named:
        return f"cannot listen on port {port}: {exc}"
    if len(named) > 1:
        flags = " and ".join(f"{flag} ({env})" for flag, env, _ in named)
        return f"{flags} are {'both' if len(named) == 2 else 'all'} {port}: each needs its own port"
    flag, env, host = named[0]
    why = _why_unbindable(host, port)
    if why == "in use":
        return f"{flag} {port} is already in use ({env}); stop the other picker or choose another port"
    return f"{flag} {port} ({env}): cannot listen on {host}:{port}: {why}"


def _why_unbindable(host: str, port: int) -> str:
    """Bind the port once more, as the servers do (SO_REUSEADDR), to say why they could not."""
    h = host.strip("[]")
    family = socket.AF_INET6 if ":" in h else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((h or "0.0.0.0", port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return "in use"
        return e.strerror or str(e)
    return "the server refused it (it is free now: try again)"
