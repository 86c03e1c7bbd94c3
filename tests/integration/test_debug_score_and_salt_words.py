"""What `/debug/score` and the TensorRT-LLM salt refusal say: `/debug/score` scores without committing, so
its blocks are what the pick WOULD book (`would_book_blocks`; `booked_blocks` stays one release as the same
value); the salt 400 tells the client what counted as a salt and the operator which flag routes by load."""

from __future__ import annotations

from epp_extproc.core.plan import TRTLLM_SALT_MESSAGE
from tests.integration.test_render_and_salt import StubRenderer, picker, stub  # noqa: F401  (fixture)


async def test_debug_score_reports_the_blocks_it_would_book_and_books_none(stub: StubRenderer) -> None:  # noqa: F811
    app = await picker(f"http://127.0.0.1:{stub.port}")
    out = await app.debug_score({"token_ids": list(range(1000, 1000 + 32 * 4 + 1))})
    assert out["would_book_blocks"] > 0
    assert out["booked_blocks"] == out["would_book_blocks"]  # the deprecated name, kept for one release
    assert app.load.total_inflight() == 0
    await app.stop()


def test_the_salt_refusal_keeps_the_reference_words_and_says_what_counts_and_what_to_set() -> None:
    assert TRTLLM_SALT_MESSAGE.startswith("cache_salt is not supported with TensorRT-LLM workers")
    assert "x-tenant-id header counts as a salt" in TRTLLM_SALT_MESSAGE
    assert "--cache-salt-policy load-only" in TRTLLM_SALT_MESSAGE

