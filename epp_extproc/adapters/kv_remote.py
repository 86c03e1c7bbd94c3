"""The KV view of `--kv-ingest apart`: the contract's `KvLookup`, answered by this host's ingest shards.

Prompts are packed and hashed here, in the decision process, exactly as `KvRouting` does (same `Prompt`);
only the hashes cross the channel (`epp_extproc/ingest/wire.py`). A lookup is one request per shard that
owns a candidate, all sent before any answer is read, each answered by one mask walk in that shard; the
wait is bounded by `lookup_timeout_s` (default 5 ms; a lookup measured 0.25-0.7 ms at the median, see
bench/README.md "Ingest apart"). A shard that is
down, restarting or late answers nothing: its workers get no overlap, so the request is routed by load, and
`epp_kv_ingest_lookups_total{result="unavailable"|"timeout"}` counts it. The wait is synchronous because
the contract's `overlap` is (it is CPU work in the in-process index, ~0.4 ms at 32k tokens); here the CPU
work runs on the shard's core and the decision process only waits for its answer, never behind ingest.

Everything else (which workers to index, block sizes learned over HTTP, predictions, resyncs, `/debug/kv`,
and the shard's worker table, pushed whenever it changes) goes over each shard's control stream,
asynchronously. Predictions go to the shard, so every picker process on the host sees every other's within
one control round trip (their lag is sampled by the shard and shown in `/debug/kv`); across hosts the replica
sync still carries them (`WorkerFacts.predict_listeners`).

What the workers say about themselves (block size and LoRA adapters over HTTP; their media-key dialect, as
their shard learned it from their events) is kept by `self.facts` (adapters/worker_facts.py), the same
component `KvRouting` holds: prompts are hashed here, so they must be hashed by the same facts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from itertools import compress
from typing import Any

import numpy as np
import orjson
from prometheus_client import CollectorRegistry, Counter

from epp_extproc.adapters.worker_facts import Prompt, WorkerFacts
from epp_extproc.core.contract import NO_IDENTITY, Credit, PromptIdentity, split_credit
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.ingest import wire
from kvindex.aio import TaskSet
from kvindex.backoff import Backoff
from kvindex.metrics import register_index, register_subscribers
from kvindex.tiers import Runs, keep_longest

log = logging.getLogger(__name__)

RECONNECT_S = 0.1  # a shard's lookup socket is re-dialled at most this often while it is down
MAX_CONTROL_BACKLOG = 8 << 20  # bytes queued to a slow shard; predictions beyond it are dropped (counted)
SNAPSHOT_TIMEOUT_S = 5.0
METRICS_REFRESH_S = 5.0  # the epp_kv_* per-worker metrics are the shards' counters as of this long ago


class _Shard:
    """One ingest shard as this picker sees it: a lookup socket (synchronous), a control stream (async),
    and the mirror of its worker table."""

    def __init__(self, directory: str, index: int) -> None:
        self.index = index
        self.lookup_path = wire.lookup_socket(directory, index)
        self.control_path = wire.control_socket(directory, index)
        self.sock: socket.socket | None = None
        self.next_dial = 0.0
        self.meta = wire.Meta()
        self.writer: asyncio.StreamWriter | None = None
        self.workers: dict[str, list[list[Any]]] = {}  # what this picker wants the shard to index
        self.snapshots: dict[int, asyncio.Future[dict[str, Any]]] = {}

    def dial(self) -> socket.socket | None:
        if self.sock is not None:
            return self.sock
        now = time.monotonic()
        if now < self.next_dial:
            return None
        self.next_dial = now + RECONNECT_S
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, wire.SEQPACKET_BUFFER)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, wire.SEQPACKET_BUFFER)
            s.connect(self.lookup_path)  # a local socket: connects or fails at once
        except OSError:
            s.close()
            return None
        self.sock = s
        return s

    def hang_up(self) -> None:
        """Late answers must never be read as the next request's: a failed exchange closes the socket."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def send(self, kind: int, body: bytes, droppable: bool = False) -> bool:
        w = self.writer
        if w is None or w.is_closing():
            return False
        if droppable and w.transport.get_write_buffer_size() > MAX_CONTROL_BACKLOG:
            return False
        w.write(wire.frame(kind, body))
        return True


class _Exported:
    """The last refreshed snapshot, in the shape the epp_kv_* collector reads (`IndexSnapshot`)."""

    def __init__(self, kv: RemoteKv) -> None:
        self._kv = kv

    def snapshot(self) -> dict[str, Any]:
        return self._kv.exported_snapshot()


class RemoteKv:
    """`KvLookup` over the ingest shards of this host (see the module docstring)."""

    def __init__(self, registry: EndpointRegistry, *, directory: str, shards: int, block_size: int,
                 prediction_ttl_s: float, lookup_timeout_s: float = 0.005,
                 metrics_registry: CollectorRegistry | None = None, client_id: str | None = None,
                 ask_server_info: bool = True, shared_stores: Mapping[str, str] | None = None) -> None:
        """``shared_stores``: `--kv-shared-stores` (address -> store), as the shards were given it: a store's
        workers are all owned by the store's shard (`wire.shard_of`)."""
        self.directory = directory
        self.stores = dict(shared_stores or {})
        self.shards = [_Shard(directory, i) for i in range(shards)]
        self.default_block_size = block_size
        self.prediction_ttl_s = prediction_ttl_s
        self.lookup_timeout_s = lookup_timeout_s
        self.client_id = client_id or f"{socket.gethostname()}:{os.getpid()}"
        self._registry = registry
        self._ids = itertools.count(1)
        self._tasks = TaskSet()
        self.facts = WorkerFacts(registry, self._tasks, events=self, block_size=self.block_size,
                                 default_block_size=block_size, told_block_size=self._told_block_size,
                                 ask_server_info=ask_server_info)
        self._closed = False
        reg = metrics_registry or CollectorRegistry()
        # The per-worker epp_kv_* series live in the shards: exported here from a snapshot refreshed in the
        # background (a scrape never waits for a shard), only when this picker exports metrics at all.
        self._exported: dict[str, Any] = {"workers": {}, "unique_blocks": 0}
        self._export = metrics_registry is not None
        if self._export:
            register_index(_Exported(self), reg)
            register_subscribers(lambda: self._exported["workers"], reg)
        self.m_lookups = Counter("epp_kv_ingest_lookups", "Lookups sent to the KV ingest shards, by result: ok, "
                                 "unavailable (shard down: its workers routed by load), timeout",
                                 ["result"], registry=reg)
        self.m_dropped = Counter("epp_kv_ingest_predictions_dropped", "Predictions not sent: the shard was "
                                 "down or its control stream backlogged", registry=reg)
        self._results = {r: self.m_lookups.labels(r) for r in ("ok", "unavailable", "timeout")}
        self._size_of: dict[str, int] = {}  # block_size's answers until a table or a learned size changes
        # bumped with every change to what `block_size` answers: `block_sizes_of` keeps its array until then
        self._sizes_gen = 0
        self._sizes_memo: tuple[Sequence[str], int, np.ndarray] | None = None
        # per-answer row of each worker of the last tuple asked about, for the shard's table it was built on
        # (None: the workers are the table's first rows, in order)
        self._rows_memo: tuple[Sequence[str], wire.Meta, np.ndarray | None] | None = None
        # several shards: (workers, their owning shards, the shards asked) and (workers, every shard's table,
        # each worker's place in the shards' answers laid end to end, where each shard's answer starts)
        self._owners_memo: tuple[Sequence[str], int, np.ndarray, tuple[int, ...]] | None = None
        self._places_memo: tuple[Sequence[str], tuple[wire.Meta, ...], np.ndarray, np.ndarray] | None = None
        self.counts = dict.fromkeys(self._results, 0)  # the same, readable (bench, tests, /debug/kv)
        # Tracing's view of each shard's answer (tracing/spans.py `ingest_answered`: shard, result, when the
        # lookups were sent in time_ns, the shard's service time, its batch lag): set only when tracing is on,
        # so a picker without tracing reads no extra clock and makes no call per lookup.
        self.lookup_observer: Callable[[int, str, int, float | None, float | None], None] | None = None
        registry.subscribe(self._on_change)

    @property
    def index(self) -> RemoteKv:
        """What replica sync feeds peers' predictions into (`block_size`, `predict_hashes`): this adapter."""
        return self

    # ------------------------------------------------------------------ what the app asks of a KV view
    def start(self) -> None:
        """Open each shard's control stream (and the metrics refresh): they run until `close`."""
        for sh in self.shards:
            self._tasks.spawn(self._control(sh))
        if self._export:
            self._tasks.spawn(self._refresh_exported())

    def use_queue_lifetime(self, grace_s: float, max_lifetime_s: float) -> None:
        """None: the shards keep fixed-ttl predictions only (Config refuses `--prediction-lifetime queue`
        with `--kv-ingest apart`)."""
        return None

    def churn_window(self) -> None:
        """None: the removals are applied in the shards, whose counters this process does not read per
        decision, so the eviction scorer has no churn to read (Config refuses `--eviction-aware` with
        `--kv-ingest apart`)."""
        return None

    async def close(self) -> None:
        self._closed = True
        await self._tasks.cancel()
        for sh in self.shards:
            sh.hang_up()
            if sh.writer is not None:
                sh.writer.close()

    def _shard(self, address: str) -> _Shard:
        shards = self.shards
        return shards[0] if len(shards) == 1 else shards[wire.shard_of(address, len(shards), self.stores)]

    # ------------------------------------------------------------------ workers
    def _on_change(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        touched: set[int] = set()
        for ep in removed:
            sh = self._shard(ep.address)
            sh.workers.pop(ep.address, None)
            self._size_of.pop(ep.address, None)
            self.facts.left(ep.address)
            self._sizes_gen += 1
            touched.add(sh.index)
        for ep in added:
            sh = self._shard(ep.address)
            sources: list[list[Any]] = [[pub, replay, rank] for rank, pub, replay in ep.kv_endpoints]
            if ep.kv_storage_events:  # llm-d's file-system connector: a second subscription, in the same shard
                sources.append([ep.kv_storage_events, None, None, True])
            sh.workers[ep.address] = sources
            touched.add(sh.index)
            self.facts.joined(ep)
        for i in touched:
            self._send_workers(self.shards[i])

    def _send_workers(self, sh: _Shard) -> None:
        sh.send(wire.T_WORKERS, orjson.dumps([[a, s] for a, s in sh.workers.items()]))

    def _told_block_size(self, address: str, n: int) -> None:
        """A worker reported its block size over HTTP (`WorkerFacts`): its shard is told, and the size is
        re-sent on every reconnect (a restarted shard knows nothing)."""
        self._size_of.pop(address, None)
        self._sizes_gen += 1
        self._shard(address).send(wire.T_BLOCK_SIZE, orjson.dumps([address, n]))

    def resync(self, address: str) -> None:
        if address in self._registry:
            self._shard(address).send(wire.T_RESYNC, orjson.dumps(address))

    def block_size(self, address: str) -> int:
        n = self._size_of.get(address)  # a decision asks for each candidate: one dict lookup when known
        if n is None:
            # what the shard's table says (events or a reported size), else what the worker reported here
            # (the shard may not have applied it yet), else the default
            sizes = self._shard(address).meta.block_sizes
            n = (sizes.get(address) if sizes else None) or self.facts.reported.get(address) \
                or self.default_block_size
            if address in self._registry:  # a peer's prediction may name any address: only the pool is kept
                self._size_of[address] = n
        return n

    def block_sizes_of(self, workers: Sequence[str]) -> np.ndarray:
        """`block_size` of each of `workers` as one array, kept for a tuple (the registry's destinations)
        until a table or a learned size changes: a thousand calls cost a decision 0.15 ms (issue 45)."""
        memo = self._sizes_memo
        if memo is not None and memo[0] is workers and memo[1] == self._sizes_gen:
            return memo[2]
        gen = self._sizes_gen
        a = np.fromiter((self.block_size(w) for w in workers), np.int64, len(workers))
        if isinstance(workers, tuple):
            self._sizes_memo = (workers, gen, a)
        return a

    def warm(self, address: str) -> bool:
        """The shard has applied the worker's first batch (replay included): readiness waits for it."""
        return address in self._shard(address).meta.warm

    # ------------------------------------------------------------------ the request path
    def prompt(self, tokens: Sequence[int], identity: PromptIdentity = NO_IDENTITY) -> Prompt:
        """`WorkerFacts.prompt`: salt, LoRA adapter and media items (keyed per worker's dialect)."""
        return self.facts.prompt(tokens, identity)

    def base_model_for(self, model: object) -> str | None:
        """`WorkerFacts.base_model_for`: the base model a LoRA adapter is rendered under."""
        return self.facts.base_model_for(model)

    def media_dialect(self, address: str) -> str | None:
        """`EventFacts` for `self.facts`: the worker's media-key dialect as its shard learned it from its
        events (None until it published a media block)."""
        d = self._shard(address).meta.dialects
        return d.get(address) if d else None

    def overlap(self, prompt: Prompt, workers: Sequence[str], *, predicted: bool = True) -> dict[str, int]:
        """One lookup per shard that owns a candidate (a text prompt), or per (shard, media dialect) group of
        candidates (a prompt with media: its chain depends on how each engine keys media blocks)."""
        return self._ask(self._groups(prompt, workers), prompt, set(workers), predicted)

    def _groups(self, prompt: Prompt, workers: Sequence[str]) -> dict[tuple[int, str | None], list[str] | None]:
        """The lookups `overlap` and `tiers` send: (shard, media dialect or None) -> its workers, None: all of
        the shard's (a text prompt needs no filter: the answer is dense and the candidates are picked after)."""
        groups: dict[tuple[int, str | None], list[str] | None] = {}
        n, stores = len(self.shards), self.stores
        if prompt.media:
            dialect = self.facts.dialect
            for w in workers:
                ws = groups.setdefault((wire.shard_of(w, n, stores), dialect(w)), [])
                assert ws is not None
                ws.append(w)
        elif n == 1:
            groups[(0, None)] = None
        else:
            for w in workers:
                groups[(wire.shard_of(w, n, stores), None)] = None
        return groups

    def has_tiers(self) -> bool:
        """Whether any shard holds a block off the GPU (host memory, disk, a shared store), as of the worker
        table it last pushed (at most `META_PERIOD_S` old): `tiers` is then worth a round trip (issue 44)."""
        return any(sh.meta.tiers for sh in self.shards)

    def tiers(self, prompt: Prompt, workers: Sequence[str], *,
              predicted: bool = True) -> dict[str, Runs]:
        """`KvRouting.tiers` over the shards: per candidate, its leading blocks of `prompt` at any tier as runs
        `(tier code, blocks)`, one tiers lookup per group `overlap` would send. A worker's answer comes from
        the shard that owns it (a store's members all live in the store's shard, so a shared chunk is credited
        there to each of them); over media dialect groups, its longest. A shard down or late adds nothing."""
        wanted = set(workers)
        res: dict[str, Runs] = {}
        for sh, flat in self._answers(self._groups(prompt, workers), prompt, predicted, tiers=True):
            try:
                per_row = wire.unpack_tier_runs(flat)
            except ValueError:  # a shard of another version: its workers get no tier credit
                continue
            names = sh.meta.workers  # rows past the picker's copy: workers added since, as in `_ask`
            keep_longest(res, {w: runs for row, runs in per_row.items()
                               if row < len(names) and (w := names[row]) in wanted})
        return res

    def overlap_array(self, prompt: Prompt, workers: Sequence[str]) -> np.ndarray | None:
        """`overlap` as one int64 array in the order of `workers`, for a text prompt: the shard's answer (one
        u32 per row of its table) is gathered by each worker's row, which is kept for a tuple of workers until
        the shard's table changes; with several shards, each asked once and their answers gathered alike
        (`_overlap_shards`). None: take the dict (`overlap`)."""
        if prompt.media:
            return None
        if len(self.shards) != 1:
            return self._overlap_shards(prompt, workers)
        answers = self._answers({(0, None): None}, prompt, True)
        if not answers:  # the shard is down or late: routed by load, as the dict path's empty answer
            return np.zeros(len(workers), np.int64)
        sh, counts = answers[0]
        meta = sh.meta
        memo = self._rows_memo
        if memo is not None and memo[0] is workers and memo[1] is meta:
            rows = memo[2]
        else:
            row_of = {w: i for i, w in enumerate(meta.workers) if w}
            spare = len(meta.workers)  # an unknown worker reads the padding below: 0
            rows = np.fromiter((row_of.get(w, spare) for w in workers), np.intp, len(workers))
            if len(rows) and rows[-1] == len(rows) - 1 and bool((rows == np.arange(len(rows))).all()):
                rows = None  # the workers are the shard's first rows, in order (the registry's order, usually)
            if isinstance(workers, tuple):
                self._rows_memo = (workers, meta, rows)
        m = min(len(counts), len(meta.workers))  # rows past the table: workers added since the picker's copy
        if rows is None and m >= len(workers):  # no gather: the answer's first rows are the workers'
            return np.frombuffer(counts, np.uint32, len(workers)).astype(np.int64)
        if rows is None:
            rows = np.arange(len(workers), dtype=np.intp)
        held = np.zeros(len(meta.workers) + 1, np.int64)
        held[:m] = np.frombuffer(counts, np.uint32, m)
        return held[rows]

    def _overlap_shards(self, prompt: Prompt, workers: Sequence[str]) -> np.ndarray:
        """`overlap_array` over several shards. The dict path hashed every candidate's address to find its
        shard and merged the answers by name, per decision: at 10,000 workers over 4 shards that was a Python
        loop over 10,000 candidates, twice (bench_tenk). Here the owners and the places are kept per tuple of
        workers (until a shard's table changes), and the answers are laid end to end and gathered at once."""
        n = len(self.shards)
        om = self._owners_memo
        if om is not None and om[0] is workers and om[1] == n:
            owners, asked = om[2], om[3]
        else:
            owners = np.fromiter((wire.shard_of(w, n) for w in workers), np.intp, len(workers))
            asked = tuple(int(k) for k in np.unique(owners))
            if isinstance(workers, tuple):
                self._owners_memo = (workers, n, owners, asked)
        answers = self._answers({(k, None): None for k in asked}, prompt, True)
        metas = tuple(sh.meta for sh in self.shards)  # as of the answers (an answer may bring a new table)
        pm = self._places_memo
        if pm is not None and pm[0] is workers and all(a is b for a, b in zip(pm[1], metas, strict=True)):
            places, starts = pm[2], pm[3]
        else:
            starts = np.cumsum([0] + [len(m.workers) + 1 for m in metas])  # each answer, then a 0 of padding
            row_of = [{w: i for i, w in enumerate(m.workers) if w} for m in metas]
            places = np.fromiter((starts[k] + row_of[k].get(w, len(metas[k].workers))
                                  for w, k in zip(workers, owners.tolist(), strict=True)), np.intp, len(workers))
            if isinstance(workers, tuple):
                self._places_memo = (workers, metas, places, starts)
        held = np.zeros(int(starts[-1]), np.int64)
        for sh, counts in answers:  # a shard down or late: its workers read 0 (routed by load), as the dict path
            m = min(len(counts), len(metas[sh.index].workers))
            at = int(starts[sh.index])
            held[at:at + m] = np.frombuffer(counts, np.uint32, m)
        return held[places]

    def _ask(self, groups: dict[tuple[int, str | None], list[str] | None], prompt: Prompt, wanted: set[str],
             predicted: bool) -> dict[str, int]:
        """Every lookup's answer (`_answers`) merged into one dict (a worker's best figure)."""
        out: dict[str, int] = {}
        for sh, counts in self._answers(groups, prompt, predicted):
            # the workers that hold any, in C: a thousand rows cost no Python loop here (rows past the table a
            # picker holds belong to workers added since its copy: they wait for the next one)
            got = dict(compress(zip(sh.meta.workers, counts, strict=False), counts))
            if not out and wanted.issuperset(got):
                out = got
            else:
                for w, n in got.items():
                    if w in wanted and n > out.get(w, 0):
                        out[w] = n
        return out

    def _answers(self, groups: dict[tuple[int, str | None], list[str] | None], prompt: Prompt,
                 predicted: bool, *, tiers: bool = False) -> list[tuple[_Shard, array]]:
        """Send every lookup (a shard's workers, or a filtered group of them), then read each answer within the
        deadline: (shard, its counts per row of its table as of the answer; with `tiers`, its tier runs as
        `wire.pack_tier_runs` packs them)."""
        deadline = time.monotonic() + self.lookup_timeout_s
        observe = self.lookup_observer
        t0 = time.time_ns() if observe is not None else 0
        sent: list[tuple[_Shard, int]] = []
        for (i, dialect), only in groups.items():
            sh = self.shards[i]
            s = sh.dial()
            if s is None:
                self._count("unavailable")
                if observe is not None:
                    observe(i, "unavailable", t0, None, None)
                continue
            sizes = sh.meta.sizes or (self.default_block_size,)
            sections = [(bs, prompt.hashes(bs, dialect) if dialect else prompt.hashes(bs)) for bs in sizes]
            req = next(self._ids) & 0xFFFFFFFF
            try:
                s.settimeout(max(deadline - time.monotonic(), 0.0001))  # a shard that stopped reading: bounded too
                s.send(wire.pack_lookup(req, sh.meta.version, predicted, sections, only, tiers=tiers))
            except OSError:
                sh.hang_up()
                self._count("unavailable")
                if observe is not None:
                    observe(i, "unavailable", t0, None, None)
                continue
            sent.append((sh, req))
        out: list[tuple[_Shard, array]] = []
        for sh, req in sent:
            s = sh.sock
            if s is None:  # an earlier answer of this shard failed: the socket (and this answer) are gone
                continue
            try:
                s.settimeout(max(deadline - time.monotonic(), 0.0001))
                buf = s.recv(wire.SEQPACKET_BUFFER)
                if not buf:
                    raise ConnectionResetError
                rid, version, meta, counts = wire.unpack_answer(buf)
                if rid != req:
                    raise ValueError("answer to another request")
            except TimeoutError:
                sh.hang_up()
                self._count("timeout")
                if observe is not None:
                    observe(sh.index, "timeout", t0, None, None)
                continue
            except (OSError, ValueError):
                sh.hang_up()
                self._count("unavailable")
                if observe is not None:
                    observe(sh.index, "unavailable", t0, None, None)
                continue
            if meta is not None:
                sh.meta = wire.Meta.decode(version, meta)
                self._size_of = {}
                self._sizes_gen += 1
            self._count("ok")
            if observe is not None:
                observe(sh.index, "ok", t0, *wire.answer_figures(buf))
            out.append((sh, counts))
        return out

    def _count(self, result: str) -> None:
        self.counts[result] += 1
        self._results[result].inc()

    def credit(self, prompt: Prompt, workers: Sequence[str]) -> dict[str, Credit]:
        """`overlap` split into what the workers' events confirmed and what only predictions add."""
        return split_credit(self.overlap(prompt, workers), self.overlap(prompt, workers, predicted=False))

    def held(self, address: str) -> int:
        """Always 0: the ingest processes keep fixed-ttl predictions only."""
        return 0

    def predict(self, address: str, prompt: Prompt, booking: str | None = None) -> None:
        # `booking` only matters to --prediction-lifetime queue, which Config refuses with --kv-ingest apart
        if self.prediction_ttl_s > 0:
            self.facts.predict(self, address, prompt, self.prediction_ttl_s)

    def predict_hashes(self, address: str, hashes: Sequence[int], ttl_s: float) -> None:
        """Credit `hashes` to `address` in its shard (a peer's prediction arrives here too, through sync)."""
        if hashes and not self._shard(address).send(
                wire.T_PREDICT, wire.pack_prediction(address, self.block_size(address), ttl_s, time.time(), hashes),
                droppable=True):
            self.m_dropped.inc()

    # ------------------------------------------------------------------ control streams
    async def _control(self, sh: _Shard) -> None:
        """Keep the shard's control stream up; on each (re)connect say who we are and what we want."""
        backoff = Backoff(0.05, 1.0)
        while not self._closed:
            try:
                reader, writer = await asyncio.open_unix_connection(sh.control_path)
            except OSError:
                await asyncio.sleep(backoff.failed())
                continue
            backoff.succeeded()
            sh.writer = writer
            sh.send(wire.T_HELLO, orjson.dumps({"client": self.client_id}))
            self._send_workers(sh)
            for a, n in self.facts.reported.items():  # a restarted shard knows no reported size
                if self._shard(a) is sh:
                    sh.send(wire.T_BLOCK_SIZE, orjson.dumps([a, n]))
            try:
                while True:
                    head = await reader.readexactly(wire.FRAME_HEADER)
                    n, kind = wire.frame_header(head)
                    body = await reader.readexactly(n)
                    if kind == wire.T_META:
                        version = int.from_bytes(body[:4], "little")
                        if version != sh.meta.version:
                            sh.meta = wire.Meta.decode(version, body[4:])
                            self._size_of = {}
                            self._sizes_gen += 1
                    elif kind == wire.T_SNAPSHOT_ANSWER:
                        d = orjson.loads(body)
                        fut = sh.snapshots.pop(d.get("id"), None)
                        if fut is not None and not fut.done():
                            fut.set_result(d["snapshot"])
            except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                pass
            finally:
                sh.writer = None
                writer.close()
                for fut in sh.snapshots.values():
                    if not fut.done():
                        fut.set_exception(ConnectionError("kv ingest shard restarted"))
                sh.snapshots.clear()
            log.warning("kv ingest shard %d: control stream lost; reconnecting", sh.index)

    async def _refresh_exported(self) -> None:
        while True:
            await asyncio.sleep(METRICS_REFRESH_S)
            snap = await self.snapshot()
            if all(s.get("up") for s in snap["ingest"]):  # a shard restarting keeps the last figures
                self._exported = snap

    def exported_snapshot(self) -> dict[str, Any]:
        """What the epp_kv_* collectors read (kvindex.metrics.IndexSnapshot): the last refreshed snapshot."""
        return self._exported

    async def snapshot(self, timeout_s: float = SNAPSHOT_TIMEOUT_S) -> dict[str, Any]:
        """`/debug/kv`: every shard's snapshot merged (a shard that is down shows as such under `ingest`)."""
        out: dict[str, Any] = {"default_block_size": self.default_block_size, "unique_blocks": 0,
                               "predicted_unique_blocks": 0, "workers": {}, "ingest": []}
        loop = asyncio.get_running_loop()
        waits = []
        for sh in self.shards:
            rid = next(self._ids)
            fut: asyncio.Future[dict[str, Any]] = loop.create_future()
            if sh.send(wire.T_SNAPSHOT, orjson.dumps({"id": rid})):
                sh.snapshots[rid] = fut
            else:
                fut.set_exception(ConnectionError("kv ingest shard down"))
            waits.append(fut)
        for sh, fut in zip(self.shards, waits, strict=True):
            try:
                async with asyncio.timeout(timeout_s):
                    snap = await fut
            except (TimeoutError, ConnectionError) as e:
                out["ingest"].append({"shard": sh.index, "up": False, "error": str(e) or type(e).__name__})
                continue
            out["max_blocks_per_worker"] = snap.get("max_blocks_per_worker")
            out["unique_blocks"] += snap.get("unique_blocks", 0)
            out["predicted_unique_blocks"] += snap.get("predicted_unique_blocks", 0)
            out["workers"].update(snap.get("workers", {}))
            if "shared_stores" in snap:  # a store lives in one shard (its members' owner)
                out.setdefault("shared_stores", {}).update(snap["shared_stores"])
            for tier, n in snap.get("tier_unique_blocks", {}).items():
                tub = out.setdefault("tier_unique_blocks", {})
                tub[tier] = tub.get(tier, 0) + n
            out["ingest"].append({"up": True, **snap.get("ingest", {})})
        self.facts.annotate(out)
        out["lookups"] = dict(self.counts)
        return out
