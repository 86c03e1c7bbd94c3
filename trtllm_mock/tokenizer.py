"""Deterministic tokenizer, chat template and output generator shared by render and inference.

Why one module: the picker's whole premise is that the token ids a renderer returns are the ids the engine
caches. Render and inference both call :func:`prompt_ids_for_chat` / :func:`prompt_ids_for_completion`, so a
mismatch can only come from the picker, never from two diverging copies inside the mock.

The tokenizer splits text with a regex into pieces (a word or a single punctuation character, each carrying
the whitespace in front of it; trailing whitespace is its own piece) and maps every piece to
``VOCAB_OFFSET + blake2b(piece) mod (VOCAB_SIZE - VOCAB_OFFSET)``. Special tokens are split out first and have
fixed small ids. Because pieces never span a special token, identical message prefixes always give identical
token prefixes.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

VOCAB_SIZE = 32000
VOCAB_OFFSET = 100
TOKENIZER_NAME = "trtllm-mock-regex-v1"

SPECIAL_TOKENS: dict[str, int] = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
_PIECE = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>tools\\n{{ tools | tojson(sort_keys) }}<|im_end|>\\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\\n{{ m.content }}<|im_end|>\\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}"
)
"""Documentation-only Jinja rendering of :func:`apply_chat_template`; its sha256 is part of the fingerprint."""

CHAT_TEMPLATES: dict[str, str] = {"chatml": CHAT_TEMPLATE, "chatml-bos": "<|endoftext|>" + CHAT_TEMPLATE}
"""Template variants a worker can be started with (``--chat-template``). ``chatml-bos`` starts every prompt
with ``<|endoftext|>``: the ids differ from ``chatml`` by one leading token, so a picker that forwards ids
rendered under the other template makes the worker run a different prompt (and its fingerprint differs)."""
DEFAULT_TEMPLATE = "chatml"

_OUTPUT_WORDS = tuple(
    " " + w
    for w in (
        "the quick brown fox jumps over a lazy dog while seven tired engineers watch cache blocks fill and"
        " drain under steady load so every token counts toward throughput latency and fairness in this"
        " simulated cluster of patient workers"
    ).split()
)

_reverse: dict[int, str] = {v: k for k, v in SPECIAL_TOKENS.items()}


def piece_id(piece: str) -> int:
    """Stable id of one non-special piece; remembered so generated tokens can be detokenized."""
    digest = hashlib.blake2b(piece.encode("utf-8"), digest_size=8).digest()
    tid = VOCAB_OFFSET + int.from_bytes(digest, "little") % (VOCAB_SIZE - VOCAB_OFFSET)
    _reverse.setdefault(tid, piece)
    return tid


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``; special-token strings inside it become their special ids."""
    ids: list[int] = []
    for segment in _SPECIAL_SPLIT.split(text):
        if not segment:
            continue
        special = SPECIAL_TOKENS.get(segment)
        if special is not None:
            ids.append(special)
            continue
        ids.extend(piece_id(p) for p in _PIECE.findall(segment))
    return ids


def detokenize(ids: Sequence[int]) -> str:
    """Best-effort text for ids this process has produced; unknown ids render as ``<id>`` placeholders."""
    return "".join(_reverse.get(i, f"<{i}>") for i in ids)


class MultimodalContentError(ValueError):
    """A message carries non-text content parts, which this text-only model (and prompt rendering) refuse."""


def message_text(content: Any) -> str:
    """Flatten a message ``content`` (string, null or list of text parts) into the text the template uses."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for part in content:
        if part.get("type") != "text":
            raise MultimodalContentError(part.get("type"))
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def apply_chat_template(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
    template: str = DEFAULT_TEMPLATE,
) -> str:
    """Render messages with the ChatML-like template ``<|im_start|>{role}\\n{content}<|im_end|>\\n``.

    Tools (if any) come first as a ``tools`` pseudo-message holding their sorted JSON, so requests with the
    same tools share a prefix. The generation prompt ``<|im_start|>assistant\\n`` closes the prompt.
    """
    out: list[str] = ["<|endoftext|>"] if template == "chatml-bos" else []
    if tools:
        out.append(
            f"<|im_start|>tools\n{json.dumps(tools, sort_keys=True, separators=(',', ':'))}<|im_end|>\n"
        )
    for m in messages:
        out.append(f"<|im_start|>{m['role']}\n{message_text(m.get('content'))}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def chat_prompt_text(body: dict[str, Any], template: str = DEFAULT_TEMPLATE) -> str:
    """The rendered prompt of a (validated) chat body without ``prompt_token_ids``."""
    return apply_chat_template(
        body["messages"],
        body.get("tools"),
        add_generation_prompt=body.get("add_generation_prompt", True),
        template=template,
    )


def prompt_ids_for_chat(body: dict[str, Any], template: str = DEFAULT_TEMPLATE) -> list[int]:
    """Prompt ids of a (validated) chat body: ``prompt_token_ids`` verbatim, else the templated messages."""
    if body.get("prompt_token_ids") is not None:
        return list(body["prompt_token_ids"])
    return tokenize(chat_prompt_text(body, template))


def prompt_ids_for_completion(prompt: str | list[int]) -> list[int]:
    """Prompt ids of ONE completions prompt: text is tokenized, a list of ints is taken as ids."""
    if isinstance(prompt, str):
        return tokenize(prompt)
    return list(prompt)


# Generated tokens always detokenize to their output word, whatever this process tokenized before: without
# this, a prompt word whose id collides with an output word's id (likely in a 32k vocabulary) would be the
# first to register it, and the answer text would depend on whether the worker ever saw the prompt as text
# (it does not when it gets prompt_token_ids), unlike a real tokenizer's fixed vocabulary.
for _w in _OUTPUT_WORDS:
    _reverse[piece_id(_w)] = _w


def output_token_ids(prompt_ids: Sequence[int], count: int) -> list[int]:
    """Deterministic "generated" tokens: the same prompt always yields the same continuation."""
    seed = hashlib.blake2b(b"".join(i.to_bytes(4, "little", signed=True) for i in prompt_ids), digest_size=8)
    base = seed.digest()
    out: list[int] = []
    for k in range(count):
        h = hashlib.blake2b(base + k.to_bytes(4, "little"), digest_size=4).digest()
        out.append(piece_id(_OUTPUT_WORDS[int.from_bytes(h, "little") % len(_OUTPUT_WORDS)]))
    return out


def fingerprint(model: str, template: str = DEFAULT_TEMPLATE, complete: bool = True) -> dict[str, Any]:
    """The render fingerprint: what a picker compares to know its renderer tokenizes like this worker.

    Shaped like TensorRT-LLM's (``serve/render/fingerprint.py``): ``digest`` is a sha256 over ``compared``,
    and ``compared.tokenizer.complete`` says whether the whole encoding could be identified; TensorRT-LLM
    never trusts ids rendered under an incomplete identity, even when both digests agree.
    """
    compared = {
        "version": 2,
        "model": model,
        "use_harmony": False,
        "templates": {"server": hashlib.sha256(CHAT_TEMPLATES[template].encode()).hexdigest()},
        "tokenizer": {
            "class": TOKENIZER_NAME,
            "vocab_size": VOCAB_SIZE,
            "special_tokens": SPECIAL_TOKENS,
            "complete": complete,
        },
    }
    digest = hashlib.sha256(json.dumps(compared, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    info = {"tokenizer_class": "MockRegexTokenizer", "renderer": "trtllm_mock"}
    return {"digest": digest, "compared": compared, "info": info}
