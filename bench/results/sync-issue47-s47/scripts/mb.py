"""CPU of NATS replica sync per request cycle (booking + prediction, prefill done, free): 3 replicas in one
process on a real nats-server; the process's CPU (all three replicas' work) and the nats-server's, each less
the same loop run without changes (the idle baseline). Issue 47, session s47.

    PYTHONPATH=<tree> python bench/results/sync-issue47-s47/scripts/mb.py 400
"""

import asyncio
import os
import sys
import time

from epp_extproc.adapters.kv_routing import Prompt
from epp_extproc.app import PickerApp
from epp_extproc.config import Config
from epp_extproc.dev.nats import NatsServer

WORKER = "127.0.0.1:1"


def cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        p = f.read().rsplit(")", 1)[1].split()
    return (int(p[11]) + int(p[12])) / os.sysconf("SC_CLK_TCK")


async def until(f, t: float = 5.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + t
    while not f():
        if time.monotonic() > deadline:
            raise TimeoutError
        await asyncio.sleep(0.0002)


async def main(n: int) -> None:
    srv = NatsServer()
    await srv.start()
    apps = []
    for _ in range(3):
        cfg = Config(grpc_port=0, health_port=0, metrics_port=0, admin_port=0, bind="127.0.0.1",
                     endpoints=f"w={WORKER}", endpoint_probe_interval_ms=0, secure_serving=False,
                     replica_sync_plane="nats", nats_url=srv.url, kv_plane_pool="r",
                     tokenizer_protocol="trtllm-render", tokenizer_service_url="http://127.0.0.1:1",
                     prediction_ttl_s=5.0)
        cfg.validate()
        app = PickerApp(cfg)
        await app.start()
        apps.append(app)
    await until(lambda: all(len(x.sync.peers) == 2 for x in apps), 10)
    a, b, c = apps
    await asyncio.sleep(1)
    prompts = [Prompt(list(range(i * 3000, i * 3000 + 2500)), None) for i in range(n)]
    assert srv.proc is not None

    async def run(work: bool) -> tuple[float, float]:
        t0, s0 = time.process_time(), cpu_of(srv.proc.pid)
        for i in range(n):
            if work:
                bk = a.load.book(WORKER, 10)
                a.kv.predict(WORKER, prompts[i])
            await asyncio.sleep(0.004)
            if work:
                assert all(x.load.load(WORKER).prefill_blocks == 10 for x in (b, c))
                bk.prefill_done()
            await asyncio.sleep(0.004)
            if work:
                bk.free()
            await asyncio.sleep(0.004)
        return time.process_time() - t0, cpu_of(srv.proc.pid) - s0

    idle, idle_srv = await run(False)
    busy, busy_srv = await run(True)
    print(f"{n} cycles: replicas' process CPU {(busy - idle) / n * 1000:.3f} ms/cycle, nats-server "
          f"{(busy_srv - idle_srv) / n * 1000:.3f} ms/cycle, (idle baseline {idle / n * 1000:.3f} / "
          f"{idle_srv / n * 1000:.3f} subtracted)")
    for x in apps:
        await x.stop(0)
    await srv.stop()


asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 500))
