"""The shared process harness (`epp_extproc.dev.procs`): a Proc stops exactly the tree it started, escalates
to SIGKILL when its process ignores SIGTERM, reports a failed start with its log, and is never run twice."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from epp_extproc.dev import procs
from epp_extproc.dev.procs import Proc, free_port
from tests.waiting import until

# a server on the given port that also leaves a child (sleeping) in its process group, and ignores SIGTERM
# when asked to
SERVER = """
import signal, socket, subprocess, sys, time
if sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child", child.pid, flush=True)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
time.sleep(600)
"""


def server(tmp_path: Path, mode: str = "normal") -> Proc:
    port = free_port()
    return Proc("server", [sys.executable, "-c", SERVER, str(port), mode], port, tmp_path / "server.log")


def child_pid(p: Proc) -> int:
    until(lambda: re.search(r"^child \d+$", p.log_text(), re.M), "the child's pid in the log")
    return int(re.findall(r"^child (\d+)$", p.log_text(), re.M)[-1])


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped


def test_stop_ends_the_process_and_every_child_it_started(tmp_path: Path) -> None:
    p = server(tmp_path).start(timeout=30)
    child = child_pid(p)
    p.stop()
    assert not p.alive()
    until(lambda: gone(child), "the child to be gone")


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    p = server(tmp_path, "ignore-term").start(timeout=30)
    until(lambda: re.search("^listening$", p.log_text(), re.M), "the signal handler installed")
    started = time.monotonic()
    p.stop(grace=0.5)
    assert not p.alive()
    assert p.proc is not None and p.proc.returncode == -9
    assert time.monotonic() - started < 10


def test_a_process_that_exits_during_start_up_is_reported_with_its_log(tmp_path: Path) -> None:
    p = Proc("broken", [sys.executable, "-c", "import sys; print('no config here'); sys.exit(3)"], free_port(),
             tmp_path / "broken.log")
    with pytest.raises(RuntimeError, match=r"(?s)broken did not start.*exited with 3.*no config here"):
        p.start(timeout=30)


def test_a_running_process_is_not_started_twice(tmp_path: Path) -> None:
    p = server(tmp_path).start(timeout=30)
    try:
        with pytest.raises(RuntimeError, match="already running"):
            p.start()
    finally:
        p.stop()


def test_ready_waits_for_a_line_in_the_log(tmp_path: Path) -> None:
    p = Proc("liner", [sys.executable, "-c", "import time; time.sleep(0.3); print('ready now', flush=True); "
                                             "time.sleep(600)"], None, tmp_path / "liner.log", ready_line="^ready now$")
    p.start(timeout=30)
    try:
        assert "ready now" in p.log_text()
    finally:
        p.stop()


def test_builders_give_each_part_its_ports_and_flags(tmp_path: Path) -> None:
    w = procs.mock_worker("worker-0", tmp_path, replay=True)
    assert w.argv[0] == procs.MOCK and w.extra["kv_port"] and w.extra["replay_port"]
    assert procs.endpoint_spec([w]) == (f"worker-0={w.address};kv=tcp://127.0.0.1:{w.extra['kv_port']};"
                                        f"replay=tcp://127.0.0.1:{w.extra['replay_port']}")
    pk = procs.picker(tmp_path, endpoints=procs.endpoint_spec([w]), protocol="none")
    assert pk.argv[pk.argv.index("--grpc-port") + 1] == str(pk.port)
    assert pk.ready_url == f"http://127.0.0.1:{pk.extra['metrics_port']}/metrics"
