"""The replay protocol's rewarm schedule: a failed replay is retried on the subscription's own `Backoff`
(the house's schedule), so a dead replay endpoint is asked less and less often, up to the cap."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq.asyncio

from kvindex.backoff import Backoff
from kvindex.index import KvIndex
from kvindex.replay import Replayer
from kvindex.subscription import KvSource, Subscription


@pytest.fixture
def replayer() -> Iterator[Replayer]:
    ctx = zmq.asyncio.Context()
    yield Replayer(ctx, KvIndex(), apply=lambda *_: None, clear=lambda _s: None, restart=lambda *_: None,
                   replay_timeout_s=0.1, replay_max_batches=10, max_batch_bytes=1024, max_replay_bytes=4096,
                   turn_budget_s=0.005)
    ctx.term()


def test_failed_replays_schedule_rebuilds_doubling_up_to_the_cap(replayer: Replayer) -> None:
    sub = Subscription("w", KvSource("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), Backoff(1.0, 4.0, rng=lambda: 1.0))
    waits = []
    for _ in range(4):
        before = time.monotonic()
        words = replayer.schedule_rewarm(sub)
        assert sub.rewarm_at is not None
        waits.append(round(sub.rewarm_at - before))
        assert "rebuilding from the replay buffer again in" in words
    assert waits == [1, 2, 4, 4] and sub.rewarm.failures == 4


def test_a_rebuild_never_comes_sooner_than_half_the_nominal_wait(replayer: Replayer) -> None:
    sub = Subscription("w", KvSource("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), Backoff(1.0, 4.0, rng=lambda: 0.0))
    before = time.monotonic()
    replayer.schedule_rewarm(sub)
    assert sub.rewarm_at is not None and sub.rewarm_at - before >= 0.5
