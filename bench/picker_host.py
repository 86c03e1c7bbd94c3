"""The real picker (`epp-extproc`, same flags) with benchmark probes added from outside the product code.

    python -m bench.picker_host [epp-extproc flags...]

Adds to the picker's own /metrics, with fine log-spaced buckets so percentiles are exact to ~10%:

* ``bench_decision_seconds``: `Director.propose` (parse, render call, schedule, the forwarded body;
  admission and commit follow it);
* ``bench_lookup_seconds``: `TableSource.table` (the candidate table's fill: loads and the KV index's overlap
  for every candidate);
* ``bench_kv_ingest_lag_seconds``: wall time from the publisher stamping a batch (its msgpack ``ts``, taken
  just before the send) to the batch being applied to the index, i.e. visible to the next lookup;
* ``bench_kv_apply_seconds``: CPU time of applying one non-empty batch to the index.

Nothing in the request path changes: the wrappers only time the original methods.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence

from prometheus_client import Histogram

from epp_extproc.app import PickerApp
from epp_extproc.cli import run, serve
from epp_extproc.config import load_config

FINE_BUCKETS = tuple(round(10e-6 * 1.2 ** i, 9) for i in range(76))  # 10 us .. ~10 s, 20% apart


def instrument(app: PickerApp) -> None:
    reg = app.metrics.registry
    decision = Histogram("bench_decision_seconds", "Director.propose wall time", buckets=FINE_BUCKETS,
                         registry=reg)
    lookup = Histogram("bench_lookup_seconds", "TableSource.table wall time", buckets=FINE_BUCKETS,
                       registry=reg)
    director, source = app.director, app.decision.source
    orig_propose, orig_table = director.propose, source.table

    async def propose(ctx, **kw):  # noqa: ANN001, ANN003, ANN202
        t0 = time.perf_counter()
        try:
            return await orig_propose(ctx, **kw)
        finally:
            decision.observe(time.perf_counter() - t0)

    def table(req, addresses):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        try:
            return orig_table(req, addresses)
        finally:
            lookup.observe(time.perf_counter() - t0)

    director.propose = propose  # type: ignore[method-assign]
    source.table = table  # type: ignore[method-assign]
    if app.kv is None or not hasattr(app.kv.index, "apply_batch"):  # no KV view, or ingest apart (shards apply)
        return
    lag = Histogram("bench_kv_ingest_lag_seconds", "KV batch publish (ts) -> applied to the index",
                    buckets=FINE_BUCKETS, registry=reg)
    apply_s = Histogram("bench_kv_apply_seconds", "KvIndex.apply_batch of one non-empty batch",
                        buckets=FINE_BUCKETS, registry=reg)
    idx = app.kv.index
    orig_apply = idx.apply_batch

    def apply_batch(worker_id, batch, rank=None):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        orig_apply(worker_id, batch, rank)
        if batch.events:
            apply_s.observe(time.perf_counter() - t0)
            lag.observe(max(0.0, time.time() - batch.ts))

    idx.apply_batch = apply_batch  # type: ignore[method-assign]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    cfg = load_config(argv)
    return run(serve(cfg, instrument), cfg.event_loop)  # the product's loop choice, not the standard one


if __name__ == "__main__":
    raise SystemExit(main())
