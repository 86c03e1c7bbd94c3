"""A shard answering lookups on its loop (the default) also answers them between two batches, from
`poll_lookups`, when the loop is too busy to reach its selector: a picker's lookup and its reconnect."""

from __future__ import annotations

import socket
import time

import pytest

from epp_extproc.ingest import wire
from epp_extproc.ingest.server import POLL_EVERY_S, IngestShard


@pytest.fixture
async def shard(tmp_path):
    s = IngestShard(str(tmp_path), block_size=4)  # the default: lookups on the loop
    await s.start()
    yield s
    await s.close()


def dial(s: IngestShard) -> socket.socket:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c.connect(wire.lookup_socket(s.directory, s.shard))
    c.settimeout(0)
    return c


async def test_a_lookup_waiting_between_two_batches_is_answered_by_the_poll_and_so_is_a_new_connection(shard):
    # no await between the sends and the polls: the loop's selector never runs, as in a busy turn of ingest
    c = dial(shard)
    time.sleep(POLL_EVERY_S * 2)
    shard.poll_lookups()  # accepts the connection
    c.send(wire.pack_lookup(7, 0, True, [(4, [1, 2, 3])]))
    time.sleep(POLL_EVERY_S * 2)
    shard.poll_lookups()
    rid, version, meta, counts = wire.unpack_answer(c.recv(1 << 16))
    assert (rid, version) == (7, shard.meta_version) and meta is not None and list(counts) == []
    c.close()
