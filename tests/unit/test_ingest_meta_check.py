"""The ingest shard's periodic worker-table check reads no worker unless the index says its table changed.

It runs every 50 ms on the loop that answers lookups; reading every worker's fields took 0.4 ms of that loop
at 1,000 workers (issue 45), so a lookup arriving meanwhile waited for it. The table still follows every
change it shows: a worker added or dropped, its block size, its first batch (warm), its media dialect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epp_extproc.dev.kvwire import pack_batch, stored_event
from epp_extproc.ingest.server import IngestShard
from kvindex.decode import decode_payload

MM = json.loads((Path(__file__).parents[1] / "fixtures" / "vllm_mm_events.json").read_text())


@pytest.fixture
def shard(tmp_path: Path) -> IngestShard:
    s = IngestShard(str(tmp_path), block_size=4)
    s.index.add_worker("a")
    s.index.add_worker("b")
    s._refresh_meta()
    return s


def count_reads(s: IngestShard, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The workers whose block size the check reads (one read per worker per table built)."""
    reads: list[str] = []
    orig = s.index.block_size

    def block_size(worker_id: str) -> int:
        reads.append(worker_id)
        return orig(worker_id)
    monkeypatch.setattr(s.index, "block_size", block_size)
    return reads


def table(s: IngestShard) -> dict[str, tuple[int, bool, str | None]]:
    rows = json.loads(s._meta)["workers"]
    return {w: (bs, warm, dialect) for w, bs, warm, dialect in rows if w}


def test_an_unchanged_pool_is_not_read_worker_by_worker(shard: IngestShard, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = count_reads(shard, monkeypatch)
    version = shard.meta_version
    for _ in range(3):
        shard._refresh_meta()
    assert reads == [] and shard.meta_version == version


def test_every_change_the_table_shows_still_reaches_it(shard: IngestShard, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = count_reads(shard, monkeypatch)
    assert table(shard) == {"a": (4, False, None), "b": (4, False, None)}

    batch = decode_payload(pack_batch([stored_event([11, 12], None, list(range(8)), 4)]))
    shard.index.apply_batch("a", batch)  # a's first batch: warm
    shard._refresh_meta()
    assert table(shard)["a"] == (4, True, None)
    version, n = shard.meta_version, len(reads)
    shard.index.apply_batch("a", decode_payload(pack_batch([stored_event([13], 12, list(range(4)), 4)])))
    shard._refresh_meta()  # a second batch changes nothing shown
    assert (shard.meta_version, len(reads)) == (version, n)

    shard.index.set_block_size("b", 16)
    shard._refresh_meta()
    assert table(shard)["b"] == (16, False, None)

    for hexp in MM["scenarios"]["image_a_after_text"]["payloads"]["vllm"]:  # media keyed as vLLM keys them
        shard.index.set_block_size("c", MM["block_size"])
        shard.index.apply_batch("c", decode_payload(bytes.fromhex(hexp)))
    shard._refresh_meta()
    assert table(shard)["c"][1:] == (True, shard.index.media_dialect("c")) and shard.index.media_dialect("c")

    shard.index.drop_worker("a")
    shard._refresh_meta()
    assert "a" not in table(shard)


def test_the_first_block_held_off_the_gpu_reaches_the_table_though_no_worker_changed(shard: IngestShard) -> None:
    shard.index.apply_batch("a", decode_payload(pack_batch([stored_event([11, 12], None, list(range(8)), 4)])))
    shard._refresh_meta()
    assert json.loads(shard._meta)["tiers"] is False
    version = shard.index.table_version()
    shard.index.apply_batch("a", decode_payload(pack_batch([stored_event([21], None, list(range(4)), 4,
                                                                         medium="CPU")])))
    assert shard.index.table_version() == version and shard.index.has_tiers()
    shard._refresh_meta()
    assert json.loads(shard._meta)["tiers"] is True
