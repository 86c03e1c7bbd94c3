"""Run one picker in this process: its event loop, its logging, its signals; and the entry point of a
`--processes` child.

It sits apart from `cli.py` so that the supervisor (`processes.py`) can name the child's entry point without
importing the command line that imports the supervisor: data flows cli -> processes -> runner, never back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from epp_extproc.app import PickerApp
from epp_extproc.config import Config, ProcessSlot


def run_child(cfg: Config, slot: ProcessSlot) -> None:
    """Entry point of one `--processes` child (a spawned interpreter: no state shared with the parent)."""
    setup_logging(cfg.log_level, cfg.log_format)
    for h in logging.getLogger().handlers:  # say which process wrote each line (text format)
        if type(h.formatter) is logging.Formatter:
            h.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [p{slot.index}] %(name)s: "
                                             "%(message)s"))
    raise SystemExit(run(serve(dataclasses.replace(cfg, processes=1), slot=slot), cfg.event_loop))


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
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


async def serve(cfg: Config, prepare: Callable[[PickerApp], None] | None = None,
                slot: ProcessSlot | None = None) -> int:
    """Run one picker until SIGINT/SIGTERM; `prepare` may instrument the app before it starts (benchmarks)."""
    app = PickerApp(cfg, slot)
    if prepare is not None:
        prepare(app)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before start: a SIGTERM during start-up still cleans up
        loop.add_signal_handler(sig, stop.set)
    await app.start()
    await stop.wait()
    logging.getLogger("epp_extproc").info("shutting down: draining for up to %.1fs", cfg.drain_timeout_s)
    await app.stop(cfg.drain_timeout_s)
    return 0
