"""The image benchmark's offline pieces: its PNGs are real images of the asked size, its block chains key image
blocks by the image over them (as the mock worker does), and the clairvoyant router credits by those chains."""

from __future__ import annotations

import json

import pytest

from bench import bench_multimodal as B
from bench import clairvoyant as CV
from trtllm_mock.image_size import image_size
from trtllm_mock.vision import vision_grid


def body(image: str, question: str = "what is in it") -> dict:
    return {"messages": [{"role": "system", "content": "be brief " * 40},
                         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": question}]}]}


def test_png_is_a_real_image_of_the_requested_size_and_seed_changes_its_bytes() -> None:
    a, b = B.png(640, 480, seed=1), B.png(640, 480, seed=2)
    assert image_size(a) == (640, 480) and a != b


def test_image_chain_counts_the_images_placeholder_tokens() -> None:
    small, big = B.data_uri(B.png(224, 224, 1)), B.data_uri(B.png(1024, 1024, 1))
    (ts, _), (tb, _) = B.image_chain(body(small)), B.image_chain(body(big))
    assert len(tb) - len(ts) == vision_grid(1024, 1024)[1] - vision_grid(224, 224)[1]


def test_image_chain_differs_from_the_first_image_block_for_another_image_of_the_same_size() -> None:
    _, a = B.image_chain(body(B.data_uri(B.png(448, 336, 1))))
    _, b = B.image_chain(body(B.data_uri(B.png(448, 336, 2))))
    same = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    assert 0 < same < len(a)  # the text before the image is shared, nothing from the image on
    assert B.image_chain(body(B.data_uri(B.png(448, 336, 1))))[1] == a


def test_clairvoyant_credits_by_the_given_chains_not_the_tokens() -> None:
    toks_a, chain_a = B.image_chain(body(B.data_uri(B.png(448, 336, 1))))
    toks_b, chain_b = B.image_chain(body(B.data_uri(B.png(448, 336, 2))))
    assert toks_a == toks_b  # identical placeholder tokens: only the chains tell the images apart
    m = B.Workload().engine_model()
    by_tokens = CV.route([toks_a, toks_b], [8, 8], [0.0, 10_000.0], m)
    by_chains = CV.route([toks_a, toks_b], [8, 8], [0.0, 10_000.0], m, chains=[chain_a, chain_b])
    assert by_chains["cached_tokens"] < by_tokens["cached_tokens"]


def test_clairvoyant_refuses_chains_that_do_not_match_the_prompts() -> None:
    toks, chain = B.image_chain(body(B.data_uri(B.png(224, 224, 1))))
    with pytest.raises(ValueError):
        CV.route([toks], [8], [0.0], B.Workload().engine_model(), chains=[chain[:-1]])


def test_schedule_is_deterministic_and_gives_each_conversation_3_to_4_follow_ups_at_most() -> None:
    w = B.Workload()
    a1, t1, c1 = B.schedule(w, 7.0, 1)
    a2, t2, c2 = B.schedule(w, 7.0, 1)
    assert a1 == a2 and [(t.conv, t.turn) for t in t1] == [(t.conv, t.turn) for t in t2]
    assert {c.turns for c in c1} <= {4, 5} and max(t.turn for t in t1) <= 5
    assert json.dumps([c.image for c in c1]) == json.dumps([c.image for c in c2])
