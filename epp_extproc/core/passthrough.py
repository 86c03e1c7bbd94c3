"""Prompt passthrough: may the forwarded request carry the rendered prompt, so the worker skips rendering it?

The picker already renders every prompt (chat template + tokenizer) to route it; without passthrough the
TensorRT-LLM worker renders it again inside time-to-first-token. Forwarding the ids is only correct when the
worker would have produced exactly those ids AND would have made no other decision from the rendered text.
This module is the whole rule set, as a pure function of plain values, so the pipeline calls it in one place
and tests can enumerate it. The rules (the seed review thread, TensorRT-LLM's serve/render code):

- the worker's `/server_info` `render_fingerprint` and the render answer's `fingerprint` have the same
  `digest` and both are complete (`compared.tokenizer.complete`, or a Harmony model); missing = mismatch;
- the render answer trusts its ids (`tokens_trusted`; false e.g. for a named `tool_choice`, which the worker
  also refuses together with `prompt_token_ids`);
- the render context is trivial (`resolved_thinking` null, `prompt_tokens_excluded_from_usage` 0): a worker
  handed ids cannot re-derive those decisions;
- the request carries no media content part (image, video, audio, embeddings): the worker must still expand
  them into placeholder tokens whose count depends on the item, so ids rendered without them (a text prefix,
  or a renderer's estimate) are never an executable prompt;
- the request was not salted under the load-only policy, and the render call succeeded;
- completions: the render answered every prompt, and `echo` is off (the worker would echo the ids).

Chat keeps `messages` (required by the worker) and gets a top-level `prompt_token_ids`, never
`nvext.token_data` (TensorRT-LLM rejects `nvext`); completions get `prompt` = the ids (a list of ints, or a list
of lists for several prompts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from epp_extproc.core.render import Rendered

POLICIES = ("off", "auto")
TOKENS = "tokens"
ORIGINAL = "original"
REASONS = ("ok", "off", "media", "salted_load_only", "render_failed", "partial_render", "untrusted", "context",
           "echo", "fingerprint_mismatch", "too_large")  # too_large: decided by the pipeline after the rewrite


@dataclass(frozen=True, slots=True)
class FingerprintId:
    """The part of a render fingerprint that decides trust: its digest and whether it is complete."""

    digest: str
    complete: bool


def fingerprint_id(doc: Any) -> FingerprintId | None:
    """Read a `fingerprint` / `render_fingerprint` object; None when it is absent or has no digest.

    Complete means TensorRT-LLM could identify the whole encoding: `compared.tokenizer.complete` is true, or
    the model renders with Harmony (`compared.use_harmony`); a top-level `complete` flag, if a build sends
    one, is taken as is.
    """
    if not isinstance(doc, Mapping):
        return None
    digest = doc.get("digest")
    if not isinstance(digest, str) or not digest:
        return None
    if "complete" in doc:
        return FingerprintId(digest, doc["complete"] is True)
    compared = doc.get("compared")
    compared = compared if isinstance(compared, Mapping) else {}
    tokenizer = compared.get("tokenizer")
    complete = compared.get("use_harmony") is True or (
        isinstance(tokenizer, Mapping) and tokenizer.get("complete") is True)
    return FingerprintId(digest, complete)


def fingerprints_match(worker: FingerprintId | None, renderer: FingerprintId | None) -> bool:
    """Ids rendered under `renderer` may be executed by `worker` (TensorRT-LLM's `fingerprints_match`)."""
    return (worker is not None and renderer is not None and worker.complete and renderer.complete
            and worker.digest == renderer.digest)


@dataclass(slots=True)
class Verdict:
    """What the forwarded body carries: `forward` is TOKENS or ORIGINAL, `reason` one of REASONS."""

    forward: str
    reason: str
    inject: dict[str, Any] = field(default_factory=dict)  # members to set in the forwarded body


def prompt_count(prompt: Any) -> int:
    """How many prompts a completions `prompt` holds (text, list of texts, ids, or a list of id lists)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return len(prompt)
    return 1


def decide(policy: str, kind: str, values: Mapping[str, Any], rendered: Rendered | None, *,
           salted_load_only: bool, worker: FingerprintId | None, has_media: bool = False) -> Verdict:
    """The passthrough verdict for one request routed to one worker (`worker`: its fingerprint, if read).

    `rendered` is None when the render call failed or was skipped (a salted request under load-only);
    `has_media`: the request has a media content part (core/media.py).
    """
    if policy == "off":  # PassthroughPolicy.OFF is a StrEnum: equal to its string
        return Verdict(ORIGINAL, "off")
    if has_media:
        return Verdict(ORIGINAL, "media")
    if salted_load_only:
        return Verdict(ORIGINAL, "salted_load_only")
    if rendered is None:
        return Verdict(ORIGINAL, "render_failed")
    if kind == "completion" and (rendered.prompts is None
                                 or len(rendered.prompts) != prompt_count(values.get("prompt"))):
        return Verdict(ORIGINAL, "partial_render")
    if not rendered.tokens_trusted:
        return Verdict(ORIGINAL, "untrusted")
    if (not rendered.has_context or rendered.resolved_thinking is not None
            or rendered.prompt_tokens_excluded_from_usage > 0):
        return Verdict(ORIGINAL, "context")
    if kind == "completion" and values.get("echo"):
        return Verdict(ORIGINAL, "echo")
    if not fingerprints_match(worker, fingerprint_id(rendered.fingerprint)):
        return Verdict(ORIGINAL, "fingerprint_mismatch")
    if kind == "chat":
        member, ids = "prompt_token_ids", rendered.token_ids
    else:
        assert rendered.prompts is not None
        member, ids = "prompt", rendered.prompts if len(rendered.prompts) > 1 else rendered.prompts[0]
    if values.get(member) == ids:  # the client already sent these ids: forward its bytes untouched
        return Verdict(TOKENS, "ok")
    return Verdict(TOKENS, "ok", {member: ids})
