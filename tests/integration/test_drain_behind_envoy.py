"""SIGTERM to a picker process behind a real, idle Envoy: the access-log stream and health checks Envoy keeps
open are not requests, so the picker exits at once (issue: it took the whole drain timeout, 26-28 s). The
shutdown grace period before the drain is 0 here (procs.picker's default); test_rolling_restart covers it."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from epp_extproc.dev import procs
from epp_extproc.dev.envoy_config import EnvoyOptions
from tests.gateway_client import request
from tests.waiting import until

DRAIN_TIMEOUT_S = 25  # the default: a drain that waits for Envoy's service streams would take all of it


def test_sigterm_behind_an_idle_envoy_exits_in_under_two_seconds(tmp_path: Path) -> None:
    worker = procs.mock_worker("w0", tmp_path).start()
    picker = procs.picker(tmp_path, endpoints=procs.endpoint_spec([worker]),
                          args=["--secure-serving=false", "--drain-timeout-s", str(DRAIN_TIMEOUT_S)])
    envoy = None
    try:
        picker.start()
        envoy = procs.envoy(tmp_path, EnvoyOptions(listen_port=0, admin_port=0, picker_port=picker.port,
                                                   picker_tls=False)).start()
        body = b'{"model":"mock-model","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
        assert request(f"http://127.0.0.1:{envoy.port}", body=body).status == 200  # Envoy's streams are open
        time.sleep(1.0)  # idle: no request in flight, the access-log stream flushed and still open
        assert picker.proc is not None
        t0 = time.monotonic()
        picker.proc.send_signal(signal.SIGTERM)
        until(lambda: picker.proc is not None and picker.proc.poll() is not None, "the picker to exit",
              timeout=DRAIN_TIMEOUT_S + 10)
        took = time.monotonic() - t0
        assert took < 2.0, f"SIGTERM with no request in flight took {took:.1f}s"
        log = picker.log.read_text() if picker.log is not None else ""
        assert "drained: 0 requests finished, 0 cut" in log, log[-2000:]
    finally:
        for p in (envoy, picker, worker):
            if p is not None:
                p.stop()
