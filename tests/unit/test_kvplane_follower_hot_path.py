"""The picker's plane follower on its hot path, without a server: a live message for a followed worker is
checked against its subject with the token computed at `add`, not with a regex and a hash per message, and a
message whose id is not the one its subject names is still refused (issue 47's ingest CPU at 256 workers)."""

from __future__ import annotations

import msgpack

from epp_extproc.dev.kvwire import stored_event
from epp_extproc.kvplane import follower as F
from epp_extproc.kvplane.wire import KIND_BATCH, Subjects, encode_live, worker_token
from kvindex.index import KvIndex
from kvindex.subscriber import KvSource, SubscriberManager

BS = 4
A, B = "10.0.0.7:8000", "10.0.0.8:8000"


def batch(h: int) -> bytes:
    return msgpack.packb([0.0, [stored_event([h], None, list(range(1, BS + 1)), BS)], None], use_bin_type=True)


async def test_live_messages_of_followed_workers_take_no_token_per_message_and_mismatches_are_refused(monkeypatch):
    idx = KvIndex(BS)
    subjects = Subjects("epp.kv", "t")
    plane = F.PlaneSubscribers(idx, SubscriberManager(idx), ["nats://127.0.0.1:1"], subjects,
                               first_connect_grace_s=60)
    try:
        for w in (A, B):
            await plane.add(w, [KvSource("tcp://127.0.0.1:1")])
            st = plane.stats(w)
            st.mode, st.epoch, st.seq = "live", 7, 0
        calls: list[str] = []
        monkeypatch.setattr(F, "worker_token", lambda w: calls.append(w) or worker_token(w))

        def msg(subject_worker: str, wid: str, seq: int) -> tuple[str, bytes]:
            return subjects.events(subject_worker), encode_live(KIND_BATCH, None, 7, seq, seq, wid, batch(seq))

        for seq in (1, 2, 3):
            plane._on_message(*msg(A, A, seq))
        assert plane.stats(A).seq == 3 and idx.stats(A).batches == 3
        assert calls == []  # the followed worker's token was computed once, at add
        # B's id on A's subject: both followed, still refused (and counted on A, whose subject it came on)
        plane._on_message(*msg(A, B, 1))
        assert plane.garbage == 1 and plane.stats(A).garbage == 1 and plane.stats(B).seq == 0
        # an unknown worker's subject carrying A's id: refused as well
        plane._on_message(*msg("10.0.0.9:8000", A, 4))
        assert plane.garbage == 2 and plane.stats(A).seq == 3
        # an unknown worker's own, well-formed message: not garbage, not ours
        plane._on_message(*msg("10.0.0.9:8000", "10.0.0.9:8000", 1))
        assert plane.garbage == 2 and plane.unknown_workers == 1
    finally:
        await plane.close()
