"""One ingest shard: the ZeroMQ subscriptions, decoding and index of its workers, served to the pickers on its host.

The process that answers Envoy no longer decodes a single KV event: it asks this one "how many leading blocks
of these hashes does each worker hold?" over a Unix socket (see `wire.py`). By default lookups are answered on
the ingest loop itself (`lookups="loop"`): when the loop waits, from the selector, and while it is busy, by a
poll of the lookup descriptors between two applied batches (at most every `POLL_EVERY_S`), so a lookup waits
for at most one batch's apply, with no GIL hand-off; a lookup is one mask walk (O(prompt blocks)). Threads
(`lookups="thread"`) were the first design: a thread waits for the GIL (0.5 ms switch interval here) behind
the ingest loop, which at 1,000 workers made the lookup p99 5.0-5.6 ms against 1.9-2.3 ms on the loop
(bench/README.md, "Ingest apart"); they stay an option. The decision process never waits behind ingest.

Sharding: shard k of K owns the workers whose `wire.shard_of(address, K)` is k; each shard is its own process
with its own index, so K shards ingest on up to K cores and a flood in one shard costs the others nothing. The
workers that mount one shared store (`--kv-shared-stores`) are all owned by the store's shard: llm-d's
file-system connector names a chunk by an engine hash that only a member's GPU events resolve, and a chunk is
credited to every member, so the store and all its members must be in one index (as in-process, where there
is one index). A worker's storage stream (`KvSource.storage`) is read by the shard that owns the worker.

Which workers: every picker process on the host (its `--processes` children) sends the set it wants indexed
(`T_WORKERS`, the shard's part of its registry); the shard indexes the union. A picker that disconnects keeps
its set for `CLIENT_GRACE_S`, so a picker restarting does not drop the index it will want back.

Budgets: the index's own bounds (per-worker block cap, rank cap) and the subscriber's (batch bytes and events,
replay caps, the turn budget) are unchanged. On top, `Pacer` gives each worker a CPU budget (a share of one
core, with a burst): a publisher over it is not read until its budget refills, so its SUB queue fills, ZeroMQ
drops its batches, and it loses its own freshness (gaps, replay, or a cleared rank), never another worker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import select
import socket
import struct
import threading
import time
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson
import zmq
import zmq.asyncio

from epp_extproc.heap import Refreezer
from epp_extproc.ingest import wire
from epp_extproc.ingest.launcher import DEFAULT_LOOKUPS, LOOKUP_MODES
from epp_extproc.ingest.pacing import DEFAULT_BURST_S, DEFAULT_WORKER_CPU_SHARE, LagSamples, Pacer
from kvindex.aio import cancel_and_wait
from kvindex.events import DecodedBatch
from kvindex.index import DEFAULT_STORAGE_BLOCK_TOKENS, KvIndex, merge_worker_rows
from kvindex.subscriber import KvSource, SubscriberManager, raise_socket_limit
from kvindex.tiers import Runs, keep_longest

log = logging.getLogger(__name__)

CLIENT_GRACE_S = 10.0  # a disconnected picker's worker set is kept this long (a restart comes back sooner)
META_PERIOD_S = 0.05  # how often the worker table (block sizes, warm flags) is checked for changes
MAX_PREDICTION_HASHES = 8192  # as replica sync: a longer prediction is cut
MAX_PREDICTION_TTL_S = 60.0
PARENT_CHECK_S = 1.0
TURN_BUDGET_S = 0.001
POLL_EVERY_S = 0.0001  # lookups="loop": how often, at most, the lookup descriptors are polled between batches
SPREAD_MIN = 64  # worker numbers from which a lookup spreads its answer with array operations (see `answer`)

# per stream: (endpoint, replay endpoint, rank, whether it is llm-d's file-system connector stream)
Sources = tuple[tuple[str, str | None, int | None, bool], ...]


class LaggedIndex(KvIndex):
    """The index behind a lock, also sampling how old each applied batch is (publisher `ts` to now).

    Lookups are answered on their own thread (see `IngestShard`), so every call that changes the index, from
    the event loop's subscribers or control messages, holds `lock`, and so does a lookup's walk: the walk never
    sees a half-applied batch, and it waits at most one batch's apply, never a whole turn of the loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_lag = LagSamples()
        self.last_lag = math.nan  # the newest stamped batch's lag, in every lookup's answer (the picker's trace)
        self.lock = threading.RLock()

    def apply_batch(self, worker_id: str, batch: DecodedBatch, rank: int | None = None) -> None:
        with self.lock:
            super().apply_batch(worker_id, batch, rank)
        if batch.ts > 1e9:  # a wall-clock stamp (vLLM, the bench); TensorRT-LLM's may be absent or relative
            self.last_lag = time.time() - batch.ts
            self.batch_lag.add(self.last_lag)

    def apply_storage_batch(self, worker_id: str, batch: DecodedBatch) -> None:
        with self.lock:
            super().apply_storage_batch(worker_id, batch)

    def set_shared_store(self, worker_id: str, store: str | None) -> None:
        with self.lock:
            super().set_shared_store(worker_id, store)

    def add_worker(self, worker_id: str) -> None:
        with self.lock:
            super().add_worker(worker_id)

    def drop_worker(self, worker_id: str) -> None:
        with self.lock:
            super().drop_worker(worker_id)

    def clear_worker(self, worker_id: str, rank: int | None = None) -> None:
        with self.lock:
            super().clear_worker(worker_id, rank)

    def set_ranks(self, worker_id: str, n: int) -> None:
        with self.lock:
            super().set_ranks(worker_id, n)

    def set_block_size(self, worker_id: str, n: int) -> None:
        with self.lock:
            super().set_block_size(worker_id, n)

    def count_garbage_frames(self, worker_id: str, n: int = 1) -> None:
        with self.lock:
            super().count_garbage_frames(worker_id, n)

    def predict_hashes(self, worker_id: str, hashes: Sequence[int], ttl_s: float) -> list[int]:
        with self.lock:
            return super().predict_hashes(worker_id, hashes, ttl_s)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return super().snapshot()


class IngestShard:
    """Subscriptions + index of one shard, with its lookup and control servers."""

    def __init__(self, directory: str, shard: int = 0, shards: int = 1, *, block_size: int = 32,
                 max_blocks_per_worker: int = 1_000_000, topic: str = "", worker_cpu_share: float = DEFAULT_WORKER_CPU_SHARE,
                 worker_burst_s: float = DEFAULT_BURST_S, parent_pid: int | None = None, lookups: str = DEFAULT_LOOKUPS,
                 shared_stores: Mapping[str, str] | None = None,
                 storage_block_tokens: int = DEFAULT_STORAGE_BLOCK_TOKENS) -> None:
        """``lookups``: where lookups are answered: ``thread`` (a thread per connected picker, under the GIL
        and the index lock) or ``loop`` (on the ingest loop itself, between every two applied batches and
        whenever the loop waits: no GIL hand-off, at most one batch's apply to wait for).

        ``shared_stores`` (`--kv-shared-stores`, address -> store) and ``storage_block_tokens``
        (`--kv-storage-block-size`) are the picker's: a store's members are all owned by the store's shard
        (`wire.shard_of`), which reads their storage streams and credits the store to each of them."""
        if lookups not in LOOKUP_MODES:
            raise ValueError(f"lookups must be one of {LOOKUP_MODES}, got {lookups!r}")
        self.lookup_mode = lookups
        self.directory = directory
        self.shard = shard
        self.shards = shards
        self.index = LaggedIndex(block_size, max_blocks_per_worker)
        self.index.set_storage_block_tokens(storage_block_tokens)
        self.stores = dict(shared_stores or {})
        self.pacer = Pacer(worker_cpu_share, worker_burst_s)
        # libzmq's default of 1023 sockets per context caps a picker near 340 workers (a SUB, its monitor and
        # the monitor's peer each): a shard that owns a 1,000-worker pool needs more, as far as RLIMIT_NOFILE goes
        self._zmq = zmq.asyncio.Context()
        raise_socket_limit(self._zmq)
        # a lookup waits at most one turn of ingest work: 1 ms here (5 ms in a picker's own loop), since this
        # loop answers lookups and nothing else is latency-bound in it
        self._lookup_s = 0.0  # lookups answered inside a batch's handling (lookups="loop"): not that worker's cost
        self.subscribers = SubscriberManager(self.index, topic=topic, zmq_context=self._zmq, pace=self._charge,
                                             turn_budget_s=TURN_BUDGET_S,
                                             between_batches=self.poll_lookups if lookups == "loop" else None)
        self._conns: dict[int, socket.socket] = {}  # lookup connections served on the loop (lookups="loop")
        self._ready = select.poll()  # the lookup socket and those connections, polled between batches
        self._polled = 0.0
        self.prediction_lag = LagSamples()
        self.answer_time = LagSamples()  # a lookup's service time here: the rest of a picker's wait is the channel
        self.parent_pid = parent_pid
        self._clients: dict[str, dict[str, Sources]] = {}
        self._client_conns: dict[str, int] = {}  # live control connections per client id
        self._drop_at: dict[str, float] = {}  # client id -> when its set is dropped (disconnected)
        self._current: dict[str, Sources] = {}
        self._meta_sig: object = None
        self._meta_seen: tuple[int, bool] | None = None  # (`table_version`, `has_tiers`) the table was built from
        self._meta = b""
        self.meta_version = 1
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[Any]] = []
        self._writers: set[asyncio.StreamWriter] = set()  # the pickers' control streams: meta is pushed there
        self._lookup_sock: socket.socket | None = None
        self._control: asyncio.AbstractServer | None = None
        self.refreezer = Refreezer()  # a new worker set's subscriptions out of the full collections' walks
        self.lookups = 0
        self.bad_requests = 0
        self.answers_dropped = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        path = wire.lookup_socket(self.directory, self.shard)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, wire.SEQPACKET_BUFFER)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, wire.SEQPACKET_BUFFER)
        s.bind(path)
        s.listen(64)
        self._lookup_sock = s
        if self.lookup_mode == "loop":
            s.setblocking(False)
            self._ready.register(s.fileno(), select.POLLIN)
            loop.add_reader(s.fileno(), self._accept_on_loop)
        else:
            threading.Thread(target=self._accept_lookups, name=f"ingest-{self.shard}-lookups", daemon=True).start()
        ctl = wire.control_socket(self.directory, self.shard)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ctl)
        self._control = await asyncio.start_unix_server(self._serve_control, ctl)
        self._refresh_meta()
        self._tasks.append(loop.create_task(self._housekeeping()))
        log.info("kv ingest shard %d/%d serving on %s", self.shard, self.shards, path)

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        if self._control is not None:
            self._control.close()
        for conn in list(self._conns.values()):
            self._drop_conn(conn)
        if self._lookup_sock is not None:
            if self.lookup_mode == "loop":
                asyncio.get_running_loop().remove_reader(self._lookup_sock.fileno())
            with contextlib.suppress(OSError):
                self._lookup_sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
            self._lookup_sock.close()
        await self.subscribers.close()
        self._zmq.destroy(linger=0)

    async def serve_forever(self) -> None:
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()

    # ------------------------------------------------------------------ lookups (the request path)
    # Lookups are answered on threads, not on the event loop: a loop with hundreds of busy subscriptions runs
    # each one's turn before it polls again, so a lookup on the loop would wait a whole round of ingest. A
    # thread waits only for the GIL (the shard sets a 0.5 ms switch interval) and for the index lock (one
    # batch's apply). One thread per picker process connected: a handful.
    def _accept_lookups(self) -> None:
        assert self._lookup_sock is not None
        while True:
            try:
                conn, _ = self._lookup_sock.accept()
            except OSError:  # closed: the shard is stopping
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, wire.SEQPACKET_BUFFER)
            threading.Thread(target=self._serve_lookups, args=(conn,), daemon=True).start()

    def _serve_lookups(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    buf = conn.recv(wire.SEQPACKET_BUFFER)
                except OSError:
                    return
                if not buf:
                    return
                try:
                    answer = self.answer(buf)
                except ValueError as e:  # a picker of another version, or garbage: no answer, it times out
                    self.bad_requests += 1
                    log.warning("kv ingest: malformed lookup (%s)", e)
                    continue
                try:
                    conn.sendall(answer)
                except OSError:
                    return

    # Lookups on the loop (lookups="loop"): the loop answers a connection when it becomes readable (the loop is
    # idle or between turns) and, through `poll_lookups`, between the batches the subscribers apply, so a
    # lookup never waits for a whole turn of a busy subscription, and no thread competes for the GIL.
    def _accept_on_loop(self) -> None:
        assert self._lookup_sock is not None
        try:
            conn, _ = self._lookup_sock.accept()
        except OSError:  # none waiting (BlockingIOError), or the shard is closing
            return
        conn.setblocking(False)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, wire.SEQPACKET_BUFFER)
        self._conns[conn.fileno()] = conn
        self._ready.register(conn.fileno(), select.POLLIN)
        asyncio.get_running_loop().add_reader(conn.fileno(), self._drain, conn)

    def _drop_conn(self, conn: socket.socket) -> None:
        fd = conn.fileno()
        if self._conns.get(fd) is conn:
            del self._conns[fd]
            self._ready.unregister(fd)
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(fd)
        conn.close()

    def poll_lookups(self) -> None:
        """Answer the lookups waiting on any connection, and accept new connections, at most every
        `POLL_EVERY_S` (one poll(2) of the lookup descriptors; a batch applies in ~50 us, so polling after
        each would cost a system call per batch for nothing). Why here and not only from the selector: with
        hundreds of busy subscriptions the loop reaches its selector only after a whole round of them, and a
        picker whose lookup timed out reconnects (its late answers must not reach it), so waiting for the
        selector would time out every lookup after the first miss."""
        started = time.perf_counter()
        if started - self._polled < POLL_EVERY_S:
            return
        self._polled = started
        for fd, _ in self._ready.poll(0):
            conn = self._conns.get(fd)
            if conn is not None:
                self._drain(conn)
            elif self._lookup_sock is not None and fd == self._lookup_sock.fileno():
                self._accept_on_loop()
        self._lookup_s += time.perf_counter() - started

    def _charge(self, worker: str, spent_s: float) -> float:
        """The pacer's charge for a message, less the lookups answered while it was handled."""
        spent_s, self._lookup_s = max(0.0, spent_s - self._lookup_s), 0.0
        return self.pacer.charge(worker, spent_s)

    def _drain(self, conn: socket.socket) -> None:
        while True:
            try:
                buf = conn.recv(wire.SEQPACKET_BUFFER)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop_conn(conn)
                return
            if not buf:
                self._drop_conn(conn)
                return
            try:
                answer = self.answer(buf)
            except ValueError as e:
                self.bad_requests += 1
                log.warning("kv ingest: malformed lookup (%s)", e)
                continue
            try:
                conn.send(answer)
            except BlockingIOError:  # the picker stopped reading (its buffer is full): it times out, counted there
                self.answers_dropped += 1
            except OSError:
                self._drop_conn(conn)
                return

    def answer(self, buf: bytes) -> bytes:
        """Answer one lookup: per worker of this shard, its leading blocks over all the request's block sizes
        (a worker's figure is its best, as the in-process index's `overlap` takes it over its slots); a tiers
        lookup (`wire.FLAG_TIERS`), its leading blocks at any tier as runs."""
        started = time.perf_counter()
        req = wire.unpack_lookup(buf)
        idx = self.index
        runs: array | None = None
        counts: list[int] | np.ndarray = []
        with idx.lock:  # the index, the worker table and its version, all as of one instant
            self.lookups += 1
            if req.tiers:  # the tiered-credit plugin's lookup: runs per worker, not one count per row
                runs = self._tier_runs(req)
            else:
                # the rows of the worker table are the index's worker numbers. A large table takes an array: the
                # walk's drops are spread onto it with a few vector operations instead of one step per dropped
                # slot (1,000 workers, 8k-token prompts: 161 -> 122 us); a small one the list (8: 24 us, not 41)
                n = idx.worker_count()
                counts = np.zeros(n, np.int64) if n >= SPREAD_MIN else [0] * n
                for bs, hashes in req.sections:
                    idx.overlap_numbered(hashes, bs, counts, req.workers, predicted=req.predicted)
            version = self.meta_version
            meta = self._meta if req.meta_version != version else None
        rows = runs if runs is not None else \
            counts.astype(np.uint32) if isinstance(counts, np.ndarray) else array("I", counts)
        service_s = time.perf_counter() - started  # all but packing the answer, which it must carry
        self.answer_time.add(service_s)
        return wire.pack_answer(req.req_id, version, meta, rows, service_s, idx.last_lag)

    def _tier_runs(self, req: wire.LookupRequest) -> array:
        """A tiers lookup (the tiered-credit plugin, issue 44): per worker its leading blocks at any tier as
        runs, its longest over the request's block sizes, as `KvRouting.tiers` takes it in-process."""
        idx = self.index
        best: dict[str, Runs] = {}
        for bs, hashes in req.sections:
            keep_longest(best, idx.overlap_tiers(hashes, bs, req.workers, predicted=req.predicted))
        numbered = {n: runs for w, runs in best.items() if (n := idx.number_of(w)) is not None}
        return wire.pack_tier_runs(numbered)

    # ------------------------------------------------------------------ the worker table
    def _refresh_meta(self) -> None:
        """Bump the meta version when a worker, its block size, warm flag or media dialect, the set of sizes, or
        whether any block is held off the GPU changed. Nothing is read per worker unless the index's
        `table_version` or its off-GPU flag moved: at 1,000 workers that read took 0.4 ms of the loop every
        `META_PERIOD_S`, and a lookup arriving then waited for it."""
        idx = self.index
        with idx.lock:
            seen = (idx.table_version(), idx.has_tiers())  # both O(1)
            if seen == self._meta_seen:
                return
            self._meta_seen = seen
            rows = [(w, idx.block_size(w) if w else 0, bool(w) and idx.stats(w).batches > 0,
                     idx.media_dialect(w) if w else None) for w in idx.worker_numbers()]
            sizes = sorted(set(idx.block_sizes()) | {r[1] for r in rows if r[0]})
            tiers = idx.has_tiers()
            sig = (tuple(rows), tuple(sizes), tiers)
            if sig == self._meta_sig:
                return
            self._meta_sig = sig
            self._meta = wire.encode_meta(rows, sizes, tiers)
            self.meta_version += 1
        for w in self._writers:
            self._push_meta(w)

    def _push_meta(self, writer: asyncio.StreamWriter) -> None:
        """Readiness and block sizes must not wait for a request to carry the table: it is pushed."""
        if not writer.is_closing():
            writer.write(wire.frame(wire.T_META, struct.pack("<I", self.meta_version) + self._meta))

    async def _housekeeping(self) -> None:
        next_parent = 0.0
        while True:
            await asyncio.sleep(META_PERIOD_S)
            self._refresh_meta()
            self.refreezer.maybe()
            now = time.monotonic()
            due = [c for c, t in self._drop_at.items() if t <= now]
            if due:
                for c in due:
                    del self._drop_at[c]
                    self._clients.pop(c, None)
                await self._apply_wanted()
            if self.parent_pid is not None and now >= next_parent:
                next_parent = now + PARENT_CHECK_S
                if os.getppid() != self.parent_pid:
                    log.warning("kv ingest shard %d: the picker that started it is gone; exiting", self.shard)
                    os._exit(0)

    async def want(self, client: str, workers: dict[str, Sources]) -> None:
        """`client` (a picker process) wants these workers indexed (its whole set: it replaces the last one);
        workers of other shards are ignored, a worker without sources is known but not subscribed."""
        self._clients[client] = {a: s for a, s in workers.items()
                                 if wire.shard_of(a, self.shards, self.stores) == self.shard}
        await self._apply_wanted()

    async def _apply_wanted(self) -> None:
        """Index the union of what the connected (or recently connected) pickers want: open what is new,
        close what nobody wants, re-open a worker whose KV endpoints changed."""
        async with self._lock:
            wanted: dict[str, Sources] = {}
            for ws in self._clients.values():
                for addr, sources in ws.items():
                    if addr not in wanted or (sources and not wanted[addr]):
                        wanted[addr] = sources
            removed = False  # a worker's objects dropped: its frozen cycles need the full refreeze (heap.py)
            for addr in [a for a in self._current if a not in wanted]:
                removed = True
                await self.subscribers.remove(addr)
                self.index.drop_worker(addr)
                self.pacer.forget(addr)
                del self._current[addr]
            for addr, sources in wanted.items():
                if self._current.get(addr) == sources:
                    continue
                if addr in self._current:
                    removed = True
                    await self.subscribers.remove(addr)
                self._current[addr] = sources
                self.index.add_worker(addr)  # numbers it: its row in answers and the worker table
                if addr in self.stores:  # a member of a shared store: credited what any member wrote there
                    self.index.set_shared_store(addr, self.stores[addr])
                if sources:
                    await self.subscribers.add(addr, [KvSource(pub, replay, rank, storage=storage)
                                                      for pub, replay, rank, storage in sources])
            self._refresh_meta()
            self.refreezer.changed(removed=removed)

    # ------------------------------------------------------------------ control
    async def _serve_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client: str | None = None
        self._writers.add(writer)
        self._push_meta(writer)
        try:
            while True:
                try:
                    head = await reader.readexactly(wire.FRAME_HEADER)
                    n, kind = wire.frame_header(head)
                    body = await reader.readexactly(n)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if kind == wire.T_PREDICT:
                    self._predict(body)
                elif kind == wire.T_HELLO:
                    client = str(orjson.loads(body)["client"])
                    self._client_conns[client] = self._client_conns.get(client, 0) + 1
                    self._drop_at.pop(client, None)
                elif kind == wire.T_WORKERS:
                    await self.want(client or "?", {
                        str(a): tuple((str(p), r if r is None else str(r), k if k is None else int(k),
                                       bool(more and more[0])) for p, r, k, *more in srcs)
                        for a, srcs in orjson.loads(body)})
                elif kind == wire.T_BLOCK_SIZE:
                    addr, size = orjson.loads(body)
                    if addr in self._current and isinstance(size, int) and size > 0:
                        self.index.set_block_size(addr, size)
                        self._refresh_meta()
                elif kind == wire.T_RESYNC:
                    addr = orjson.loads(body)
                    if addr in self._current:
                        log.warning("worker %s is gone: its KV entries are dropped until it publishes again", addr)
                        self.subscribers.resync(addr)
                elif kind == wire.T_SNAPSHOT:
                    req = orjson.loads(body)
                    writer.write(wire.frame(wire.T_SNAPSHOT_ANSWER,
                                            orjson.dumps({"id": req.get("id"), "snapshot": self.snapshot()})))
                    await writer.drain()
        except ConnectionError:  # the picker went away mid-answer
            pass
        except Exception:  # a malformed control frame from a local picker: log it and drop that connection
            log.exception("kv ingest shard %d: bad control message", self.shard)
        finally:
            self._writers.discard(writer)
            if client is not None:
                left = self._client_conns.get(client, 1) - 1
                self._client_conns[client] = left
                if left <= 0:
                    self._drop_at[client] = time.monotonic() + CLIENT_GRACE_S
            writer.close()

    def _predict(self, body: bytes) -> None:
        address, bs, ttl, sent, hashes = wire.unpack_prediction(body, MAX_PREDICTION_HASHES)
        self.prediction_lag.add(time.time() - sent)
        # only for workers indexed here, in the size their prompts are hashed with (as replica sync does)
        if address in self._current and self.index.block_size(address) == bs and ttl > 0:
            self.index.predict_hashes(address, hashes, min(ttl, MAX_PREDICTION_TTL_S))

    def snapshot(self) -> dict[str, Any]:
        """`/debug/kv` for this shard: the index, each worker's subscriber counters and pacing, and the shard's
        own figures (lookups served, lags)."""
        snap = self.index.snapshot()
        merge_worker_rows(snap, self.subscribers.stats_snapshot())
        merge_worker_rows(snap, self.pacer.snapshot())
        snap["ingest"] = {"shard": self.shard, "shards": self.shards, "pid": os.getpid(), "lookups": self.lookups,
                          "bad_requests": self.bad_requests,
                          "lookup_mode": self.lookup_mode, "answers_dropped": self.answers_dropped, "batch_lag_s": self.index.batch_lag.summary(),
                          "prediction_lag_s": self.prediction_lag.summary(), "answer_s": self.answer_time.summary(),
                          "meta_version": self.meta_version,
                          "heap_refreezes": self.refreezer.refreezes,
                          "heap_full_refreezes": self.refreezer.full_refreezes}
        return snap
