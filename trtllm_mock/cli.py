"""``trtllm-mock`` command line: parse flags into a MockConfig, run a MockWorker until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from .config import MockConfig
from .server import MockWorker


def build_parser() -> argparse.ArgumentParser:
    """All flags map 1:1 onto MockConfig fields (see README.md for what each one simulates)."""
    d = MockConfig()
    p = argparse.ArgumentParser(prog="trtllm-mock", description="A trtllm-serve double for picker tests.")
    a = p.add_argument
    a("--host", default=d.host)
    a("--port", type=int, default=d.port, help="HTTP port (0 = pick a free one)")
    a("--name", default=d.name, help="value of the x-trtllm-mock-worker header on every response")
    a("--model", default=d.model)
    a("--role", choices=["worker", "renderer"], default=d.role)
    a(
        "--enable-render-endpoints",
        action="store_true",
        default=os.environ.get("TRTLLM_ENABLE_RENDER_ENDPOINTS") == "1",
        help="serve the render routes on a worker (also TRTLLM_ENABLE_RENDER_ENDPOINTS=1)",
    )
    a("--error-shape", choices=["current", "legacy"], default=d.error_shape)
    a("--tokens-per-block", type=int, default=d.tokens_per_block)
    a("--num-blocks", type=int, default=d.num_blocks)
    a("--host-blocks", type=int, default=d.host_blocks,
      help="off-GPU tier: blocks of host memory that GPU evictions are offloaded to (0 = none; issue 44)")
    a("--storage-blocks", type=int, default=d.storage_blocks,
      help="off-GPU tier: blocks of storage that host-memory evictions go to (0 = none)")
    a("--host-offload", choices=["auto", "evict", "compute"], default=d.host_offload,
      help="when a block reaches host memory: once computed (vLLM's OffloadingConnector) or when the GPU evicts "
           "it; auto = compute for the vllm dialects")
    a("--max-seq-len", type=int, default=d.max_seq_len)
    a("--default-max-tokens", type=int, default=d.default_max_tokens)
    a("--no-kv-events", dest="kv_events", action="store_false", help="do not bind a KV-event PUB")
    a("--kv-events-endpoint", default=d.kv_events_endpoint)
    a("--kv-events-topic", default=d.kv_events_topic)
    a("--replay-endpoint", default=d.replay_endpoint)
    a("--replay-buffer", type=int, default=d.replay_buffer, help="batches kept for replay")
    a("--seq-start", choices=["zero", "time_ns"], default=d.seq_start)
    a("--heartbeat-interval", type=float, default=d.heartbeat_interval, help="seconds; 0 disables")
    a("--event-encoding", choices=["compact", "int64"], default=d.event_encoding)
    a("--dp-rank", type=int, default=d.dp_rank)
    a("--event-dialect", choices=["trtllm", "vllm", "vllm-array", "sglang"], default=d.event_dialect,
      help="whose KV-event wire form to publish")
    a("--prefill-ms-per-token", type=float, default=d.prefill_ms_per_token)
    a("--decode-ms-per-token", type=float, default=d.decode_ms_per_token)
    a("--max-batch-size", type=int, default=d.max_batch_size)
    a("--speedup", type=float, default=d.speedup)
    a("--chat-template", choices=["chatml", "chatml-bos"], default=d.chat_template,
      help="template variant; part of the render fingerprint (chatml-bos adds a leading <|endoftext|>)")
    a("--incomplete-tokenizer-identity", dest="tokenizer_identity_complete", action="store_false",
      help="report fingerprint.compared.tokenizer.complete = false (ids are then never to be trusted)")
    a("--render-us-per-char", type=float, default=d.render_us_per_char,
      help="CPU microseconds burnt per prompt character this server must template/tokenize itself")
    a("--render-threads", type=int, default=d.render_threads, help="threads that pay the render cost")
    a("--prompt-tokens-excluded-from-usage", type=int, default=d.prompt_tokens_excluded_from_usage,
      help="value the chat render answer reports in context.prompt_tokens_excluded_from_usage")
    a("--scheduler", choices=["independent", "iteration"], default=d.scheduler,
      help="iteration = engine steps with a token budget whose duration grows with their tokens")
    a("--max-num-tokens", type=int, default=d.max_num_tokens, help="per-step token budget (iteration)")
    a("--step-base-ms", type=float, default=d.step_base_ms)
    a("--step-prefill-ms-per-token", type=float, default=d.step_prefill_ms_per_token)
    a("--step-decode-ms-per-token", type=float, default=d.step_decode_ms_per_token)
    a("--step-kv-read-ms-per-token", type=float, default=d.step_kv_read_ms_per_token)
    a("--kv-admission", choices=["auto", "reserve", "preempt"], default=d.kv_admission,
      help="iteration: reserve prompt + max_tokens at admission (TensorRT-LLM) or allocate per step and preempt "
           "the newest request when full (vLLM); auto = preempt for the vllm event dialects")
    a("--multimodal", action="store_true", default=d.multimodal,
      help="vision mode: image_url parts become Qwen2/2.5-VL placeholder runs (docs/mock-vision.md)")
    a("--url-image-size", default=d.url_image_size, help="size an http(s) image stands in as (never fetched)")
    a("--encoder-ms-per-patch", type=float, default=d.encoder_ms_per_patch,
      help="vision encoder time per 14x14 patch of an uncached image")
    a("--encoder-cache-tokens", type=int, default=d.encoder_cache_tokens,
      help="encoder cache capacity in embeddings (vLLM: max_num_batched_tokens)")
    a("--render-dialect", choices=["trtllm", "vllm"], default=d.render_dialect,
      help="render answer shape: TensorRT-LLM's render objects or vLLM's GenerateRequest")
    a("--disagg-handoff-timeout-s", type=float, default=d.disagg_handoff_timeout_s,
      help="seconds a context worker keeps a context-only request's blocks for the generation worker")
    a("--disagg-transfer-ms-per-block", type=float, default=d.disagg_transfer_ms_per_block,
      help="simulated KV transfer time per block on a generation-only request")
    a("--log-level", default="INFO")
    return p


def config_from_args(argv: Sequence[str] | None = None) -> tuple[MockConfig, str]:
    """Parse ``argv`` into a config (and the log level), keeping the CLI free of behaviour of its own."""
    ns = vars(build_parser().parse_args(argv))
    log_level = ns.pop("log_level")
    return MockConfig(**ns), log_level


async def serve(config: MockConfig) -> None:
    """Start a worker, print its endpoints one per line, and wait for SIGINT/SIGTERM to stop cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with MockWorker(config) as worker:
        print(f"trtllm-mock {config.name} ({config.role}) HTTP {worker.url}", flush=True)
        if worker.kv_events_endpoint:
            print(f"trtllm-mock {config.name} KV events {worker.kv_events_endpoint}", flush=True)
        if worker.replay_endpoint:
            print(f"trtllm-mock {config.name} replay {worker.replay_endpoint}", flush=True)
        await stop.wait()
    print(f"trtllm-mock {config.name} stopped", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point (``trtllm-mock``)."""
    try:
        config, log_level = config_from_args(argv)
        config.validate()
    except ValueError as exc:
        print(f"trtllm-mock: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
