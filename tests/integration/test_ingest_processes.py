"""`epp-extproc --processes 2 --kv-ingest apart` behind a real Envoy, real mock workers publishing real KV events:
the supervisor runs one ingest shard for both children, both children route through it, and SIGTERM stops
the shard with the group."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.integration.test_replicas_processes import chat, metric, process_group
from tests.waiting import until


def ingest_children(pid: int) -> list[int]:
    """Pids of `python -m epp_extproc.ingest` processes whose parent is `pid`."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == pid and b"epp_extproc.ingest" in cmd:
            out.append(int(d))
    return out


@pytest.fixture(scope="module")
def group() -> Any:
    yield from process_group("--kv-ingest", "apart")


def test_one_ingest_shard_serves_both_processes(group) -> None:  # noqa: ANN001
    _, proc, envoy, metrics_port = group
    assert len(ingest_children(proc.pid)) == 1  # the supervisor's, not one per child
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda i: chat(envoy.url, i), range(40)))
    assert statuses == [200] * 40
    looked = [metric(metrics_port + i, 'epp_kv_ingest_lookups_total{result="ok"}') for i in range(2)]
    assert min(looked) > 0, f"lookups answered by the shard, per process: {looked}"


def test_sigterm_stops_the_ingest_shard_with_the_group(group) -> None:  # noqa: ANN001
    _, proc, _, _ = group
    shard = ingest_children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    until(lambda: not os.path.exists(f"/proc/{shard[0]}") or b"Z" in open(f"/proc/{shard[0]}/stat", "rb").read()[:64],
          "the ingest shard to exit", timeout=10)
