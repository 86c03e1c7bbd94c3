"""Strict request validation by pydantic models, as trtllm-serve's own ``extra="forbid"`` models do it.

The real server rejects unknown top-level fields (``nvext`` included, even when null). A picker that forgets
to strip its own fields must get a 400 here, not a silent success. Each route is a model whose fields are the
allow-list; the fields the mock reads are typed (strictly: ``"5"`` is not an integer), the rest accept any JSON
value (the mock ignores them). pydantic's errors become the 400 text in one place (`_field_errors`), printed
as pydantic prints a ValidationError (`format_errors`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

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


# ------------------------------------------------------------------ the models (pydantic, as trtllm-serve)
_STRICT = ConfigDict(extra="forbid", strict=True)
_LOOSE = ConfigDict(extra="allow", strict=True)


def _in_vocab(t: int) -> int:
    if not 0 <= t < VOCAB_SIZE:
        raise ValueError(f"token id {t} is outside the vocabulary [0, {VOCAB_SIZE})")
    return t


def _priority(p: float) -> float:
    if not 0.0 <= p <= 1.0:
        raise PydanticCustomError("value_error", "Input should be between 0.0 and 1.0")
    return p


def _stop(v: Any) -> Any:
    if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        return v
    raise PydanticCustomError("string_type", "Input should be a valid string or a list of strings")


def _a_dict(v: Any) -> Any:
    if not isinstance(v, dict):
        raise PydanticCustomError("dict_type", "Input should be a valid dictionary")
    return v


def _content(v: Any) -> Any:
    """A message's content: null, a string, or a list of parts (only the list has more to check)."""
    if v is None or isinstance(v, str):
        return None
    if not isinstance(v, list):
        raise PydanticCustomError("union_tag_invalid", "Input should be a valid string or a list of content parts")
    return v


def _part(v: Any) -> Any:
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise PydanticCustomError("missing", "Field required")  # reported at `.type` (see _LOC_SUFFIX)
    return v


def _prompt_kind(v: Any) -> str | None:
    if isinstance(v, str):
        return "text"
    if isinstance(v, list) and v and all(isinstance(p, str) for p in v):
        return "texts"
    if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return "ids"
    if isinstance(v, list) and v and all(isinstance(p, list) for p in v):
        return "id_lists"
    return None


def _a_prompt(v: Any) -> Any:
    if _prompt_kind(v) is None:
        raise PydanticCustomError("union_tag_invalid", "Input should be a string, a list of strings, a list of "
                                  "token ids or a list of such lists")
    return v


TokenId = Annotated[int, AfterValidator(_in_vocab)]
NonNegInt = Annotated[int, Field(ge=1)]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ContentPart(BaseModel):
    model_config = _LOOSE
    type: str
    text: Any = Field(default=None, validate_default=True)

    @field_validator("text")
    @classmethod
    def _text_of_a_text_part(cls, v: Any, info: ValidationInfo) -> Any:
        if info.data.get("type") == "text" and not isinstance(v, str):
            raise PydanticCustomError("string_type", "Input should be a valid string")
        return v


class Message(BaseModel):
    model_config = _LOOSE
    role: str
    content: Annotated[list[Annotated[ContentPart, BeforeValidator(_part)]] | None, BeforeValidator(_content)] = None


class _Common(BaseModel):
    """The fields both routes share; the ones the mock reads are typed, the rest take any JSON value."""

    model_config = _STRICT
    model: str
    max_tokens: NonNegInt | None = None
    n: NonNegInt | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    top_k: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    echo: bool | None = None
    add_special_tokens: bool | None = None
    skip_special_tokens: bool | None = None
    user: str | None = None
    stop: Annotated[Any, AfterValidator(_stop)] = None
    stop_token_ids: list[TokenId] | None = None
    priority: Annotated[float, AfterValidator(_priority)] | None = None
    logit_bias: Any = None
    logprobs: Any = None
    response_format: Any = None
    best_of: Any = None
    use_beam_search: Any = None
    top_p_min: Any = None
    length_penalty: Any = None
    early_stopping: Any = None
    include_stop_str_in_output: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    lora_request: Any = None
    disaggregated_params: Any = None
    conversation_params: Any = None
    prompt_ignore_length: Any = None
    thinking_token_budget: Any = None

    def _stream_options_need_stream(self, msg: str) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError(msg)


class ChatCompletionRequest(_Common):
    messages: list[Annotated[Message, BeforeValidator(_a_dict)]]
    prompt_token_ids: list[TokenId] | None = None
    max_completion_tokens: NonNegInt | None = None
    add_generation_prompt: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    cache_salt: Any = None
    prompt_token_ids_b64: Any = None
    top_logprobs: Any = None
    parallel_tool_calls: Any = None
    reasoning_effort: Any = None
    thinking: Any = None
    documents: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    injected_chat_template_kwargs: Any = None
    media_io_kwargs: Any = None
    agent_hierarchy: Any = None
    mm_processor_kwargs: Any = None

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, v: Any) -> Any:
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise ValueError(CACHE_SALT_ERROR)
        return v

    @model_validator(mode="after")
    def _whole(self) -> ChatCompletionRequest:
        if self.tool_choice is not None and self.tool_choice not in ("none", "auto") and not self.tools:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        self._stream_options_need_stream("stream_options can only be set if stream is true")
        return self


class CompletionRequest(_Common):
    prompt: Annotated[
        Annotated[str, Tag("text")] | Annotated[list[str], Tag("texts")] | Annotated[list[TokenId], Tag("ids")]
        | Annotated[list[list[TokenId]], Tag("id_lists")],
        Discriminator(_prompt_kind), BeforeValidator(_a_prompt),
    ]
    suffix: Any = None
    return_context_logits: Any = None
    detokenize: Any = None

    @model_validator(mode="after")
    def _whole(self) -> CompletionRequest:
        self._stream_options_need_stream("Stream options can only be defined when stream is true.")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


_TAGS = frozenset({"text", "texts", "ids", "id_lists"})  # a tagged union's branch names, not body locations


def _loc(model: str, loc: tuple[str | int, ...]) -> str:
    parts = [str(p) for i, p in enumerate(loc)
             if not (model == "CompletionRequest" and i == 1 and loc[0] == "prompt" and p in _TAGS)]
    return ".".join(parts)


def _field_errors(model: str, exc: ValidationError) -> list[FieldError]:
    """The one place pydantic's errors become the mock's 400 text: dotted locations without union tags, a bad
    content part reported at its `.type`, unknown top-level fields first (in the body's order), then the rest
    in pydantic's (the models' field order)."""
    out: list[FieldError] = []
    for e in exc.errors(include_url=False, include_context=False):
        loc = _loc(model, e["loc"])
        if e["type"] == "missing" and len(e["loc"]) == 4 and e["loc"][2] == "content":
            loc += ".type"  # a part that is not an object with a string `type` (`_part`)
        out.append(FieldError(loc, e["msg"], e["type"], e["input"]))
    extras = [f for f in out if f.type == "extra_forbidden" and "." not in f.loc]
    return extras + [f for f in out if not (f.type == "extra_forbidden" and "." not in f.loc)]


def _validate(model: type[BaseModel], body: dict[str, Any]) -> None:
    try:
        model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(model.__name__, _field_errors(model.__name__, e)) from None


def validate_chat(body: dict[str, Any]) -> dict[str, Any]:
    """Validate a chat-completions body like ``ChatCompletionRequest`` (extra="forbid"); returns it unchanged."""
    _validate(ChatCompletionRequest, body)
    if body.get("prompt_token_ids") is not None and not body["prompt_token_ids"]:
        raise RequestRejected("prompt_token_ids must not be empty")
    return body


def validate_completion(body: dict[str, Any]) -> dict[str, Any]:
    """Validate a completions body like ``CompletionRequest``; note it has NO ``cache_salt`` field."""
    _validate(CompletionRequest, body)
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
