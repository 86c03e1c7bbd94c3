"""Strict request validation with pydantic-style error text, mirroring trtllm-serve's ``extra="forbid"`` models.

The real server rejects unknown top-level fields (``nvext`` included, even when null). A picker that forgets
to strip its own fields must get a 400 here, not a silent success. Fields are an explicit allow-list per
route; the key ones are type-checked, the rest are accepted with any JSON value (the mock ignores them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .tokenizer import VOCAB_SIZE

COMMON_FIELDS = frozenset(
    {
        "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
        "response_format", "seed", "stop", "stream", "stream_options", "temperature", "top_p", "user",
        "best_of", "use_beam_search", "top_k", "top_p_min", "min_p", "repetition_penalty", "length_penalty",
        "early_stopping", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
        "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "lora_request",
        "add_special_tokens", "disaggregated_params", "priority", "conversation_params", "echo",
        "prompt_ignore_length", "thinking_token_budget",
    }
)  # fmt: skip
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "prompt_token_ids", "prompt_token_ids_b64", "top_logprobs", "max_completion_tokens", "tools",
    "tool_choice", "parallel_tool_calls", "reasoning_effort", "thinking", "add_generation_prompt", "documents",
    "chat_template", "chat_template_kwargs", "injected_chat_template_kwargs", "media_io_kwargs", "cache_salt",
    "agent_hierarchy", "mm_processor_kwargs",
}  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "suffix", "return_context_logits", "detokenize"}
STREAM_OPTION_FIELDS = frozenset({"include_usage", "continuous_usage_stats"})
RENDER_STRIPPED_FIELDS = ("nvext", "cache_namespace")

CACHE_SALT_ERROR = "Parameter 'cache_salt' must be a non-empty string if provided."
MULTIMODAL_RENDER_ERROR = "Multimodal input is not supported by prompt rendering."


@dataclass
class FieldError:
    """One pydantic-style error line: location, message, error type and the offending input."""

    loc: str
    msg: str
    type: str
    value: Any


class RequestValidationError(Exception):
    """A body failed validation; ``str()`` is the pydantic-like text the real server returns."""

    def __init__(self, model: str, errors: list[FieldError]) -> None:
        self.model = model
        self.errors = errors
        super().__init__(format_errors(model, errors))


class RequestRejected(Exception):
    """A well-formed request the server still refuses (plain message, no pydantic framing)."""


def _type_name(value: Any) -> str:
    return {type(None): "NoneType", bool: "bool", int: "int", float: "float", str: "str", list: "list",
            dict: "dict"}.get(type(value), type(value).__name__)  # fmt: skip


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 50 else text[:24] + "..." + text[-24:]


def format_errors(model: str, errors: list[FieldError]) -> str:
    """Render errors the way pydantic v2 prints a ValidationError (the text clients and logs grep for)."""
    head = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''} for {model}"
    lines = [head]
    for e in errors:
        lines.append(e.loc)
        lines.append(
            f"  {e.msg} [type={e.type}, input_value={_short_repr(e.value)}, input_type={_type_name(e.value)}]"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ checkers
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class _Checker:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.errors: list[FieldError] = []

    def err(self, loc: str, msg: str, typ: str, value: Any) -> None:
        self.errors.append(FieldError(loc, msg, typ, value))

    def optional(self, name: str, check: Callable[[str, Any], None]) -> None:
        if name in self.body and self.body[name] is not None:
            check(name, self.body[name])

    def int_(self, loc: str, v: Any, ge: int | None = None) -> None:
        if not _is_int(v):
            self.err(loc, "Input should be a valid integer", "int_type", v)
        elif ge is not None and v < ge:
            self.err(loc, f"Input should be greater than or equal to {ge}", "greater_than_equal", v)

    def num(self, loc: str, v: Any) -> None:
        if not _is_num(v):
            self.err(loc, "Input should be a valid number", "float_type", v)

    def bool_(self, loc: str, v: Any) -> None:
        if not isinstance(v, bool):
            self.err(loc, "Input should be a valid boolean", "bool_type", v)

    def str_(self, loc: str, v: Any) -> None:
        if not isinstance(v, str):
            self.err(loc, "Input should be a valid string", "string_type", v)

    def token_ids(self, loc: str, v: Any) -> None:
        if not isinstance(v, list):
            self.err(loc, "Input should be a valid list", "list_type", v)
            return
        for i, t in enumerate(v):
            if not _is_int(t):
                self.err(f"{loc}.{i}", "Input should be a valid integer", "int_type", t)
            elif not 0 <= t < VOCAB_SIZE:
                self.err(f"{loc}.{i}", f"Value error, token id {t} is outside the vocabulary [0, {VOCAB_SIZE})",
                         "value_error", t)  # fmt: skip

    def stop(self, loc: str, v: Any) -> None:
        if isinstance(v, str):
            return
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            self.err(loc, "Input should be a valid string or a list of strings", "string_type", v)

    def stream_options(self, loc: str, v: Any) -> None:
        if not isinstance(v, dict):
            self.err(loc, "Input should be a valid dictionary or instance of StreamOptions", "model_type", v)
            return
        for k, item in v.items():
            if k not in STREAM_OPTION_FIELDS:
                self.err(f"{loc}.{k}", "Extra inputs are not permitted", "extra_forbidden", item)
            elif item is not None:
                self.bool_(f"{loc}.{k}", item)

    def extra(self, allowed: frozenset[str] | set[str]) -> None:
        for k, v in self.body.items():
            if k not in allowed:
                self.err(k, "Extra inputs are not permitted", "extra_forbidden", v)

    def common(self) -> None:
        b = self.body
        if "model" not in b:
            self.err("model", "Field required", "missing", b)
        else:
            self.str_("model", b["model"])
        self.optional("max_tokens", lambda n, v: self.int_(n, v, ge=1))
        self.optional("n", lambda n, v: self.int_(n, v, ge=1))
        self.optional("stream", self.bool_)
        self.optional("stream_options", self.stream_options)
        for f in (
            "temperature",
            "top_p",
            "frequency_penalty",
            "presence_penalty",
            "min_p",
            "repetition_penalty",
        ):
            self.optional(f, self.num)
        for f in ("seed", "top_k", "min_tokens"):
            self.optional(f, self.int_)
        for f in ("ignore_eos", "echo", "add_special_tokens", "skip_special_tokens"):
            self.optional(f, self.bool_)
        self.optional("user", self.str_)
        self.optional("stop", self.stop)
        self.optional("stop_token_ids", self.token_ids)
        if "priority" in b and b["priority"] is not None:
            p = b["priority"]
            if not _is_num(p):
                self.err("priority", "Input should be a valid number", "float_type", p)
            elif not 0.0 <= p <= 1.0:
                self.err("priority", "Input should be between 0.0 and 1.0", "value_error", p)

    def model_validators(self, stream_options_msg: str) -> None:
        b = self.body
        if b.get("stream_options") is not None and not b.get("stream"):
            self.err("", f"Value error, {stream_options_msg}", "value_error", b)
        if b.get("suffix"):
            self.err("", "Value error, suffix is not supported", "value_error", b)


def _messages(c: _Checker, v: Any) -> None:
    if not isinstance(v, list):
        c.err("messages", "Input should be a valid list", "list_type", v)
        return
    for i, m in enumerate(v):
        loc = f"messages.{i}"
        if not isinstance(m, dict):
            c.err(loc, "Input should be a valid dictionary", "dict_type", m)
            continue
        if "role" not in m:
            c.err(f"{loc}.role", "Field required", "missing", m)
        elif not isinstance(m["role"], str):
            c.err(f"{loc}.role", "Input should be a valid string", "string_type", m["role"])
        content = m.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            c.err(f"{loc}.content", "Input should be a valid string or a list of content parts", "union_tag_invalid",
                  content)  # fmt: skip
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                c.err(f"{loc}.content.{j}.type", "Field required", "missing", part)
            elif part["type"] == "text" and not isinstance(part.get("text"), str):
                c.err(
                    f"{loc}.content.{j}.text",
                    "Input should be a valid string",
                    "string_type",
                    part.get("text"),
                )


def validate_chat(body: dict[str, Any]) -> dict[str, Any]:
    """Validate a chat-completions body like ``ChatCompletionRequest`` (extra="forbid"); returns it unchanged."""
    c = _Checker(body)
    c.extra(CHAT_FIELDS)
    c.common()
    if "messages" not in body:
        c.err("messages", "Field required", "missing", body)
    else:
        _messages(c, body["messages"])
    c.optional("prompt_token_ids", c.token_ids)
    c.optional("max_completion_tokens", lambda n, v: c.int_(n, v, ge=1))
    c.optional("add_generation_prompt", c.bool_)
    c.optional("tools", lambda n, v: None if isinstance(v, list) else c.err(n, "Input should be a valid list",
                                                                             "list_type", v))  # fmt: skip
    if "cache_salt" in body and body["cache_salt"] is not None:
        salt = body["cache_salt"]
        if not isinstance(salt, str) or not salt.strip():
            c.err("cache_salt", f"Value error, {CACHE_SALT_ERROR}", "value_error", salt)
    tc = body.get("tool_choice")
    if tc is not None and tc not in ("none", "auto") and not body.get("tools"):
        c.err("", "Value error, When using `tool_choice`, `tools` must be set.", "value_error", body)
    c.model_validators("stream_options can only be set if stream is true")
    if c.errors:
        raise RequestValidationError("ChatCompletionRequest", c.errors)
    if body.get("prompt_token_ids") is not None and not body["prompt_token_ids"]:
        raise RequestRejected("prompt_token_ids must not be empty")
    return body


def _prompt(c: _Checker, v: Any) -> None:
    if isinstance(v, str):
        return
    if isinstance(v, list) and v and all(isinstance(p, str) for p in v):
        return
    if isinstance(v, list) and all(_is_int(t) for t in v):
        c.token_ids("prompt", v)
        return
    if isinstance(v, list) and v and all(isinstance(p, list) for p in v):
        for i, p in enumerate(v):
            c.token_ids(f"prompt.{i}", p)
        return
    c.err("prompt", "Input should be a string, a list of strings, a list of token ids or a list of such lists",
          "union_tag_invalid", v)  # fmt: skip


def validate_completion(body: dict[str, Any]) -> dict[str, Any]:
    """Validate a completions body like ``CompletionRequest``; note it has NO ``cache_salt`` field."""
    c = _Checker(body)
    c.extra(COMPLETION_FIELDS)
    c.common()
    if "prompt" not in body:
        c.err("prompt", "Field required", "missing", body)
    else:
        _prompt(c, body["prompt"])
    c.model_validators("Stream options can only be defined when stream is true.")
    if c.errors:
        raise RequestValidationError("CompletionRequest", c.errors)
    return body


def completion_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """Split a validated ``prompt`` into individual prompts (text or token ids), one per render object."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        return [[]]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    return [list(prompt)]


def multimodal_part_type(body: dict[str, Any]) -> str | None:
    """The first non-text content part type in a chat body, if any (render and this text model refuse it)."""
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") != "text":
                    return str(part.get("type"))
    return None
