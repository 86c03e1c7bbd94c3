"""What differs between the engines a pool may run, in one place: each rule the decision applies per engine
is a field here, named for what it decides, with the reason and the upstream source beside it.

The renderer's protocol names the engine (`--tokenizer-protocol`): a pool behind one renderer runs one engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from epp_extproc.config import TokenizerProtocol


class SaltRule(StrEnum):
    """What a request's cache salt (x-tenant-id, cache_salt, nvext.cache_salt) does to the decision."""

    # TensorRT-LLM: its KV events carry no salt, so the index cannot tell tenants apart; refused, or routed by
    # load with `cache_salt` forwarded on chat requests (--cache-salt-policy)
    UNINDEXABLE = "unindexable"
    # vLLM: the salt seeds the first block's hash, so it is hashed in and forwarded as `cache_salt`
    HASHED_AND_FORWARDED = "hashed_and_forwarded"
    # SGLang: hashed in (its events and ours agree), nothing injected
    HASHED = "hashed"


@dataclass(frozen=True, slots=True)
class EngineProfile:
    protocol: str
    salt: SaltRule
    # the render answers each media item's hash and placeholder span (vLLM `mm_payload: none`, vllm 0.32.0
    # chat_completion/protocol.py); otherwise the text before the first item is found by rendering the
    # conversation cut there with two sentinels (core/media.py)
    media_spans: bool
    # media items without a caller uuid get one derived from their content, as vLLM keys them
    derives_media_uuids: bool
    # why a request with media is credited only up to its first item, when the render has no spans
    media_prefix_reason: str
    # the forwarded body may carry the rendered prompt (TensorRT-LLM skips its own render: core/passthrough.py)
    passthrough: bool
    # Does a decode worker's cache hold the prompt blocks a prefill worker sent it as soon as they land, so
    # that the next request sharing the prefix finds them there? vLLM (NIXL connector): yes, the scheduler
    # caches the received blocks once the load finishes (vllm 0.32.0 v1/core/sched/scheduler.py,
    # `_update_waiting_for_remote_kv` -> `kv_cache_manager.cache_blocks`), so they are predicted on the
    # decode worker too. TensorRT-LLM: no; a generation server's blocks enter its reuse tree when the
    # sequence is released at the request's end (cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp @b35ac1b,
    # `BlockManager::releaseBlocks` -> `storeBlocksForReuse`), and its own KV events report them then.
    # SGLang: not predicted (unchecked). See docs/pd-pools.md.
    decode_keeps_transferred_blocks: bool


ENGINES: dict[str, EngineProfile] = {
    TokenizerProtocol.TRTLLM: EngineProfile(TokenizerProtocol.TRTLLM, SaltRule.UNINDEXABLE, media_spans=False,
                                            derives_media_uuids=False, media_prefix_reason="renderer_refuses_media",
                                            passthrough=True, decode_keeps_transferred_blocks=False),
    TokenizerProtocol.VLLM: EngineProfile(TokenizerProtocol.VLLM, SaltRule.HASHED_AND_FORWARDED, media_spans=True,
                                          derives_media_uuids=True, media_prefix_reason="renderer_has_no_spans",
                                          passthrough=False, decode_keeps_transferred_blocks=True),
    TokenizerProtocol.SGLANG: EngineProfile(TokenizerProtocol.SGLANG, SaltRule.HASHED, media_spans=False,
                                            derives_media_uuids=False, media_prefix_reason="renderer_has_no_spans",
                                            passthrough=False, decode_keeps_transferred_blocks=False),
}


def engine_for(protocol: str | None) -> EngineProfile | None:
    """The engine behind a renderer's protocol; None without a renderer (load-only routing)."""
    return ENGINES.get(protocol) if protocol else None  # type: ignore[call-overload]
