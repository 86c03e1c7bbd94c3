"""`--processes N`: N picker processes on one host acting as one picker, so every core routes.

One Python process routes on one core. The supervisor (this process, which serves nothing itself) spawns N
children. All of them bind the same ext_proc port with SO_REUSEPORT, so the kernel spreads the gateway's
connections over them (the gateway must open several: Envoy does one per worker thread, or rotate them
with max_requests_per_connection). They share bookings and predictions through the replica-sync service
over Unix sockets in a private directory, exactly as replicas on different hosts do over TCP. Process 0
serves health and /metrics on the configured ports; process i serves its own /metrics on metrics-port + i
(its health port is ephemeral). A child that dies is restarted; SIGTERM/SIGINT is passed on to every child,
which drains, and the supervisor waits for them.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from multiprocessing.process import BaseProcess

from epp_extproc.config import Config, ProcessSlot

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = 1.0


def child_configs(cfg: Config, sock_dir: str) -> list[tuple[Config, ProcessSlot]]:
    """The config of each child: its own sync socket, the siblings' sockets as peers, its own side ports."""
    n = cfg.processes
    socks = [f"unix:{os.path.join(sock_dir, f'p{i}.sock')}" for i in range(n)]
    out = []
    for i in range(n):
        # process i serves /metrics on metrics-port + i; its /debug follows a shared metrics listener, else
        # takes a free port (logged): metrics-port + 1 may well be the default admin port, and process 0's
        # /debug already shows the aggregate load
        shared = (cfg.admin_bind, cfg.admin_port) == (cfg.bind, cfg.metrics_port) and cfg.admin_port != 0
        metrics = cfg.metrics_port + i if cfg.metrics_port else 0
        side = {} if i == 0 else {"health_port": 0, "metrics_port": metrics,
                                  "admin_port": metrics if shared else 0}
        child = dataclasses.replace(cfg, processes=1, peers=",".join(s for j, s in enumerate(socks) if j != i),
                                    **side)
        out.append((child, ProcessSlot(index=i, sync_listen=(socks[i],), share_port=True)))
    return out


def supervise(cfg: Config) -> int:
    from epp_extproc.cli import run_child

    ctx = multiprocessing.get_context("spawn")  # a clean interpreter each: no forked event loop or gRPC state
    sock_dir = tempfile.mkdtemp(prefix="epp-replicas-")
    configs = child_configs(cfg, sock_dir)
    children: list[BaseProcess | None] = [None] * len(configs)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def spawn(i: int) -> None:
        p = ctx.Process(target=run_child, args=configs[i], name=f"epp-extproc-p{i}", daemon=False)
        p.start()
        children[i] = p

    log.info("starting %d picker processes sharing ext_proc port %d (sync over %s)", len(configs),
             cfg.grpc_port, sock_dir)
    try:
        for i in range(len(configs)):
            spawn(i)
        while not stopping:
            time.sleep(0.2)
            for i, p in enumerate(children):
                if p is not None and not p.is_alive() and not stopping:
                    log.error("picker process %d exited with %s; restarting it in %.0fs", i, p.exitcode,
                              RESTART_BACKOFF_S)
                    time.sleep(RESTART_BACKOFF_S)
                    spawn(i)
    finally:
        for p in children:
            if p is not None and p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + cfg.drain_timeout_s + 5
        for p in children:
            if p is not None:
                p.join(max(deadline - time.monotonic(), 0.1))
                if p.is_alive():
                    log.error("picker process %s did not drain in time; killing it", p.name)
                    p.kill()
                    p.join(5)
        shutil.rmtree(sock_dir, ignore_errors=True)
    return 0
