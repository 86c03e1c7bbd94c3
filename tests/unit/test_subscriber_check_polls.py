"""The subscriptions' stale check walks every worker on the loop; an ingest shard answers lookups from that loop,
so the walk lets them be answered (`between_batches`) every `CHECK_POLL_EVERY` workers instead of holding a
lookup for the whole pool (about 1 ms at 1,000 workers, issue 45)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from kvindex.backoff import Backoff
from kvindex.index import KvIndex
from kvindex.subscriber import CHECK_POLL_EVERY, SubscriberManager
from kvindex.subscription import KvSource, Subscription


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.term()


def manager(ctx: zmq.Context, n: int, polls: list[int]) -> SubscriberManager:
    mgr = SubscriberManager(KvIndex(32), zmq_context=ctx, between_batches=lambda: polls.append(len(polls)))
    for i in range(n):
        sub = Subscription(f"w{i}", KvSource(f"tcp://127.0.0.1:{20000 + i}"), Backoff(1.0, 2.0))
        sub.stats.heartbeating = True
        sub.stats.last_message_monotonic = time.monotonic()
        mgr._subs[f"w{i}"] = [sub]
    return mgr


def test_the_stale_check_of_a_large_pool_lets_lookups_be_answered_as_it_goes(ctx: zmq.Context) -> None:
    polls: list[int] = []
    mgr = manager(ctx, 4 * CHECK_POLL_EVERY, polls)
    assert mgr.check_stale(now=time.monotonic() + 1) == []
    assert len(polls) == 4
    # and it still finds the stale ones
    assert len(mgr.check_stale(now=time.monotonic() + 3600)) == 4 * CHECK_POLL_EVERY


def test_a_small_pool_is_checked_without_a_poll(ctx: zmq.Context) -> None:
    polls: list[int] = []
    mgr = manager(ctx, 8, polls)
    mgr.check_stale(now=time.monotonic() + 1)
    assert polls == []
