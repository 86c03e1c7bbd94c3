"""Media content parts of a chat request: what they are, which identity each item is forwarded with, and how
the render's item spans are read. Pure functions over plain values; the pipeline calls them in one place.

Why the picker rewrites item identities (issue 29.2). vLLM keys a media item by the caller's `uuid` when the
content part carries one and trusts it blindly (vllm 0.32.0 `multimodal/processing/inputs.py`
`ProcessorInputs.get_mm_hashes`: with no processor/media-io kwargs the uuid IS the item's `mm_hash`; with them
it is hashed together with them), and that hash is the identifier its KV blocks are keyed by
(`v1/engine/input_processor.py` `_get_mm_identifier`: `mm_hash`, or `"<lora>:<mm_hash>"` with tower-connector
LoRA; `v1/core/kv_cache_utils.py` `_gen_mm_extra_hash_keys`: `("mm", identifier, item_offset - block_start)`
per overlapping item). A part may even carry the uuid alone, without data (`renderers/chat_utils.py`
`_parse_chat_message_content_mm_part`: a `uuid` sends a part through the "no data" branch): a client that
reuses another client's uuid is served the other item's KV, or its embeddings. So, per item:

- the operator trusts callers (`--trust-media-uuids`): the caller's uuid is forwarded as sent;
- else a caller uuid under a tenant salt is replaced by a digest of (salt, uuid): a tenant can only reach
  its own items;
- else a base64 `data:` URI's identity is the sha256 of its decoded bytes, forwarded as the part's `uuid`
  (the client holds the bytes, so it cannot claim an item it does not have), replacing any caller uuid;
- an http(s) URL is never turned into an identity (its content can change behind it): a caller uuid is
  removed and the engine hashes what it fetches; the picker never fetches it;
- a part that references an item by an untrusted uuid alone (no data) is refused: 400.

The picker never fetches a URL, decodes no image, and credits image blocks only where the render reported the
items' spans (`spans_from_features`): placeholder counts depend on the image's size, so they are never
guessed from placeholder tokens.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from epp_extproc.core.body import REMOVE
from epp_extproc.core.contract import MediaItem

# Content part kinds, named after vLLM 0.32.0 renderers/chat_utils.py MM_PARSER_MAP and the keys its
# `_parse_chat_message_content_mm_part` looks for when a part has no `type` or carries a `uuid`, in its order.
URL_KINDS = frozenset({"image_url", "input_image", "audio_url", "video_url"})  # data: URI or http(s) URL
MEDIA_KEYS = ("image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds",
              "audio_url", "input_audio", "video_url")
MODALITY_OF = {"image_url": "image", "input_image": "image", "image_pil": "image", "image_embeds": "embeds",
               "audio_embeds": "embeds", "video_embeds": "embeds", "prompt_embeds": "embeds",
               "audio_url": "audio", "input_audio": "audio", "video_url": "video"}
MAX_CREDITED_ITEMS = 256  # items one request may be credited for; more route by load (the uuid rules still hold)
MAX_IDENTIFIER_CHARS = 512  # a render answer's item hash longer than this is not a hash: the answer is refused
SALTED_UUID_PREFIX = "epp-salted-"
DIGEST_PREFIX = "sha256-"


class Source(StrEnum):
    """Where an item's forwarded identity comes from (metric label `identity`, bounded)."""

    TRUSTED_UUID = "trusted_uuid"  # the caller's uuid, forwarded as sent (--trust-media-uuids)
    SALTED_UUID = "salted_uuid"  # the caller's uuid namespaced by the tenant salt
    DIGEST = "digest"  # sha256 of a data URI's decoded bytes, forwarded as the part's uuid
    ENGINE = "engine"  # no uuid forwarded: the engine hashes the item (http(s) URL, undecodable data URI, embeds)
    DROPPED_UUID = "dropped_uuid"  # an untrusted caller uuid on an http(s) URL: removed, the engine hashes it


class Scored(StrEnum):
    """How an image request was scored (metric label `scored`)."""

    EXACT = "exact"  # with the items' spans and identities from the render: image blocks credited
    TEXT_PREFIX = "text_prefix"  # only the text before the first item
    LOAD_ONLY = "load_only"  # by load


# Why (metric label `reason`): a closed set, so the label stays bounded.
REASONS = ("spans", "flag_text_prefix", "renderer_refuses_media", "renderer_has_no_spans", "video", "audio",
           "embeds", "too_many_items", "salted_load_only", "render_failed", "no_features", "invalid_features",
           "mismatched_items", "no_renderer", "empty_prefix")


@dataclass(slots=True)
class MediaPart:
    """One media content part of the request, where it sits, and what the picker forwards for it."""

    message: int  # index in `messages`
    part: int  # index in that message's `content`
    modality: str  # image | video | audio | embeds
    origin: str  # data | http | none (no data: referenced by uuid) | other
    source: Source
    forward_uuid: str | None = None  # the uuid the forwarded part carries (None: no uuid)
    rewrite: bool = False  # the forwarded part's `uuid` member differs from what the client sent


@dataclass(slots=True)
class MediaRequest:
    """The media of one chat request, and the verdict on how it can be scored."""

    parts: list[MediaPart] = field(default_factory=list)
    refused: str | None = None  # a reason to answer 400 (an untrusted uuid-only reference)

    @property
    def images(self) -> list[MediaPart]:
        return [p for p in self.parts if p.modality == "image"]

    @property
    def load_only_reason(self) -> str | None:
        """Why this request cannot be credited past its text at all, before any render (None: it can)."""
        for modality in ("video", "audio", "embeds"):
            if any(p.modality == modality for p in self.parts):
                return modality
        if len(self.parts) > MAX_CREDITED_ITEMS:
            return "too_many_items"
        return None

    @property
    def first_message(self) -> int:
        return min(p.message for p in self.parts)

    def edits(self) -> dict[tuple[int, int], object]:
        """(message, part) -> the forwarded `uuid` value (body.REMOVE: no uuid), for the parts that change."""
        return {(p.message, p.part): REMOVE if p.forward_uuid is None else p.forward_uuid
                for p in self.parts if p.rewrite}


def part_kind(part: Mapping[str, Any]) -> str | None:
    """The media kind of a content part as vLLM classifies it (None: text or unknown, not media)."""
    t = part.get("type")
    if isinstance(t, str) and t in MODALITY_OF and part.get("uuid") is None:
        return t
    if t is None or part.get("uuid") is not None:
        for key in MEDIA_KEYS:
            if key in part:
                return key
    if isinstance(t, str) and t in MODALITY_OF:
        return t
    return None


def _url_of(kind: str, part: Mapping[str, Any]) -> Any:
    v = part.get(kind) if kind != "input_image" else part.get("image_url")
    if isinstance(v, Mapping):
        v = v.get("url")
    return v


def data_uri_digest(url: str) -> str | None:
    """sha256 hex of a base64 `data:` URI's decoded bytes; None when it is not one or does not decode."""
    head, sep, payload = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        return None
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None
    return hashlib.sha256(raw).hexdigest()


def salted_uuid(salt: str, uuid: str) -> str:
    """A caller uuid namespaced by its tenant: another tenant's same uuid is another item."""
    h = hashlib.sha256()
    h.update(salt.encode("utf-8", "surrogatepass"))
    h.update(b"\0")
    h.update(uuid.encode("utf-8", "surrogatepass"))
    return SALTED_UUID_PREFIX + h.hexdigest()


def _caller_uuid(part: Mapping[str, Any]) -> str | None:
    u = part.get("uuid")
    if u is None:
        return None
    return u if isinstance(u, str) else repr(u)  # vLLM does str(uuid); any non-null value is a uuid to it


def has_content_parts(values: Mapping[str, Any]) -> bool:
    """Whether any message's `content` is a list of parts: only then can the request carry media. A text chat
    (string contents, the common case) stops here, before the salt is resolved or anything is allocated."""
    messages = values.get("messages")
    if not isinstance(messages, list):
        return False
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages)


def inspect(values: Mapping[str, Any], *, trust_uuids: bool, salt: str | None, derive: bool = True) -> MediaRequest:
    """The request's media parts in prompt order, each with the identity it is forwarded with.

    `derive`: forward a data URI's digest as its uuid (vLLM workers key the item by it); without it (other
    engines) only the caller-uuid rules apply. CPU: one base64 decode and sha256 per data URI, in C."""
    out = MediaRequest()
    messages = values.get("messages")
    if not isinstance(messages, list):
        return out
    for mi, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for pi, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            kind = part_kind(part)
            if kind is None:
                continue
            out.parts.append(_decide(mi, pi, kind, part, trust_uuids, salt, derive, out))
    return out


def _decide(mi: int, pi: int, kind: str, part: Mapping[str, Any], trust: bool, salt: str | None, derive: bool,
            out: MediaRequest) -> MediaPart:
    modality = MODALITY_OF[kind]
    caller = _caller_uuid(part)
    url = _url_of(kind, part) if kind in URL_KINDS else part.get(kind)
    if isinstance(url, str) and url.startswith("data:"):
        origin = "data"
    elif isinstance(url, str) and url.lower().startswith(("http://", "https://")):
        origin = "http"
    elif url is None:
        origin = "none"  # no data: the part names its item by uuid only
    else:
        origin = "other"
    p = MediaPart(mi, pi, modality, origin, Source.ENGINE)
    if caller is not None and trust:
        p.source, p.forward_uuid = Source.TRUSTED_UUID, caller
        return p
    if caller is not None and salt is not None:
        p.source, p.forward_uuid, p.rewrite = Source.SALTED_UUID, salted_uuid(salt, caller), True
        return p
    digest = data_uri_digest(url) if derive and origin == "data" and modality == "image" else None
    if digest is not None:
        p.source, p.forward_uuid = Source.DIGEST, DIGEST_PREFIX + digest
        p.rewrite = p.forward_uuid != part.get("uuid")
        return p
    if caller is not None:
        if origin == "none":
            out.refused = ("a media content part references an item by `uuid` alone; this gateway does not "
                           "trust caller uuids (the operator's --trust-media-uuids): send the item's data")
        p.source, p.rewrite = Source.DROPPED_UUID, True  # removed: the engine hashes the content
    return p


# ---------------------------------------------------------------------------------------------- render spans
class SpansInvalid(ValueError):
    """The render answer's `features` cannot be believed: the request is routed by load."""


def spans_from_features(features: Any, n_tokens: int) -> tuple[tuple[str, MediaItem], ...] | None:
    """(modality, item) per multimodal item of a vLLM render answer, sorted by offset; None when the answer
    has no `features` (a text-only render). Raises SpansInvalid for anything a vLLM renderer would not send.

    Shape (vllm 0.32.0 `entrypoints/scale_out/token_in_token_out/protocol.py` `MultiModalFeatures`, built by
    `mm_features.extract_mm_features`): `{"mm_hashes": {modality: [str, ...]}, "mm_placeholders": {modality:
    [{"offset": int >= 0, "length": int > 0}, ...]}, "kwargs_data": ..., "mm_metadata": ...}`; the same
    modalities in both maps, parallel lists, ranges globally non-overlapping. The picker asks for
    `mm_payload: "none"` so kwargs_data/mm_metadata are null; they are ignored whatever they hold. Bounded:
    at most MAX_CREDITED_ITEMS items, each hash at most MAX_IDENTIFIER_CHARS, every span inside the prompt.
    """
    if features is None:
        return None
    if not isinstance(features, dict):
        raise SpansInvalid("`features` is not an object")
    hashes, places = features.get("mm_hashes"), features.get("mm_placeholders")
    if not isinstance(hashes, dict) or not isinstance(places, dict) or set(hashes) != set(places):
        raise SpansInvalid("`mm_hashes` and `mm_placeholders` are not objects over the same modalities")
    items: list[tuple[str, MediaItem]] = []
    for modality, hs in hashes.items():
        ps = places[modality]
        if not isinstance(hs, list) or not isinstance(ps, list) or len(hs) != len(ps):
            raise SpansInvalid(f"{modality!r}: hashes and placeholders are not parallel lists")
        if len(items) + len(hs) > MAX_CREDITED_ITEMS:
            raise SpansInvalid(f"more than {MAX_CREDITED_ITEMS} items")
        for h, p in zip(hs, ps, strict=True):
            if not isinstance(h, str) or not h or len(h) > MAX_IDENTIFIER_CHARS:
                raise SpansInvalid(f"{modality!r}: an item hash is not a string of 1..{MAX_IDENTIFIER_CHARS} chars")
            off = p.get("offset") if isinstance(p, dict) else None
            length = p.get("length") if isinstance(p, dict) else None
            if type(off) is not int or type(length) is not int or off < 0 or length <= 0 \
                    or off + length > n_tokens:
                raise SpansInvalid(f"{modality!r}: a placeholder range is not inside the {n_tokens}-token prompt")
            items.append((str(modality)[:64], MediaItem(h, off, length)))
    items.sort(key=lambda mi: mi[1].offset)
    for (_, a), (_, b) in zip(items, items[1:], strict=False):
        if b.offset < a.offset + a.length:
            raise SpansInvalid("placeholder ranges overlap")
    return tuple(items)


# ---------------------------------------------------------------------------------------------- text prefix
SENTINELS = ("\u2460 epp prefix probe A", "\u2461 epp prefix probe B")  # two texts that differ at their first char


def truncated_conversation(values: Mapping[str, Any], first_message: int, sentinel: str) -> dict[str, Any]:
    """The request with the messages before `first_message` kept, that message's content replaced by a text
    `sentinel` and everything after it dropped; what a renderer that refuses media can still render.

    Rendered with two different sentinels, the two answers' common prefix is the prompt's text up to that
    message's content, whatever the message's media expand to and wherever the engine puts them inside the
    message (TensorRT-LLM may place an image before the message's text): see `certain_prefix`.
    """
    messages = list(values.get("messages") or [])[:first_message + 1]
    last = dict(messages[-1]) if isinstance(messages[-1], dict) else {"role": "user"}
    last["content"] = sentinel
    messages[-1] = last
    body = {k: v for k, v in values.items() if k not in ("messages", "nvext")}
    body["messages"] = messages
    return body


def certain_prefix(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """The tokens both renders share, minus the last one: a tokenizer may merge the boundary token with what
    follows it (the sentinel here, the media placeholder in the real prompt), so only the tokens before the
    last shared one are certainly the real prompt's. Assumes a causal chat template (a message renders from
    the messages up to it), the assumption every multi-turn prefix cache already makes."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return list(a[:max(n - 1, 0)])
