"""Simulated paged KV cache with prefix reuse, salts, LRU eviction and TensorRT-LLM style events.

The cache is a radix tree of FULL blocks keyed by an engine hash chained over (parent hash, salt, tokens).
It is deliberately pure and synchronous: the engine calls it between awaits, so no lock is needed and every
state change and the events describing it happen atomically.

Rules copied from the real engine because a picker that ignores them must get measurably worse results:

* the last prompt token is never reusable, so a prompt of exactly k full blocks reuses at most k-1;
* a salted request only reuses blocks stored with the same salt (the salt changes the engine hash), yet the
  published ``token_ids`` look unsalted;
* only full blocks are stored and published; partial tails and decode blocks are private to their request;
* blocks referenced by running requests are pinned; eviction takes the least recently used unreferenced LEAF,
  so the tree never holds a child whose parent was evicted.

Off-GPU tiers (issue 44, ``host_blocks`` / ``storage_blocks``): a block evicted from the GPU is offloaded to
host memory (an LRU of ``host_blocks``), or, with ``offload_on_compute`` (vLLM's OffloadingConnector), every
prompt block is stored there as soon as its prefill computes it; a block evicted from host memory goes to
storage (``storage_blocks``) or away. A prompt continuing past its GPU-cached chain into an offloaded one LOADS
those blocks instead of computing them (the engine charges the load time, engine.py); they are GPU blocks again
once the prefill commits, and their offloaded copies stay. Every tier move is published as vLLM's self-describing offload events
do (vllm-project/vllm 896c8e6e .../kv_connector/v1/offloading/events.py): a ``BlockStored`` at the new medium
with the block's hash, parent, tokens and GPU block size, a ``BlockRemoved`` at the old one.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

U64 = 1 << 64


def wire_hash(h: int) -> int:
    """Engine hash as published: SIGNED int64 when the top bit is set, so pickers must normalise to u64."""
    return h - U64 if h >= 1 << 63 else h


def engine_block_hash(
    parent: int | None, tokens: Sequence[int], salt: str | None, extra: Sequence[Any] = ()
) -> int:
    """64-bit engine hash of one block; chaining the parent makes equal blocks at different prefixes differ.

    ``extra`` are the block's multimodal keys (objects with ``hash_key() -> bytes``, vision.MmKey): an image
    block's tokens are all the same placeholder id, so, as in the engines, the item's identity and its offset
    relative to the block are what tell two image blocks apart.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(b"root" if parent is None else parent.to_bytes(8, "little"))
    if salt is not None:
        h.update(b"\x01salt:" + salt.encode("utf-8") + b"\x00")
    for key in extra:
        h.update(b"\x02mm:" + key.hash_key() + b"\x00")
    h.update(b"".join((t & 0xFFFFFFFF).to_bytes(4, "little") for t in tokens))
    return int.from_bytes(h.digest(), "little")


@dataclass(eq=False)
class Block:
    """One cached full block."""

    engine_hash: int
    parent: Block | None
    tokens: tuple[int, ...]
    salt: str | None
    position: int
    ref_count: int = 0
    children: int = 0
    last_used: int = 0
    cleared: bool = False


@dataclass(eq=False)
class OffBlock:
    """One block held off the GPU (host memory or storage): what its store event must say."""

    engine_hash: int
    parent_hash: int | None
    tokens: tuple[int, ...]
    salt: str | None
    position: int


TIER_MEDIA = ("CPU", "DISK")  # the mock's off-GPU tiers in order; the publisher spells them per engine


@dataclass(eq=False)
class Allocation:
    """The blocks one running request holds: reused (pinned) cached blocks plus private ones."""

    prompt: list[int]
    salt: str | None
    hashes: list[int]
    held: list[Block] = field(default_factory=list)
    mm_blocks: Sequence[Sequence[Any]] | None = None  # per full block, its multimodal keys (vision mode)
    private: int = 0
    reused_blocks: int = 0
    cached_tokens: int = 0  # reused on the GPU plus loaded from an off-GPU tier: neither is computed
    loaded: list[str] = field(default_factory=list)  # per loaded block (after the GPU ones), its medium
    committed: bool = False

    @property
    def blocks(self) -> int:
        """Physical blocks it holds: its cached (pinned) ones and its private ones."""
        return len(self.held) + self.private


class KVCache:
    """The simulated cache; see the module docstring for the rules it enforces."""

    def __init__(self, tokens_per_block: int, num_blocks: int, host_blocks: int = 0, storage_blocks: int = 0,
                 offload_on_compute: bool = False) -> None:
        self.tokens_per_block = tokens_per_block
        self.num_blocks = num_blocks
        # when a block reaches host memory: as soon as it is computed (vLLM's OffloadingConnector stores every
        # block that fills up, each step: offloading/scheduler.py `_get_reqs_to_store`), or when the GPU evicts it
        self.offload_on_compute = offload_on_compute
        # off-GPU tiers, in TIER_MEDIA order: (medium, capacity, LRU of the blocks it holds); empty = GPU only
        self.tiers: list[tuple[str, int, OrderedDict[int, OffBlock]]] = [
            (m, n, OrderedDict()) for m, n in zip(TIER_MEDIA, (host_blocks, storage_blocks), strict=True) if n > 0]
        self.blocks: dict[int, Block] = {}
        self._lru: OrderedDict[int, Block] = OrderedDict()
        self.private_in_use = 0
        self.orphans = 0
        self._clock = 0

    # ------------------------------------------------------------------ queries
    @property
    def used_blocks(self) -> int:
        """Physical blocks in use: cached, private to running requests, or orphaned by a clear."""
        return len(self.blocks) + self.private_in_use + self.orphans

    @property
    def utilization(self) -> float:
        """Fraction of capacity in use, as ``trtllm_kv_cache_utilization`` reports it."""
        return self.used_blocks / self.num_blocks

    def blocks_needed(self, total_tokens: int) -> int:
        """Blocks a request of ``total_tokens`` (prompt + max output) occupies while it runs."""
        return -(-total_tokens // self.tokens_per_block)

    def chain_hashes(
        self, prompt: Sequence[int], salt: str | None, mm_blocks: Sequence[Sequence[Any]] | None = None
    ) -> list[int]:
        """Engine hashes of every FULL block of ``prompt``, chained from the root."""
        tpb = self.tokens_per_block
        out: list[int] = []
        parent: int | None = None
        for i in range(len(prompt) // tpb):
            extra = mm_blocks[i] if mm_blocks else ()
            parent = engine_block_hash(parent, prompt[i * tpb : (i + 1) * tpb], salt, extra)
            out.append(parent)
        return out

    def match(
        self, prompt: Sequence[int], salt: str | None, mm_blocks: Sequence[Sequence[Any]] | None = None
    ) -> list[Block]:
        """Cached blocks a new request may reuse: the longest cached chain within ``prompt[:-1]``."""
        reusable = max(len(prompt) - 1, 0) // self.tokens_per_block
        found: list[Block] = []
        for h in self.chain_hashes(prompt, salt, mm_blocks)[:reusable]:
            b = self.blocks.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def match_offloaded(self, hashes: Sequence[int]) -> list[str]:
        """The medium of each block continuing the chain off the GPU (``hashes`` start after the GPU match),
        up to the first block no tier holds; each one found becomes its tier's most recently used."""
        out: list[str] = []
        for h in hashes:
            for medium, _, od in self.tiers:
                if h in od:
                    od.move_to_end(h)
                    out.append(medium)
                    break
            else:
                break
        return out

    def _offload(self, victims: list[Block]) -> list[dict[str, Any]]:
        """GPU blocks (evicted ones, or just computed ones with offload_on_compute) into the first tier, its
        overflow into the next, the last one's away: the events. A block a tier holds already is only touched.

        Stores go parent first (by position): eviction takes leaves, so a chain leaves the GPU child first,
        but vLLM offloads a request's blocks in chain order when they are computed, and an event's parent must
        be known to whoever keys it."""
        events: list[dict[str, Any]] = []
        moving = sorted((OffBlock(b.engine_hash, None if b.parent is None else b.parent.engine_hash, b.tokens,
                                  b.salt, b.position) for b in victims), key=lambda o: o.position)
        for medium, cap, od in self.tiers:
            stored = [o for o in moving if o.engine_hash not in od]
            for o in moving:
                od[o.engine_hash] = o
                od.move_to_end(o.engine_hash)
            events.extend(self._tier_stored(o, medium) for o in stored)
            moving = []
            while len(od) > cap:
                _, o = od.popitem(last=False)
                moving.append(o)
            moving.sort(key=lambda o: o.position)
            if moving:
                events.append({"type": "BlockRemoved", "block_hashes": [wire_hash(o.engine_hash) for o in moving],
                               "medium": medium})
        return events

    def _tier_stored(self, o: OffBlock, medium: str) -> dict[str, Any]:
        ev: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": [wire_hash(o.engine_hash)],
            "parent_block_hash": None if o.parent_hash is None else wire_hash(o.parent_hash),
            "token_ids": list(o.tokens), "block_size": self.tokens_per_block, "lora_id": None,
            "medium": medium, "lora_name": None,
        }
        if o.salt is not None:
            ev["_salt"] = o.salt
        return ev

    # ---------------------------------------------------------------- mutations
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _pin(self, b: Block) -> None:
        if b.ref_count == 0:
            self._lru.pop(b.engine_hash, None)
        b.ref_count += 1
        b.last_used = self._tick()

    def _unpin(self, b: Block) -> None:
        b.ref_count -= 1
        if b.cleared:
            if b.ref_count == 0:
                self.orphans -= 1
            return
        if b.ref_count == 0:
            b.last_used = self._tick()
            self._lru[b.engine_hash] = b

    def _evict_one(self) -> Block | None:
        for h, b in self._lru.items():
            if b.children == 0:
                del self._lru[h]
                del self.blocks[h]
                if b.parent is not None:
                    b.parent.children -= 1
                return b
        return None

    def admit(
        self, prompt: list[int], salt: str | None, total_tokens: int,
        mm_blocks: Sequence[Sequence[Any]] | None = None,
    ) -> tuple[Allocation, list[dict[str, Any]]] | None:
        """Reserve blocks for a request, evicting LRU blocks if needed; None if it must wait for capacity.

        Returns the allocation and the events to publish (a ``BlockRemoved`` if anything was evicted).
        """
        reused = self.match(prompt, salt, mm_blocks)
        need_new = self.blocks_needed(total_tokens) - len(reused)
        for b in reused:
            self._pin(b)
        if not self._fits(need_new):
            for b in reused:
                self._unpin(b)
            return None
        victims = self._make_room(need_new)
        self.private_in_use += need_new
        hashes = self.chain_hashes(prompt, salt, mm_blocks)
        reusable = max(len(prompt) - 1, 0) // self.tokens_per_block
        loaded = self.match_offloaded(hashes[len(reused):reusable]) if self.tiers else []
        alloc = Allocation(
            prompt=prompt,
            salt=salt,
            hashes=hashes,
            held=list(reused),
            mm_blocks=mm_blocks,
            private=need_new,
            reused_blocks=len(reused),
            cached_tokens=(len(reused) + len(loaded)) * self.tokens_per_block,
            loaded=loaded,
        )
        return alloc, self._eviction_events(victims)

    def grow(self, alloc: Allocation, blocks: int) -> list[dict[str, Any]] | None:
        """``blocks`` more private blocks for a running request (a decode step crossing into a new block, vLLM's
        ``allocate_slots``), evicting LRU blocks if it must: the events to publish, or None when even evicting
        every unreferenced block would not make room (the engine then preempts a request)."""
        if not self._fits(blocks):
            return None
        victims = self._make_room(blocks)
        self.private_in_use += blocks
        alloc.private += blocks
        return self._eviction_events(victims)

    def _fits(self, blocks: int) -> bool:
        return blocks <= self.num_blocks - self.used_blocks + len(self._lru)

    def _make_room(self, blocks: int) -> list[Block]:
        """Evict LRU leaves until ``blocks`` are free (the caller checked :meth:`_fits`): the victims."""
        victims: list[Block] = []
        while self.num_blocks - self.used_blocks < blocks:
            victim = self._evict_one()
            if victim is None:  # cannot happen: evictable counted leaves-eventually
                break
            victims.append(victim)
        return victims

    def _eviction_events(self, victims: list[Block]) -> list[dict[str, Any]]:
        # the offload first: a block reaches host memory before its GPU copy can be evicted (stored already when
        # it was computed, with offload_on_compute)
        offload = victims and self.tiers and not self.offload_on_compute
        events: list[dict[str, Any]] = self._offload(victims) if offload else []
        if victims:
            events.append({"type": "BlockRemoved", "block_hashes": [wire_hash(v.engine_hash) for v in victims],
                           "medium": "GPU"})
        return events

    def commit_prefill(self, alloc: Allocation) -> list[dict[str, Any]]:
        """Store the request's full prompt blocks once prefill completes; return coalesced BlockStored events.

        A block another request stored meanwhile is shared instead of duplicated (its private copy is freed)
        and breaks the run, so every event's parent is the engine hash of the block right before it.
        """
        alloc.committed = True
        if any(b.cleared for b in alloc.held):
            return []  # the chain it builds on was wiped by a clear; nothing it stores could be found again
        tpb = self.tokens_per_block
        events: list[dict[str, Any]] = []
        run: list[Block] = []

        def flush() -> None:
            if not run:
                return
            parent = run[0].parent
            ev: dict[str, Any] = {
                "type": "BlockStored",
                "block_hashes": [wire_hash(b.engine_hash) for b in run],
                "parent_block_hash": None if parent is None else wire_hash(parent.engine_hash),
                "token_ids": [t for b in run for t in b.tokens],
                "block_size": tpb,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
            # private facts for the publisher's engine dialects (stripped before anything is sent): the salt
            # the chain was hashed with, and the prompt's tokens after the chain's last block
            if alloc.salt is not None:
                ev["_salt"] = alloc.salt
            end = (run[-1].position + 1) * tpb
            ev["_tail"] = alloc.prompt[end:]
            if alloc.mm_blocks is not None:  # vision mode: each block's multimodal keys, for every dialect
                ev["_mm"] = [tuple(alloc.mm_blocks[b.position]) for b in run]
            events.append(ev)
            run.clear()

        for i in range(alloc.reused_blocks, len(alloc.hashes)):
            h = alloc.hashes[i]
            existing = self.blocks.get(h)
            alloc.private -= 1
            self.private_in_use -= 1
            if existing is not None:
                flush()
                self._pin(existing)
                alloc.held.append(existing)
                continue
            parent = alloc.held[-1] if alloc.held else None
            b = Block(
                engine_hash=h,
                parent=parent,
                tokens=tuple(alloc.prompt[i * tpb : (i + 1) * tpb]),
                salt=alloc.salt,
                position=i,
                ref_count=1,
                last_used=self._tick(),
            )
            if parent is not None:
                parent.children += 1
            self.blocks[h] = b
            alloc.held.append(b)
            run.append(b)
        flush()
        if self.offload_on_compute and self.tiers:
            # every full prompt block goes to host memory once computed; one a tier holds already is only
            # touched (vLLM's prepare_store filters stored hashes), loaded ones included
            events.extend(self._offload(alloc.held))
        return events

    def release(self, alloc: Allocation) -> None:
        """Return a finished (or cancelled) request's blocks: private ones are freed, cached ones unpinned."""
        for b in alloc.held:
            self._unpin(b)
        alloc.held = []
        self.private_in_use -= alloc.private
        alloc.private = 0

    def clear(self) -> None:
        """Forget every cached block (AllBlocksCleared); blocks still used by running requests become orphans."""
        for b in self.blocks.values():
            if b.ref_count > 0:
                b.cleared = True
                self.orphans += 1
        self.blocks.clear()
        self._lru.clear()
        for _, _, od in self.tiers:
            od.clear()

    def snapshot(self) -> dict[str, Any]:
        """JSON view for ``GET /mock/cache``: lets tests compare an index with what the engine really holds."""
        blocks = sorted(self.blocks.values(), key=lambda b: (b.position, b.last_used))
        return {
            "tokens_per_block": self.tokens_per_block,
            "num_blocks": self.num_blocks,
            "used_blocks": self.used_blocks,
            "cached_blocks": len(self.blocks),
            "private_blocks": self.private_in_use,
            "blocks": [
                {
                    "position": b.position,
                    "engine_hash": b.engine_hash,
                    "published_hash": wire_hash(b.engine_hash),
                    "parent": None if b.parent is None else b.parent.engine_hash,
                    "token_count": len(b.tokens),
                    "token_ids": list(b.tokens),
                    "salt": b.salt,
                    "ref_count": b.ref_count,
                    "last_used": b.last_used,
                }
                for b in blocks
            ],
            # off-GPU tiers (host_blocks / storage_blocks): the published hashes each holds, oldest first
            "tiers": {m: [wire_hash(h) for h in od] for m, _, od in self.tiers},
        }
