"""`epp-extproc`: run the picker until SIGINT/SIGTERM (drain first), as one process or `--processes N`;
`epp-extproc envoy-config`: print an Envoy config for it."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from epp_extproc.config import load_config
from epp_extproc.runner import run, run_child, serve, setup_logging

__all__ = ["SUBCOMMANDS", "main", "run", "run_child", "serve", "setup_logging"]  # run..: re-exports (bench)

SUBCOMMANDS = ("envoy-config",)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "envoy-config":
        from epp_extproc.dev.envoy_config import main as envoy_config_main

        return envoy_config_main(args[1:])
    cfg = load_config(args)
    setup_logging(cfg.log_level, cfg.log_format)
    if cfg.processes > 1:
        from epp_extproc.processes import supervise

        return supervise(cfg)
    return run(serve(cfg), cfg.event_loop)


if __name__ == "__main__":
    raise SystemExit(main())
