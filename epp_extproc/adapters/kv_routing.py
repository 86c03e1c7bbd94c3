"""The picker's KV view: one KvIndex fed by one ZMQ subscriber per discovered worker.

Endpoint changes open and close subscribers (one per KV-event endpoint: a data-parallel worker has one per
rank, all under the worker's id; its overlap is the best over its ranks) and drop a departed worker's entries.
Each new worker is asked its block size and its LoRA adapters by `self.facts` (adapters/worker_facts.py, shared
with the ingest-apart view `kv_remote.RemoteKv`), so the index hashes prompts the way that worker does even
before its first event. Workers are keyed by their routable address, the same string the picker names to Envoy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from epp_extproc.adapters.worker_facts import Prompt, WorkerFacts
from epp_extproc.core.contract import NO_IDENTITY, Credit, PromptIdentity, split_credit
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.load import BookingChange, BookingListener
from epp_extproc.ingest.pacing import DEFAULT_BURST_S, DEFAULT_WORKER_CPU_SHARE, Pacer
from kvindex.aio import TaskSet
from kvindex.churn import ChurnWindow
from kvindex.index import KvIndex, PredictionHold, merge_worker_rows
from kvindex.subscriber import KvSource, SubscriberManager
from kvindex.tiers import Runs, keep_longest

log = logging.getLogger(__name__)

MAX_HOLDS = 100_000  # live held predictions (one per booking); beyond it the oldest is released early


class KvRouting:
    """`KvLookup` over an index in this process; what it knows of each worker beyond its events is
    `self.facts` (adapters/worker_facts.py), shared with `kv_remote.RemoteKv`."""

    def __init__(self, registry: EndpointRegistry, *, block_size: int, max_blocks_per_worker: int, topic: str,
                 prediction_ttl_s: float, metrics_registry: CollectorRegistry | None,
                 ask_server_info: bool = True, clock: Callable[[], float] = time.monotonic,
                 worker_cpu_share: float | None = DEFAULT_WORKER_CPU_SHARE) -> None:
        """``worker_cpu_share``: the share of one core one worker's events may use here (a flooding publisher
        is read more slowly and loses its own freshness; the decisions on this loop keep the rest); None: no
        per-worker budget, only the subscriber's turn budget."""
        self.index = KvIndex(block_size, max_blocks_per_worker, metrics_registry, clock=clock)
        self.pacer = None if worker_cpu_share is None else Pacer(worker_cpu_share, DEFAULT_BURST_S)
        self.subscribers = SubscriberManager(self.index, topic=topic, is_healthy=registry.healthy,
                                             registry=metrics_registry,
                                             pace=None if self.pacer is None else self.pacer.charge)
        self.prediction_ttl_s = prediction_ttl_s
        self._registry = registry
        self._tasks = TaskSet()
        self.facts = WorkerFacts(registry, self._tasks, events=self.index, block_size=self.index.block_size,
                                 default_block_size=block_size, told_block_size=self.index.set_block_size,
                                 ask_server_info=ask_server_info)
        self._lock = asyncio.Lock()
        # --prediction-lifetime queue (`use_queue_lifetime`): booking id -> its held prediction, released by
        # the booking's first change after it was made (prefill_done, move, free), in insertion order
        self.grace_s: float | None = None
        self.max_lifetime_s = 0.0
        self._holds: dict[str, PredictionHold] = {}
        # per-worker arrays of the last tuple of workers asked about (the registry's destinations: the same
        # object decision after decision), kept until the index's generation changes (`_per_worker`)
        self._memo: dict[str, tuple[Sequence[str], int, np.ndarray]] = {}
        registry.subscribe(self._on_change)

    # ------------------------------------------------------------------ what the app asks of a KV view
    def start(self) -> None:
        """Nothing to start: subscribers open as discovery adds workers."""

    def use_queue_lifetime(self, grace_s: float, max_lifetime_s: float) -> BookingListener:
        """Predictions made for a booking (`predict(..., booking=id)`) stay credited while that booking waits
        for its prefill, then `grace_s`, at most `max_lifetime_s`. Returns what the booking changes must be
        fed to (`LoadTracker.add_listener`). Predictions without a booking, and peers', keep the fixed ttl."""
        self.grace_s = grace_s
        self.max_lifetime_s = max_lifetime_s
        return self.on_booking

    def churn_window(self) -> ChurnWindow:
        """Cache churn per worker from the removals this index applies (the eviction scorer reads it)."""
        return ChurnWindow(self.index)

    def warm(self, address: str) -> bool:
        """The worker's first event batch (its replay included) is in: readiness waits for it."""
        return self.index.stats(address).batches > 0

    def on_booking(self, change: BookingChange) -> None:
        """A local booking changed: the first change after `book` (its prefill ended, it moved to another
        worker, or it ended) releases its held prediction, whose blocks then get the grace to be confirmed."""
        if change.kind == "book" or not self._holds:
            return
        hold = self._holds.pop(change.id, None)
        if hold is not None and self.grace_s is not None:
            self.index.release(hold, self.grace_s)

    # ------------------------------------------------------------------ workers
    def _on_change(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        self._tasks.spawn(self._apply(added, removed))

    async def _apply(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        async with self._lock:  # keep add/remove of the same address in order
            for ep in removed:
                await self.subscribers.remove(ep.address)
                self.index.drop_worker(ep.address)
                if self.pacer is not None:
                    self.pacer.forget(ep.address)
                self.facts.left(ep.address)
            for ep in added:
                self.index.add_worker(ep.address)
                sources = [KvSource(pub, replay, rank) for rank, pub, replay in ep.kv_endpoints]
                if ep.kv_storage_events:  # llm-d's file-system connector: a second subscription (issue 44)
                    sources.append(KvSource(ep.kv_storage_events, storage=True))
                if sources:
                    await self.subscribers.add(ep.address, sources)
                self.facts.joined(ep)

    def resync(self, address: str) -> None:
        """The worker at `address` died: forget its blocks, rebuild from its events when it is back."""
        if address in self._registry:
            log.warning("worker %s is gone: its KV entries are dropped until it publishes again", address)
            self.subscribers.resync(address)

    # ------------------------------------------------------------------ the request path
    def block_size(self, address: str) -> int:
        return self.index.block_size(address)

    def prompt(self, tokens: Sequence[int], identity: PromptIdentity = NO_IDENTITY) -> Prompt:
        """`WorkerFacts.prompt`: salt, LoRA adapter and media items, keyed per worker's dialect."""
        return self.facts.prompt(tokens, identity)

    def base_model_for(self, model: object) -> str | None:
        """`WorkerFacts.base_model_for`: the base model a LoRA adapter is rendered under."""
        return self.facts.base_model_for(model)

    def overlap(self, prompt: Prompt, workers: Sequence[str], *, predicted: bool = True) -> dict[str, int]:
        if prompt.media:
            return self._media_overlap(prompt, workers, predicted)
        sizes = self.index.block_sizes()
        if len(sizes) == 1:  # the usual pool: hash once, reuse the hashes for the prediction
            return self.index.overlap_hashes(prompt.hashes(sizes[0]), sizes[0], workers, predicted=predicted)
        return self.index.overlap(prompt.packed, workers=workers, lora_name=prompt.lora, salt=prompt.salt,
                                  exclude_last_token=True, predicted=predicted)

    def _per_worker(self, kind: str, workers: Sequence[str], make: Callable[[], np.ndarray]) -> np.ndarray:
        memo = self._memo.get(kind)
        gen = self.index.generation
        if memo is not None and memo[0] is workers and memo[1] == gen:
            return memo[2]
        a = make()
        if isinstance(workers, tuple):  # a list may change in place: only an immutable tuple is kept
            self._memo[kind] = (workers, gen, a)
        return a

    def block_sizes_of(self, workers: Sequence[str]) -> np.ndarray:
        """`block_size` of each of `workers`, as one array (a columnar table divides the prompt by it)."""
        size = self.index.block_size
        return self._per_worker("sizes", workers,
                                lambda: np.fromiter((size(w) for w in workers), np.int64, len(workers)))

    def overlap_array(self, prompt: Prompt, workers: Sequence[str]) -> np.ndarray | None:
        """`overlap` as one int64 array in the order of `workers` (issue 45: a columnar table takes it as its
        column, no dict per worker); None where only the dict path applies (media, several block sizes)."""
        if prompt.media:
            return None
        sizes = self.index.block_sizes()
        if len(sizes) != 1:
            return None
        return self.index.overlap_array(prompt.hashes(sizes[0]), sizes[0], workers)

    def _media_overlap(self, prompt: Prompt, workers: Sequence[str], predicted: bool) -> dict[str, int]:
        """Per (block size, engine dialect) group of candidates, one chain and one mask walk: a pool of one
        engine version and one block size (the usual case) costs one chain, like a text-only prompt."""
        by_dialect: dict[str, list[str]] = {}
        dialect = self.facts.dialect
        for w in workers:
            by_dialect.setdefault(dialect(w), []).append(w)
        res: dict[str, int] = {}
        for size in self.index.block_sizes():
            for d, ws in by_dialect.items():
                for w, n in self.index.overlap_hashes(prompt.hashes(size, d), size, ws,
                                                      predicted=predicted).items():
                    if n > res.get(w, 0):
                        res[w] = n
        return res

    def set_shared_stores(self, stores: dict[str, str]) -> None:
        """Which shared store each worker address mounts (`--kv-shared-stores`): a block one of them publishes
        on the shared tier is credited to all of them (issue 44)."""
        for address, store in stores.items():
            self.index.set_shared_store(address, store)

    def set_storage_block_tokens(self, n: int) -> None:
        """Tokens per chunk of llm-d's file-system connector (`--kv-storage-block-size`)."""
        self.index.set_storage_block_tokens(n)

    def has_tiers(self) -> bool:
        """Whether any worker holds a block off the GPU now (issue 44; `tiers` is then worth asking)."""
        return self.index.has_tiers()

    def tiers(self, prompt: Prompt, workers: Sequence[str], *,
              predicted: bool = True) -> dict[str, Runs]:
        """Per candidate, its leading blocks of `prompt` at any tier as runs `(tier code, blocks)`
        (`KvIndex.overlap_tiers`), grouped by block size and media dialect as `overlap` is; a worker's answer
        is its longest over the groups."""
        groups: dict[str | None, list[str]] = {None: list(workers)}
        if prompt.media:
            groups = {}
            for w in workers:
                groups.setdefault(self.dialect(w), []).append(w)
        res: dict[str, Runs] = {}
        for size in self.index.block_sizes():
            for dialect, ws in groups.items():
                hashes = prompt.hashes(size, dialect) if prompt.media else prompt.hashes(size)
                keep_longest(res, self.index.overlap_tiers(hashes, size, ws, predicted=predicted))
        return res

    def credit(self, prompt: Prompt, workers: Sequence[str]) -> dict[str, Credit]:
        """`overlap` split into what the workers' events confirmed and what only predictions add."""
        return split_credit(self.overlap(prompt, workers), self.overlap(prompt, workers, predicted=False))

    def predict(self, address: str, prompt: Prompt, booking: str | None = None) -> None:
        if self.grace_s is not None and booking is not None:
            self._hold(address, prompt, booking)
        elif self.prediction_ttl_s > 0:
            self.facts.predict(self.index, address, prompt, self.prediction_ttl_s)

    def _hold(self, address: str, prompt: Prompt, booking: str) -> None:
        """Queue lifetime: predict held by the booking; peers are told the fixed ttl (their index cannot see
        our booking's prefill end), so they credit it as they always did."""
        size = self.index.block_size(address)
        hashes = self.facts.hashes(prompt, address, size)
        hold = self.index.hold_hashes(address, hashes, self.max_lifetime_s)
        if hold is not None:
            old = self._holds.pop(booking, None)  # one hold per booking: a second predict replaces the first
            if old is not None and self.grace_s is not None:
                self.index.release(old, self.grace_s)
            if len(self._holds) >= MAX_HOLDS and self.grace_s is not None:
                self.index.release(self._holds.pop(next(iter(self._holds))), self.grace_s)
            self._holds[booking] = hold
        if self.prediction_ttl_s > 0:
            self.facts.predicted(address, size, hashes, self.prediction_ttl_s)

    def held(self, address: str) -> int:
        """Predicted blocks on `address` still held by a request waiting for its prefill (queue lifetime)."""
        return self.index.hold_count(address)

    # ------------------------------------------------------------------ /debug/kv and close
    def snapshot(self) -> dict[str, Any]:
        """The index's per-worker state with each worker's subscriber counters and adapters (`/debug/kv`)."""
        snap = self.index.snapshot()
        merge_worker_rows(snap, self.subscribers.stats_snapshot())
        if self.pacer is not None:
            merge_worker_rows(snap, self.pacer.snapshot())
        self.facts.annotate(snap)
        return snap

    async def close(self) -> None:
        await self._tasks.cancel()
        await self.subscribers.close()
