"""The picker's KV view: one KvIndex fed by one ZMQ subscriber per discovered worker.

Endpoint changes open and close subscribers (and drop a departed worker's entries); each new worker's live
block size is asked from its /server_info so the index hashes prompts the way that worker does even before its
first event. Workers are keyed by their routable address, the same string the picker names to Envoy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from epp_extproc.adapters.render_client import fetch_block_size
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from kvindex.hashing import chain_hashes, pack_tokens, root_seed
from kvindex.index import KvIndex
from kvindex.subscriber import SubscriberManager

log = logging.getLogger(__name__)


class Prompt:
    """A rendered prompt, packed once, with its chained block hashes per block size computed at most once.

    The TensorRT-LLM rule applies: the last prompt token is never part of a reusable block, so the hashes
    cover `tokens[:-1]`.
    """

    __slots__ = ("packed", "salt", "_hashes", "_seed")

    def __init__(self, tokens: Sequence[int], salt: str | None) -> None:
        self.packed = pack_tokens(tokens)
        self.salt = salt
        self._seed = root_seed(None, salt)
        self._hashes: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.packed)

    def hashes(self, block_size: int) -> list[int]:
        h = self._hashes.get(block_size)
        if h is None:
            h = self._hashes[block_size] = chain_hashes(self.packed, max(len(self.packed) - 1, 0), block_size,
                                                        self._seed)
        return h


class KvRouting:
    def __init__(self, registry: EndpointRegistry, *, block_size: int, max_blocks_per_worker: int, topic: str,
                 prediction_ttl_s: float, metrics_registry: CollectorRegistry | None,
                 ask_server_info: bool = True) -> None:
        self.index = KvIndex(block_size, max_blocks_per_worker, metrics_registry)
        self.subscribers = SubscriberManager(self.index, topic=topic)
        self.prediction_ttl_s = prediction_ttl_s
        self.ask_server_info = ask_server_info
        self._registry = registry
        self._tasks: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()
        registry.subscribe(self._on_change)

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
            for ep in added:
                self.index.add_worker(ep.address)
                if ep.kv_events:
                    await self.subscribers.add(ep.address, ep.kv_events, ep.replay)
                else:
                    log.warning("endpoint %s (%s) has no KV-event endpoint: it gets load-based routing only",
                                ep.name, ep.address)
                if self.ask_server_info:
                    self._spawn(self._learn_block_size(ep.address))

    async def _learn_block_size(self, address: str) -> None:
        n = await fetch_block_size(address)
        if n is not None and address in self._registry and n != self.index.block_size(address):
            log.info("worker %s reports tokens_per_block=%d (configured default %d)", address, n,
                     self.index.default_block_size)
            self.index.set_block_size(address, n)

    def resync(self, address: str) -> None:
        """The worker at `address` died: forget its blocks, rebuild from its events when it is back."""
        if address in self._registry:
            log.warning("worker %s is gone: its KV entries are dropped until it publishes again", address)
            self.subscribers.resync(address)

    def block_size(self, address: str) -> int:
        return self.index.block_size(address)

    def prompt(self, tokens: Sequence[int], salt: str | None) -> Prompt:
        return Prompt(tokens, salt)

    def overlap(self, prompt: Prompt, workers: Sequence[str]) -> dict[str, int]:
        sizes = self.index.block_sizes()
        if len(sizes) == 1:  # the usual pool: hash once, reuse the hashes for the prediction
            return self.index.overlap_hashes(prompt.hashes(sizes[0]), sizes[0], workers)
        return self.index.overlap(prompt.packed, workers=workers, salt=prompt.salt, exclude_last_token=True)

    def predict(self, address: str, prompt: Prompt) -> None:
        if self.prediction_ttl_s > 0:
            self.index.predict_hashes(address, prompt.hashes(self.index.block_size(address)),
                                      self.prediction_ttl_s)

    def snapshot(self) -> dict[str, Any]:
        return self.index.snapshot()

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.subscribers.close()
