"""Choosing the KV view at start-up (`--kv-ingest`), so `app.py` only asks for one."""

from __future__ import annotations

import logging
import tempfile

from prometheus_client import CollectorRegistry

from epp_extproc.adapters.kv_remote import RemoteKv
from epp_extproc.adapters.kv_routing import KvRouting
from epp_extproc.config import Config, ProcessSlot
from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.ingest.launcher import IngestGroup, shard_argv

log = logging.getLogger(__name__)


def ingest_group(config: Config, directory: str) -> IngestGroup:
    """The shard processes for `config` (not started)."""
    n = config.kv_ingest_shards
    return IngestGroup([shard_argv(directory, i, n, block_size=config.kv_cache_block_size,
                                   max_blocks_per_worker=config.max_index_blocks_per_worker,
                                   topic=config.kv_event_topic, worker_cpu_share=config.kv_ingest_worker_cpu_share,
                                   log_level=config.log_level) for i in range(n)])


def build_kv(config: Config, slot: ProcessSlot, registry: EndpointRegistry,
             metrics_registry: CollectorRegistry) -> tuple[KvRouting | RemoteKv, IngestGroup | None, str | None]:
    """(the KV view, the shards this process must run itself or None, their socket directory or None).

    Under `--processes` the supervisor runs the shards (`slot.ingest_dir`); a lone picker runs its own in a
    private directory it removes at exit."""
    if config.kv_ingest != "apart":
        kv = KvRouting(registry, block_size=config.kv_cache_block_size,
                       max_blocks_per_worker=config.max_index_blocks_per_worker, topic=config.kv_event_topic,
                       prediction_ttl_s=config.prediction_ttl_s, metrics_registry=metrics_registry)
        if config.kv_event_plane == "nats":
            from epp_extproc.kvplane.follower import PlaneSubscribers
            from epp_extproc.kvplane.wire import Subjects

            # the ZeroMQ subscriber KvRouting made stays, as the fallback of workers the plane cannot serve
            kv.subscribers = PlaneSubscribers(  # type: ignore[assignment]
                kv.index, kv.subscribers, [u.strip() for u in config.nats_url.split(",") if u.strip()],
                Subjects(pool=config.kv_plane_pool), fallback_mode=config.kv_plane_fallback,
                name=f"epp-picker-{slot.index}", registry=metrics_registry)
        return kv, None, None
    group = None
    own_dir = None
    directory = slot.ingest_dir
    if directory is None:
        directory = own_dir = tempfile.mkdtemp(prefix="epp-ingest-")
        group = ingest_group(config, directory)
    kv = RemoteKv(registry, directory=directory, shards=config.kv_ingest_shards,
                  block_size=config.kv_cache_block_size, prediction_ttl_s=config.prediction_ttl_s,
                  lookup_timeout_s=config.kv_ingest_lookup_timeout_ms / 1000, metrics_registry=metrics_registry,
                  client_id=f"p{slot.index}")
    return kv, group, own_dir
