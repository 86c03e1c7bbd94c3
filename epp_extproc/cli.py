"""`epp-extproc`: run the picker until SIGINT/SIGTERM; `epp-extproc envoy-config`: print an Envoy config for it."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence

from epp_extproc.app import PickerApp
from epp_extproc.config import Config, load_config

SUBCOMMANDS = ("envoy-config",)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "envoy-config":
        from epp_extproc.dev.envoy_config import main as envoy_config_main

        return envoy_config_main(args[1:])
    cfg = load_config(args)
    setup_logging(cfg.log_level, cfg.log_format)
    return asyncio.run(serve(cfg))


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
    logging.getLogger("epp_extproc").info("shutting down")
    await app.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
