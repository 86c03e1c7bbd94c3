"""Reading usage from responses as they pass: SSE split anywhere, unary JSON, and what reaches the metrics."""

from __future__ import annotations

import json

from prometheus_client import generate_latest

from epp_extproc.core.decision import Decision
from epp_extproc.core.load import LoadTracker
from epp_extproc.core.usage import ModelLabels, UsageObserver
from epp_extproc.metrics import PickerMetrics

USAGE = {"prompt_tokens": 100, "completion_tokens": 4, "total_tokens": 104,
         "prompt_tokens_details": {"cached_tokens": 64}}


def observer(predicted: int | None = 32) -> tuple[UsageObserver, PickerMetrics]:
    m = PickerMetrics()
    d = Decision("a:1", b"{}", LoadTracker().book("a:1", 1), "model-x", predicted)
    return UsageObserver(d, m, ModelLabels()), m


def sample(m: PickerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def sse_bytes() -> bytes:
    chunks = [{"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]},
              {"choices": [], "usage": USAGE}]
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_sse_usage_is_read_however_the_stream_is_split() -> None:
    raw = sse_bytes()
    for size in (1, 7, 64, len(raw)):
        obs, m = observer()
        obs.on_headers({":status": ["200"], "content-type": ["text/event-stream"]})
        for i in range(0, len(raw), size):
            obs.on_chunk(raw[i:i + size])
        obs.finish()
        assert sample(m, "dynamo_epp_cached_tokens_sum", model="model-x") == 64, size
        assert sample(m, "dynamo_epp_cached_tokens_count", model="model-x") == 1


def test_sse_usage_split_at_any_byte_into_two_chunks_is_read() -> None:
    """Whole events skip the scan; a chunk cut anywhere (inside `"usage"` too) must still be joined."""
    raw = sse_bytes()
    for cut in range(1, len(raw)):
        obs, m = observer()
        obs.on_headers({":status": ["200"], "content-type": ["text/event-stream"]})
        obs.on_chunk(raw[:cut])
        obs.on_chunk(raw[cut:])
        obs.finish()
        assert sample(m, "dynamo_epp_cached_tokens_sum", model="model-x") == 64, cut


def test_unary_usage_is_read_at_the_end() -> None:
    obs, m = observer()
    obs.on_headers({":status": ["200"], "content-type": ["application/json"]})
    body = json.dumps({"choices": [], "usage": USAGE}).encode()
    obs.on_chunk(body[:10])
    obs.on_chunk(body[10:])
    obs.finish()
    assert sample(m, "dynamo_epp_cached_tokens_sum", model="model-x") == 64
    assert sample(m, "epp_prompt_tokens_total", model="model-x") == 100


def test_prediction_error_is_observed_minus_predicted() -> None:
    obs, m = observer(predicted=96)
    obs.on_headers({"content-type": ["application/json"]})
    obs.on_chunk(json.dumps({"usage": USAGE}).encode())
    obs.finish()
    # 64 - 96 = -32: inside the le=-32 bucket, not the le=-128 one (no _sum: buckets go negative)
    assert sample(m, "epp_cached_tokens_prediction_error_bucket", le="-32.0") == 1
    assert sample(m, "epp_cached_tokens_prediction_error_bucket", le="-128.0") == 0
    assert sample(m, "epp_predicted_cached_tokens_sum", model="model-x") == 96


def test_responses_without_usage_leave_the_histogram_alone() -> None:
    obs, m = observer()
    obs.on_headers({"content-type": ["application/json"]})
    obs.on_chunk(b'{"error": "extra_forbidden"}')
    obs.finish()
    assert sample(m, "dynamo_epp_cached_tokens_count", model="model-x") is None


def test_garbage_responses_never_raise() -> None:
    for ctype in ("text/event-stream", "application/json"):
        obs, m = observer()
        obs.on_headers({"content-type": [ctype], ":status": ["nope"]})
        obs.on_chunk(b'data: {"usage": [1,2]}\n\ndata: {"usage"\n\xff\xfe')
        obs.finish()
        assert b"dynamo_epp_cached_tokens" in generate_latest(m.registry)


def test_model_label_values_are_bounded() -> None:
    labels = ModelLabels(limit=2)
    assert [labels(m) for m in ("a", "b", "c", "a", None)] == ["a", "b", "other", "a", "other"]
