"""A bounded soak through the real gateway, with random faults injected while traffic flows.

Envoy + the picker + a mock renderer + two mock TensorRT-LLM workers; four client threads send a steady mix
of unary and streaming chats, unsalted and salted (x-tenant-id, with `--cache-salt-policy load-only`), over
a pool of shared prefixes. A fault thread restarts the renderer, hangs it (SIGSTOP for longer than the render
timeout: the circuit breaker must open and requests route by load), restarts a worker's KV publisher (cache
and sequence reset) or drops a worker's next KV batch, at random. None of these faults may cost a request.

Checks: every request got a complete response (goal and assertion: zero lost, zero errors), no booking or
stream is left, the picker's traced memory is flat between warm-up and the end, and the index agrees with
every worker's cache. The error rate by cause is printed. CI size is 36 s; EPP_SOAK_SECONDS=600 for longer.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import re
import signal
import threading
import time
import tracemalloc
from collections import Counter
from typing import Any

import pytest

from tests.gateway_client import request
from tests.stack import GatewayStack

SECONDS = float(os.environ.get("EPP_SOAK_SECONDS", "36"))
RATE = float(os.environ.get("EPP_SOAK_RATE", "30"))  # requests per second, all clients together
CLIENTS = 4
FAULT_EVERY_S = min(5.0, SECONDS / 9)  # every kind at least once in the CI size (4 kinds, the last by ~24 s)
WARMUP_FRACTION = 0.3
PREFIXES = [f"Soak system prompt {k}: you are a terse assistant for team {k}. " * (4 + k % 5) for k in range(12)]
FAULT_KINDS = ["renderer-restart", "renderer-hang", "publisher-restart", "drop-batch"]
HANG_S = 3.0  # longer than the render timeout (2 s): requests time out until the circuit opens
TENANTS = ["tenant-a", "tenant-b", "tenant-c"]
PICKER_FILES = ("epp_extproc", "kvindex")


def picker_bytes(snap: tracemalloc.Snapshot) -> int:
    """Bytes currently allocated by the picker's own code (its index, bookings, streams, metrics)."""
    return sum(s.size for s in snap.statistics("filename")
               if any(f"/{p}/" in s.traceback[0].filename for p in PICKER_FILES))


class CountingHandler(logging.Handler):
    """Counts the picker's log records by level without keeping them: pytest's capture keeps every record
    (and the request strings in its args) for the report, which would read as picker memory growth."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[f"{record.name} {record.levelname}"] += 1


class Soak:
    def __init__(self, stack: GatewayStack, seed: int) -> None:
        self.stack = stack
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.outcomes: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.sent = 0
        self.stop = threading.Event()
        self._schedule: list[str] = []

    def one(self, i: int, rng: random.Random) -> str:
        stream, salted = rng.random() < 0.4, rng.random() < 0.3
        msgs = [{"role": "system", "content": rng.choice(PREFIXES)},
                {"role": "user", "content": f"question {rng.randrange(50)}"}]
        body: dict[str, Any] = {"model": "mock-model", "messages": msgs, "max_tokens": rng.randint(2, 12)}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        headers = {"x-tenant-id": rng.choice(TENANTS)} if salted else None
        with self.lock:
            self.kinds[("stream" if stream else "unary") + ("+salted" if salted else "")] += 1
        try:
            r = request(self.stack.url, body=json.dumps(body).encode(), headers=headers, timeout=30)
        except OSError as e:
            return f"lost:{type(e).__name__}"
        if r.status != 200:
            return f"http {r.status}: {r.body[:60].decode(errors='replace').strip()}"
        if stream:
            if not r.body.rstrip().endswith(b"data: [DONE]") or not re.search(rb'"usage"', r.body):
                return "truncated stream"
        elif "choices" not in r.json():
            return "bad unary body"
        return "ok"

    def client(self, k: int, deadline: float, limit: int) -> None:
        rng = random.Random(self.rng.random())
        interval = CLIENTS / RATE
        next_at = time.monotonic()
        while not self.stop.is_set() and time.monotonic() < deadline:
            with self.lock:
                if self.sent >= limit:
                    return
                self.sent += 1
                i = self.sent
            outcome = self.one(i, rng)
            with self.lock:
                self.outcomes[outcome] += 1
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))

    def fault(self) -> None:
        s = self.stack
        if not self._schedule:  # every kind once per round, in a random order
            self._schedule = self.rng.sample(FAULT_KINDS, len(FAULT_KINDS))
        kind = self._schedule.pop()
        worker = self.rng.choice(s.mocks)
        if kind == "renderer-restart":
            s.renderer.stop(signal.SIGKILL)
            time.sleep(0.3)
            s.renderer.start()
        elif kind == "renderer-hang":  # the process stays up and accepts connections but answers nothing
            assert s.renderer.proc is not None
            s.renderer.proc.send_signal(signal.SIGSTOP)
            try:
                time.sleep(HANG_S)
            finally:
                s.renderer.proc.send_signal(signal.SIGCONT)
        elif kind == "publisher-restart":
            worker.post("/mock/faults/restart-publisher")
        else:
            worker.post("/mock/faults/drop-next-batch")
        with self.lock:
            self.faults[kind] += 1

    def faulter(self, deadline: float) -> None:
        while not self.stop.wait(FAULT_EVERY_S * self.rng.uniform(0.5, 1.5)):
            if time.monotonic() > deadline - 3:
                return
            self.fault()


@pytest.mark.timeout(SECONDS + 180)
def test_soak_with_random_faults_loses_no_request_leaks_no_booking_and_keeps_memory_flat() -> None:
    stack = GatewayStack(workers=2, worker_args=["--decode-ms-per-token", "1"],
                         picker={"cache_salt_policy": "load-only", "endpoint_probe_interval_ms": 250}).start()
    counting = CountingHandler()
    loggers = [logging.getLogger(n) for n in PICKER_FILES]
    for lg in loggers:
        lg.addHandler(counting)
        lg.propagate = False
    tracemalloc.start(1)
    try:
        soak = Soak(stack, seed=int(os.environ.get("EPP_SOAK_SEED", "8")))
        started = time.monotonic()
        deadline = started + SECONDS
        limit = int(RATE * SECONDS * 1.1) + 10
        threads = [threading.Thread(target=soak.client, args=(k, deadline, limit)) for k in range(CLIENTS)]
        threads.append(threading.Thread(target=soak.faulter, args=(deadline,)))
        for t in threads:
            t.start()
        time.sleep(SECONDS * WARMUP_FRACTION)
        stack.wait_subscribed()
        gc.collect()  # count what is live, not cycles the collector has not reached yet
        warm_snap = tracemalloc.take_snapshot()
        warm = picker_bytes(warm_snap)
        for t in threads[:-1]:
            t.join(SECONDS + 60)
        soak.stop.set()
        threads[-1].join(30)
        assert not any(t.is_alive() for t in threads), "a soak thread is stuck"
        stack.wait_idle(timeout=30)
        gc.collect()
        end_snap = tracemalloc.take_snapshot()
        end = picker_bytes(end_snap)
        growth = [f"{d.traceback[0].filename.rsplit('/', 2)[-2:]}:{d.traceback[0].lineno} {d.size_diff:+d} B"
                  for d in end_snap.compare_to(warm_snap, "lineno")
                  if any(f"/{p}/" in d.traceback[0].filename for p in PICKER_FILES)][:5]
        elapsed = time.monotonic() - started
        assert stack.app is not None
        inflight, active = stack.app.load.total_inflight(), stack.app.picker.open_requests
        answered = sum(soak.outcomes.values())
        errors = {k: v for k, v in soak.outcomes.items() if k != "ok"}
        report = {"seconds": round(elapsed, 1), "sent": soak.sent, "answered": answered,
                  "lost": sum(v for k, v in errors.items() if k.startswith("lost")),
                  "rate_per_s": round(answered / elapsed, 1), "mix": dict(soak.kinds),
                  "faults": dict(soak.faults), "errors_by_cause": errors,
                  "error_rate": round(sum(errors.values()) / max(answered, 1), 5),
                  "picker_traced_bytes": {"after_warmup": warm, "end": end, "top_growth": growth},
                  "inflight_at_end": inflight, "streams_at_end": active,
                  "picker_log_records": dict(counting.counts)}
        print("\nSOAK REPORT " + json.dumps(report, indent=1))
        assert answered == soak.sent and soak.sent >= RATE * SECONDS * 0.8, report
        assert errors == {}, report
        assert inflight == 0 and active == 0, report
        assert set(soak.faults) == set(FAULT_KINDS), report
        # flat: after warm-up the picker's own live allocations grow by at most a quarter (+256 KiB for the
        # index filling up with the bounded prefix pool); a per-request leak would grow without bound
        assert end <= warm * 1.25 + 256 * 1024, report
        stack.wait_index_matches(timeout=15)
    finally:
        tracemalloc.stop()
        for lg in loggers:
            lg.removeHandler(counting)
            lg.propagate = True
        stack.stop()
