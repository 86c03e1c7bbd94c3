"""Integration: image blocks (vLLM 0.32.0's own encoded batches, both key dialects) through a real ingest process:
the remote lookup credits exactly what the in-process index credits, per worker's dialect."""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.core.contract import MediaItem, PromptIdentity
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry
from epp_extproc.ingest.launcher import IngestGroup, shard_argv
from kvindex.decode import encode_seq
from tests.integration.test_ingest_apart import Publisher, remote
from tests.waiting import until_async

FIX = json.loads((Path(__file__).parents[1] / "fixtures" / "vllm_mm_events.json").read_text())
SC = FIX["scenarios"]
BS = FIX["block_size"]


async def publish_raw(pub: Publisher, payloads: list[str]) -> None:
    for hexp in payloads:
        pub.seq += 1
        payload = bytes.fromhex(hexp)
        pub.buffer.append((pub.seq, payload))
        await pub.pub.send_multipart([b"", encode_seq(pub.seq), payload])


def prompt_of(kv, scenario: str, media: bool = True):  # noqa: ANN001, ANN201 - either KV view
    s = SC[scenario]
    items = tuple(MediaItem(i, o, n) for i, o, n in s["media"]) if media else ()
    return kv.prompt(s["tokens"] + [7, 8], PromptIdentity(salt=s["salt"], media=items))


@pytest.fixture
def sock_dir():
    with tempfile.TemporaryDirectory(prefix="epp-ingest-") as d:  # short: a Unix socket path has 107 bytes
        yield d


@pytest.mark.parametrize("dialect", ["vllm", "vllm-bare"])
async def test_image_blocks_are_credited_over_the_channel_as_in_process(sock_dir, dialect) -> None:  # noqa: ANN001
    ctx = zmq.asyncio.Context()
    group = IngestGroup([shard_argv(sock_dir, 0, 1, block_size=BS, max_blocks_per_worker=100_000, topic="",
                                    worker_cpu_share=0.1, log_level="WARNING")])
    group.start()
    pubs = [Publisher(ctx), Publisher(ctx)]
    eps = [Endpoint(n, f"127.0.0.1:{8800 + i}", p.endpoint, p.replay) for i, (n, p) in enumerate(zip("ab", pubs,
                                                                                                     strict=True))]
    reg_local, reg_remote = EndpointRegistry(), EndpointRegistry()
    local = KvRouting(reg_local, block_size=BS, max_blocks_per_worker=100_000, topic="", prediction_ttl_s=0.0,
                      metrics_registry=None, ask_server_info=False)
    kv = remote(reg_remote, sock_dir)
    try:
        reg_local.replace(eps)
        reg_remote.replace(eps)
        await asyncio.sleep(0.5)
        await publish_raw(pubs[0], SC["image_a_after_text"]["payloads"][dialect])
        await publish_raw(pubs[1], SC["image_b_after_text"]["payloads"][dialect])
        a, b = eps[0].address, eps[1].address
        await until_async(lambda: kv.shards[0].meta.dialects == {a: dialect, b: dialect}, timeout=15)
        want = {a: 8, b: 2}  # b: the text before the image
        await until_async(lambda: local.overlap(prompt_of(local, "image_a_after_text"), [a, b]) == want, timeout=15)
        assert kv.overlap(prompt_of(kv, "image_a_after_text"), [a, b]) == want
        assert kv.overlap(prompt_of(kv, "image_b_after_text"), [a, b]) == {a: 2, b: 8}
        assert kv.overlap(prompt_of(kv, "image_a_after_text", media=False), [a, b]) == {a: 2, b: 2}
    finally:
        await kv.close()
        await local.close()
        for p in pubs:
            p.close()
        group.stop()
        ctx.destroy(linger=0)
