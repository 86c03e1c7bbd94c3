"""`GET /debug/pool`: the pool as the debug page shows it, one row per worker, from what the picker already keeps.

`/debug/endpoints` (roles, health, load) and `/debug/kv` (the index per worker, with every counter of its
subscriptions) answer different questions in full; the page needs a few figures of each per worker, joined,
on every refresh. Joining them here keeps the page's JavaScript a renderer only and its polls small: a row is a
dozen numbers whatever the index holds. Nothing is computed that the two endpoints do not already expose.

Event lag: where the index runs in ingest shards (`--kv-ingest apart`) each shard samples how old a batch is
when applied (its publisher's stamp to now), summarised as `batch_lag_s`; every worker row also says how long
ago its last KV message (batch or heartbeat) arrived, which is what shows a silent or stalled publisher.
"""

from __future__ import annotations

import time
from typing import Any

from epp_extproc.core.endpoints import EndpointRegistry
from epp_extproc.core.load import LoadTracker

KV_FIGURES = ("block_size", "blocks_indexed", "max_blocks", "predicted", "predicted_held", "blocks_by_tier",
              "stale", "silent", "heartbeating", "gaps", "dropped_batches")


def _last_event_age(row: dict[str, Any], now: float) -> float | None:
    """Seconds since the worker's newest KV message on any of its streams (None: none yet). The stamps are
    `time.monotonic()`, system-wide on Linux, so an ingest shard's compare with this process's clock."""
    stamps = [e.get("last_message_monotonic") for e in row.get("kv_endpoints") or ()]
    latest = max((s for s in stamps if isinstance(s, int | float)), default=None)
    return None if latest is None else round(max(0.0, now - latest), 3)


def _lag(kv: dict[str, Any]) -> dict[str, Any] | None:
    """The ingest shards' batch lag, worst shard first per figure (None in-process: not sampled there)."""
    shards = [s.get("batch_lag_s") for s in kv.get("ingest") or () if isinstance(s, dict) and s.get("up")]
    shards = [s for s in shards if isinstance(s, dict)]
    if not shards:
        return None
    out: dict[str, Any] = {"count": sum(int(s.get("count", 0)) for s in shards)}
    for k in ("p50", "p99", "max"):
        vals = [float(s[k]) for s in shards if k in s]
        if vals:
            out[k] = max(vals)
    return out


def pool_document(registry: EndpointRegistry, load: LoadTracker, kv: dict[str, Any] | None,
                  now: float | None = None) -> dict[str, Any]:
    """Workers (role, health, load, KV blocks per worker and tier, last event age) and the pool's totals.
    `kv` is a `/debug/kv` snapshot, or None when the picker keeps no index."""
    now = time.monotonic() if now is None else now
    kv_workers = (kv or {}).get("workers") or {}
    rows = []
    healthy = 0
    for ep in registry.all():
        ld = load.load(ep.address)
        ok = registry.healthy(ep.address)
        healthy += ok
        row: dict[str, Any] = {"name": ep.name, "address": ep.address, "role": ep.role.value, "healthy": ok,
                               "kv_events": ep.kv_events is not None, "inflight": ld.inflight,
                               "prefill_blocks": round(ld.prefill_blocks, 3),
                               "decode_blocks": round(ld.decode_blocks, 3),
                               "unbooked_blocks": round(ld.unbooked_blocks, 3), "kv": None}
        k = kv_workers.get(ep.address)
        if isinstance(k, dict):
            row["kv"] = {f: k.get(f) for f in KV_FIGURES if f in k}
            row["kv"]["last_event_age_s"] = _last_event_age(k, now)
        rows.append(row)
    doc: dict[str, Any] = {"synced": registry.synced, "workers": rows, "healthy": healthy,
                           "inflight_total": load.total_inflight(), "kv": None}
    if kv is not None:
        doc["kv"] = {"unique_blocks": kv.get("unique_blocks"),
                     "predicted_unique_blocks": kv.get("predicted_unique_blocks"),
                     "tier_unique_blocks": kv.get("tier_unique_blocks"), "batch_lag_s": _lag(kv)}
    return doc
