"""Image blocks are credited exactly as the engine keys them: vLLM samples built by vLLM 0.32.0's own code
(tests/fixtures/make_vllm_mm_events.py), replayed into the index, looked up from the render's media spans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.adapters.worker_facts import Prompt
from epp_extproc.core.contract import MediaItem, PromptIdentity
from epp_extproc.core.endpoints import EndpointRegistry
from kvindex.decode import decode_payload
from kvindex.hashing import (
    DIALECT_TRTLLM,
    DIALECT_VLLM,
    DIALECT_VLLM_BARE,
    block_hashes,
    media_chain_hashes,
    pack_tokens,
)

FIX = json.loads((Path(__file__).parents[1] / "fixtures" / "vllm_mm_events.json").read_text())
SC = FIX["scenarios"]
BS = FIX["block_size"]
NEXT_TURN = [7, 8, 9]  # the next user turn: the stored blocks are all reusable prefix of the new prompt
DIALECTS = [DIALECT_VLLM, DIALECT_VLLM_BARE]


def routing() -> KvRouting:
    return KvRouting(EndpointRegistry(), block_size=BS, max_blocks_per_worker=100_000, topic="",
                     prediction_ttl_s=60.0, metrics_registry=None, ask_server_info=False)


def store(kv: KvRouting, worker: str, scenario: str, dialect: str) -> int:
    """Replay the engine's events for `scenario` as `worker`; returns the blocks stored."""
    for hexp in SC[scenario]["payloads"][dialect]:
        batch = decode_payload(bytes.fromhex(hexp))
        assert not batch.garbage and batch.events, batch.counters
        kv.index.apply_batch(worker, batch)
    return kv.index.blocks_indexed(worker)


def media(scenario: str, **override: int) -> tuple[MediaItem, ...]:
    return tuple(MediaItem(i, override.get("offset", o), override.get("length", n)) for i, o, n in SC[scenario]["media"])


def ask(kv: KvRouting, scenario: str, items: tuple[MediaItem, ...] | None = None, salt: str | None = None,
        tokens: list[int] | None = None) -> int:
    toks = (SC[scenario]["tokens"] if tokens is None else tokens) + NEXT_TURN
    identity = PromptIdentity(salt=salt if salt is not None else SC[scenario]["salt"],
                              media=media(scenario) if items is None else items)
    return kv.overlap(kv.prompt(toks, identity), ["w"]).get("w", 0)


@pytest.fixture(params=DIALECTS)
def dialect(request: pytest.FixtureRequest) -> str:
    return request.param


def test_fixtures_come_from_vllm_itself() -> None:
    assert FIX["vllm_version"] == "0.32.0"
    # what vLLM 0.32 publishes for an image straddling blocks: (identifier, item start - block start)
    assert SC["image_a_after_text"]["extra_keys"][2:] == [f"[['{'a' * 63}1', 8]]", f"[['{'a' * 63}1', -8]]"]


def test_same_image_at_the_same_place_is_credited_through_and_past_the_image(dialect: str) -> None:
    kv = routing()
    n = store(kv, "w", "image_a_after_text", dialect)
    assert n == 8 and ask(kv, "image_a_after_text") == 8


def test_another_image_at_the_same_place_is_credited_only_up_to_it(dialect: str) -> None:
    kv = routing()
    store(kv, "w", "image_a_after_text", dialect)
    assert SC["image_b_after_text"]["tokens"] == SC["image_a_after_text"]["tokens"]  # placeholders look alike
    assert ask(kv, "image_b_after_text") == 2  # blocks 0-1 are text; block 2 holds the image's first tokens


def test_same_image_at_another_offset_in_the_same_tokens_is_not_credited_past_its_first_block() -> None:
    kv = routing()
    store(kv, "w", "image_a_after_text", DIALECT_VLLM)
    moved = media("image_a_after_text", offset=44, length=44)  # same identifier, same tokens, other span
    assert ask(kv, "image_a_after_text", moved) == 2


def test_older_vllm_keys_an_item_by_its_identifier_alone_so_a_move_inside_the_same_tokens_still_matches() -> None:
    # faithful to that engine version: it reused these blocks too (the bug vLLM fixed by adding the offset)
    kv = routing()
    store(kv, "w", "image_a_after_text", DIALECT_VLLM_BARE)
    assert ask(kv, "image_a_after_text", media("image_a_after_text", offset=44, length=44)) == 8


def test_a_shifted_image_is_credited_up_to_the_block_where_prompts_differ(dialect: str) -> None:
    kv = routing()
    store(kv, "w", "image_a_after_text", dialect)
    assert ask(kv, "image_a_shifted") == 2


def test_a_text_only_prompt_is_never_credited_with_media_blocks(dialect: str) -> None:
    kv = routing()
    store(kv, "w", "image_a_after_text", dialect)
    assert ask(kv, "image_a_after_text", items=()) == 2  # identical tokens, but no image: text before it only


def test_media_blocks_of_a_prompt_are_never_credited_by_a_text_only_chain() -> None:
    kv = routing()
    toks = SC["image_a_after_text"]["tokens"]
    kv.index.add_worker("w")
    kv.index.predict("w", toks + NEXT_TURN, 60.0)  # a text-only chain of the very same tokens
    assert ask(kv, "image_a_after_text") == 2


def test_a_salted_prompt_with_an_image_in_its_first_block_needs_both_salt_and_image(dialect: str) -> None:
    kv = routing()
    store(kv, "w", "salted_image_in_first_block", dialect)
    assert ask(kv, "salted_image_in_first_block") == 5
    assert ask(kv, "salted_image_in_first_block", salt="tenant-b") == 0
    other = (MediaItem("c" * 64, 5, 40),)
    assert ask(kv, "salted_image_in_first_block", items=other) == 0


def test_two_images_swapped_are_not_credited_past_the_first_one(dialect: str) -> None:
    kv = routing()
    store(kv, "w", "two_images", dialect)
    assert ask(kv, "two_images") == 6
    (a, b) = media("two_images")
    swapped = (MediaItem(b.identifier, a.offset, a.length), MediaItem(a.identifier, b.offset, b.length))
    assert ask(kv, "two_images", swapped) == 1


def test_the_workers_dialect_is_learned_from_its_events(dialect: str) -> None:
    kv = routing()
    kv.index.add_worker("w")
    assert kv.facts.dialect("w") == DIALECT_VLLM  # the default before any media block
    store(kv, "w", "image_a_after_text", dialect)
    assert kv.facts.dialect("w") == dialect and kv.index.snapshot()["workers"]["w"]["media_dialect"] == dialect


def test_a_predicted_image_prompt_is_confirmed_by_the_engines_own_events(dialect: str) -> None:
    kv = routing()
    store(kv, "w", "image_b_after_text", dialect)  # teaches the dialect (another image: no overlap)
    kv.predict("w", kv.prompt(SC["image_a_after_text"]["tokens"] + NEXT_TURN,
                              PromptIdentity(media=media("image_a_after_text"))))
    assert kv.index.predicted_count("w") == 6  # blocks 0-1 are already stored (text shared with image B's prompt)
    store(kv, "w", "image_a_after_text", dialect)
    assert kv.index.predicted_count("w") == 0 and kv.index.stats("w").predictions_confirmed == 6


def test_each_worker_is_asked_in_its_own_engines_dialect() -> None:
    kv = routing()
    store(kv, "new", "image_a_after_text", DIALECT_VLLM)
    store(kv, "old", "image_a_after_text", DIALECT_VLLM_BARE)
    p = kv.prompt(SC["image_a_after_text"]["tokens"] + NEXT_TURN, PromptIdentity(media=media("image_a_after_text")))
    assert kv.overlap(p, ["new", "old"]) == {"new": 8, "old": 8}
    assert kv.credit(p, ["new", "old"])["old"].confirmed == 8


def test_a_tensorrt_llm_worker_is_credited_the_text_before_the_first_image_only() -> None:
    # its media blocks' token ids are engine-internal: a request cannot rebuild them, so its chain stops there
    toks = SC["image_a_after_text"]["tokens"]
    hs = media_chain_hashes(pack_tokens(toks), len(toks), BS, None, None, media("image_a_after_text"),
                            DIALECT_TRTLLM)
    assert hs == block_hashes(toks[: 2 * BS], BS)


def test_a_prompt_without_media_hashes_exactly_as_before() -> None:
    toks = list(range(300))
    assert Prompt(toks, "s").hashes(BS) == block_hashes(toks[:-1], BS, salt="s")
    assert media_chain_hashes(pack_tokens(toks), 299, BS, None, "s", ()) == block_hashes(toks[:-1], BS, salt="s")


def test_media_spans_that_overlap_end_the_chain_before_them_rather_than_guess() -> None:
    toks = pack_tokens(SC["two_images"]["tokens"])
    bad = (MediaItem("a" * 64, 20, 40), MediaItem("b" * 64, 50, 30))  # the second starts inside the first
    assert len(media_chain_hashes(toks, len(toks), BS, None, None, bad)) == 1


def test_request_side_keys_equal_exactly_where_vllms_engine_hashes_equal() -> None:
    """Ground truth from vLLM 0.32.0's own block hasher: over prompts with identical tokens whose images differ in
    identity, split point and salt, two blocks get the same key on the request side iff vLLM hashes them alike."""
    eq = FIX["equivalence"]
    packed = pack_tokens(eq["tokens"])
    n = len(eq["tokens"])
    ours = [media_chain_hashes(packed, n, BS, None, c["salt"], tuple(MediaItem(*m) for m in c["media"]))
            for c in eq["cases"]]
    engine = [c["engine_hashes"] for c in eq["cases"]]
    assert all(len(o) == len(e) == n // BS for o, e in zip(ours, engine, strict=True))
    same_engine = same_ours = 0
    for b in range(n // BS):
        for i in range(len(engine)):
            for j in range(i + 1, len(engine)):
                e, o = engine[i][b] == engine[j][b], ours[i][b] == ours[j][b]
                assert e == o, (b, eq["cases"][i], eq["cases"][j])
                same_engine += e
                same_ours += o
    assert same_engine > 0 and same_ours == same_engine  # the sample holds equal blocks, not only distinct ones
