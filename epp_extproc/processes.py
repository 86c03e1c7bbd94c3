"""`--processes N`: N picker processes on one host acting as one picker, so every core routes.

One Python process routes on one core. The supervisor (this process, which serves nothing itself) spawns N
children. All of them bind the same ext_proc port with SO_REUSEPORT, so the kernel spreads the gateway's
connections over them (the gateway must open several: Envoy does one per worker thread, or rotate them
with max_requests_per_connection). They share bookings and predictions through the replica-sync service
over Unix sockets in a private directory, exactly as replicas on different hosts do over TCP. Process 0
serves health and /metrics on the configured ports; process i serves its own /metrics on metrics-port + i
(its health port is ephemeral). A child that dies is restarted after the house's backoff (1 s doubling to
60 s, half-jittered; a child that stayed up `STABLE_S` starts over at 1 s); after `MAX_CONSECUTIVE_CRASHES`
crashes in a row of one child the supervisor gives up: it stops every child and exits 1, so a crash loop
(a bad flag, a port taken) surfaces to the process manager instead of spinning. SIGTERM/SIGINT is passed on
to every child, which drains, and the supervisor waits for them.

With `--kv-ingest apart` the supervisor also runs the KV ingest shards (epp_extproc/ingest), once for all
children, in the same private directory: N children share one index instead of building N copies, and see
each other's predictions there. It restarts a dead shard on the ingest's own, shorter backoff (the children
route by load meanwhile), and stops the shards after the children.
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
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from epp_extproc.config import Config, ProcessSlot
from epp_extproc.ingest.setup import ingest_group
from epp_extproc.runner import run_child
from kvindex.backoff import Backoff

log = logging.getLogger(__name__)

RESTART_INITIAL_S = 1.0
RESTART_MAX_S = 60.0
STABLE_S = 60.0  # a child up this long before it died was not crash-looping: its backoff starts over
MAX_CONSECUTIVE_CRASHES = 10  # 9 restarts, ~2-4 min of waits (nominal 243 s, half-jittered); then exit 1
POLL_S = 0.2


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
        ingest_dir = sock_dir if cfg.kv_ingest == "apart" else None
        out.append((child, ProcessSlot(index=i, sync_listen=(socks[i],), share_port=True, ingest_dir=ingest_dir)))
    return out


def supervise(cfg: Config, target: Callable[[Config, ProcessSlot], None] = run_child,
              backoff: Callable[[], Backoff] = lambda: Backoff(RESTART_INITIAL_S, RESTART_MAX_S),
              max_crashes: int = MAX_CONSECUTIVE_CRASHES, stable_s: float = STABLE_S) -> int:
    """Run the children until SIGTERM/SIGINT (returns 0) or until one crashed `max_crashes` times in a row
    (returns 1). `target`, `backoff`, `max_crashes`, `stable_s` are seams for tests; `target` must be a
    module-level function (the spawn context pickles it by name)."""
    ctx = multiprocessing.get_context("spawn")  # a clean interpreter each: no forked event loop or gRPC state
    sock_dir = tempfile.mkdtemp(prefix="epp-replicas-")
    configs = child_configs(cfg, sock_dir)
    n = len(configs)
    children: list[BaseProcess | None] = [None] * n
    started = [0.0] * n
    restart_at: list[float | None] = [None] * n  # when a dead child is due to be spawned again
    backoffs = [backoff() for _ in range(n)]
    stopping = False
    code = 0
    # passed on to the children: SIGTERM runs their shutdown grace period, SIGINT (Ctrl-C) skips it
    forward = signal.SIGTERM

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping, forward
        stopping, forward = True, signal.Signals(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def spawn(i: int) -> None:
        p = ctx.Process(target=target, args=configs[i], name=f"epp-extproc-p{i}", daemon=False)
        p.start()
        children[i] = p
        started[i] = time.monotonic()
        restart_at[i] = None

    ingest = ingest_group(cfg.sections.kv, sock_dir, log_level=cfg.log_level) if cfg.kv_ingest == "apart" else None
    log.info("starting %d picker processes sharing ext_proc port %d (sync over %s)", n, cfg.grpc_port,
             sock_dir)
    try:
        if ingest is not None:
            ingest.start()
        for i in range(n):
            spawn(i)
        while not stopping:
            time.sleep(POLL_S)  # never a long sleep: a signal must stop the group within one poll
            if ingest is not None:
                ingest.poll()
            now = time.monotonic()
            for i, p in enumerate(children):
                if stopping:
                    break
                if restart_at[i] is not None:
                    if now >= restart_at[i]:  # type: ignore[operator]
                        spawn(i)
                    continue
                if p is None or p.is_alive():
                    continue
                if now - started[i] >= stable_s:
                    backoffs[i].succeeded()
                delay = backoffs[i].failed()
                if backoffs[i].failures >= max_crashes:
                    log.error("picker process %d exited with %s, %d times in a row; giving up: stopping "
                              "every process", i, p.exitcode, backoffs[i].failures)
                    stopping, code, forward = True, 1, signal.SIGINT  # nothing to hand over: no grace period
                    break
                log.error("picker process %d exited with %s (%d in a row); restarting it in %.1fs", i,
                          p.exitcode, backoffs[i].failures, delay)
                restart_at[i] = now + delay
    finally:
        for p in children:
            if p is not None and p.is_alive() and p.pid is not None:
                os.kill(p.pid, forward)
        deadline = time.monotonic() + cfg.graceful_shutdown_grace_period_s + cfg.drain_timeout_s + 5
        for p in children:
            if p is not None:
                p.join(max(deadline - time.monotonic(), 0.1))
                if p.is_alive():
                    log.error("picker process %s did not drain in time; killing it", p.name)
                    p.kill()
                    p.join(5)
        if ingest is not None:
            ingest.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
    return code
