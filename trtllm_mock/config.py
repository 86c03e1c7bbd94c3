"""Configuration of one mock worker: a plain dataclass so the CLI, tests and benchmarks share one source of truth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["worker", "renderer"]
SeqStart = Literal["zero", "time_ns"]
EventEncoding = Literal["compact", "int64"]
EventDialect = Literal["trtllm", "vllm", "vllm-array", "sglang"]
ErrorShape = Literal["current", "legacy"]
RenderDialect = Literal["trtllm", "vllm"]
Scheduler = Literal["independent", "iteration"]
KvAdmission = Literal["auto", "reserve", "preempt"]
HostOffload = Literal["auto", "evict", "compute"]
VLLM_DIALECTS = ("vllm", "vllm-array")  # whose engine allocates as it goes and offloads on compute (auto)

# Step-time constants fitted to TensorRT-LLM's published throughput of Llama-3.1-8B-Instruct-FP8 on one H100
# SXM 80GB (docs/source/performance/perf-overview.md, "Llama 3.1 8B FP8", TP 1, 11 ISL/OSL rows): a
# least-squares fit of  request time = p*ISL + d*OSL + kv*OSL*(ISL + OSL/2)  reproduces every row within 8%.
# The fixed per-step cost is not in those tables (it amortises away at their batch sizes): 3 ms is one read of
# the ~8 GB of FP8 weights at ~2.7 TB/s (80% of the H100's 3.35 TB/s). README.md shows the derivation.
LLAMA_8B_H100: dict[str, float] = {
    "step_base_ms": 3.0,
    "step_prefill_ms_per_token": 0.0142,
    "step_decode_ms_per_token": 0.0155,
    "step_kv_read_ms_per_token": 2.55e-5,
}

# Vision encoder time per 14x14 patch: Qwen2.5-VL's ViT has 675M parameters (Qwen2.5-VL technical report, Table 1:
# 32 layers, hidden 1280; vLLM's Qwen2.5-VL recipe quotes "ViT 675M, LM 72B"), run in BF16. The same H100 that the
# text timing is fitted to computes ~70k prefill tokens/s of the 8B FP8 model (0.0142 ms/token above); a patch costs
# 675M/8B of a token's matrix work at half the FP8 rate (BF16): 0.0142 * 0.0844 * 2 = 0.0024 ms. A 980x980 image
# (4,900 patches, 1,225 LLM tokens) then encodes in ~12 ms, ~0.7x the ~17 ms its 1,225 tokens cost to prefill.
# Derived, not measured: docs/mock-vision.md says so.
ENCODER_MS_PER_PATCH = 0.0024

# Off-GPU tiers' load time (issue 44), fixed here so that no benchmark can tune it. One token's KV bytes of
# Llama-3.1-8B in FP8: K and V x 32 layers x 8 KV heads x head_dim 128 x 1 byte = 65,536 B = 64 KiB (the model's
# config.json: num_hidden_layers 32, num_key_value_heads 8, head_dim 128; read in a derivative's copy,
# huggingface.co NbAiLab/nb-llama-3.1-8B config.json, "_name_or_path": "meta-llama/Llama-3.1-8B"; the original
# repository is gated). Host memory -> GPU at an effective 25 GB/s (PCIe Gen5 x16's 64 GB/s at about 40%):
# 2.62 us per token; storage at 5 GB/s: 13.1 us per token. Scaled as the mock scales its prefill time: as a
# fraction of the fitted H100 prefill cost per token above (0.0142 ms), so a mock running prefill N x faster
# or slower loads N x faster or slower too.
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 1
HOST_TO_GPU_BYTES_PER_S = 25e9
STORAGE_TO_GPU_BYTES_PER_S = 5e9
LOAD_VS_PREFILL: dict[str, float] = {
    "CPU": KV_BYTES_PER_TOKEN / HOST_TO_GPU_BYTES_PER_S * 1000.0 / LLAMA_8B_H100["step_prefill_ms_per_token"],
    "DISK": KV_BYTES_PER_TOKEN / STORAGE_TO_GPU_BYTES_PER_S * 1000.0 / LLAMA_8B_H100["step_prefill_ms_per_token"],
}


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
    # Off-GPU tiers (issue 44): blocks evicted from the GPU go to host memory, from there to storage, then away;
    # a prompt continuing into them loads them (LOAD_VS_PREFILL) instead of computing them. Published as vLLM's
    # self-describing offload events (vllm, vllm-array) or SGLang HiCache's media (sglang); the trtllm dialect
    # publishes no tier moves, as the engine (its host tier is invisible to a picker). 0 = no such tier.
    host_blocks: int = 0
    storage_blocks: int = 0
    # When a block reaches host memory: compute = as soon as its prefill computes it (vLLM's OffloadingConnector
    # stores every block that fills up, each scheduler step: offloading/scheduler.py `_get_reqs_to_store`),
    # evict = when the GPU evicts it. auto: compute for the vLLM dialects, evict otherwise.
    host_offload: HostOffload = "auto"
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
    dp_rank: int = 0  # like the engines, rank r binds the PUB and replay ports + r
    # Publisher behaviours of the other engines, so the picker is tested against each one's wire form:
    # trtllm (maps, no salt, 4-frame replay), vllm (0.32+: maps in a map envelope, salt in the first block's
    # extra_keys, 4-frame replay), vllm-array (<= 0.31: positional arrays, 3-frame replay), sglang (0.5: maps
    # with a typed cache_salt, 3-frame replay).
    event_dialect: EventDialect = "trtllm"
    replay_hwm: int = 0  # send HWM of the replay ROUTER (0: ZeroMQ's 1000); small values drop replay frames
    tail_block_size: int = 0  # > 0: also publish each prompt's partial tail in blocks of this size (vLLM hybrid)
    bigram_pages: bool = False  # SGLang EAGLE: token_ids published as [t, next] pairs

    # Vision mode (docs/mock-vision.md): image_url parts are expanded Qwen2/2.5-VL style, keyed per item in the KV
    # cache and its events, and charged encoder time when not cached. Off: a text-only model (images are 400s).
    multimodal: bool = False
    url_image_size: str = "640x480"  # http(s) images are never fetched: they stand in as an image of this size
    encoder_ms_per_patch: float = ENCODER_MS_PER_PATCH
    encoder_cache_tokens: int = 8192  # vLLM: encoder_cache_size = max_num_batched_tokens embeddings
    # Render answers: trtllm (TensorRT-LLM's render objects; media refused) or vllm (vLLM's GenerateRequest, with
    # multimodal features when --multimodal).
    render_dialect: RenderDialect = "trtllm"

    # Timing model.
    prefill_ms_per_token: float = 0.01
    decode_ms_per_token: float = 0.5
    max_batch_size: int = 64
    speedup: float = 1.0

    # Disaggregated serving (trtllm_mock/disagg.py): how long a context worker keeps a finished context's
    # blocks for the generation worker, and the simulated KV transfer time per block (before ``speedup``).
    disagg_handoff_timeout_s: float = 30.0
    disagg_transfer_ms_per_block: float = 0.0

    # Prompt rendering (chat template + tokenizer) on the HTTP side, before the scheduler sees the request.
    chat_template: str = "chatml"  # a key of tokenizer.CHAT_TEMPLATES; part of the render fingerprint
    tokenizer_identity_complete: bool = True  # False: fingerprint.compared.tokenizer.complete is false
    render_us_per_char: float = 0.0  # CPU burnt per character of prompt text this server must render
    render_threads: int = 1  # threads that render (templating + tokenizing holds about one core)
    prompt_tokens_excluded_from_usage: int = 0  # render-context value (kimi_k3-like templates: > 0)
    # Iteration-level scheduling (opt-in: scheduler="iteration"; the default keeps the fast independent model).
    # One engine loop runs steps: every decoding request gets one token, then waiting prefills fill the rest of
    # the max_num_tokens budget in chunks (chunked prefill). A step lasts
    #   step_base_ms + prefill_tokens*step_prefill_ms_per_token + decode_tokens*step_decode_ms_per_token
    #   + context_tokens_of_decoding_requests*step_kv_read_ms_per_token   (all / speedup),
    # so a prefill-heavy step slows every decode in it. prefill_ms_per_token/decode_ms_per_token are unused.
    scheduler: Scheduler = "independent"
    max_num_tokens: int = 8192
    step_base_ms: float = LLAMA_8B_H100["step_base_ms"]
    step_prefill_ms_per_token: float = LLAMA_8B_H100["step_prefill_ms_per_token"]
    step_decode_ms_per_token: float = LLAMA_8B_H100["step_decode_ms_per_token"]
    step_kv_read_ms_per_token: float = LLAMA_8B_H100["step_kv_read_ms_per_token"]
    # How a request gets KV room (iteration scheduler). reserve: prompt + max_tokens at admission, then it never
    # waits again (TensorRT-LLM's default GUARANTEED_NO_EVICT capacity scheduler). preempt: the prompt's blocks at
    # admission, one more block whenever decoding crosses into it; when none is free the NEWEST running request
    # is preempted (its blocks freed, back to the front of the queue, recomputed on resume), as vLLM V1's
    # scheduler does (vllm/v1/core/sched/scheduler.py, vllm-project/vllm 00024d31: allocate_slots per step,
    # self.running.pop() on failure). auto: preempt for the vLLM event dialects, reserve otherwise.
    kv_admission: KvAdmission = "auto"

    @property
    def offloads_on_compute(self) -> bool:
        """Whether a block is stored to host memory when computed rather than when evicted (``host_offload``)."""
        if self.host_offload == "auto":
            return self.event_dialect in VLLM_DIALECTS
        return self.host_offload == "compute"

    @property
    def preempts(self) -> bool:
        """Whether the iteration scheduler allocates as it goes and preempts (see ``kv_admission``)."""
        if self.scheduler != "iteration":
            return False
        if self.kv_admission == "auto":
            return self.event_dialect in VLLM_DIALECTS
        return self.kv_admission == "preempt"

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
        if self.event_dialect not in ("trtllm", "vllm", "vllm-array", "sglang"):
            raise ValueError("event_dialect must be trtllm, vllm, vllm-array or sglang")
        if self.replay_hwm < 0 or self.tail_block_size < 0 or self.dp_rank < 0:
            raise ValueError("replay_hwm, tail_block_size and dp_rank must be >= 0")
        if self.tail_block_size >= self.tokens_per_block:
            raise ValueError("tail_block_size must be smaller than tokens_per_block")
        if self.scheduler not in ("independent", "iteration"):
            raise ValueError("scheduler must be 'independent' or 'iteration'")
        if self.max_num_tokens < 1:
            raise ValueError("max_num_tokens must be >= 1")
        if min(self.step_base_ms, self.step_prefill_ms_per_token, self.step_decode_ms_per_token,
               self.step_kv_read_ms_per_token) < 0:
            raise ValueError("step times must be >= 0")
        if self.render_dialect not in ("trtllm", "vllm"):
            raise ValueError("render_dialect must be trtllm or vllm")
        if self.encoder_ms_per_patch < 0 or self.encoder_cache_tokens < 0:
            raise ValueError("encoder_ms_per_patch and encoder_cache_tokens must be >= 0")
        from .vision import parse_image_size

        parse_image_size(self.url_image_size)
        if self.disagg_handoff_timeout_s <= 0 or self.disagg_transfer_ms_per_block < 0:
            raise ValueError("disagg_handoff_timeout_s must be > 0 and disagg_transfer_ms_per_block >= 0")
        if self.host_blocks < 0 or self.storage_blocks < 0:
            raise ValueError("host_blocks and storage_blocks must be >= 0")
        if (self.host_blocks or self.storage_blocks) and self.multimodal:
            raise ValueError("host_blocks/storage_blocks: off-GPU tiers are text-only in the mock (no media keys)")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
        if self.host_offload not in ("auto", "evict", "compute"):
            raise ValueError("host_offload must be auto, evict or compute")
        if self.kv_admission not in ("auto", "reserve", "preempt"):
            raise ValueError("kv_admission must be auto, reserve or preempt")
        if self.kv_admission == "preempt" and self.scheduler != "iteration":
            raise ValueError("kv_admission preempt needs scheduler iteration (preemption happens between steps)")
