"""`epp-extproc`: run the picker until SIGINT/SIGTERM (drain first), as one process or `--processes N`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Callable, Sequence

from epp_extproc.app import PickerApp
from epp_extproc.config import Config, load_config


def main(argv: Sequence[str] | None = None) -> int:
    cfg = load_config(argv)
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.processes > 1:
        from epp_extproc.processes import supervise

        return supervise(cfg)
    return asyncio.run(serve(cfg))


def run_child(cfg: Config) -> None:
    """Entry point of one `--processes` child (a spawned interpreter: no state shared with the parent)."""
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [p{cfg.process_index}] %(name)s: %(message)s")
    raise SystemExit(asyncio.run(serve(dataclasses.replace(cfg, processes=1))))


async def serve(cfg: Config, prepare: Callable[[PickerApp], None] | None = None) -> int:
    """Run one picker until SIGINT/SIGTERM; `prepare` may instrument the app before it starts (benchmarks)."""
    app = PickerApp(cfg)
    if prepare is not None:
        prepare(app)
    await app.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger("epp_extproc").info("shutting down: draining for up to %.1fs", cfg.drain_timeout_s)
    await app.stop(cfg.drain_timeout_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
