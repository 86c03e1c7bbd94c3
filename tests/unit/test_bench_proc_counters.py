"""bench/harness.py's process counters (bench_trace --proc-counters, issue 47): where a configuration's extra
CPU and wake-ups land, per process, read from /proc."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from bench import harness as H


@dataclass
class _P:  # what counters_of reads of a harness Proc
    name: str
    proc: subprocess.Popen[bytes] | None


def test_a_process_that_sleeps_in_many_short_waits_counts_a_voluntary_switch_for_each() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nfor _ in range(200): time.sleep(0.001)\n"
                              "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        time.sleep(1.5)
        c = H.proc_counters(child.pid)
        assert c is not None and c[1] >= 200
    finally:
        child.kill()
        child.wait()


def test_cpu_is_summed_over_every_thread_of_the_process() -> None:
    import os

    before = H.proc_counters(os.getpid())
    stop = time.monotonic() + 0.4

    def spin() -> None:
        while time.monotonic() < stop:
            pass

    t = threading.Thread(target=spin)
    t.start()
    t.join()
    after = H.proc_counters(os.getpid())
    assert before is not None and after is not None and after[0] - before[0] >= 200


def test_a_process_that_has_gone_is_left_out_and_repeated_names_stay_apart() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    a = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    b = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        got = H.counters_of([_P("picker", a), _P("picker", b), _P("old", gone), _P("never", None)])  # type: ignore[list-item]
        assert sorted(got) == ["picker", "picker#2"]
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_the_delta_is_per_process_seen_both_times_and_per_request() -> None:
    d = H.counters_delta({"nats": (100, 10, 1), "gone": (5, 5, 5)}, {"nats": (160, 410, 21), "new": (9, 9, 9)}, 200)
    assert d == {"nats": {"cpu_ms": 60, "vcsw": 400, "ivcsw": 20, "cpu_ms_per_req": 0.3, "vcsw_per_req": 2.0,
                          "ivcsw_per_req": 0.1}}
