"""What each worker says about itself, learned once for whichever KV view serves the decision.

Both KV views (`kv_routing.KvRouting`, the index in this process; `kv_remote.RemoteKv`, lookups against the
ingest shards of `--kv-ingest apart`) must hash a prompt exactly as the worker's engine does, or a worker's
blocks are never found. That takes facts about the worker that do not depend on where the index lives:

* its block size, as the worker reports it over HTTP (adapters/server_info.py); the index still learns a
  size from the worker's events, so the view resolves a worker's size (`KvRouting.block_size`,
  `RemoteKv.block_size`) from what its index saw and what is kept here;
* the LoRA adapters it serves and their base models (adapters/lora_adapters.py): a request naming one is
  hashed with it and rendered under its base model;
* how its engine keys media blocks (the event dialect), which only its events tell: read from the view's
  index (`EventFacts`), defaulted here;
* who hears of a local prediction (`predict_listeners`: replica sync shares them with the peers).

`WorkerFacts` keeps each of these once; the views hold one (composition) and call it at the same points:
`joined` / `left` when the pool changes, `prompt` and `hashes` on the request path, `predicted` after a
prediction. Before it, both views kept their own copy of each rule and the app switched on the view's type.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from epp_extproc.adapters.lora_adapters import AdapterTable
from epp_extproc.adapters.server_info import fetch_block_size, fetch_served_adapters
from epp_extproc.core.contract import NO_IDENTITY, MediaItem, PromptIdentity
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from kvindex.aio import TaskSet
from kvindex.hashing import DEFAULT_DIALECT, chain_hashes, media_chain_hashes, pack_tokens, root_seed
from kvindex.index import merge_worker_rows

log = logging.getLogger(__name__)
MAX_LEARNING = 32  # workers asked about themselves (block size, adapters) at once, as the prober keeps 32 in flight

# Called with (worker, block size, hashes, ttl_s) after each local prediction: replica sync shares it.
PredictListener = Callable[[str, int, list[int], float], None]


class Prompt:
    """A rendered prompt, packed once, with its chained block hashes per block size computed at most once.

    The TensorRT-LLM rule applies: the last prompt token is never part of a reusable block, so the hashes
    cover `tokens[:-1]`. `lora` is the LoRA adapter the request targets (see `WorkerFacts.adapter_for`): the
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


class EventFacts(Protocol):
    """What only a worker's own KV events tell, read from the index that applies them (`KvIndex` in this
    process; the shards' worker table with ingest apart)."""

    def media_dialect(self, address: str, /) -> str | None:
        """How the worker's engine keys media blocks; None until it published a media block."""
        ...


class PredictionSink(Protocol):
    """Where a prediction is credited: the in-process `KvIndex`, or `RemoteKv` (which forwards it to the
    worker's shard). Replica sync feeds peers' predictions into the same two calls."""

    def block_size(self, address: str, /) -> int: ...

    def predict_hashes(self, address: str, hashes: Sequence[int], ttl_s: float, /) -> Sequence[int] | None:
        """Credit `hashes`; returns those credited (not held by the worker already), or None when the sink
        cannot tell at once (a remote shard): then every hash is what was predicted."""
        ...


class WorkerFacts:
    """Block size reported over HTTP, LoRA adapters, event dialect and prediction listeners, per worker.

    At most `MAX_LEARNING` workers are asked at once: a pool of 10,000 given at start-up asked all of them
    together (about 40,000 connections, each its own HTTP client), which took the process to its descriptor
    limit (19,981 of 20,000 open) and kept its loop from answering for seconds.

    `told_block_size(address, n)` hands a size the worker reported to the view's index (the in-process index
    adopts it; the remote view tells the worker's shard); `block_size` is the view's current size for the
    worker, only to say in the log when the report changes it. Learning runs in `tasks` (the view's own), so
    the view's close ends it too.
    """

    def __init__(self, registry: EndpointRegistry, tasks: TaskSet, *, events: EventFacts,
                 block_size: Callable[[str], int], default_block_size: int,
                 told_block_size: Callable[[str, int], None], ask_server_info: bool = True) -> None:
        self.ask_server_info = ask_server_info
        self.default_block_size = default_block_size
        self.predict_listeners: list[PredictListener] = []
        self.reported: dict[str, int] = {}  # block sizes workers reported over HTTP (re-sent to a shard)
        self._registry = registry
        self._tasks = tasks
        self._events = events
        self._block_size = block_size
        self._told_block_size = told_block_size
        self._lora = AdapterTable()  # address -> LoRA adapter -> its base model
        self._learning = asyncio.Semaphore(MAX_LEARNING)

    # ------------------------------------------------------------------ the pool
    def joined(self, ep: Endpoint) -> None:
        """A worker joined the pool: say when it publishes no KV events, and ask it about itself."""
        if not ep.kv_endpoints:
            log.warning("endpoint %s (%s) has no KV-event endpoint: it gets load-based routing only",
                        ep.name, ep.address)
        if self.ask_server_info:
            self._tasks.spawn(self._learn(ep.address))

    def left(self, address: str) -> None:
        """A worker left the pool: what it said about itself goes with it."""
        self._lora.drop(address)
        self.reported.pop(address, None)

    async def _learn(self, address: str) -> None:
        """Block size and adapters from the worker itself (at most `MAX_LEARNING` workers at once)."""
        async with self._learning:
            if address in self._registry:  # (it may have left while it waited its turn)
                await self._ask(address)

    async def _ask(self, address: str) -> None:
        """Silence (404 everywhere) is normal, not a warning: the block size is then learned from the worker's
        first event."""
        n = await fetch_block_size(address)
        if address not in self._registry:
            return
        if n is None:
            log.debug("worker %s does not say its block size over HTTP: learning it from its events", address)
        else:
            if n != self._block_size(address):
                log.info("worker %s reports %d tokens per KV block (configured default %d)", address, n,
                         self.default_block_size)
            self.reported[address] = n
            self._told_block_size(address, n)
        adapters = await fetch_served_adapters(address)
        if adapters and address in self._registry:
            log.info("worker %s serves LoRA adapters %s", address, sorted(adapters))
            self._lora.set(address, adapters)

    # ------------------------------------------------------------------ adapters
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

    # ------------------------------------------------------------------ hashing
    def prompt(self, tokens: Sequence[int], identity: PromptIdentity = NO_IDENTITY) -> Prompt:
        """The request's prompt as the engines hash it: with its salt and, when its `model` names a LoRA
        adapter a worker serves, with that adapter (see `adapter_for`); with its media items (the render's
        identities and spans), the blocks they cover are keyed the way each worker's engine keys them."""
        return Prompt(tokens, identity.salt, self.adapter_for(identity.model), identity.media)

    def dialect(self, address: str) -> str:
        """How the worker's engine keys media blocks: learned from its events, else the default (vLLM's)."""
        return self._events.media_dialect(address) or DEFAULT_DIALECT

    def hashes(self, prompt: Prompt, address: str, block_size: int) -> list[int]:
        """`prompt`'s chain as the worker at `address` keys it in `block_size` (its dialect only with media)."""
        return prompt.hashes(block_size, self.dialect(address)) if prompt.media else prompt.hashes(block_size)

    # ------------------------------------------------------------------ predictions
    def predict(self, sink: PredictionSink, address: str, prompt: Prompt, ttl_s: float) -> None:
        """A fixed-lifetime prediction: credit `prompt` to `address` in `sink` for `ttl_s`, hashed as that
        worker hashes it, and tell the listeners."""
        size = sink.block_size(address)
        hashes = self.hashes(prompt, address, size)
        credited = sink.predict_hashes(address, hashes, ttl_s)
        if credited is None or credited:
            self.predicted(address, size, hashes if credited is None else credited, ttl_s)

    def predicted(self, address: str, size: int, hashes: Sequence[int], ttl_s: float) -> None:
        """A local prediction was made: every listener hears of it (replica sync sends it to the peers)."""
        for fn in self.predict_listeners:
            fn(address, size, hashes, ttl_s)

    # ------------------------------------------------------------------ /debug/kv
    def annotate(self, snapshot: dict[str, Any]) -> None:
        """Add each indexed worker's LoRA adapters to a `/debug/kv` snapshot's worker rows."""
        merge_worker_rows(snapshot, {wid: {"lora_adapters": sorted(adapters)} for wid, adapters in self._lora.items()})
