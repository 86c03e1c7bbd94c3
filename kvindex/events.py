"""Plain data types for decoded KV-cache events.

The decoder turns wire bytes (TensorRT-LLM/vLLM/SGLang maps or positional arrays, any envelope) into these
objects so the index never has to know about encodings.  They are slotted dataclasses because the ingest path
creates one per event and attribute access on slots is the cheapest Python offers.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockStored:
    """A chain of consecutive full blocks the engine just stored.

    ``block_hashes`` are engine hashes already normalised to unsigned 64-bit, ``token_ids`` is a packed
    ``array('I')`` (validated to fit u32) so the index can hash memoryview slices without re-packing.
    ``lora_name`` and ``salt`` are what the engine hashed the chain with (from ``lora_name``/``extra_keys``/
    ``cache_salt``); ``salt`` is only set on a chain that starts at the root, the only place it seeds.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: array
    block_size: int
    lora_name: str | None = None
    lora_id: int | None = None
    salt: str | None = None
    # per block, the canonical bytes of the multimodal keys the engine hashed it with (kvindex.hashing
    # ``mm_*_key``), None for a text-only block; the whole list is None for a text-only chain (the fast path)
    mm: list[bytes | None] | None = None
    mm_dialect: str | None = None  # kvindex.hashing DIALECT_* the keys came in (None: no media block)
    tier: str = "gpu"  # where the engine holds the blocks (kvindex.tiers TIER_*, from the event's `medium`)


@dataclass(slots=True)
class BlockRemoved:
    """Engine hashes (u64) of blocks the engine evicted from one tier (`tier`, from the event's `medium`)."""

    block_hashes: list[int]
    tier: str = "gpu"


@dataclass(slots=True)
class AllBlocksCleared:
    """The engine dropped its whole cache (or restarted / lost events and says so)."""


@dataclass(slots=True)
class ChunksStored:
    """llm-d's file-system connector wrote these offload chunks to its store (kvindex/decode.py
    `decode_storage_payload`): one hash per chunk, the engine's block hash of the chunk's LAST GPU block (u64),
    no tokens, no parent. ``tier`` is always the shared tier; ``medium`` the spelling the event carried."""

    block_hashes: list[int]
    medium: str = "SHARED_STORAGE"


@dataclass(slots=True)
class ChunksRemoved:
    """Offload chunks deleted from a store (llm-d's PVC evictor publishes these), by the same chunk hashes."""

    block_hashes: list[int]
    medium: str = "SHARED_STORAGE"


Event = BlockStored | BlockRemoved | AllBlocksCleared | ChunksStored | ChunksRemoved


@dataclass(slots=True)
class DecodeCounters:
    """What the decoder dropped and why, so per-worker metrics can say what a publisher gets wrong."""

    skipped_length: int = 0  # len(token_ids) != block_size * len(block_hashes)
    skipped_medium: int = 0  # kept for the metric's label set: since issue 44 every medium is indexed by tier
    # vLLM's legacy offload events (one hash per offload chunk, no tokens, block_size 0): nothing to key
    skipped_placeholder: int = 0
    unknown_medium: int = 0  # events at a medium no engine is known to send: indexed as tier "unknown"
    skipped_group: int = 0  # not the main KV-cache group
    skipped_extra_keys: int = 0  # extra keys the request side cannot rebuild (prompt embeddings, unknown keys)
    skipped_mm_shape: int = 0  # multimodal keys in a shape no known engine version sends: never guessed
    garbage_events: int = 0  # an event with wrong types or absurd sizes
    unknown_events: int = 0  # event type we do not know (ignored)
    unknown_keys: int = 0  # keys we do not know inside known events (ignored)
    # multimodal blocks decoded, per dialect (vLLM (identifier, offset) pairs, older vLLM bare identifiers,
    # TensorRT-LLM per-block `mm_keys`: its V2 msgspec wire tags every key `"type": "mm_key"` (NVIDIA/TensorRT-LLM
    # 13599e98 tensorrt_llm/_torch/pyexecutor/kv_cache_events.py `MultimodalKey`), as the V1 serializer does, so
    # the two cannot be told apart by the keys and are counted together)
    mm_blocks_vllm: int = 0
    mm_blocks_vllm_bare: int = 0
    mm_blocks_trtllm: int = 0
    # llm-d file-system connector stream only: a store event in a shape that connector does not send (tokens, a
    # parent, a block size): a newer self-describing form is not guessed at, it is counted and skipped
    skipped_storage_shape: int = 0

    @property
    def skipped(self) -> int:
        """Valid-looking events deliberately not applied."""
        return (self.skipped_length + self.skipped_medium + self.skipped_group + self.skipped_extra_keys
                + self.skipped_mm_shape + self.skipped_placeholder + self.skipped_storage_shape)

    @property
    def mm_blocks(self) -> int:
        """Multimodal blocks decoded, all dialects together."""
        return self.mm_blocks_vllm + self.mm_blocks_vllm_bare + self.mm_blocks_trtllm


@dataclass(slots=True)
class DecodedBatch:
    """One publisher batch: its events plus everything the decoder noticed.

    ``garbage`` is set (with ``reason``) when the whole payload was unusable; ``events`` is then empty.
    ``raw_event_count`` is the number of events on the wire, so an empty list on the wire (a heartbeat) can be
    told apart from a batch whose events were all skipped.
    """

    ts: float = 0.0
    events: list[Event] = field(default_factory=list)
    dp_rank: int | None = None
    raw_event_count: int = 0
    counters: DecodeCounters = field(default_factory=DecodeCounters)
    garbage: bool = False
    reason: str = ""

    @property
    def heartbeat(self) -> bool:
        """An empty event list is the publisher saying 'alive, nothing new'."""
        return not self.garbage and self.raw_event_count == 0
