"""Choosing the KV view at start-up (`--kv-ingest`), so `app.py` only asks for one.

`KvBackend` is what the app asks of either view: every difference between them is a capability the view
answers (None where it has none), so the app never asks which view it holds."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Awaitable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from epp_extproc.adapters.kv_remote import RemoteKv
from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.adapters.worker_facts import PredictionSink, WorkerFacts
from epp_extproc.config import KvSection, ProcessSlot
from epp_extproc.core.contract import KvLookup
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.load import BookingListener
from epp_extproc.core.scheduling.eviction_scorer import ChurnView
from epp_extproc.ingest.launcher import IngestGroup, shard_argv
from kvindex.tiers import parse_shared_stores

log = logging.getLogger(__name__)


class KvBackend(KvLookup, Protocol):
    """A KV view as the app wires it: `KvRouting` (in-process index) or `RemoteKv` (ingest apart)."""

    facts: WorkerFacts  # what the workers say about themselves; its `predict_listeners` feed replica sync

    @property
    def index(self) -> PredictionSink:
        """Where replica sync credits the peers' predictions."""
        ...

    def start(self) -> None:
        """Start what runs in the background (called once the event loop runs)."""
        ...

    async def close(self) -> None: ...

    def resync(self, address: str) -> None:
        """The worker's process is gone: forget its blocks until its events rebuild them."""
        ...

    def warm(self, address: str) -> bool:
        """The worker's first event batch (replay included) is indexed: readiness waits for it."""
        ...

    def snapshot(self) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        """`/debug/kv` (awaitable where the index lives in other processes)."""
        ...

    def use_queue_lifetime(self, grace_s: float, max_lifetime_s: float) -> BookingListener | None:
        """Hold predictions while their booking waits for its prefill (`--prediction-lifetime queue`): the
        listener the booking changes must be fed to, or None where the view keeps fixed-ttl ones only."""
        ...

    def churn_window(self) -> ChurnView | None:
        """The workers' cache churn from their removals (the eviction scorer), or None where it is not read."""
        ...


def ingest_group(kv: KvSection, directory: str, *, log_level: str = "INFO") -> IngestGroup:
    """The shard processes for the KV section (not started); `log_level` is the picker's (`--log-level`)."""
    n = kv.kv_ingest_shards
    return IngestGroup([shard_argv(directory, i, n, block_size=kv.kv_cache_block_size,
                                   max_blocks_per_worker=kv.max_index_blocks_per_worker,
                                   topic=kv.kv_event_topic, worker_cpu_share=kv.kv_ingest_worker_cpu_share,
                                   log_level=log_level, shared_stores=kv.kv_shared_stores,
                                   storage_block_size=kv.kv_storage_block_size) for i in range(n)])


def build_kv(section: KvSection, slot: ProcessSlot, registry: EndpointRegistry,
             metrics_registry: CollectorRegistry, *, log_level: str = "INFO",
             ) -> tuple[KvBackend, IngestGroup | None, str | None]:
    """(the KV view, the shards this process must run itself or None, their socket directory or None), from
    the KV section alone (`config.sections.kv`); `log_level` is only handed to the shards it starts.

    Under `--processes` the supervisor runs the shards (`slot.ingest_dir`); a lone picker runs its own in a
    private directory it removes at exit."""
    if section.kv_ingest != "apart":
        kv = KvRouting(registry, block_size=section.kv_cache_block_size,
                       max_blocks_per_worker=section.max_index_blocks_per_worker, topic=section.kv_event_topic,
                       prediction_ttl_s=section.prediction_ttl_s, metrics_registry=metrics_registry,
                       worker_cpu_share=section.kv_ingest_worker_cpu_share)
        if section.kv_shared_stores:  # issue 44: shared-tier blocks credited to every worker of the store
            kv.set_shared_stores(parse_shared_stores(section.kv_shared_stores))
        kv.set_storage_block_tokens(section.kv_storage_block_size)
        if section.kv_event_plane == "nats":
            from epp_extproc.kvplane.follower import PlaneSubscribers
            from epp_extproc.kvplane.wire import Subjects

            # the ZeroMQ subscriber KvRouting made stays, as the fallback of workers the plane cannot serve
            kv.subscribers = PlaneSubscribers(  # type: ignore[assignment]
                kv.index, kv.subscribers, [u.strip() for u in section.nats_url.split(",") if u.strip()],
                Subjects(pool=section.kv_plane_pool), fallback_mode=section.kv_plane_fallback,
                name=f"epp-picker-{slot.index}", registry=metrics_registry)
        return kv, None, None
    group = None
    own_dir = None
    directory = slot.ingest_dir
    if directory is None:
        directory = own_dir = tempfile.mkdtemp(prefix="epp-ingest-")
        group = ingest_group(section, directory, log_level=log_level)
    kv = RemoteKv(registry, directory=directory, shards=section.kv_ingest_shards,
                  block_size=section.kv_cache_block_size, prediction_ttl_s=section.prediction_ttl_s,
                  lookup_timeout_s=section.kv_ingest_lookup_timeout_ms / 1000, metrics_registry=metrics_registry,
                  client_id=f"p{slot.index}", shared_stores=parse_shared_stores(section.kv_shared_stores))
    return kv, group, own_dir
