"""The picker's KV view: one KvIndex fed by one ZMQ subscriber per discovered worker.

Endpoint changes open and close subscribers (one per KV-event endpoint: a data-parallel worker has one per
rank, all under the worker's id; its overlap is the best over its ranks) and drop a departed worker's entries.
Each new worker is asked its block size and its LoRA adapters (adapters/server_info.py), so the index hashes
prompts the way that worker does even before its first event. Workers are keyed by their routable address, the
same string the picker names to Envoy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from epp_extproc.adapters.lora_adapters import AdapterTable
from epp_extproc.adapters.server_info import fetch_block_size, fetch_served_adapters
from epp_extproc.core.contract import NO_IDENTITY, Credit, MediaItem, PromptIdentity, split_credit
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.core.load import BookingChange
from kvindex.aio import cancel_and_wait
from kvindex.hashing import DEFAULT_DIALECT, chain_hashes, media_chain_hashes, pack_tokens, root_seed
from kvindex.index import KvIndex, PredictionHold
from kvindex.subscriber import KvSource, SubscriberManager

log = logging.getLogger(__name__)

MAX_HOLDS = 100_000  # live held predictions (one per booking); beyond it the oldest is released early


class Prompt:
    """A rendered prompt, packed once, with its chained block hashes per block size computed at most once.

    The TensorRT-LLM rule applies: the last prompt token is never part of a reusable block, so the hashes
    cover `tokens[:-1]`. `lora` is the LoRA adapter the request targets (see `KvRouting.adapter_for`): the
    engines hash an adapter's blocks with its name, so the chain is seeded with it like the events' chains.
    `media`: the render's multimodal items (identity and placeholder span); blocks they overlap are keyed with
    their keys in the worker's engine dialect (kvindex/hashing.py), so the chain depends on the dialect too. A
    prompt without media takes exactly the text-only path (one chain per block size, dialect ignored).
    """

    __slots__ = ("packed", "salt", "lora", "media", "_hashes", "_media_hashes", "_seed")

    def __init__(self, tokens: Sequence[int], salt: str | None, lora: str | None = None,
                 media: tuple[MediaItem, ...] = ()) -> None:
        self.packed = pack_tokens(tokens)
        self.salt = salt
        self.lora = lora or None
        self.media = media
        self._seed = root_seed(self.lora, salt)
        self._hashes: dict[int, list[int]] = {}
        self._media_hashes: dict[tuple[int, str], list[int]] | None = None

    def __len__(self) -> int:
        return len(self.packed)

    def hashes(self, block_size: int, dialect: str | None = None) -> list[int]:
        """Chained hashes of the prompt's reusable full blocks in `block_size`; with media, as an engine of
        `dialect` keys them (None: the default dialect, vLLM's)."""
        if self.media:
            return self._keyed(block_size, dialect or DEFAULT_DIALECT)
        h = self._hashes.get(block_size)
        if h is None:
            h = self._hashes[block_size] = chain_hashes(self.packed, max(len(self.packed) - 1, 0), block_size,
                                                        self._seed)
        return h

    def _keyed(self, block_size: int, dialect: str) -> list[int]:
        cache = self._media_hashes
        if cache is None:
            cache = self._media_hashes = {}
        h = cache.get((block_size, dialect))
        if h is None:
            h = cache[(block_size, dialect)] = media_chain_hashes(
                self.packed, max(len(self.packed) - 1, 0), block_size, self.lora, self.salt, self.media, dialect)
        return h


class KvRouting:
    def __init__(self, registry: EndpointRegistry, *, block_size: int, max_blocks_per_worker: int, topic: str,
                 prediction_ttl_s: float, metrics_registry: CollectorRegistry | None,
                 ask_server_info: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = KvIndex(block_size, max_blocks_per_worker, metrics_registry, clock=clock)
        self.subscribers = SubscriberManager(self.index, topic=topic, is_healthy=registry.healthy,
                                             registry=metrics_registry)
        self.prediction_ttl_s = prediction_ttl_s
        self.ask_server_info = ask_server_info
        self._registry = registry
        self._lora = AdapterTable()  # address -> LoRA adapter -> its base model
        self._tasks: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()
        # Called with (worker, block size, hashes, ttl_s) after each local prediction: replica sync shares it.
        self.predict_listeners: list[Callable[[str, int, list[int], float], None]] = []
        # --prediction-lifetime queue (`use_queue_lifetime`): booking id -> its held prediction, released by
        # the booking's first change after it was made (prefill_done, move, free), in insertion order
        self.grace_s: float | None = None
        self.max_lifetime_s = 0.0
        self._holds: dict[str, PredictionHold] = {}
        # per-worker arrays of the last tuple of workers asked about (the registry's destinations: the same
        # object decision after decision), kept until the index's generation changes (`_per_worker`)
        self._memo: dict[str, tuple[Sequence[str], int, np.ndarray]] = {}
        registry.subscribe(self._on_change)

    def use_queue_lifetime(self, grace_s: float, max_lifetime_s: float) -> None:
        """Predictions made for a booking (`predict(..., booking=id)`) stay credited while that booking waits
        for its prefill, then `grace_s`, at most `max_lifetime_s`; feed `on_booking` the booking changes
        (`LoadTracker.add_listener`). Predictions without a booking, and peers', keep the fixed ttl."""
        self.grace_s = grace_s
        self.max_lifetime_s = max_lifetime_s

    def on_booking(self, change: BookingChange) -> None:
        """A local booking changed: the first change after `book` (its prefill ended, it moved to another
        worker, or it ended) releases its held prediction, whose blocks then get the grace to be confirmed."""
        if change.kind == "book" or not self._holds:
            return
        hold = self._holds.pop(change.id, None)
        if hold is not None and self.grace_s is not None:
            self.index.release(hold, self.grace_s)

    def _on_change(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        self._spawn(self._apply(added, removed))

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _apply(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        async with self._lock:  # keep add/remove of the same address in order
            for ep in removed:
                await self.subscribers.remove(ep.address)
                self.index.drop_worker(ep.address)
                self._lora.drop(ep.address)
            for ep in added:
                self.index.add_worker(ep.address)
                if ep.kv_endpoints:
                    await self.subscribers.add(ep.address, [KvSource(pub, replay, rank)
                                                            for rank, pub, replay in ep.kv_endpoints])
                else:
                    log.warning("endpoint %s (%s) has no KV-event endpoint: it gets load-based routing only",
                                ep.name, ep.address)
                if self.ask_server_info:
                    self._spawn(self._learn(ep.address))

    async def _learn(self, address: str) -> None:
        """Block size and adapters from the worker itself; silence (404 everywhere) is normal, not a warning:
        the block size is then learned from the worker's first event."""
        n = await fetch_block_size(address)
        if address not in self._registry:
            return
        if n is None:
            log.debug("worker %s does not say its block size over HTTP: learning it from its events", address)
        elif n != self.index.block_size(address):
            log.info("worker %s reports %d tokens per KV block (configured default %d)", address, n,
                     self.index.default_block_size)
        if n is not None:
            self.index.set_block_size(address, n)
        adapters = await fetch_served_adapters(address)
        if adapters and address in self._registry:
            log.info("worker %s serves LoRA adapters %s", address, sorted(adapters))
            self._lora.set(address, adapters)

    def adapter_for(self, model: object, address: str | None = None) -> str | None:
        """The LoRA adapter a request targets: its `model` field when it names an adapter a worker serves (the
        one at `address`, or any), as vLLM and TensorRT-LLM select adapters; None for the base model."""
        return self._lora.adapter_for(model, address)

    def set_adapters(self, address: str, adapters: Sequence[str] | dict[str, str]) -> None:
        """Declare the adapters a worker serves, optionally with their base models (tests, or a caller that
        knows them better than /v1/models)."""
        self._lora.set(address, adapters)

    def base_model_for(self, model: object) -> str | None:
        """The base model of the LoRA adapter `model` names, when a worker said (its /v1/models `parent`).

        A render-only server knows no adapters (vLLM's answers 404 "model does not exist"), and an adapter
        changes neither template nor tokenizer, so the prompt is rendered under its base model."""
        return self._lora.base_model_for(model)

    def resync(self, address: str) -> None:
        """The worker at `address` died: forget its blocks, rebuild from its events when it is back."""
        if address in self._registry:
            log.warning("worker %s is gone: its KV entries are dropped until it publishes again", address)
            self.subscribers.resync(address)

    def block_size(self, address: str) -> int:
        return self.index.block_size(address)

    def prompt(self, tokens: Sequence[int], identity: PromptIdentity = NO_IDENTITY) -> Prompt:
        """The request's prompt as the engines hash it: with its salt and, when its `model` names a LoRA
        adapter a worker serves, with that adapter (see `adapter_for`); with its media items (the render's
        identities and spans), the blocks they cover are keyed the way each worker's engine keys them."""
        return Prompt(tokens, identity.salt, self.adapter_for(identity.model), identity.media)

    def dialect(self, address: str) -> str:
        """How the worker's engine keys media blocks: learned from its events, else the default (vLLM's)."""
        return self.index.media_dialect(address) or DEFAULT_DIALECT

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
        for w in workers:
            by_dialect.setdefault(self.dialect(w), []).append(w)
        res: dict[str, int] = {}
        for size in self.index.block_sizes():
            for dialect, ws in by_dialect.items():
                for w, n in self.index.overlap_hashes(prompt.hashes(size, dialect), size, ws,
                                                      predicted=predicted).items():
                    if n > res.get(w, 0):
                        res[w] = n
        return res

    def credit(self, prompt: Prompt, workers: Sequence[str]) -> dict[str, Credit]:
        """`overlap` split into what the workers' events confirmed and what only predictions add."""
        total = self.overlap(prompt, workers)
        confirmed = self.overlap(prompt, workers, predicted=False)
        return split_credit(total, confirmed)

    def predict(self, address: str, prompt: Prompt, booking: str | None = None) -> None:
        if self.grace_s is not None and booking is not None:
            self._hold(address, prompt, booking)
        elif self.prediction_ttl_s > 0:
            size = self.index.block_size(address)
            hashes = prompt.hashes(size, self.dialect(address)) if prompt.media else prompt.hashes(size)
            self.index.predict_hashes(address, hashes, self.prediction_ttl_s)
            for fn in self.predict_listeners:
                fn(address, size, hashes, self.prediction_ttl_s)

    def _hold(self, address: str, prompt: Prompt, booking: str) -> None:
        """Queue lifetime: predict held by the booking; peers are told the fixed ttl (their index cannot see
        our booking's prefill end), so they credit it as they always did."""
        size = self.index.block_size(address)
        hashes = prompt.hashes(size, self.dialect(address)) if prompt.media else prompt.hashes(size)
        hold = self.index.hold_hashes(address, hashes, self.max_lifetime_s)
        if hold is not None:
            old = self._holds.pop(booking, None)  # one hold per booking: a second predict replaces the first
            if old is not None and self.grace_s is not None:
                self.index.release(old, self.grace_s)
            if len(self._holds) >= MAX_HOLDS and self.grace_s is not None:
                self.index.release(self._holds.pop(next(iter(self._holds))), self.grace_s)
            self._holds[booking] = hold
        if self.prediction_ttl_s > 0:
            for fn in self.predict_listeners:
                fn(address, size, hashes, self.prediction_ttl_s)

    def held(self, address: str) -> int:
        """Predicted blocks on `address` still held by a request waiting for its prefill (queue lifetime)."""
        return self.index.hold_count(address)

    def snapshot(self) -> dict[str, Any]:
        """The index's per-worker state with each worker's subscriber counters merged in (`/debug/kv`)."""
        snap = self.index.snapshot()
        for wid, d in self.subscribers.stats_snapshot().items():
            w = snap["workers"].get(wid)
            if w is not None:
                w.update(d)
        for wid, adapters in self._lora.items():
            if wid in snap["workers"]:
                snap["workers"][wid]["lora_adapters"] = sorted(adapters)
        return snap

    async def close(self) -> None:
        await cancel_and_wait(list(self._tasks))
        await self.subscribers.close()
