"""Starting and restarting the ingest shards: a child process each, owned by the picker that needs them.

One picker process starts its shards itself (`PickerApp`, through `run`); under `--processes N` the
supervisor starts them once for all its children (`processes.supervise` calls `poll` in its loop), so N
pickers share one index. A shard that dies is restarted after a short backoff (0.2 s doubling to 10 s; a
shard up `STABLE_S` starts over): while it is down the pickers route by load (counted), and once it is back
it re-warms every worker from its replay endpoint like a fresh picker does. A shard exits by itself when the
process that started it is gone (`--parent-pid`), so a killed picker leaves no orphan.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from kvindex.backoff import Backoff

log = logging.getLogger(__name__)

LOOKUP_MODES = ("thread", "loop")  # where a shard answers lookups (`IngestShard`)
DEFAULT_LOOKUPS = "loop"
RESTART_INITIAL_S = 0.2
RESTART_MAX_S = 10.0
STABLE_S = 30.0
POLL_S = 0.2


def shard_argv(directory: str, shard: int, shards: int, *, block_size: int, max_blocks_per_worker: int,
               topic: str, worker_cpu_share: float, log_level: str = "INFO", lookups: str = DEFAULT_LOOKUPS,
               shared_stores: str | None = None, storage_block_size: int | None = None) -> list[str]:
    """The command line of shard `shard` of `shards`. `shared_stores` (`--kv-shared-stores`' spec) must be
    the picker's own: the picker and its shards place a store's workers by it (`wire.shard_of`)."""
    argv = [sys.executable, "-m", "epp_extproc.ingest", "--dir", directory, "--shard", str(shard),
            "--shards", str(shards), "--block-size", str(block_size), "--max-blocks-per-worker",
            str(max_blocks_per_worker), "--topic", topic, "--worker-cpu-share", str(worker_cpu_share),
            "--log-level", log_level, "--parent-pid", str(os.getpid()), "--lookups", lookups]
    if shared_stores:
        argv += ["--shared-stores", shared_stores]
    if storage_block_size is not None:
        argv += ["--storage-block-size", str(storage_block_size)]
    return argv


class IngestGroup:
    """The shards' processes: `start`, then `poll` often (it restarts the dead ones when due), then `stop`."""

    def __init__(self, argvs: Sequence[list[str]]) -> None:
        self.argvs = list(argvs)
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(argvs)
        self.started = [0.0] * len(argvs)
        self.restart_at: list[float | None] = [None] * len(argvs)
        self.backoffs = [Backoff(RESTART_INITIAL_S, RESTART_MAX_S) for _ in argvs]
        self.restarts = 0

    def _spawn(self, i: int) -> None:
        self.procs[i] = subprocess.Popen(self.argvs[i], stdin=subprocess.DEVNULL)
        self.started[i] = time.monotonic()
        self.restart_at[i] = None

    def start(self) -> None:
        for i in range(len(self.argvs)):
            self._spawn(i)

    def poll(self) -> None:
        """Non-blocking: notice dead shards and restart those whose backoff is over."""
        now = time.monotonic()
        for i, p in enumerate(self.procs):
            due = self.restart_at[i]
            if due is not None:
                if now >= due:
                    self.restarts += 1
                    self._spawn(i)
                continue
            if p is None or p.poll() is None:
                continue
            if now - self.started[i] >= STABLE_S:
                self.backoffs[i].succeeded()
            delay = self.backoffs[i].failed()
            log.error("kv ingest shard %d exited with %s; restarting it in %.1fs (requests route by load "
                      "until it is back)", i, p.returncode, delay)
            self.restart_at[i] = now + delay

    def alive(self) -> list[bool]:
        return [p is not None and p.poll() is None for p in self.procs]

    def pids(self) -> list[int | None]:
        return [p.pid if p is not None and p.poll() is None else None for p in self.procs]

    async def run(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(POLL_S)

    async def astop(self, timeout_s: float = 5.0) -> None:
        """`stop` without blocking the event loop: SIGTERM, poll until gone, then kill what is left."""
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(p is not None and p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.stop(0.1)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every shard, wait up to `timeout_s`, then kill what is left."""
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            if p is None:
                continue
            try:
                p.wait(max(deadline - time.monotonic(), 0.05))
            except subprocess.TimeoutExpired:
                log.error("kv ingest pid %d did not stop on SIGTERM; killing it", p.pid)
                p.kill()
                p.wait(5)
