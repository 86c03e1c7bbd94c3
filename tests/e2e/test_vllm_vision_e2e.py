"""Images through the picker in front of two real vLLM workers serving a tiny Qwen2-VL model (issue 29's proof).

Opt-in (`make e2e-vllm-vision`: E2E_VLLM=1 and E2E_VLLM_VISION=1), its own stack (`VisionStack`), so the text
suite is unchanged. Each check compares the picker with what the ENGINES say: vLLM's own
`usage.prompt_tokens_details.cached_tokens` (which counts image placeholder tokens), which engine served (its
request counters), and the blocks its KV events leave cached, keyed by tokens and per-block
`(identifier, offset)` extra keys. The tests run in file order on one stack; each starts from empty caches.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import FIGURES, ROOT
from tests.e2e.vision_stack import (
    Item,
    VisionStack,
    block_extra_keys,
    expected_media_overlap,
    image_part,
    media_prefix_keys,
    normalize_extra,
    png_data_uri,
)
from tests.e2e.vllm_stack import BLOCK_SIZE, Sent

PREDICTION_TTL_S = 2.0  # the picker's default --prediction-ttl-s: wait it out so credit comes from events
WORDS = ("cache block token prefix worker router engine request tenant salt event replay index model prompt "
         "system user assistant answer question document section chapter report summary policy contract "
         "invoice order customer account payment shipping product service support ticket issue error value").split()
RED, BLUE, GREEN = (220, 30, 30), (30, 30, 220), (30, 200, 60)


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def image_chat(system_seed: int, image: str, *, lead: str = "Look at this scan.") -> list[dict[str, Any]]:
    """A shared system prompt (several blocks), then a user turn: text, the image, a question."""
    return [{"role": "system", "content": text(system_seed, 120)},
            {"role": "user", "content": [{"type": "text", "text": lead}, image_part(image),
                                         {"type": "text", "text": "What is the order value? " + text(7, 30)}]}]


Probe = list[dict[str, Any]]


class State:
    probes: list[Probe] = []  # image chats sent since the last reset


@pytest.fixture(scope="module")
def stack() -> Iterator[VisionStack]:
    logs = Path(ROOT / ".venv-vllm" / "e2e-logs" / time.strftime("vision-%Y%m%d-%H%M%S"))
    logs.mkdir(parents=True, exist_ok=True)
    s = VisionStack(logs)
    FIGURES["logs"] = str(logs)
    try:
        s.start()
        FIGURES["start_s"] = s.figures["start_s"]
        FIGURES["stack_start_s"] = s.figures["stack_start_s"]
        yield s
    finally:
        FIGURES["unattributed_requests"] = s.unattributed
        s.stop()


@pytest.fixture
def fresh(stack: VisionStack) -> VisionStack:
    """Every check starts from empty engine caches (and an index that has seen them emptied)."""
    stack.reset_caches()
    stack.wait_events_settled()
    State.probes = []
    return stack


def send(stack: VisionStack, messages: Probe) -> Sent:
    r = stack.chat(messages)
    assert r.status == 200, f"gateway answered {r.status}: {r.body[:400]!r}"
    assert r.worker is not None, f"could not tell which engine served the request: {stack.unattributed[-1:]}"
    State.probes.append(messages)
    return r


def settle(stack: VisionStack) -> None:
    """All events in, and the picker's own predictions expired: credit now comes from the engines' events."""
    stack.wait_events_settled()
    time.sleep(PREDICTION_TTL_S + 0.5)


def media_of(doc: dict[str, Any]) -> list[Item]:
    return [Item(i["identifier"], i["offset"], i["length"]) for i in doc["media"]["items"]]


def overlaps(doc: dict[str, Any]) -> dict[str, int]:
    return {w["name"]: w["overlap_blocks"] for w in doc["workers"]}


def row(sent: Sent) -> dict[str, Any]:
    return {"worker": sent.worker, "prompt_tokens": sent.prompt_tokens, "engine_cached": sent.cached,
            "picker_predicted": sent.predicted, "picker_observed": sent.observed}


# ----------------------------------------------------------------------------------------------- checks
def test_render_reports_the_image_span_the_engine_prefills(fresh: VisionStack) -> None:
    """The picker scores an image request exactly: the render's span, an identity it forwards to the worker,
    and as many prompt tokens as the engine then prefills (the image's placeholders included)."""
    msgs = image_chat(1, png_data_uri(RED))
    doc = fresh.score_doc({"messages": msgs})
    media = doc["media"]
    r = send(fresh, msgs)
    FIGURES["render"] = {"media": media, "engine_prompt_tokens": r.prompt_tokens}
    assert media["scored"] == "exact", media
    (item,) = media["items"]
    assert item["identity_source"] == "digest" and item["identifier"] == item["forwarded_uuid"], item
    assert item["length"] == 100, "a 280x280 image is 10x10 placeholder tokens at 28 px each"
    assert item["offset"] > 2 * BLOCK_SIZE, "the text before the image must fill blocks for the checks to mean much"
    assert r.prompt_tokens == doc["prompt_tokens"] == media["prompt_tokens"]


def test_repeated_image_request_goes_to_its_worker_and_its_cached_tokens_match_the_prediction(
        fresh: VisionStack) -> None:
    """A repeat goes where the image is cached, and the engine's cached_tokens equal the picker's prediction,
    which covers the image's blocks and the text after them."""
    rows = []
    for color in (RED, BLUE):
        msgs = image_chat(2, png_data_uri(color))
        first = send(fresh, msgs)
        settle(fresh)
        doc = fresh.score_doc({"messages": msgs})
        (item,) = media_of(doc)
        again = send(fresh, msgs)
        rows.append({"first": row(first), "again": row(again), "image": [item.offset, item.length],
                     "picker_overlap_blocks": overlaps(doc)})
        fresh.reset_caches()
        fresh.wait_events_settled()
    FIGURES["repeat"] = rows
    for r in rows:
        assert r["again"]["worker"] == r["first"]["worker"], r
        assert r["first"]["engine_cached"] == 0, r
        assert r["again"]["picker_predicted"] == r["again"]["engine_cached"], r
        assert r["again"]["picker_observed"] == r["again"]["engine_cached"], r
        end = sum(r["image"])
        assert r["again"]["engine_cached"] >= end, f"credit must run past the image (ends at token {end}): {r}"
        assert r["again"]["engine_cached"] == (r["again"]["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE, r


def test_same_text_with_another_image_gets_no_credit_past_the_image(fresh: VisionStack) -> None:
    """Identical tokens, another image: the picker credits only the blocks before the image's first block,
    and that is exactly what the engine reuses."""
    red, green = image_chat(3, png_data_uri(RED)), image_chat(3, png_data_uri(GREEN))
    first = send(fresh, red)
    settle(fresh)
    doc = fresh.score_doc({"messages": green})
    (item,) = media_of(doc)
    credit = overlaps(doc)
    other = send(fresh, green)
    before_image = item.offset // BLOCK_SIZE
    FIGURES["another_image"] = {"first": row(first), "other": row(other), "image": [item.offset, item.length],
                                "picker_overlap_blocks": credit, "blocks_before_image": before_image}
    assert credit[first.worker] == before_image > 0, (credit, before_image)
    assert other.worker == first.worker
    assert other.cached == before_image * BLOCK_SIZE, row(other)
    assert other.predicted == other.cached == other.observed, row(other)


def test_image_after_a_shared_text_prefix_is_credited_up_to_the_image(fresh: VisionStack) -> None:
    """A text-only chat leaves blocks a later chat with the same text and then an image reuses: credited up to
    the image (the last full block of shared tokens), by the picker and by the engine."""
    lead = "Look at this scan. " + text(11, 60)
    text_only = [{"role": "system", "content": text(4, 120)},
                 {"role": "user", "content": [{"type": "text", "text": lead}]}]
    with_image = image_chat(4, png_data_uri(BLUE), lead=lead)
    first = send(fresh, text_only)
    settle(fresh)
    a, b = fresh.render(text_only), fresh.render(with_image)
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    doc = fresh.score_doc({"messages": with_image})
    (item,) = media_of(doc)
    credit = overlaps(doc)
    r = send(fresh, with_image)
    FIGURES["text_then_image"] = {"text_only": row(first), "with_image": row(r), "shared_tokens": common,
                                  "image": [item.offset, item.length], "picker_overlap_blocks": credit}
    assert common <= item.offset, "the chats must agree up to the image and no further"
    assert credit[first.worker] == common // BLOCK_SIZE > 0, (credit, common)
    assert r.worker == first.worker
    assert r.cached == common // BLOCK_SIZE * BLOCK_SIZE == r.predicted == r.observed, row(r)


def test_pickers_index_matches_the_engines_image_blocks(fresh: VisionStack) -> None:
    """The engines' events key the image blocks by (identifier, offset) pairs the picker's render reported;
    the picker indexes as many blocks as each engine holds and credits each worker, for each image chat sent
    and for two never sent (another image; the same image after another lead), exactly the blocks the engine's
    events say it would reuse (tokens and pairs)."""
    chats = [image_chat(5, png_data_uri(RED)), image_chat(5, png_data_uri(GREEN)),
             image_chat(6, png_data_uri(RED)), image_chat(6, png_data_uri(RED), lead="Another lead, longer.")]
    unsent = [image_chat(5, png_data_uri(BLUE)), image_chat(6, png_data_uri(RED), lead="Look at this scan, then tell me about the order.")]
    for msgs in chats:
        send(fresh, msgs)
    settle(fresh)
    states = {w.name: fresh.recorder.state(w.address) for w in fresh.workers}
    pairs_seen = {normalize_extra(b.extra) for st in states.values() for b in st.blocks.values() if b.extra}
    snap = fresh.kv_snapshot()["workers"]
    indexed = {w.name: snap.get(w.address, {}).get("blocks_indexed") for w in fresh.workers}
    cached = {n: len(st.blocks) for n, st in states.items()}
    keys = {n: media_prefix_keys(st) for n, st in states.items()}
    table = []
    for msgs in chats + unsent:
        doc = fresh.score_doc({"messages": msgs})
        items = media_of(doc)
        toks = fresh.render(msgs)
        want_pairs = [p for p in block_extra_keys(items, len(toks) // BLOCK_SIZE) if p]
        table.append({"picker": overlaps(doc), "engine": {n: expected_media_overlap(k, toks, items)
                                                           for n, k in keys.items()},
                      "image_block_pairs": [list(map(list, p)) for p in want_pairs],
                      "pairs_in_events": all(p in pairs_seen for p in want_pairs),
                      "prompt_blocks": (len(toks) - 1) // BLOCK_SIZE, "image_first_block": items[0].offset // BLOCK_SIZE})
    FIGURES["index_vs_events"] = {"blocks_indexed": indexed, "engine_blocks": cached, "probes": table}
    assert indexed == cached
    for t in table:
        assert t["picker"] == t["engine"], t
        assert any(o < 0 for p in t["image_block_pairs"] for _, o in p), "later image blocks carry offsets < 0"
    for t in table[:len(chats)]:  # sent: its image blocks are in the events, and it is wholly cached somewhere
        assert t["pairs_in_events"] and max(t["engine"].values()) == t["prompt_blocks"], t
    for t in table[len(chats):]:  # never sent: credited its text before the image, never the image
        assert 0 < max(t["engine"].values()) <= t["image_first_block"], t
    assert not table[len(chats)]["pairs_in_events"], "an image never sent keys no engine block"


def test_text_prefix_mode_credits_less_than_the_engine_reuses(fresh: VisionStack) -> None:
    """Control: with image credit off (`--media-credit text-prefix`, the behaviour before issue 29) the engine
    still reuses the repeat's blocks past the image, but the picker predicts only the text before it. So the
    checks above tell exact image credit from text-prefix credit (they fail without it)."""
    fresh.restart_picker("--media-credit", "text-prefix")
    try:
        msgs = image_chat(8, png_data_uri(RED))
        first = send(fresh, msgs)
        settle(fresh)
        media = fresh.score_doc({"messages": msgs})["media"]
        again = send(fresh, msgs)
    finally:
        fresh.restart_picker()
    FIGURES["text_prefix_control"] = {"first": row(first), "again": row(again), "media": {
        k: media[k] for k in ("scored", "reason", "credited_tokens", "prompt_tokens")}}
    assert media["scored"] == "text_prefix", media
    assert again.worker == first.worker
    assert again.cached == (again.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE, row(again)
    assert again.predicted == media["credited_tokens"] // BLOCK_SIZE * BLOCK_SIZE < again.cached, row(again)
