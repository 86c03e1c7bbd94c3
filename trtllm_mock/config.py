"""Configuration of one mock worker: a plain dataclass so the CLI, tests and benchmarks share one source of truth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["worker", "renderer"]
SeqStart = Literal["zero", "time_ns"]
EventEncoding = Literal["compact", "int64"]
ErrorShape = Literal["current", "legacy"]


@dataclass
class MockConfig:
    """Everything that shapes how the mock behaves.

    Defaults are tuned for fast tests (sub-millisecond per token); README.md lists realistic settings for
    benchmarks. The CLI is a thin layer that fills this in, so tests build it directly.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    name: str = "trtllm-mock"
    model: str = "mock-model"
    role: Role = "worker"
    enable_render_endpoints: bool = False
    error_shape: ErrorShape = "current"

    # Simulated paged KV cache.
    tokens_per_block: int = 32
    num_blocks: int = 4096
    max_seq_len: int = 32768
    default_max_tokens: int = 16

    # Native KV events.
    kv_events: bool = True
    kv_events_endpoint: str = "tcp://*:5557"
    kv_events_topic: str = ""
    replay_endpoint: str | None = None
    replay_buffer: int = 1000
    seq_start: SeqStart = "zero"
    heartbeat_interval: float = 5.0
    event_encoding: EventEncoding = "compact"
    dp_rank: int = 0

    # Timing model.
    prefill_ms_per_token: float = 0.01
    decode_ms_per_token: float = 0.5
    max_batch_size: int = 64
    speedup: float = 1.0

    # Prompt rendering (chat template + tokenizer) on the HTTP side, before the scheduler sees the request.
    chat_template: str = "chatml"  # a key of tokenizer.CHAT_TEMPLATES; part of the render fingerprint
    tokenizer_identity_complete: bool = True  # False: fingerprint.compared.tokenizer.complete is false
    render_us_per_char: float = 0.0  # CPU burnt per character of prompt text this server must render
    render_threads: int = 1  # threads that render (templating + tokenizing holds about one core)
    prompt_tokens_excluded_from_usage: int = 0  # render-context value (kimi_k3-like templates: > 0)

    def validate(self) -> None:
        """Reject nonsensical settings up front, so a typo fails at start rather than as odd behaviour later."""
        if self.role not in ("worker", "renderer"):
            raise ValueError(f"role must be 'worker' or 'renderer', got {self.role!r}")
        if self.tokens_per_block < 1:
            raise ValueError("tokens_per_block must be >= 1")
        if self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.speedup <= 0:
            raise ValueError("speedup must be > 0")
        if self.prefill_ms_per_token < 0 or self.decode_ms_per_token < 0:
            raise ValueError("per-token times must be >= 0")
        if self.heartbeat_interval < 0:
            raise ValueError("heartbeat_interval must be >= 0 (0 disables heartbeats)")
        if self.replay_buffer < 1:
            raise ValueError("replay_buffer must be >= 1")
        if self.seq_start not in ("zero", "time_ns"):
            raise ValueError("seq_start must be 'zero' or 'time_ns'")
        if self.event_encoding not in ("compact", "int64"):
            raise ValueError("event_encoding must be 'compact' or 'int64'")
        if self.error_shape not in ("current", "legacy"):
            raise ValueError("error_shape must be 'current' or 'legacy'")
        from .tokenizer import CHAT_TEMPLATES

        if self.chat_template not in CHAT_TEMPLATES:
            raise ValueError(f"chat_template must be one of {sorted(CHAT_TEMPLATES)}")
        if self.render_us_per_char < 0:
            raise ValueError("render_us_per_char must be >= 0")
        if self.render_threads < 1:
            raise ValueError("render_threads must be >= 1")
        if self.prompt_tokens_excluded_from_usage < 0:
            raise ValueError("prompt_tokens_excluded_from_usage must be >= 0")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
