"""`epp-extproc`: run the picker until SIGINT/SIGTERM (drain first), as one process or `--processes N`;
`epp-extproc envoy-config`: print an Envoy config for it; `epp-extproc conformance HOST:PORT`: check any
ext_proc picker against the endpoint-picker protocol."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence

from epp_extproc.config import Config, load_config, setting
from epp_extproc.core.scheduling.config_file import ConfigFileError
from epp_extproc.runner import ListenError, run, run_child, serve, setup_logging

__all__ = ["SUBCOMMANDS", "check_inputs", "load", "main", "run", "run_child", "serve", "setup_logging",
           "with_config_file"]  # run..: re-exports (bench)

SUBCOMMANDS = ("envoy-config", "conformance")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "envoy-config":
        from epp_extproc.dev.envoy_config import main as envoy_config_main

        return envoy_config_main(args[1:])
    if args and args[0] == "conformance":
        from epp_extproc.conformance.runner import main as conformance_main

        return conformance_main(args[1:])
    cfg = load(args)
    setup_logging(cfg.log_level, cfg.log_format)
    if cfg.processes > 1:
        from epp_extproc.processes import supervise

        return supervise(cfg)
    try:
        return run(serve(cfg), cfg.event_loop)
    except ListenError as e:  # a port in use: one line naming its flag, not a traceback
        print(f"epp-extproc: {e}", file=sys.stderr)
        return 1
    except ConfigFileError as e:  # a plugin the file names cannot be built with these settings
        print(f"epp-extproc: {setting('config_file').split(' ')[0]}: {e}", file=sys.stderr)
        return 1


def check_inputs(cfg: Config) -> None:
    """What `Config.validate` leaves to start-up: the files the settings name (certificates) and the
    endpoints spec in the static discovery's grammar. A typo must stop start-up with one line, before any
    port is bound, rather than as a traceback from inside the app."""
    from epp_extproc.adapters.discovery_static import EndpointSpecError, parse_flag
    from epp_extproc.adapters.model_rewrites import read_rewrites_file
    from epp_extproc.adapters.replica_sync import SyncTls
    from epp_extproc.adapters.session_keys import read_keys_file
    from epp_extproc.envoy.tls import cert_files

    if cfg.cert_path is not None and cfg.secure_serving:
        _named("cert_path", cert_files, cfg.cert_path)
    if cfg.replica_sync_tls_path:  # named if missing or broken
        _named("replica_sync_tls_path", SyncTls.load, cfg.replica_sync_tls_path, cfg.replica_sync_server_name)
    if cfg.model_rewrites_file and not cfg.inference_pool_name:  # read at start-up: a typo stops it here
        try:
            read_rewrites_file(cfg.model_rewrites_file)
        except OSError as e:
            raise ValueError(f"{setting('model_rewrites_file')}: cannot read {cfg.model_rewrites_file}: "
                             f"{e.strerror or e}") from None
        except ValueError as e:
            raise ValueError(f"{setting('model_rewrites_file')}: {e}") from None
    if cfg.session_affinity_keys_file:
        _named("session_affinity_keys_file", read_keys_file, cfg.session_affinity_keys_file)
    if cfg.endpoints:
        try:
            parse_flag(cfg.endpoints, kv_event_port=cfg.kv_event_port, replay_port=cfg.kv_event_replay_port)
        except EndpointSpecError as e:
            raise ValueError(f"{setting('endpoints')}: {e}; expected comma separated `name=ip:port` or "
                             "`ip:port`, numeric IPs (Envoy routes to the address as given), e.g. "
                             "w0=127.0.0.1:8001,w1=127.0.0.1:8002") from None


def _named(dest: str, check: Callable[..., object], *args: str) -> None:
    """Run a file check from another module, its message led by the flag that named the file."""
    try:
        check(*args)
    except ValueError as e:
        raise ValueError(f"{setting(dest).split(' ')[0]}: {e}") from None


def load(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """The settings the picker starts with: flags and env (`load_config`), then `check_inputs`; any fault
    exits with one line `epp-extproc: <what is wrong>`."""
    cfg = load_config(argv, env)
    try:
        check_inputs(cfg)
        cfg = with_config_file(cfg)
    except ValueError as e:
        raise SystemExit(f"epp-extproc: {e}") from None
    return cfg


def with_config_file(cfg: Config) -> Config:
    """The settings once `--config-file` is read: the file must compile (one error naming the entry), and
    what it sets that is a flag here (block size, flow control, saturation thresholds: its `settings`)
    replaces the flag's value. The scheduler itself is built from the file by the app (each process reads
    it again: a few KiB)."""
    if not cfg.config_file:
        return cfg
    from dataclasses import replace

    from epp_extproc.core.scheduling.config_file import load_config_file

    try:
        spec = load_config_file(cfg.config_file)
    except ConfigFileError as e:  # it names the file, the entry and the field
        raise ValueError(f"{setting('config_file').split(' ')[0]}: {e}") from None
    return replace(cfg, **dict(spec.settings)) if spec.settings else cfg


if __name__ == "__main__":
    raise SystemExit(main())
