"""One KV-event subscription's state: the endpoint it reads (`KvSource`), its counters (`SubscriberStats`)
and its sequence bookkeeping (`Subscription`), shared by the socket lifecycle (`kvindex/subscriber.py`) and
the replay protocol (`kvindex/replay.py`), so neither has to import the other.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import zmq.asyncio

from kvindex.backoff import Backoff

GAP_WARN_INTERVAL_S = 10.0  # one gap warning per burst, not one per gap


@dataclass(frozen=True, slots=True)
class KvSource:
    """One KV-event endpoint of a worker.  ``rank``: the data-parallel rank it publishes (None: one endpoint
    for the whole worker, the payload's ``data_parallel_rank`` is used, bounded by the index)."""

    endpoint: str
    replay_endpoint: str | None = None
    rank: int | None = None
    # llm-d's file-system connector stream (kvindex/decode.py `decode_storage_payload`): chunks the worker
    # wrote to its store, applied to the store (`KvIndex.apply_storage_batch`), never replayed nor cleared
    storage: bool = False


@dataclass(slots=True)
class SubscriberStats:
    """Sequence and liveness counters of one subscription (the index counts what it did with the events)."""

    endpoint: str = ""
    rank: int | None = None
    last_seq: int | None = None
    messages: int = 0
    gaps: int = 0
    dropped_batches: int = 0  # batches lost on the wire (sum of gap sizes): what a flood costs
    replays: int = 0
    replay_lost: int = 0
    replay_failures: int = 0
    replay_holes: int = 0
    replay_ok: int = 0
    restarts: int = 0
    oversized: int = 0
    reconnects: int = 0
    heartbeating: bool = False
    stale: bool = False
    silent: bool = False
    connected_monotonic: float = field(default_factory=time.monotonic)
    last_message_monotonic: float | None = None



class Reset(Exception):
    """Raised by the replay protocol when the subscription was reset while a replay was in flight: what it
    fetched is stale, and the receive loop goes on with the next message."""


class Subscription:
    """One KV-event stream of a worker: its socket and tasks (owned by the manager) and its sequence
    bookkeeping (shared by the live stream and the replay protocol)."""

    __slots__ = ("worker_id", "source", "sock", "task", "monitor", "rx", "mon_rx", "loop", "fds", "waiter", "pause", "stats", "last_live", "applied", "digest",
                 "gen", "need_warm", "recheck", "rewarm_at", "rewarm", "gap_warned_at", "gaps_unwarned", "pending",
                 "reconnected", "verify")

    def __init__(self, worker_id: str, source: KvSource, rewarm: Backoff) -> None:
        self.worker_id = worker_id
        self.source = source
        self.sock: zmq.asyncio.Socket | None = None
        self.task: asyncio.Task[None] | None = None
        self.monitor: zmq.asyncio.Socket | None = None  # the SUB's disconnect events (a new socket on each)
        # synchronous shadows of the SUB and its monitor, what the receive loop reads (kvindex/subscriber.py
        # `_open_socket` says why), the loop their descriptors `fds` are registered with, and the future a
        # waiting receive sleeps on until either descriptor is readable
        self.rx: zmq.Socket | None = None
        self.mon_rx: zmq.Socket | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fds: tuple[int, ...] = ()
        self.waiter: asyncio.Future[None] | None = None
        self.pause = 0.0  # seconds to pause before reading again: set where a batch is applied off the task
        self.stats = SubscriberStats(endpoint=source.endpoint, rank=source.rank)
        self.last_live: int | None = None  # last seq seen on the SUB socket (restart detection)
        self.applied: int | None = None  # last seq applied from any source (gap detection, dedup)
        self.digest = 0  # xxh3 of the payload applied at `applied`: is a replay the same history?
        self.gen = 0  # bumped by every reset; in-flight replays check it after each await
        self.need_warm = source.replay_endpoint is not None
        self.recheck = False  # the warm-up applied nothing: ask again from 0 at the first live message
        self.rewarm_at: float | None = None  # a replay failed: rebuild from 0 at the first message after this
        self.rewarm = rewarm  # failed replays in a row: how long until the next rebuild from 0
        self.gap_warned_at = -GAP_WARN_INTERVAL_S
        self.gaps_unwarned = 0
        # a live message read from the SUB during a replay to learn where the live stream starts (the replay is
        # complete only once it reaches it); handled next, before the socket is read again
        self.pending: list[bytes] | None = None
        self.reconnected = False  # the SUB was recreated: its first message, if malformed, may be a restart
        self.verify = False  # the SUB was recreated: prove by replay that the publisher is the same process

    @property
    def label(self) -> str:
        if self.source.storage:
            return f"{self.worker_id} storage"
        return self.worker_id if self.source.rank is None else f"{self.worker_id} rank {self.source.rank}"
