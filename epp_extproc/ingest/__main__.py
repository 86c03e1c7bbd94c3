"""`python -m epp_extproc.ingest --dir D --shard K --shards N ...`: one ingest shard, until SIGTERM.

Started by the picker (`launcher.IngestGroup`), never by hand in production; tests and the bench start it too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

from epp_extproc.heap import freeze_startup_heap
from epp_extproc.ingest.launcher import DEFAULT_LOOKUPS, LOOKUP_MODES
from epp_extproc.ingest.pacing import DEFAULT_WORKER_CPU_SHARE
from epp_extproc.ingest.server import IngestShard
from kvindex.index import DEFAULT_STORAGE_BLOCK_TOKENS
from kvindex.tiers import parse_shared_stores


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m epp_extproc.ingest", description=__doc__)
    p.add_argument("--dir", required=True, help="directory of the Unix sockets")
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-blocks-per-worker", type=int, default=1_000_000)
    p.add_argument("--topic", default="")
    p.add_argument("--worker-cpu-share", type=float, default=DEFAULT_WORKER_CPU_SHARE)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--lookups", choices=LOOKUP_MODES, default=DEFAULT_LOOKUPS,
                   help="answer lookups on the ingest loop between batches (default) or on threads")
    p.add_argument("--shared-stores", default=None,
                   help="the picker's --kv-shared-stores (store=addr,addr;other=addr): which workers mount one store")
    p.add_argument("--storage-block-size", type=int, default=DEFAULT_STORAGE_BLOCK_TOKENS,
                   help="the picker's --kv-storage-block-size: tokens per llm-d file-system connector chunk")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


async def _main(args: argparse.Namespace) -> None:
    shard = IngestShard(args.dir, args.shard, args.shards, block_size=args.block_size,
                        max_blocks_per_worker=args.max_blocks_per_worker, topic=args.topic,
                        worker_cpu_share=args.worker_cpu_share, parent_pid=args.parent_pid,
                        lookups=args.lookups, shared_stores=parse_shared_stores(args.shared_stores),
                        storage_block_tokens=args.storage_block_size)
    # with --lookups thread, lookups are answered on threads while the loop ingests: a thread waiting for the
    # GIL gets it within half a millisecond instead of Python's default 5 ms
    sys.setswitchinterval(0.0005)
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)  # type: ignore[union-attr]
    with contextlib.suppress(asyncio.CancelledError):
        await shard.start()
        try:
            freeze_startup_heap()  # its full collections would stall lookups (epp_extproc/heap.py)
            await asyncio.Event().wait()
        finally:
            await shard.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s ingest-{args.shard} %(name)s: %(message)s")
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
