"""A nats-server started by a harness goes away with the harness, however the harness ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

OWNER = """
import asyncio, sys, time
from epp_extproc.dev.nats import NatsServer

async def main():
    s = NatsServer()
    await s.start()
    print(s.proc.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")  # exited, waiting to be reaped by whoever adopted it


def test_a_nats_server_dies_with_the_harness_that_was_killed() -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    server_pid = 0
    try:
        assert owner.stdout is not None
        server_pid = int(owner.stdout.readline())
        assert not _gone(server_pid)
        owner.send_signal(signal.SIGKILL)  # no `stop`, no finally: what `timeout` or the OOM killer does
        owner.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(server_pid), "the nats-server outlived the process that started it"
    finally:
        owner.kill()
        if server_pid and not _gone(server_pid):
            os.kill(server_pid, signal.SIGKILL)
