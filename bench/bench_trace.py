"""Routing quality on the public Mooncake trace, driven by NVIDIA AIPerf (issues 16 and 28).

    python -m bench.bench_trace [--quick] [--out DIR] [--only a,c] [--rates 10,17.5,25] [--speedup 2.5]
                                [--repeats 3] [--capacities ample,75,scarce] [--work DIR]
                                [--variant NAME=FLAGS] [--prediction-variant NAME=FLAGS]
                                [--workload NAME] [--seed N] [--rate R] [--requests N] [--worker-speeds 0.5,1,1,1]
                                [--oob-seed N] [--restart-window-s 60]

`--workload` replays another workload of issue 42's suite (bench/workloads.py: system-prompt, multi-turn, rag,
agents, no-reuse, hetero) through exactly this method: its records have the trace's shape, so sampling aside
everything below applies as written. Without `--rates`/`--rate` each capacity runs at that workload's own
three loads (below, at and past saturation: workloads.RATES). `--seed` is the workload's CONTENT seed (for
the trace, which 1-in-10 set of prefix trees; 0 = the sample every recording replayed); repeats still jitter
the arrivals of the same requests. `--worker-speeds` gives each worker a relative speed (step costs divided
by it; `hetero` brings 0.5,1,1,1); the clairvoyant figures (d) still model every worker at full speed.

Nobody here shaped this workload: the Mooncake FAST'25 synthetic trace (`bench/traces/`, 3,993 requests,
multi-turn, 512-token prefix blocks), reduced as `bench/trace_workload.py` says exactly (whole prefix trees
1 in 10, one hash id = 32 mock tokens = one KV block, outputs / 4, timestamps / the load multiplier / the mock
speedup), replayed on its own timestamps by AIPerf (`aiperf profile --custom-dataset-type mooncake_trace
--fixed-schedule`, literal prompts in `text_input`, a locally trained BPE tokenizer, server token counts).

Four `trtllm-mock` workers run the iteration-level timing model (`--scheduler iteration`) calibrated to
TensorRT-LLM's published Llama-3.1-8B FP8 H100 figures (trtllm_mock/README.md), scaled so one mock prompt
token costs what the 16 real tokens it stands for would, with its per-step budget (max_num_tokens 8192 real
= 512 mock tokens).

  (a)  Envoy round-robin, no ext_proc (baseline)
  (b)  Envoy + picker, load only (--tokenizer-protocol none)
  (c)  Envoy + picker, trtllm-render + KV events, defaults (overlap credit 2.0)
  (c1) the same with Dynamo's overlap credit 1.0
  (e)  Envoy + picker, trtllm-render, NO KV events: only its own predictions of what it routed where, kept
       for the whole run (the "approximate prefix" routing llm-d compares against). Frozen: its flags do not
       change with the picker's defaults, so it stays the same yardstick across recordings (it places by the
       cost alone, `--affinity-load-bound 0 --prefill-load-scale 1`, as every recording before bounded-load
       affinity and issue 42's prefill weight became the defaults did). `--prediction-variant NAME=FLAGS` adds
       prediction-only pickers with other flags.
  (r2) two replicas of (c) with replica sync (--peers) behind the same Envoy, which round-robins ext_proc
       streams across them (bench_replicas' setup): issue 28.9, routing quality of synced replicas
  (r3m) three replicas of (c) synced over the gRPC full mesh (each --peers the other two), behind one Envoy
       as (r2); (r3n) the same three synced over NATS subjects (--replica-sync-plane nats, a nats-server of
       their own; KV events still straight from the workers): issue 47 item 3, routing quality of synced
       replicas on each plane. Targets r3m_/r3n_within_spread_of_c, as (r2)'s. (g3): the same three
       pickers with NO replica sync, their control (what three processes on the machine cost by themselves)
  (c3i) issue 47's control for (r3n): (c) with two more pickers synced with it over NATS that Envoy never
       sends a request to (they ingest, probe and sync, and apply every booking and prediction of the first);
       (c3u) the same three with no sync at all; (c3in) (c3i) with the two idle pickers and the nats-server at
       nice 19; (c1n) (c) alone with NATS replica sync on (it publishes, no peer receives); (c3il), (r3nl)
       (c3i), (r3n) with --replica-sync-linger-ms SYNC_LINGER_MS (changes held that long, then sent together);
       (c3is), (r3ns) (c3i), (r3n) with --replica-sync-share-metrics true (each worker's /metrics read by one
       replica; the default since 2026-12-05, so the same as (c3i), (r3n) from then on).
  (cnd) issue 47 item 4 under the trace: (c) with its KV events through epp-kv-relay on NATS, workers without
       engine replay, the nats-server stopped at 1/3 of the schedule and started again (same port) at 2/3;
       (cnr) the same plane with the relay restarted at 1/3; (cnu) its relay replaced by a rolling update (a second
       relay from 1/3, the first stopped at 1/2); (cnl) its relay down from 1/3 to 2/3 (past the
       picker's relay_stale_s: the workers' own ZeroMQ events meanwhile); (r3nd) (r3n) with its nats-server down
       as (cnd)'s.
       The row's `fault` says when and what the pickers counted (fallbacks, recoveries, sync gaps); the window
       figures (from 1/3 to the end) are computed as for the restarts. With
       --envoy-timings (off by default) every run also writes Envoy's per-request timing log, joined with
       AIPerf's records (work dir requests-*.jsonl), and each configuration is compared with (c) of the same
       seed request by request (request_deltas: the same worker and cached tokens, then where the time went);
       with --proc-counters every run records each process's CPU and context switches over the replay
  (rs) (c) with the workers' KV event replay, SIGTERMed at ~1/3 of the schedule and started again at once
       with the same flags (same ports): issue 28.9, routing quality across a restart; the new process
       re-warms its index from the workers' replay. Envoy's ext_proc filter has failure_mode_allow off and
       the workers' cluster is ORIGINAL_DST on the picker's header, so while no picker answers a request
       FAILS (AIPerf counts it as an error); nothing is routed around the picker. The run records the
       restart's timings, the errors, and `routed_without_picker` (worker-served minus picker picks; 0 is
       the expected figure).
  (rs2) the rolling restart a user would deploy: (r2)'s two synced replicas with the workers' replay
       endpoints, each with the product's shutdown grace period (--graceful-shutdown-grace-period-s, 5 s),
       behind Envoy's gRPC health checks of the picker cluster (every 1 s); replica 0 is SIGTERMed at ~1/3 of
       the schedule and started again (the same Restarter as (rs)): it reports NOT_SERVING, keeps serving
       the streams Envoy still opens until Envoy has moved them to replica 1, drains, restarts, re-warms from
       the replay and its peer, and gets streams again once healthy. Target: 0 errors, quality within (c)'s
       spread. Records errors, routed_without_picker, picks per picker, the restart's timings and when Envoy
       saw the replica unhealthy and healthy again.
  (rsz) issue 47: a lone picker restarted as (rs) in front of workers whose replay it is NOT told (a
       trtllm-serve pool without `replay_endpoint`), on the ZeroMQ plane: the new process starts with an empty
       index and learns only from new events. (rsn): the same, with the KV events through epp-kv-relay on
       NATS (`--kv-event-plane nats`); the restarted picker loads the relay's dumps. Both record, with every
       plain configuration of the same run, the RESTART WINDOW: the cached ratio of the requests scheduled to
       arrive from the restart's scheduled time (1/3 of the schedule's span) for at most --restart-window-s
       (60 s of wall time) or to the last arrival (trace_stats.window_cached_ratio), from the workers' own
       per-request cached tokens as each response's usage carried them into AIPerf's per-record export (the
       only per-request record with arrival times; its whole-run sums are checked against the workers'
       /mock/stats deltas: `window.records_match_workers`). The same scheduled times give (c) and (e) the
       same requests in their window; requests that fail while the picker is away are counted apart, and
       (c)'s and (e)'s ratio over the requests a restart configuration served in the same seed is kept beside
       (`window.matched`). Targets: `rsn_window_within_5pct_of_c` (ratio of medians >= 0.95),
       `rsn_beats_e_in_window` (a claim), `rsz_beside` (today's figure, no target).
  (cv) the clairvoyant placement REPLAYED through the same Envoy and mocks: bench/plan_picker.py routes each
       request to the worker bench/clairvoyant.py planned for it (matched by prompt content), so its TTFT
       and the mocks' cached ratio are the replayed bound beside the offline one (d) clairvoyant
  Issue 42 item 3, situations in which a picker's own predictions are wrong (each KV-aware configuration is
  claimed against the prediction-only one under the same conditions: targets `X_beats_BASE`):
  (g2)  two gateways with their own pickers and NO replica sync: (r2)'s two replicas of (c) behind one Envoy
        that round-robins ext_proc streams, without --peers, so each picker predicts only the requests it
        routed itself (as two gateways behind a round-robin L4 balancer would); both get every worker's KV
        events. (g2e): the same pair of (e) pickers, the yardstick. Records picks_per_picker.
  (X-oobNN) configuration X (c-oob10, e-oob10, c-oob30, e-oob30 listed; any plain X and NN by name in --only)
        with NN% of the schedule's requests out of band: taken out of AIPerf's input and sent straight to a
        worker (round-robin, as another plain gateway would) at their scheduled times by bench/out_of_band.py,
        so no picker sees them but the workers' KV events show their blocks. The subset is seeded
        (`--oob-seed`, default 0), the same in every configuration and repeat, the 10% inside the 30%. AIPerf's
        figures are then those of the PICKER-ROUTED requests only; the row adds the out-of-band requests'
        own (`oob`), TTFT over every request (`all_ttft_p50_ms`, `all_ttft_p90_ms`, claimed between the
        pairs too) and `routed_without_picker` (= the out-of-band count). out_of_band.py says how the two
        replays share one clock and how well they met (`oob.sync_lag_ms`).
       (r2, r3m, r3n, rs, rs2, rsz, rsn, cv, g2, g2e, g3, c3i, c3in, c3u, c1n, c3il, r3nl, c3is, r3ns, cnd, cnr,
       cnl, cnu, r3nd and the X-oobNN run only when named in --only; the default set is unchanged)
  (d)  offline cached-token ratios of the same prompts in arrival order: `pooled_lru` (one LRU cache with
       the capacity of all four workers together, the figure earlier recordings called "the oracle"),
       `infinite`, and `clairvoyant` (bench/clairvoyant.py: placement and Belady eviction knowing the future
       and each worker's real capacity; a strong heuristic, not a proven bound; see its docstring)

Method (issue 28, "a benchmark that can tell"):

* **Cache pressure** is an axis (`--capacities`): the same trace at KV capacities per worker derived from the
  sample's working set W (distinct full blocks of all prompts): `ample` = 2W per worker (every worker could
  hold the whole trace and as much again in reservations), `75` = W / 1.33 over the pool (the working set
  is ~1.33x the pool's capacity, the ~75%-of-demand point llm-d measured at), `scarce` = W / 2.5 over the
  pool; `h100` = 900 blocks (the GPU's real capacity, the earlier recordings' setting). Per-worker figures
  are floored at twice the largest request's reservation so no request waits forever.
* **Repeats** (`--repeats`, default 3): every (capacity, config, load) cell runs once per arrival-jitter seed;
  seed 0 is the trace as recorded, seed k shifts every timestamp by a seeded uniform jitter of +-1/4 of the
  mean inter-arrival gap (trace_workload.jitter says why jitter and not other subsamples). Within one seed
  every configuration runs back to back, so a slow drift of the machine's load hits all of them alike.
* **Claims**: a cell is its median with the spread min..max; a ratio between two configurations is claimed
  only when their spreads do not overlap (bench/trace_stats.claim), else the report says "no claim".

Every run gets a fresh picker and Envoy and starts from empty worker caches. TTFT, ITL, output tokens/s and
the cached-token ratio are AIPerf's own figures (its usage-based `overall_usage_prompt_cache_read_pct`); the
workers' /mock/stats deltas give which worker served what and cross-check the cached tokens; the picker's
`epp_picks_total` is recorded for the picker configurations.

JSON result schema (`trace.json`), besides the common `bench`, `meta` keys, `configs`, `plan`, `aiperf_command`:

    result.requests, trace_requests, trace_rate_rps, prompt_tokens, output_tokens, working_set_blocks
    result.capacities[]: {name, blocks_per_worker, pool_blocks, working_set_over_pool,
                          oracle: {pooled_lru, infinite, prompt_tokens},
                          clairvoyant: [{offered_rps, divisor, cached_ratio: spread, runs: [{seed, cached_ratio,
                                         waited_requests, evicted_blocks, per_worker_requests}]}]}
    result.cells[]: {capacity, config, offered_rps, divisor,
                     summary: {metric: spread | null}, runs: [run]}     spread = {median, min, max, n}
        run: {seed, ttft_{p50,p90,p99,avg}_ms, itl_{p50,p90,p99,avg}_ms, output_tokens_per_s, requests, errors,
              aiperf_cached_ratio, aiperf_prompt_tokens, workers_cached_ratio, workers_prompt_tokens,
              per_worker_served, picker_picks, replay_sched_lag_p99_ms, benchmark_duration_s, aiperf_wall_s,
              loadavg_1m, machine_busy_cores (cores busy over the replay, anything on the machine);
              (r2, r3m, r3n, r3nl, r3ns, rs2, g2, g2e, g3, c3i, c3il, c3is, c3in, c3u) picks_per_picker, pickers_decision_mean_ms (every
              replica's); every picker configuration routed_without_picker;
              (--envoy-timings) envoy_to_upstream_p50_ms, envoy_worker_headers_p50_ms,
              envoy_worker_first_body_p50_ms, envoy_timed_requests, and for every configuration but (c) against
              (c) of its seed: vs_c: {requests, same_worker, same_cached, less_cached, compared},
              vs_c_same_worker_share, vs_c_same_cached_share, vs_c_dttft_ms, vs_c_dto_upstream_ms,
              vs_c_dworker_first_body_ms, vs_c_rest_ms (request_deltas);
              (--proc-counters) proc_counters: {process name: {cpu_ms, vcsw, ivcsw and each per request}} over
              the replay (workers, renderer, pickers, Envoy, nats-server; harness.proc_counters);
              (rs, rs2) restart: {drain_s,
              down_s, resubscribed_s, picks_before_restart, index_blocks_before, index_blocks_after_replay,
              picks_after_restart, error?; (rs2) envoy_unhealthy_s, envoy_healthy_again_s};
              (cv) plan_match: {matched, unmatched, plan_entries_left};
              (a run with a restart configuration, every plain configuration) window_cached_ratio,
              window_requests, window_failed, window_s, window: {start_s, length_s, requests, served, failed,
              prompt_tokens, cached_tokens, cached_ratio, records_prompt_tokens, records_cached_tokens,
              records_match_workers; restarts: sigterm_at_s, picker_back_at_s (on AIPerf's clock); unrestarted:
              matched: {restart config: cached ratio over the requests it served in its window}};
              (X-oobNN) oob_requests, oob_ttft_p90_ms, all_ttft_p50_ms, all_ttft_p90_ms,
              oob: {requests, completed, sent_per_worker, errors, error, ttft_p50_ms, ttft_p90_ms,
                    sched_lag_p99_ms, sync_lag_ms}}
    result.claims[]: {capacity, offered_rps, metric, config, baseline, median_ratio, claim}
        median_ratio: baseline/config for latencies, config/baseline otherwise (> 1 = config is better);
        claim: the same ratio when the two spreads do not overlap, else null
    targets: {capacity: {target: {...}}}, with r2_, r3m_, r3n_, rs_, rs2_within_spread_of_c and
             clairvoyant_replayed (offline beside replayed) when those configurations ran,
             issue 47's rsn_window_within_5pct_of_c, rsn_beats_e_in_window, rsz_beside, c_vs_e_in_window, and
             issue 42 item 3's g2_beats_g2e, c-oobNN_beats_e-oobNN:
             {per_load: [{offered_rps, METRIC: {median_ratio, claim}}],
             won_somewhere, lost_somewhere, met} (met: a claimed win on TTFT p90 at some load, no claimed loss
             on TTFT p90 or output tokens/s at any)
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import bench_replicas as BR
from bench import clairvoyant as CV
from bench import harness as H
from bench import out_of_band as OB
from bench import plan_picker as PP
from bench import trace_stats as S
from bench import trace_workload as T
from bench import workloads as W
from epp_extproc.config import Config
from epp_extproc.dev import envoy_config, procs
from trtllm_mock.config import LLAMA_8B_H100

AIPERF = str(H.BIN / "aiperf")
SYNC_LINGER_MS = 5  # (c3il), (r3nl): past a request's own CPU steps at 5 req/s (Envoy, the worker's HTTP)
LINGER = ("--replica-sync-linger-ms", str(SYNC_LINGER_MS))
# (c3is), (r3ns): the replicas split the workers' /metrics reads. The product's default since 2026-12-05
# (recorded runs before it: off), so (c3i), (r3n) and every synced config share them too from then on.
SHARE = ("--replica-sync-share-metrics", "true")
CONFIGS = {"a": "envoy round-robin", "b": "picker, load only", "c": "picker, KV-aware (defaults)",
           "c1": "picker, KV-aware, overlap credit 1.0", "e": "picker, prediction only (no KV events)",
           "r2": "2 picker replicas, replica sync", "rs": "picker restarted at 1/3 of the run",
           "r3m": "3 picker replicas, replica sync over the gRPC full mesh",
           "r3n": "3 picker replicas, replica sync over NATS subjects (issue 47)",
           "rs2": "2 synced replicas, one restarted (grace period, health checks)",
           "cv": "clairvoyant plan replayed",
           "rsz": "picker restarted at 1/3 of the run, workers without engine replay (ZeroMQ plane)",
           "rsn": "picker restarted at 1/3 of the run, workers without engine replay, KV events through "
                  "epp-kv-relay on NATS (the restarted picker loads the relay's dumps; issue 47)",
           "g2": "2 KV-aware pickers, NO replica sync (two gateways' pickers)",
           "g2e": "2 prediction-only pickers, no replica sync (two gateways' pickers)",
           "g3": "3 KV-aware pickers, NO replica sync (r3m/r3n's control: three processes, no sync)",
           "c3i": "(c) with 2 more pickers synced over NATS that Envoy never sends a request to (issue 47's "
                  "control: the sync's traffic and two more processes, without replication's split)",
           "c3in": "(c3i) with its two idle pickers and the nats-server at nice 19 (issue 47: whether the sync's "
                   "wakeups cost the request's processes the CPU, or something in the serving picker)",
           "c1n": "(c) publishing its replica sync on NATS with no peer to hear it (issue 47: the serving "
                  "picker's own share of the sync's cost)",
           "c3u": "(c) with 2 more pickers, NOT synced, that Envoy never sends a request to (issue 47: what two "
                  "more processes cost by themselves, (c3i) without the sync)",
           "c3il": f"(c3i) with --replica-sync-linger-ms {SYNC_LINGER_MS} (issue 47: the peers' wake-ups moved "
                   "past the request's own steps, and changes coalesced)",
           "r3nl": f"(r3n) with --replica-sync-linger-ms {SYNC_LINGER_MS}",
           "c3is": "(c3i) with --replica-sync-share-metrics (issue 47: each worker's /metrics read by one of "
                   "the three, the samples sent on the sync)",
           "r3ns": "(r3n) with --replica-sync-share-metrics",
           "cnd": "(c) with KV events through epp-kv-relay on NATS, workers without engine replay; the "
                  "nats-server down for the middle third of the run (issue 47 item 4)",
           "cnr": "(cnd)'s plane, its relay restarted at 1/3 of the run (issue 47 item 4)",
           "cnl": "(cnd)'s plane, its relay down for the middle third of the run (the workers' own ZeroMQ "
                  "events meanwhile)",
           "cnu": "(cnd)'s plane, its relay replaced by a rolling update at 1/3 of the run: a second relay for the "
                  "same workers started, the first stopped 1/6 of the run later (both publish meanwhile)",
           "r3nd": "(r3n) with its nats-server (the replica sync) down for the middle third of the run",
           **{OB.name(base, share): f"{what}, {share:.0%} of requests out of band (straight to a worker)"
              for share in (0.1, 0.3) for base, what in (("c", "picker, KV-aware (defaults)"),
                                                         ("e", "picker, prediction only (no KV events)"))}}
# only with --only: the default set (and its cost) stays what it was
OPT_IN = ("r2", "r3m", "r3n", "rs", "rs2", "cv", "rsz", "rsn", "g2", "g2e", "g3", "c3i", "c3in", "c3u", "c1n", "c3il", "r3nl",
          "c3is", "r3ns", "cnd", "cnr", "cnl", "cnu", "r3nd", "c-oob10", "e-oob10", "c-oob30", "e-oob30")
BS = 32
# (rs2)'s replicas: the product's default shutdown grace period, named so the benchmark follows it
GRACE_PERIOD_S = Config.__dataclass_fields__["graceful_shutdown_grace_period_s"].default
CAPACITIES = ("ample", "75", "scarce", "h100")
METRICS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "output_tokens_per_s",
           "aiperf_cached_ratio", "workers_cached_ratio", "errors")
LOWER_IS_BETTER = ("ttft_p50_ms", "ttft_p90_ms", "itl_p90_ms")
CLAIMED_METRICS = (*LOWER_IS_BETTER, "output_tokens_per_s", "aiperf_cached_ratio")
# the X-oobNN rows' own figures (bench/out_of_band.py): TTFT over every request and over the out-of-band ones;
# summarised where present, and all_ttft_p90_ms also claimed between the out-of-band pairs
OOB_METRICS = ("all_ttft_p50_ms", "all_ttft_p90_ms", "oob_ttft_p90_ms", "oob_requests", "routed_without_picker")
OOB_CLAIMED_METRICS = ("all_ttft_p90_ms",)
# issue 47: the restart configurations, when the picker is restarted (a fraction of the schedule's span after
# the first arrival), and the figures of the window after it (restart_window): computed for every plain
# configuration of a run that has a restart configuration, over the same scheduled times, and claimed
# between the pairs that both have it
RESTARTS = ("rs", "rs2", "rsz", "rsn")
RESTART_AT = 1 / 3
# issue 47 item 4 under the trace: (cnd) the KV plane's nats-server stopped from RESTART_AT of the schedule for
# FAULT_DOWN of it, then started again on its port; (cnr) the relay restarted at RESTART_AT, (cnl) stopped for
# FAULT_DOWN; (r3nd) (r3n)'s
# nats-server (its replica sync) down as (cnd)'s; (cnu) a rolling update of the relay: a second relay started at
# RESTART_AT, the first stopped UPDATE_OVERLAP later. The window figures are computed for them as for a restart.
FAULTS = ("cnd", "cnr", "cnl", "cnu", "r3nd")
FAULT_DOWN = 1 / 3
UPDATE_OVERLAP = 1 / 6
WINDOW_METRICS = ("window_cached_ratio", "window_requests", "window_failed", "window_s")
WINDOW_CLAIMED_METRICS = ("window_cached_ratio",)


@dataclass
class Plan:
    scale: T.TraceScale = field(default_factory=T.TraceScale)
    rates: tuple[float, ...] = (10.0, 17.5, 25.0)  # offered loads, req/s of simulated time
    capacities: tuple[str, ...] = ("ample", "75", "scarce")
    repeats: int = 3
    jitter_gap_fraction: float = 0.25  # +- this fraction of the mean inter-arrival gap, seeds >= 1
    speedup: float = 2.5
    workers: int = 4
    max_num_tokens: int = 512  # 8192 real tokens (TensorRT-LLM default) / 16
    max_batch_size: int = 2048  # trtllm-serve default; KV capacity binds first
    aiperf_timeout_s: float = 240.0
    # issue 42's suite (bench/workloads.py): which workload, its content seed, how many requests (None: the
    # workload's default), each worker's relative speed (None: all full speed), and the loads per capacity
    # (None: ``rates`` at every capacity, as before)
    workload: str = "mooncake"
    workload_seed: int = 0
    requests: int | None = None
    worker_speeds: tuple[float, ...] | None = None
    rates_by_capacity: dict[str, tuple[float, ...]] | None = None
    # issue 44: each worker also keeps a host-memory tier of this many times its GPU blocks (0: none) and then
    # publishes vLLM-dialect events (self-describing offload events); the load time is the mock's fixed model
    host_tier: float = 0.0
    # issue 42 item 3: which requests the X-oobNN configurations send out of band (bench/out_of_band.py); a
    # seed of its own, so every configuration and repeat of a cell gets the same out-of-band requests
    oob_seed: int = 0
    # issue 47: the restart window's longest span (wall seconds of the replay, from the restart's scheduled
    # time; it ends earlier at the schedule's last arrival)
    restart_window_s: float = 60.0
    # issue 47: Envoy's per-request timing log (envoy_config.timing_access_log) in every run, joined with
    # AIPerf's per-request records (request_records) and compared request by request with (c) of the same
    # seed (request_deltas). Off by default: it is one more file write per request in Envoy.
    envoy_timings: bool = False
    # issue 47: every process's CPU and context switches over each replay (where the sync's cost lands)
    proc_counters: bool = False

    def rates_for(self, capacity: str) -> tuple[float, ...]:
        """The offered loads at one capacity: the workload's own three when the plan has them."""
        return (self.rates_by_capacity or {}).get(capacity, self.rates)

    def speed(self, worker: int) -> float:
        return self.worker_speeds[worker] if self.worker_speeds else 1.0

    def mock_args(self, num_blocks: int, speed: float = 1.0) -> list[str]:
        """A worker's flags; ``speed`` < 1 is a slower GPU: every step cost divided by it (0.5 = twice the
        time per step), the arrivals and the other workers unchanged."""
        k = self.scale.length_divisor
        c = LLAMA_8B_H100
        return ["--scheduler", "iteration", "--speedup", str(self.speedup), "--num-blocks", str(num_blocks),
                "--max-num-tokens", str(self.max_num_tokens), "--max-batch-size", str(self.max_batch_size),
                "--step-base-ms", str(c["step_base_ms"] / speed),  # str(): at speed 1 the flags recorded so far
                "--step-prefill-ms-per-token", f"{c['step_prefill_ms_per_token'] * k / speed:.6g}",
                "--step-decode-ms-per-token", str(c["step_decode_ms_per_token"] / speed),
                "--step-kv-read-ms-per-token", f"{c['step_kv_read_ms_per_token'] * k / speed:.6g}",
                "--max-seq-len", "1000000", "--heartbeat-interval", "1",
                *(["--host-blocks", str(math.ceil(num_blocks * self.host_tier)), "--event-dialect", "vllm"]
                  if self.host_tier > 0 else [])]

    def engine_model(self, num_blocks: int) -> CV.EngineModel:
        """The same capacity and step costs as `mock_args`, for the clairvoyant router."""
        k = self.scale.length_divisor
        c = LLAMA_8B_H100
        return CV.EngineModel(workers=self.workers, num_blocks=num_blocks, block_tokens=BS,
                              max_batch=min(self.max_batch_size, self.max_num_tokens),
                              max_num_tokens=self.max_num_tokens, step_base_ms=c["step_base_ms"],
                              prefill_ms_per_token=c["step_prefill_ms_per_token"] * k,
                              decode_ms_per_token=c["step_decode_ms_per_token"],
                              kv_read_ms_per_token=c["step_kv_read_ms_per_token"] * k)


QUICK = Plan(scale=T.TraceScale(max_requests=24), rates=(40.0,), capacities=("scarce",), repeats=2, speedup=4.0,
             aiperf_timeout_s=60.0)


def capacity_blocks(name: str, working_set: int, workers: int, largest_request: int) -> int:
    """KV blocks per worker for a named cache pressure (see the module docstring for the rules and why)."""
    floor = 2 * largest_request
    if name == "ample":
        return max(floor, 2 * working_set)
    if name == "75":
        return max(floor, math.ceil(working_set / (4 / 3) / workers))
    if name == "scarce":
        return max(floor, math.ceil(working_set / 2.5 / workers))
    if name == "h100":
        return 900  # H100 80GB, Llama-3.1-8B, BF16 KV: ~458k tokens = ~900 blocks of 512
    raise ValueError(f"unknown capacity {name!r} (one of {', '.join(CAPACITIES)})")


# ----------------------------------------------------------------------------- AIPerf
def aiperf_command(url: str, input_file: Path, tokenizer: Path, artifacts: Path, timeout_s: float) -> list[str]:
    """The AIPerf invocation a user would run against their own gateway (only --url changes)."""
    return [AIPERF, "profile", "--model", "mock-model", "--url", url, "--endpoint-type", "chat", "--streaming",
            "--input-file", str(input_file), "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
            "--fixed-schedule-auto-offset", "--tokenizer", str(tokenizer), "--use-server-token-count",
            "--request-timeout-seconds", str(int(timeout_s)), "--random-seed", "1",
            "--artifact-dir", str(artifacts), "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
            "--workers-max", "4", "--record-processors", "1"]


def run_aiperf(cmd: list[str], timeout_s: float, log: Path) -> None:
    """Run AIPerf in its own process group, so a hang is ended with everything it spawned."""
    with log.open("wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env={**os.environ, "NO_COLOR": "1"})
        try:
            rc = p.wait(timeout_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
    if rc != 0:
        raise RuntimeError(f"aiperf exited {rc}:\n{log.read_text()[-3000:]}")


def aiperf_usage(artifacts: Path) -> tuple[dict[int, tuple[int, int] | None], int | None]:
    """Per request of the schedule (its index: AIPerf names the n-th input line's session ``session_<n>``),
    the (prompt tokens, cached tokens) of the worker's own response usage, None for a request that failed;
    and AIPerf's first credit (epoch ns), the schedule's time 0 on the machine's clock. From AIPerf's per-record
    export (``profile_export.jsonl``), profiling phase only."""
    out: dict[int, tuple[int, int] | None] = {}
    records, first = OB.profiling_records(artifacts)
    for rec in records:
        meta = rec.get("metadata") or {}
        i = int(str(meta["conversation_id"]).rsplit("_", 1)[1])
        m = rec.get("metrics") or {}
        p, k = (m.get("usage_prompt_tokens") or {}).get("value"), (m.get("usage_prompt_cache_read_tokens") or {}).get(
            "value")
        out[i] = None if rec.get("error") or p is None else (int(p), int(k or 0))
    return out, first


def restart_window(plan: Plan, input_file: Path, artifacts: Path, row: dict[str, Any]) -> dict[str, Any]:
    """Issue 47's figure for one run: the cached ratio of the requests scheduled in the window after the
    restart's scheduled time (RESTART_AT of the schedule's span; trace_stats.window_cached_ratio), from the
    workers' per-request counts as AIPerf recorded them (each response's usage), with the whole run's sums of
    those records beside the workers' /mock/stats deltas as the cross-check. For a restart configuration,
    also where its SIGTERM fell on the schedule's clock (Restarter waits from the first pick, not from the
    schedule's time 0)."""
    rows = [json.loads(line) for line in input_file.read_text().splitlines() if line.strip()]
    t0 = min(r["timestamp"] for r in rows)
    arrivals = [(r["timestamp"] - t0) / 1000 for r in rows]
    usage, first = aiperf_usage(artifacts)
    w = S.window_cached_ratio(arrivals, usage, RESTART_AT * max(arrivals), plan.restart_window_s)
    served = [u for u in usage.values() if u is not None]
    w["records_prompt_tokens"] = sum(u[0] for u in served)
    w["records_cached_tokens"] = sum(u[1] for u in served)
    w["records_match_workers"] = (w["records_prompt_tokens"] == row["workers_prompt_tokens"]
                                  and w["records_cached_tokens"] == row["workers_cached_tokens"])
    sig = (row.get("restart") or {}).get("sigterm_epoch_ns")
    if sig is not None and first is not None:
        w["sigterm_at_s"] = round((sig - first) / 1e9, 3)
        down = row["restart"].get("down_s")
        if down is not None:
            w["picker_back_at_s"] = round(w["sigterm_at_s"] + down, 3)
    inside = {i for i, t in enumerate(arrivals) if w["start_s"] <= t <= w["start_s"] + w["length_s"]}
    return {"window": w, "window_cached_ratio": w["cached_ratio"], "window_requests": w["requests"],
            "window_failed": w["failed"], "window_s": w["length_s"],
            "_window_usage": {i: u for i, u in usage.items() if i in inside}}  # matched_windows; not kept


def matched_windows(seed_rows: Sequence[dict[str, Any]]) -> None:
    """Within one seed: each unrestarted configuration's window cached ratio over the requests each restart
    configuration SERVED in its window (``window.matched[restart config]``), the same requests on both sides
    (a restarted picker fails the requests that arrive while it is away); then drops the per-request usage."""
    restarted = {r["config"]: {i for i, u in r["_window_usage"].items() if u is not None}
                 for r in seed_rows if r["config"] in RESTARTS and "_window_usage" in r}
    for x in seed_rows:
        if "_window_usage" in x and x["config"] not in RESTARTS:
            x["window"]["matched"] = {cfg: S.cached_ratio_over(x["_window_usage"], ids)
                                      for cfg, ids in restarted.items()}
    for x in seed_rows:
        x.pop("_window_usage", None)


def aiperf_figures(artifacts: Path) -> dict[str, Any]:
    doc = json.loads((artifacts / "profile_export_aiperf.json").read_text())

    def q(metric: str, *keys: str) -> dict[str, float | None]:
        m = doc.get(metric) or {}
        return {k: m.get(k) for k in keys}

    ttft = q("time_to_first_token", "p50", "p90", "p99", "avg")
    itl = q("inter_token_latency", "p50", "p90", "p99", "avg")
    out = {f"ttft_{k}_ms": v for k, v in ttft.items()}
    out.update({f"itl_{k}_ms": v for k, v in itl.items()})
    out["output_tokens_per_s"] = (doc.get("output_token_throughput") or {}).get("avg")
    out["requests"] = int((doc.get("request_count") or {}).get("avg") or 0)
    errs = doc.get("error_summary") or []
    out["errors"] = int(sum(e.get("count", 0) for e in errs)) if isinstance(errs, list) else 0
    out["aiperf_cached_ratio"] = ((doc.get("overall_usage_prompt_cache_read_pct") or {}).get("avg") or 0.0) / 100
    out["aiperf_prompt_tokens"] = (doc.get("total_usage_prompt_tokens") or {}).get("avg")
    out["replay_sched_lag_p99_ms"] = (doc.get("replay_sched_lag_p99") or {}).get("avg")
    out["benchmark_duration_s"] = (doc.get("benchmark_duration") or {}).get("avg")
    return out


# ----------------------------------------------------------------------------- one run
def stats(workers: list[H.Proc]) -> dict[str, dict[str, Any]]:
    return {m.name: H.get_json(m.url + "/mock/stats") for m in workers}


def wait_idle(workers: list[H.Proc], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s["running"] == 0 and s["waiting"] == 0 for s in stats(workers).values()):
            return
        time.sleep(0.2)


_PICKS = re.compile(r'^epp_picks_total\{endpoint="([^"]+)"[^}]*\} (\S+)$', re.M)


_SUMS = re.compile(r'^(epp_(?:decision|score|render)_seconds)_(sum|count) (\S+)$', re.M)


def picker_timings(pk: H.Proc) -> dict[str, float | None]:
    """The picker's mean decision, render and scoring time in ms over the run (its histograms' sum / count):
    what a KV-aware configuration pays on the request path beside a load-only one."""
    seen: dict[tuple[str, str], float] = {}
    for name, kind, v in _SUMS.findall(H.get_text(H.picker_url(pk) + "/metrics")):
        seen[(name, kind)] = seen.get((name, kind), 0.0) + float(v)
    out: dict[str, float | None] = {}
    for what in ("decision", "score", "render"):
        n, total = seen.get((f"epp_{what}_seconds", "count"), 0.0), seen.get((f"epp_{what}_seconds", "sum"), 0.0)
        out[f"picker_{what}_mean_ms"] = round(total / n * 1000, 3) if n else None
    return out


_LEAN = re.compile(r'^epp_lean_signals_total\{signal="([^"]+)"\} (\S+)$', re.M)


def lean_signals(pks: Sequence[H.Proc]) -> dict[str, int]:
    """Lean mode's signals summed over the pickers: with several replicas behind one Envoy, a request's
    first-chunk signal reaches a replica its own stream may not have (first_chunk = its own booking,
    first_chunk_forwarded = handed to the replica that booked it over the sync, first_chunk_unknown = lost)."""
    out: dict[str, int] = {}
    for p in pks:
        for k, v in _LEAN.findall(H.get_text(H.picker_url(p) + "/metrics")):
            out[k] = out.get(k, 0) + int(float(v))
    return out


def picker_picks(pk: H.Proc) -> dict[str, int]:
    return {ep: int(float(v)) for ep, v in _PICKS.findall(H.get_text(H.picker_url(pk) + "/metrics"))}


def start_worker(st: H.Stack, name: str, args: Sequence[str]) -> H.Proc:
    """A mock worker that also serves KV event replay (only (rs)'s picker is told the replay endpoint: the
    others start on empty caches, where a replay has nothing to give)."""
    return st.add(procs.mock_worker(name, st.dir, kv=True, replay=True, args=["--log-level", "WARNING", *args]))


def start_plan_picker(st: H.Stack, plan_file: Path) -> tuple[H.Proc, H.Proc]:
    """bench/plan_picker.py and an Envoy that asks it (BUFFERED request body, response phases skipped, no
    TLS, no health check: a benchmark tool, not the product's edge)."""
    port = H.free_port()
    pk = st.add(H.Proc("plan-picker", [sys.executable, "-m", "bench.plan_picker", "--port", str(port), "--plan",
                                       str(plan_file), "--stats", str(plan_file.with_suffix(".stats.json"))],
                       port, st.dir / "plan-picker.log", cwd=str(Path(__file__).resolve().parents[1])))
    opts = envoy_config.EnvoyOptions(
        listen_port=H.free_port(), admin_port=H.free_port(), picker_port=port, body_mode="BUFFERED",
        processing=envoy_config.ProcessingOptions(request_body_mode="BUFFERED", response_header_mode="SKIP",
                                                  response_body_mode="NONE", request_trailer_mode="SKIP",
                                                  response_trailer_mode="SKIP"),
        response_mode="echo", picker_tls=False, picker_health_check=False,
        picker_max_inflight=H.PICKER_MAX_INFLIGHT)
    return st.add(procs.envoy(st.dir, opts, name="envoy-plan"), timeout=60), pk


def start_config(st: H.Stack, cfg: str, workers: list[H.Proc], renderer: H.Proc,
                 plan_file: Path | None = None) -> tuple[H.Proc, list[H.Proc]]:
    """Envoy and the picker processes of one configuration (none for (a); (cv)'s is the plan picker)."""
    addrs = [m.address for m in workers]
    if cfg == "a":
        return H.envoy(st, upstreams=addrs), []
    if cfg == "cv":
        assert plan_file is not None, "(cv) needs the clairvoyant plan"
        env, pk = start_plan_picker(st, plan_file)
        return env, [pk]
    if cfg == "r2":
        return start_replicas(st, "sync", H.endpoints_spec(workers), workers, renderer)
    if cfg == "r3m":  # issue 47 item 3: three synced replicas, the gRPC full mesh (each peers the other two)
        return start_replicas(st, "sync", H.endpoints_spec(workers), workers, renderer, replicas=3)
    if cfg in ("r3n", "r3nl", "r3ns", "r3nd"):  # the same three on NATS subjects (a nats-server of their own; KV events direct)
        from epp_extproc.dev.nats import nats_server_proc

        nats = st.add(nats_server_proc(st.dir))
        return start_replicas(st, "sync", H.endpoints_spec(workers), workers, renderer, replicas=3,
                              nats_url=f"nats://127.0.0.1:{nats.port}",
                              extra={"r3nl": LINGER, "r3ns": SHARE}.get(cfg, ()))
    if cfg == "rs2":  # (r2) with the replay endpoints and the product's grace period; replica 0 restarts
        return start_replicas(st, "sync", procs.endpoint_spec(workers, replay=True), workers, renderer,
                              extra=["--graceful-shutdown-grace-period-s", str(GRACE_PERIOD_S)])
    if cfg == "g2":  # two gateways' pickers: (r2) without the sync, each sees only the streams Envoy gives it
        return start_replicas(st, "nosync", H.endpoints_spec(workers), workers, renderer)
    if cfg == "g3":  # (r3m)/(r3n) without the sync: what three picker processes cost on their own
        return start_replicas(st, "nosync", H.endpoints_spec(workers), workers, renderer, replicas=3)
    if cfg in ("c3i", "c3il", "c3is"):  # (r3n)'s three synced pickers, but Envoy sends every request to the first one
        from epp_extproc.dev.nats import nats_server_proc

        nats = st.add(nats_server_proc(st.dir))
        return start_replicas(st, "sync", H.endpoints_spec(workers), workers, renderer, replicas=3,
                              nats_url=f"nats://127.0.0.1:{nats.port}", serving=1,
                              extra={"c3il": LINGER, "c3is": SHARE}.get(cfg, ()))
    if cfg == "c3in":  # (c3i), its idle pickers and nats-server at the lowest priority
        from epp_extproc.dev.nats import nats_server_proc

        nats = st.add(nats_server_proc(st.dir))
        env, pks = start_replicas(st, "sync", H.endpoints_spec(workers), workers, renderer, replicas=3,
                                  nats_url=f"nats://127.0.0.1:{nats.port}", serving=1)
        for p in (nats, *pks[1:]):
            renice_session(p, 19)
        return env, pks
    if cfg == "c1n":  # (c) with NATS replica sync and no peers: it publishes every change, nobody receives
        from epp_extproc.dev.nats import nats_server_proc

        nats = st.add(nats_server_proc(st.dir))
        return start_replicas(st, "sync", H.endpoints_spec(workers), workers, renderer, replicas=1,
                              nats_url=f"nats://127.0.0.1:{nats.port}")
    if cfg == "c3u":  # the same three pickers with no sync at all: only the first gets requests
        return start_replicas(st, "nosync", H.endpoints_spec(workers), workers, renderer, replicas=3, serving=1)
    if cfg == "g2e":  # the same pair of (e) pickers: each predicts only what it routed itself
        return start_replicas(st, "nosync", prediction_spec(workers), workers, renderer, extra=E_FLAGS,
                              kv_events=False)
    if cfg in ("rsz", "rsn", "cnd", "cnr", "cnl", "cnu"):  # issue 47: workers with no replay, on ZeroMQ or the plane
        extra: list[str] = []
        if cfg != "rsz":
            from epp_extproc.dev.nats import nats_server_proc, relay_proc

            nats = st.add(nats_server_proc(st.dir))
            eps = st.dir / "relay-endpoints.json"
            eps.write_text(json.dumps({"endpoints": [{"address": m.address,
                                                      "kv_events": f"tcp://127.0.0.1:{m.extra['kv_port']}"}
                                                     for m in workers]}))
            url = f"nats://127.0.0.1:{nats.port}"
            st.add(relay_proc(st.dir, nats_url=url, endpoints_file=eps, pool="trace", block_size=BS))
            if cfg == "cnu":  # the rolling update's new relay: started by the Fault, stopped with the stack
                st.procs.append(relay_proc(st.dir, nats_url=url, endpoints_file=eps, pool="trace", block_size=BS,
                                           name="kv-relay-new"))
            extra = ["--kv-event-plane", "nats", "--nats-url", url, "--kv-plane-pool", "trace"]
        pk = H.picker(st, procs.endpoint_spec(workers, replay=False), "trtllm-render", renderer, extra=extra)
        H.wait_subscribed(pk, addrs)
        return H.envoy(st, picker_proc=pk), [pk]
    if cfg == "rs":  # as (c), with the replay endpoints a restarted picker re-warms from
        pk = H.picker(st, procs.endpoint_spec(workers, replay=True), "trtllm-render", renderer)
        H.wait_subscribed(pk, addrs)
        return H.envoy(st, picker_proc=pk), [pk]
    if cfg == "b":
        pk = H.picker(st, H.endpoints_spec(workers))
    elif cfg in ("c", "c1") or cfg in VARIANTS:
        extra = ["--kv-overlap-score-credit", "1"] if cfg == "c1" else VARIANTS.get(cfg, [])
        pk = H.picker(st, H.endpoints_spec(workers), "trtllm-render", renderer, extra=extra)
        H.wait_subscribed(pk, addrs)
    else:  # (e) and its variants: no KV endpoint given and no default port, predictions kept for the whole run
        pk = H.picker(st, prediction_spec(workers), "trtllm-render", renderer,
                      extra=[*E_FLAGS, *E_VARIANTS.get(cfg, [])])
    return H.envoy(st, picker_proc=pk), [pk]


def renice_session(p: H.Proc, nice: int) -> int:
    """Every thread of every process of ``p``'s session (Proc starts each in a session of its own) to ``nice``
    (a thread's niceness is its own; the ones it starts later inherit it). Returns the threads changed."""
    assert p.proc is not None
    n = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getsid(int(d.name)) != p.proc.pid:
                continue
            for t in (d / "task").iterdir():
                os.setpriority(os.PRIO_PROCESS, int(t.name), nice)
                n += 1
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return n


def prediction_spec(workers: Sequence[H.Proc]) -> str:
    """(e)'s `--endpoints`: names and addresses only, no KV event endpoint."""
    return ",".join(f"{m.name}={m.address}" for m in workers)


def start_replicas(st: H.Stack, mode: str, spec: str, workers: Sequence[H.Proc], renderer: H.Proc,
                   extra: Sequence[str] = (), kv_events: bool = True, replicas: int = 2,
                   nats_url: str | None = None, serving: int | None = None) -> tuple[H.Proc, list[H.Proc]]:
    """``replicas`` pickers (two unless said; bench_replicas.pickers_for's ``mode``: "sync" = replica sync
    between them, on NATS with ``nats_url``, else the gRPC mesh; "nosync" = none) behind one Envoy that
    round-robins ext_proc streams across them, once each has every worker's first KV batch (``kv_events``)
    and Envoy holds them all healthy. ``serving``: only the first that many are in Envoy's picker cluster (the
    others run, ingest and sync, but get no request: (c3i))."""
    pks = BR.pickers_for(st, mode, spec, renderer, extra=extra, replicas=replicas, nats_url=nats_url, pool="trace")
    if kv_events:
        for p in pks:
            H.wait_subscribed(p, [m.address for m in workers])
    n = len(pks) if serving is None else serving
    env = H.envoy(st, picker_proc=pks[0], more_pickers=pks[1:n])
    wait_pickers_healthy(env, n)
    return env, pks


def picker_health(env: H.Proc) -> dict[str, str]:
    """Envoy's health flags of each host of the picker cluster (admin /clusters)."""
    text = H.get_text(f"http://127.0.0.1:{env.extra['admin_port']}/clusters")
    pre = f"{envoy_config.PICKER_CLUSTER}::"
    return {line.split("::")[1]: line.rsplit("::", 1)[1] for line in text.splitlines()
            if line.startswith(pre) and "::health_flags::" in line}


def wait_pickers_healthy(env: H.Proc, n: int, timeout: float = 30.0) -> None:
    """Until Envoy holds all ``n`` picker replicas healthy. Envoy health-checks the picker cluster (every 1 s;
    a host that fails its first check waits for the next ones), and an unhealthy replica gets no ext_proc
    stream: without this wait, on a loaded machine, (r2) ran some repeats with every request on one replica."""
    deadline = time.monotonic() + timeout
    flags: dict[str, str] = {}
    while time.monotonic() < deadline:
        flags = picker_health(env)
        if len(flags) == n and all(f == "healthy" for f in flags.values()):
            return
        time.sleep(0.2)
    raise TimeoutError(f"picker replicas not all healthy in Envoy after {timeout}s: {flags}")


def schedule_span_s(input_file: Path) -> float:
    """Wall seconds from the first to the last arrival of an AIPerf fixed-schedule input."""
    ts = [json.loads(line)["timestamp"] for line in input_file.read_text().splitlines() if line.strip()]
    return (max(ts) - min(ts)) / 1000 if ts else 0.0


def wait_for_moment(pk: H.Proc, cancel: threading.Event, delay_s: float, timeout_s: float, info: dict[str, Any],
                    what: str) -> bool:
    """Until the picker has routed its first request, then `delay_s` more (the restart's and the fault's
    moment on the schedule); False, with the reason in `info["error"]`, when the run ended first."""
    deadline = time.monotonic() + timeout_s
    while sum(picker_picks(pk).values()) == 0:
        if cancel.wait(0.2) or time.monotonic() > deadline:
            info["error"] = "no request reached the picker"
            return False
    if cancel.wait(delay_s):
        info["error"] = f"the run ended before {what}"
        return False
    return True


class Restarter(threading.Thread):
    """(rs, rs2): once the picker has routed its first request, waits `at_fraction` of the schedule, SIGTERMs
    the picker, waits for it to exit (its grace period if it has one, then its drain: no new streams, the
    in-flight ones finish), and starts it again with the same argv (same ports, same flags). Records what a
    restart costs: how long the drain took and how long no picker was serving, and the picks of the first
    process (its counters die with it). With `envoy` (rs2), also when Envoy's health checks saw the replica
    unhealthy (from the SIGTERM) and healthy again (from the new process being ready)."""

    def __init__(self, pk: H.Proc, addrs: Sequence[str], span_s: float, at_fraction: float = RESTART_AT,
                 timeout_s: float = 120, envoy: H.Proc | None = None) -> None:
        super().__init__(daemon=True, name="picker-restarter")
        self.pk, self.addrs, self.delay, self.timeout_s = pk, list(addrs), span_s * at_fraction, timeout_s
        self.envoy = envoy
        self.host = f"127.0.0.1:{pk.port}"
        self.info: dict[str, Any] = {"at_fraction": at_fraction, "scheduled_after_first_pick_s": self.delay}
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - reported in the row: a failed restart must not pass silently
            self.info["error"] = repr(e)

    def _run(self) -> None:
        if not wait_for_moment(self.pk, self._cancel, self.delay, self.timeout_s, self.info, "the restart"):
            return
        self.info["picks_before_restart"] = sum(picker_picks(self.pk).values())
        self.info["index_blocks_before"] = index_blocks(self.pk)
        t0 = time.monotonic()
        self.info["sigterm_epoch_ns"] = time.time_ns()  # AIPerf's per-record clock: restart_window places it
        self.pk.signal_group(signal.SIGTERM)
        assert self.pk.proc is not None
        metrics_open = True
        while self.pk.proc.poll() is None and time.monotonic() - t0 < 60:  # its last count, while it drains
            if metrics_open:
                try:
                    self.info["picks_before_restart"] = sum(picker_picks(self.pk).values())
                except OSError:
                    metrics_open = False  # its metrics server has closed
            if self.envoy is not None and "envoy_unhealthy_s" not in self.info and not self._healthy():
                self.info["envoy_unhealthy_s"] = round(time.monotonic() - t0, 3)
            if not metrics_open and (self.envoy is None or "envoy_unhealthy_s" in self.info):
                break
            time.sleep(0.05)
        try:
            self.pk.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.pk.stop(signal.SIGKILL)
        self.info["drain_s"] = round(time.monotonic() - t0, 3)
        self.pk.start(60)
        self.info["down_s"] = round(time.monotonic() - t0, 3)  # SIGTERM -> the new process ready
        H.wait_subscribed(self.pk, self.addrs, timeout=30)  # every worker's replay and first batch are in
        self.info["resubscribed_s"] = round(time.monotonic() - t0, 3)
        self.info["index_blocks_after_replay"] = index_blocks(self.pk)
        while self.envoy is not None and time.monotonic() - t0 < 120 and not self._cancel.is_set():
            if self._healthy():
                self.info["envoy_healthy_again_s"] = round(time.monotonic() - t0, 3)
                break
            time.sleep(0.05)

    def _healthy(self) -> bool:
        """Envoy's health flags for this replica say healthy."""
        assert self.envoy is not None
        return picker_health(self.envoy).get(self.host) == "healthy"


class Fault(threading.Thread):
    """(cnd, cnr, cnl, r3nd): once the picker has routed its first request, waits `at_fraction` of the schedule,
    stops `target` (the nats-server or the relay: SIGTERM, SIGKILL after 5 s), waits `down_fraction` of the
    schedule (0: a restart at once) and starts it again with the same argv, on the same port. (cnu) with
    `surge`: a rolling update, as a Deployment with maxSurge 1 makes it: `surge` (the new relay) started
    first, `target` stopped `down_fraction` of the schedule after it is ready, and not started again. Records
    when."""

    def __init__(self, pk: H.Proc, target: H.Proc, span_s: float, down_fraction: float,
                 at_fraction: float = RESTART_AT, surge: H.Proc | None = None) -> None:
        super().__init__(daemon=True, name="fault")
        self.pk, self.target, self.surge = pk, target, surge
        self.delay, self.down = span_s * at_fraction, span_s * down_fraction
        self.info: dict[str, Any] = {"target": target.name, "at_fraction": at_fraction,
                                     "down_fraction": down_fraction}
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    def run(self) -> None:
        try:
            if not wait_for_moment(self.pk, self._cancel, self.delay, 120, self.info, "the fault"):
                return
            t0 = time.monotonic()
            if self.surge is not None:
                self.surge.start(60)
                self.info["surge_ready_s"] = round(time.monotonic() - t0, 3)
                if self._cancel.wait(self.down):
                    self.info["error"] = "the run ended before the old relay was stopped"
                    return
                self.info["stopped_epoch_ns"] = time.time_ns()
                self.target.stop(signal.SIGTERM, grace=5.0)
                self.info["stop_s"] = round(time.monotonic() - t0, 3)
                return
            self.info["stopped_epoch_ns"] = time.time_ns()
            self.target.stop(signal.SIGTERM, grace=5.0)
            self.info["stop_s"] = round(time.monotonic() - t0, 3)
            self._cancel.wait(max(0.0, self.down - (time.monotonic() - t0)))  # back even if the run ended
            self.target.start(60)
            self.info["back_s"] = round(time.monotonic() - t0, 3)  # stopped -> listening (ready) again
        except Exception as e:  # noqa: BLE001 - reported in the row: a failed fault must not pass silently
            self.info["error"] = repr(e)


_FAULT_COUNTERS = re.compile(r"^(epp_kv_plane_(?:fallbacks|recoveries|relay_restarts|carried|carried_missed|carry_cleared|dumps_merged|other_relay|dumps|"
                             r"dump_failures)_total|"
                             r"epp_replica_sync_nats_gaps_total|epp_replica_peer_expired_total) (\S+)$", re.M)


def fault_counters(pks: Sequence[H.Proc]) -> dict[str, int]:
    """What the pickers counted of a fault (the plane's fallbacks and recoveries, the sync's gaps), summed."""
    out: dict[str, int] = {}
    for p in pks:
        try:
            text = H.get_text(H.picker_url(p) + "/metrics")
        except OSError:
            continue
        for k, v in _FAULT_COUNTERS.findall(text):
            out[k] = out.get(k, 0) + int(float(v))
    return out


def index_blocks(pk: H.Proc) -> int:
    """Blocks the picker's index holds (all workers, deduplicated): how warm it is."""
    return int(H.get_json(H.picker_url(pk) + "/debug/kv").get("unique_blocks", 0))


def all_picks(pks: Sequence[H.Proc]) -> dict[str, int] | None:
    """Picks per endpoint summed over the configuration's pickers (None for (a) and the plan picker)."""
    if not pks or pks[0].name == "plan-picker":
        return None
    out: dict[str, int] = {}
    for p in pks:
        for ep, n in picker_picks(p).items():
            out[ep] = out.get(ep, 0) + n
    return out


def run_one(cfg: str, divisor: float, plan: Plan, workers: list[H.Proc], renderer: H.Proc, input_file: Path,
            tokenizer: Path, work: Path, tag: str, plan_file: Path | None = None,
            oob: OB.Part | None = None, window: bool = False) -> dict[str, Any]:
    """One AIPerf replay through one configuration, from empty worker caches; ``tag`` names its artifacts.
    With ``oob`` (an ``X-oobNN`` configuration), AIPerf replays the in-band part of the schedule through
    configuration X while out_of_band.Replayer sends the rest straight to the workers. With ``window`` the row
    also gets issue 47's restart window (restart_window)."""
    wait_idle(workers)
    for m in workers:
        H.post_json(m.url + "/mock/cache/clear")
    before = stats(workers)
    extra: dict[str, Any] = {}
    replayer: OB.Replayer | None = None
    timing_log = work / f"envoy-timing-{tag}.log" if plan.envoy_timings else None
    if timing_log is not None:
        timing_log.unlink(missing_ok=True)
    with H.Stack(prefix=f"epp-trace-{cfg}-") as st:
        st.envoy_timing_log = timing_log
        env, pks = start_config(st, OB.base_config(cfg), workers, renderer, plan_file)
        if oob is not None:
            input_file = oob.file
            replayer = OB.Replayer(oob.requests, [m.url for m in workers],
                                   f"http://127.0.0.1:{env.extra['admin_port']}", plan.aiperf_timeout_s)
            replayer.start()
        restarter = Restarter(pks[0], [m.address for m in workers], schedule_span_s(input_file),
                              envoy=env if cfg == "rs2" else None) if cfg in ("rs", "rs2", "rsz", "rsn") else None
        if restarter is not None:
            restarter.start()
        fault = Fault(pks[0],
                      next(p for p in st.procs if p.name == ("kv-relay" if cfg in ("cnr", "cnl", "cnu") else "nats")),
                      schedule_span_s(input_file),
                      {"cnr": 0.0, "cnu": UPDATE_OVERLAP}.get(cfg, FAULT_DOWN),
                      surge=next((p for p in st.procs if p.name == "kv-relay-new"), None)) if cfg in FAULTS else None
        if fault is not None:
            fault.start()
        art = work / f"aiperf-{tag}"
        shutil.rmtree(art, ignore_errors=True)
        counted = [*workers, renderer, *st.procs] if plan.proc_counters else []
        counters0 = H.counters_of(counted)
        t0, busy0 = time.monotonic(), H.machine_busy()
        try:
            run_aiperf(aiperf_command(env.url, input_file, tokenizer, art, plan.aiperf_timeout_s),
                       plan.aiperf_timeout_s + 120, work / f"aiperf-{tag}.log")
        except BaseException:
            if replayer is not None:
                replayer.cancel()
            raise
        finally:
            if restarter is not None:
                restarter.cancel()
                restarter.join(90)
            if fault is not None:
                fault.cancel()
                fault.join(90)
            if replayer is not None:  # its last requests may end after AIPerf's
                replayer.join(plan.aiperf_timeout_s + 30)
        wall = time.monotonic() - t0
        extra["machine_busy_cores"] = H.busy_cores(busy0, H.machine_busy())  # everything on the machine, ours or not
        if replayer is not None:
            extra.update(OB.figures(replayer, art))
        wait_idle(workers)
        counters1 = H.counters_of(counted)
        after = stats(workers)
        picks = all_picks(pks)
        if pks and cfg not in ("cv",) and pks[0].alive():
            try:
                extra.update(picker_timings(pks[0]))
                if len(pks) > 1 and all(p.alive() for p in pks):  # every replica's, weighted by its picks
                    extra["pickers_decision_mean_ms"] = pickers_decision_mean(pks)
            except OSError:
                pass
        if picks is not None and len(pks) > 1:
            extra["picks_per_picker"] = [sum(picker_picks(p).values()) for p in pks]
        if picks is not None and all(p.alive() for p in pks):
            try:
                extra["lean_signals"] = lean_signals(pks)
            except OSError:
                pass
        if fault is not None:
            fault.info["pickers"] = fault_counters(pks)
            extra["fault"] = fault.info
        if restarter is not None and picks is not None and pks[0].alive():  # the new process's own share
            restarter.info["picks_after_restart"] = sum(picker_picks(pks[0]).values())
    if restarter is not None:
        extra["restart"] = restarter.info
        if picks is not None:  # the first process's picks died with it: add what it had counted
            picks["<before restart>"] = restarter.info.get("picks_before_restart", 0)
            if "picks_per_picker" in extra:  # replica 0's total: its first process's and its second's
                extra["picks_per_picker"][0] += picks["<before restart>"]
    if cfg == "cv" and plan_file is not None:
        sf = plan_file.with_suffix(".stats.json")
        extra["plan_match"] = json.loads(sf.read_text()) if sf.exists() else None
    served = {k: after[k]["requests_served"] - before[k]["requests_served"] for k in after}
    if picks is not None:
        extra["routed_without_picker"] = sum(served.values()) - sum(picks.values())
    if counted:
        extra["proc_counters"] = H.counters_delta(counters0, counters1, sum(served.values()))
    def moved(counter: str) -> int:  # summed over the workers (0 where an older mock lacks the counter)
        return sum(after[k].get(counter, 0) - before[k].get(counter, 0) for k in after)

    dp, dc = moved("prompt_tokens_total"), moved("cached_tokens_total")
    row = {"config": cfg, "divisor": divisor, **aiperf_figures(art), "per_worker_served": served,
           "workers_cached_ratio": dc / dp if dp else 0.0, "workers_prompt_tokens": dp,
           "workers_cached_tokens": dc, "picker_picks": picks,
           # the engines' KV room: requests preempted for it (vLLM dialects, kv_admission preempt) and what
           # their resumptions computed again
           "workers_preemptions": moved("preemptions"),
           "workers_recomputed_tokens": moved("recomputed_tokens_total"),
           "aiperf_wall_s": round(wall, 1), "loadavg_1m": os.getloadavg()[0], **extra}
    if window:
        row.update(restart_window(plan, input_file, art, row))
    if timing_log is not None:  # read once Envoy has exited (its file logger has flushed)
        reqs = request_records(art, timing_log)
        row["_requests"] = reqs  # request_deltas; not kept in the row
        row.update(timing_medians(reqs))
        T.write_jsonl([{"i": i, **r} for i, r in sorted(reqs.items())], work / f"requests-{tag}.jsonl")
    return row


def pickers_decision_mean(pks: Sequence[H.Proc]) -> float | None:
    """The mean decision time in ms over every picker of a configuration (sum of their histograms' sums over
    the sum of their counts): replica 0's alone hides a replica that decides slower."""
    n = total = 0.0
    for p in pks:
        for name, kind, v in _SUMS.findall(H.get_text(H.picker_url(p) + "/metrics")):
            if name == "epp_decision_seconds":
                n, total = (n + float(v), total) if kind == "count" else (n, total + float(v))
    return round(total / n * 1000, 3) if n else None


def request_records(artifacts: Path, timing_log: Path) -> dict[int, dict[str, Any]]:
    """Per request of the schedule (its index, as `aiperf_usage`): AIPerf's own figures (TTFT, the time to the
    response's first bytes `ack_ms`, prompt and cached tokens) joined by X-Correlation-ID with Envoy's timing
    log (which worker served it, and where Envoy's time went: envoy_config.TIMING_LOG_FIELDS). Failed
    requests are left out."""
    envoy = {r["correlation_id"]: r for r in envoy_config.parse_timing_log(
        timing_log.read_text() if timing_log.exists() else "")}
    records, _ = OB.profiling_records(artifacts)
    out: dict[int, dict[str, Any]] = {}
    for rec in records:
        if rec.get("error"):
            continue
        meta, m = rec.get("metadata") or {}, rec.get("metrics") or {}
        i = int(str(meta["conversation_id"]).rsplit("_", 1)[1])
        ack = meta.get("request_ack_ns")
        e = envoy.get(str(meta.get("x_correlation_id")), {})
        out[i] = {"ttft_ms": (m.get("time_to_first_token") or {}).get("value"),
                  "ack_ms": (ack - meta["request_start_ns"]) / 1e6 if ack else None,
                  "prompt_tokens": (m.get("usage_prompt_tokens") or {}).get("value"),
                  "cached_tokens": (m.get("usage_prompt_cache_read_tokens") or {}).get("value") or 0,
                  "worker": e.get("upstream_host"),
                  **{k: e.get(k) for k, _ in envoy_config.TIMING_LOG_FIELDS if k.endswith("_us")}}
    return out


# where a request's time went, from request_records: the medians kept in each row (ms)
TIMING_PARTS = (("envoy_to_upstream_p50_ms", "to_upstream_us"), ("envoy_worker_headers_p50_ms", "upstream_headers_us"),
                ("envoy_worker_first_body_p50_ms", "upstream_first_body_us"))


def timing_medians(reqs: dict[int, dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, key in TIMING_PARTS:
        v = sorted(r[key] for r in reqs.values() if r.get(key) is not None)
        out[name] = round(v[len(v) // 2] / 1000, 3) if v else None
    out["envoy_timed_requests"] = sum(1 for r in reqs.values() if r.get("to_upstream_us") is not None)
    return out


# request_deltas' figures in each row, summarised per cell where present
DELTA_METRICS = ("vs_c_same_worker_share", "vs_c_same_cached_share", "vs_c_dttft_ms", "vs_c_dto_upstream_ms",
                 "vs_c_dworker_first_body_ms", "vs_c_rest_ms")


def request_deltas(seed_rows: Sequence[dict[str, Any]]) -> None:
    """Within one seed (the same requests in the same order): every configuration against (c), request by
    request. Routing: the share of requests served by the same worker and with the same cached tokens.
    Overhead, over the requests with the same worker and cached tokens (so the placement is equal): the
    median difference of the TTFT, of Envoy's time to the upstream request (the picker's share and Envoy's
    forwarding), of the worker's time to its first body bytes, and of the rest (the TTFT less those two: the
    client <-> Envoy legs and the response's way back). Then drops the per-request records."""
    base = next((r.get("_requests") for r in seed_rows if r["config"] == "c"), None)
    for x in seed_rows:
        reqs = x.get("_requests")
        if base is None or reqs is None or x["config"] == "c":
            continue
        both = [i for i in base if i in reqs]
        same_w = [i for i in both if base[i]["worker"] and base[i]["worker"] == reqs[i]["worker"]]
        same = [i for i in same_w if base[i]["cached_tokens"] == reqs[i]["cached_tokens"]
                and None not in (base[i]["to_upstream_us"], reqs[i]["to_upstream_us"],
                                 base[i]["upstream_first_body_us"], reqs[i]["upstream_first_body_us"],
                                 base[i]["ttft_ms"], reqs[i]["ttft_ms"])]

        def med(v: list[float]) -> float | None:
            v = sorted(v)
            return round(v[len(v) // 2], 3) if v else None

        def rest(r: dict[str, Any]) -> float:
            return r["ttft_ms"] - (r["to_upstream_us"] + r["upstream_first_body_us"]) / 1000

        x["vs_c"] = {"requests": len(both), "same_worker": len(same_w),
                     "same_cached": sum(1 for i in both if base[i]["cached_tokens"] == reqs[i]["cached_tokens"]),
                     "less_cached": sum(1 for i in both if reqs[i]["cached_tokens"] < base[i]["cached_tokens"]),
                     "compared": len(same)}
        x["vs_c_same_worker_share"] = round(len(same_w) / len(both), 4) if both else None
        x["vs_c_same_cached_share"] = round(x["vs_c"]["same_cached"] / len(both), 4) if both else None
        x["vs_c_dttft_ms"] = med([reqs[i]["ttft_ms"] - base[i]["ttft_ms"] for i in same])
        x["vs_c_dto_upstream_ms"] = med([(reqs[i]["to_upstream_us"] - base[i]["to_upstream_us"]) / 1000 for i in same])
        x["vs_c_dworker_first_body_ms"] = med([(reqs[i]["upstream_first_body_us"] - base[i]["upstream_first_body_us"])
                                               / 1000 for i in same])
        x["vs_c_rest_ms"] = med([rest(reqs[i]) - rest(base[i]) for i in same])
    for x in seed_rows:
        x.pop("_requests", None)


# ----------------------------------------------------------------------------- the trace, once
@dataclass
class Workload:
    """The sampled trace and what the offline figures need from it (computed once per benchmark)."""

    rows: list[dict[str, Any]]
    trace_requests: int
    prompts: list[list[int]]
    outputs: list[int]
    working_set: int
    largest_request: int
    jitter_ms: float

    def arrivals_ms(self, seed: int, divisor: float) -> list[float]:
        """Simulated engine ms of each arrival for one jitter seed at one load."""
        rows = T.jitter(self.rows, seed, self.jitter_ms)
        return [(r["timestamp"] - rows[0]["timestamp"]) / divisor for r in rows]


def workload(plan: Plan) -> Workload:
    """The plan's workload: the Mooncake sample as always (seed 0), or a generated one (bench/workloads.py)."""
    if plan.workload == "mooncake":
        rows_all = T.load(T.find_trace())
        rows = T.sample(rows_all, plan.scale, residue=plan.workload_seed)
        if plan.requests:
            rows = rows[:plan.requests]
    else:  # timestamps at the workload's reference load; each --rates load rescales them as the trace's
        rows_all = rows = W.generate(plan.workload, plan.workload_seed, plan.requests or plan.scale.max_requests)
    prompts = [T.prompt_ids(T.prompt_text(r, plan.scale)) for r in rows]
    outputs = [T.output_tokens(r, plan.scale) for r in rows]
    largest = max(-(-(len(p) + o) // BS) for p, o in zip(prompts, outputs, strict=True))
    return Workload(rows, len(rows_all), prompts, outputs, T.working_set_blocks(prompts, BS), largest,
                    plan.jitter_gap_fraction * T.mean_gap_ms(rows))


def clairvoyant_cell(plan: Plan, wl: Workload, blocks: int, rate: float, divisor: float,
                     placements: dict[int, list[int]] | None = None) -> dict[str, Any]:
    """The clairvoyant router's cached ratio at one capacity and load, once per jitter seed; each seed's
    placement (worker index per request) goes into ``placements`` for (cv) to replay."""
    runs = []
    for seed in range(plan.repeats):
        out = CV.route(wl.prompts, wl.outputs, wl.arrivals_ms(seed, divisor), plan.engine_model(blocks))
        runs.append({"seed": seed, **{k: out[k] for k in ("cached_ratio", "waited_requests", "evicted_blocks",
                                                            "per_worker_requests")}})
        if placements is not None:
            placements[seed] = out["placement"]
    return {"offered_rps": rate, "divisor": divisor, "cached_ratio": S.summarize(runs, ["cached_ratio"])[
        "cached_ratio"], "runs": runs}


# ----------------------------------------------------------------------------- the runs
def print_run(cap: str, row: dict[str, Any]) -> None:
    print(f"  [{cap}] ({row['config']:>2}) {row['offered_rps']:g} req/s seed {row['seed']}: TTFT p50/p90/p99 "
          f"{H.fmt(row['ttft_p50_ms'], '.0f')}/{H.fmt(row['ttft_p90_ms'], '.0f')}/{H.fmt(row['ttft_p99_ms'], '.0f')}"
          f" ms, ITL p50/p90 {H.fmt(row['itl_p50_ms'], '.1f')}/{H.fmt(row['itl_p90_ms'], '.1f')} ms, "
          f"{H.fmt(row['output_tokens_per_s'], '.0f')} out tok/s, cached {row['aiperf_cached_ratio']:.3f} "
          f"(workers {row['workers_cached_ratio']:.3f}), errors {row['errors']}, served {row['per_worker_served']}, "
          f"{row['aiperf_wall_s']}s"
          + (f", picker decision/render/score {H.fmt(row['picker_decision_mean_ms'], '.2f')}/"
             f"{H.fmt(row.get('picker_render_mean_ms'), '.2f')}/{H.fmt(row.get('picker_score_mean_ms'), '.2f')} ms"
             if row.get("picker_decision_mean_ms") is not None else "")
          + (f", picks per picker {row['picks_per_picker']}" if row.get("picks_per_picker") else "")
          + (f"; out of band {row['oob']['requests']} (errors {row['oob']['errors']}, sent "
             f"{row['oob']['sent_per_worker']}, TTFT p90 {H.fmt(row['oob']['ttft_p90_ms'], '.0f')} ms, clock "
             f"{H.fmt(row['oob']['sync_lag_ms'], '.1f')} ms after AIPerf's), routed without picker "
             f"{row.get('routed_without_picker')}, all requests TTFT p90 {H.fmt(row['all_ttft_p90_ms'], '.0f')} ms"
             if row.get("oob") else "")
          + (f"; restart window {row['window']['length_s']:.1f}s, {row['window']['requests']} requests "
             f"({row['window']['failed']} failed), cached {H.fmt(row['window']['cached_ratio'], '.3f')}"
             if row.get("window") else ""), flush=True)


def run_capacity(plan: Plan, configs: Sequence[str], wl: Workload, cap: str, work: Path) -> tuple[
        dict[str, Any], list[dict[str, Any]]]:
    """Every (load, seed, config) run at one capacity, on workers started with that capacity."""
    blocks = capacity_blocks(cap, wl.working_set, plan.workers, wl.largest_request)
    pool = blocks * plan.workers
    info: dict[str, Any] = {"name": cap, "blocks_per_worker": blocks, "pool_blocks": pool,
                            "working_set_over_pool": wl.working_set / pool,
                            "oracle": T.oracle(wl.prompts, workers=plan.workers, capacity=blocks, bs=BS),
                            "clairvoyant": []}
    if plan.host_tier > 0:  # issue 44: the pooled LRU bound over GPU + host blocks (it knows both tiers)
        host = math.ceil(blocks * plan.host_tier)
        info["host_blocks_per_worker"] = host
        info["oracle_gpu_and_host"] = T.oracle(wl.prompts, workers=plan.workers, capacity=blocks + host, bs=BS)
        print(f"capacity {cap}: + {host} host blocks per worker; pooled LRU of GPU + host "
              f"{info['oracle_gpu_and_host']['pooled_lru']:.3f}", flush=True)
    base_rate = T.offered_rate(wl.rows, 1.0)
    runs: list[dict[str, Any]] = []
    print(f"capacity {cap}: {blocks} blocks per worker, working set {wl.working_set} = "
          f"{info['working_set_over_pool']:.2f}x the pool", flush=True)
    with H.Stack(prefix=f"epp-trace-{cap}-") as outer:
        workers = [start_worker(outer, f"worker-{i}", plan.mock_args(blocks, plan.speed(i)))
                   for i in range(plan.workers)]
        renderer = H.mock_renderer(outer)
        texts = [T.prompt_text(r, plan.scale) for r in wl.rows]
        for rate in plan.rates_for(cap):
            d = rate / base_rate  # the trace replayed d times faster than recorded
            placements: dict[int, list[int]] = {}
            info["clairvoyant"].append(clairvoyant_cell(plan, wl, blocks, rate, d, placements))
            for seed in range(plan.repeats):
                rows = T.jitter(wl.rows, seed, wl.jitter_ms)
                tag = f"{cap}-{rate:g}rps-s{seed}"
                records = T.aiperf_records(rows, plan.scale, d * plan.speedup)
                f = T.write_jsonl(records, work / f"trace-{tag}.jsonl")
                # the X-oobNN configurations' splits: the same out-of-band requests in every config and repeat
                parts = {share: OB.write_part(records, share, plan.oob_seed, plan.workers,
                                              work / f"trace-{tag}-oob{round(share * 100)}.jsonl")
                         for share in sorted({p[1] for p in map(OB.parse, configs) if p})}
                pf = None
                if "cv" in configs:  # the offline plan of this very seed, replayed
                    pf = PP.write_plan(work / f"plan-{tag}.json", [m.address for m in workers], texts,
                                       placements[seed])
                seed_rows: list[dict[str, Any]] = []
                for cfg in configs:
                    share = (OB.parse(cfg) or (cfg, None))[1]
                    row = run_one(cfg, d, plan, workers, renderer, f, work / "tokenizer", work, f"{cfg}-{tag}", pf,
                                  parts.get(share) if share is not None else None,
                                  window=share is None and any(c in RESTARTS or c in FAULTS for c in configs))
                    row.update(capacity=cap, offered_rps=rate, seed=seed)
                    runs.append(row)
                    seed_rows.append(row)
                    print_run(cap, row)
                matched_windows(seed_rows)
                request_deltas(seed_rows)
    return info, runs


def cells(runs: Sequence[dict[str, Any]], metrics: Sequence[str] = METRICS) -> list[dict[str, Any]]:
    """The runs grouped by (capacity, config, load), each group summarised as median and spread."""
    keys: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in runs:
        keys.setdefault((r["capacity"], r["config"], r["offered_rps"]), []).append(r)
    return [{"capacity": cap, "config": cfg, "offered_rps": rate, "divisor": rs[0]["divisor"],
             "summary": S.summarize(rs, [*metrics, *(m for m in OOB_METRICS if OB.parse(cfg)),
                                         *(m for m in (*DELTA_METRICS, *(n for n, _ in TIMING_PARTS),
                                                       "pickers_decision_mean_ms") if any(m in r for r in rs)),
                                         *(m for m in WINDOW_METRICS if any(m in r for r in rs))]), "runs": rs}
            for (cap, cfg, rate), rs in keys.items()]


def _workload_summary(plan: Plan) -> str:
    s = W.WORKLOADS[plan.workload].summary
    if plan.worker_speeds:  # the clairvoyant figures (d) model every worker at full speed
        s += f"; worker speeds {','.join(f'{x:g}' for x in plan.worker_speeds)} (clairvoyant assumes all 1)"
    return s


def run(plan: Plan, configs: list[str], work: Path) -> dict[str, Any]:
    wl = workload(plan)
    T.build_tokenizer(work / "tokenizer")
    caps, runs = [], []
    for cap in plan.capacities:
        info, rs = run_capacity(plan, configs, wl, cap, work)
        caps.append(info)
        runs += rs
    return {"workload": {"name": plan.workload, "seed": plan.workload_seed, "summary": _workload_summary(plan),
                         "worker_speeds": plan.worker_speeds, **W.describe(wl.rows)},
            "capacities": caps, "cells": cells(runs), "requests": len(wl.rows), "trace_requests": wl.trace_requests,
            "trace_rate_rps": T.offered_rate(wl.rows, 1.0), "prompt_tokens": sum(map(len, wl.prompts)),
            "output_tokens": sum(wl.outputs), "working_set_blocks": wl.working_set}


# ----------------------------------------------------------------------------- claims and targets
def _cell(doc: dict[str, Any], cap: str, cfg: str, rate: float) -> dict[str, Any] | None:
    return next((c for c in doc["result"]["cells"]
                 if c["capacity"] == cap and c["config"] == cfg and c["offered_rps"] == rate), None)


def _values(cell: dict[str, Any], metric: str) -> list[float | None]:
    return [r.get(metric) for r in cell["runs"]]


def compare(x: dict[str, Any], base: dict[str, Any], metric: str) -> dict[str, Any]:
    """``x`` against ``base`` on one metric, oriented so > 1 means ``x`` is better: the ratio of medians,
    and the claim (the same ratio only when the runs' spreads do not overlap)."""
    xs, bs = _values(x, metric), _values(base, metric)
    num, den = (bs, xs) if metric in LOWER_IS_BETTER or metric in OOB_CLAIMED_METRICS else (xs, bs)
    sn, sd = S.spread(num), S.spread(den)
    return {"capacity": x["capacity"], "offered_rps": x["offered_rps"], "metric": metric, "config": x["config"],
            "baseline": base["config"], "median_ratio": H.ratio(sn.median if sn else None, sd.median if sd else None),
            "claim": S.claim(num, den)}


PAIRS = (("b", "a"), ("c", "a"), ("c1", "a"), ("e", "a"), ("c", "b"), ("c", "e"), ("c", "c1"),
         ("r2", "c"), ("r3m", "c"), ("r3n", "c"), ("r3n", "r3m"), ("g3", "c"), ("r3n", "g3"), ("r3m", "g3"),
         ("c3i", "c"), ("r3n", "c3i"), ("c3u", "c"), ("c3i", "c3u"), ("c3in", "c"), ("c3in", "c3i"), ("c1n", "c"),
         ("c3i", "c1n"), ("c3il", "c"), ("c3il", "c3i"), ("r3nl", "c"), ("r3nl", "r3n"),
         ("c3is", "c"), ("c3is", "c3i"), ("r3ns", "c"), ("r3ns", "r3n"),
         ("rs", "c"), ("rs2", "c"), ("cv", "c"), ("cv", "e"),
         ("g2", "g2e"), ("g2", "c"), ("g2e", "e"),
         ("rsz", "c"), ("rsn", "c"), ("rsz", "e"), ("rsn", "e"), ("rsn", "rsz"),
         ("cnd", "c"), ("cnr", "c"), ("cnl", "c"), ("cnu", "c"), ("r3nd", "c"), ("r3nd", "r3n"))
# issue 42 item 3, "events earn their keep where predictions cannot see": in each situation the KV-aware
# configuration against the prediction-only one under the same conditions (the X-oobNN pairs are added per
# share present: oob_pairs)
ITEM3_PAIRS = (("g2", "g2e"),)
VARIANTS: dict[str, list[str]] = {}  # --variant NAME=FLAGS: more KV-aware pickers, each compared with (c) and (e)
# (e)'s flags, frozen: no KV events, predictions kept for the run, and the cost alone placing with Dynamo's
# prefill weight 1.0 (the placement of the recordings before --affinity-load-bound and then issue 42's
# prefill weight 8.0 became the defaults)
E_FLAGS = ("--kv-event-port", "0", "--prediction-ttl-s", "100000", "--affinity-load-bound", "0",
           "--prefill-load-scale", "1")
# --prediction-variant NAME=FLAGS: prediction-only pickers ((e)'s flags, then these), compared with (e), and
# (c) with each: whether KV events still matter under another placement rule
E_VARIANTS: dict[str, list[str]] = {}


def oob_pairs(configs: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """For every out-of-band configuration X-oobNN but the prediction-only ones: (X-oobNN, e-oobNN), the
    KV-aware picker against prediction-only with the same out-of-band requests, and (X-oobNN, X), what
    the out-of-band share costs it."""
    out = []
    for cfg in configs:
        p = OB.parse(cfg)
        if p is None or p[0] == "e" or p[0] in E_VARIANTS:
            continue
        out += [(cfg, OB.name("e", p[1])), (cfg, p[0])]
    return tuple(out)


def claims(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pair of PAIRS present in a (capacity, load) on every claimed metric (and the out-of-band pairs
    also on OOB_CLAIMED_METRICS, where both have them)."""
    out = []
    present = sorted({c["config"] for c in doc["result"]["cells"]})
    pairs = (PAIRS + tuple((v, base) for v in VARIANTS for base in ("c", "e"))
             + tuple(pair for v in E_VARIANTS for pair in ((v, "e"), ("c", v))) + oob_pairs(present))
    for c in doc["result"]["cells"]:
        for x, base in pairs:
            if c["config"] != x:
                continue
            b = _cell(doc, c["capacity"], base, c["offered_rps"])
            if b is not None:
                both_oob = OB.parse(x) is not None and OB.parse(base) is not None
                both_window = all(any("window_cached_ratio" in r for r in cell["runs"]) for cell in (c, b))
                out += [compare(c, b, m) for m in (*CLAIMED_METRICS, *(OOB_CLAIMED_METRICS if both_oob else ()),
                                                   *(WINDOW_CLAIMED_METRICS if both_window else ()))]
    return out


def _median(cell: dict[str, Any] | None, metric: str) -> float | None:
    s = (cell or {}).get("summary", {}).get(metric)
    return s["median"] if s else None


def saturating_rate(doc: dict[str, Any], cap: str) -> float | None:
    """The first load at which round-robin's median TTFT p90 is 3x its value at the lowest load (else the top
    one): where (a) has saturated, the load the issue's TTFT targets are judged at."""
    a = sorted((c for c in doc["result"]["cells"] if c["capacity"] == cap and c["config"] == "a"),
               key=lambda c: c["offered_rps"])
    if not a:
        return None
    floor = _median(a[0], "ttft_p90_ms") or 0.0
    return next((c["offered_rps"] for c in a if (_median(c, "ttft_p90_ms") or 0.0) >= 3 * floor),
                a[-1]["offered_rps"])


def _find_claim(doc: dict[str, Any], cap: str, rate: float, metric: str, cfg: str, base: str) -> dict | None:
    return next((k for k in doc["claims"] if (k["capacity"], k["offered_rps"], k["metric"], k["config"],
                                              k["baseline"]) == (cap, rate, metric, cfg, base)), None)


def capacity_targets(doc: dict[str, Any], cap: str) -> dict[str, Any]:
    """Issue 16's targets at one capacity, judged on claims (a median ratio alone never meets a target)."""
    out: dict[str, Any] = {}
    sat = saturating_rate(doc, cap)
    for base, factor in (("a", 5.0), ("e", 2.0)):
        k = _find_claim(doc, cap, sat, "ttft_p90_ms", "c", base) if sat is not None else None
        if k is not None:
            out[f"c_ttft_p90_{factor:g}x_below_{base}_at_saturation"] = {
                "saturating_rps": sat, **k, "met": k["claim"] is not None and k["claim"] >= factor}
    info = next(i for i in doc["result"]["capacities"] if i["name"] == cap)
    per = []
    for c in (c for c in doc["result"]["cells"] if c["capacity"] == cap and c["config"] == "c"):
        cv = next(x for x in info["clairvoyant"] if x["offered_rps"] == c["offered_rps"])
        med = _median(c, "aiperf_cached_ratio")
        per.append({"offered_rps": c["offered_rps"], "c": med, "clairvoyant": cv["cached_ratio"]["median"],
                    "pooled_lru": info["oracle"]["pooled_lru"],
                    "c_over_clairvoyant": H.ratio(med, cv["cached_ratio"]["median"]),
                    "c_over_pooled_lru": H.ratio(med, info["oracle"]["pooled_lru"])})
    if per:
        out["c_cached_within_5pct_of_clairvoyant"] = {"per_load": per, "met": all(
            (p["c_over_clairvoyant"] or 0) >= 0.95 for p in per)}
    wins = [k for k in doc["claims"] if k["capacity"] == cap and k["config"] == "c" and k["baseline"] == "c1"
            and k["claim"] is not None and k["claim"] < 1]
    if any(c["config"] == "c1" for c in doc["result"]["cells"]):
        out["c1_beats_c"] = {"where": wins, "any": bool(wins)}
    return out


GAP_METRICS = ("ttft_p90_ms", "aiperf_cached_ratio")


def gap_closure(e: float, c: float, bound: float, lower_is_better: bool) -> float | None:
    """The share of the gap between prediction-only (e) and the bound that (c) closes (1 = at the bound,
    0 = no better than (e), < 0 = worse); None where the bound is no better than (e) (no gap to close)."""
    gap = (e - bound) if lower_is_better else (bound - e)
    if gap <= 0:
        return None
    return ((e - c) if lower_is_better else (c - e)) / gap


def half_gap_targets(doc: dict[str, Any], cap: str) -> dict[str, Any] | None:
    """Issue 28's target at one capacity: at every load, (c) closes at least half of the gap between (e) and
    the clairvoyant bound in TTFT p90 and cached ratio, and no claim has (c) worse than (e). The bound is the
    clairvoyant plan REPLAYED through the mocks (cv) when this run has it, as the issue defines it; else only
    the cached ratio is judged, against the offline clairvoyant figure. A metric whose bound is no better than
    (e)'s median leaves no gap: it is met when (c)'s median is no worse than (e)'s."""
    info = next(i for i in doc["result"]["capacities"] if i["name"] == cap)
    per: list[dict[str, Any]] = []
    for c in (c for c in doc["result"]["cells"] if c["capacity"] == cap and c["config"] == "c"):
        rate = c["offered_rps"]
        e, cv = _cell(doc, cap, "e", rate), _cell(doc, cap, "cv", rate)
        if e is None:
            continue
        for metric in GAP_METRICS:
            lower = metric in LOWER_IS_BETTER
            if cv is not None:
                bound, source = _median(cv, metric), "replayed"
            elif metric == "aiperf_cached_ratio":
                offline = next(x for x in info["clairvoyant"] if x["offered_rps"] == rate)
                bound, source = offline["cached_ratio"]["median"], "offline"
            else:
                continue
            me, mc = _median(e, metric), _median(c, metric)
            if me is None or mc is None or bound is None:
                continue
            closed = gap_closure(me, mc, bound, lower)
            met = closed >= 0.5 if closed is not None else (mc <= me if lower else mc >= me)
            per.append({"offered_rps": rate, "metric": metric, "e": me, "c": mc, "bound": bound,
                        "bound_source": source, "closed": closed, "met": met})
    if not per:
        return None
    worse = [k for k in doc.get("claims", []) if k["capacity"] == cap and (k["config"], k["baseline"]) == ("c", "e")
             and k["claim"] is not None and k["claim"] < 1]
    return {"per_load": per, "c_worse_than_e": worse, "met": all(p["met"] for p in per) and not worse}


WITHIN_METRICS = ("ttft_p50_ms", "ttft_p90_ms", "itl_p90_ms", "aiperf_cached_ratio")


def within_spread(x: dict[str, Any], base: dict[str, Any], metric: str) -> dict[str, Any]:
    """Issue 28.9's test for one metric: is ``x``'s median inside ``base``'s min..max (one warm picker's
    spread)? ``overlap`` (the spreads overlap: no claim either way) is the weaker reading, kept beside it."""
    sx, sb = x["summary"].get(metric), base["summary"].get(metric)
    if not sx or not sb:
        return {"metric": metric, "median": None, "base_spread": sb, "inside": None, "overlap": None}
    return {"metric": metric, "median": sx["median"], "base_spread": [sb["min"], sb["max"]],
            "inside": sb["min"] <= sx["median"] <= sb["max"],
            "overlap": sx["min"] <= sb["max"] and sb["min"] <= sx["max"]}


def replica_restart_targets(doc: dict[str, Any], cap: str) -> dict[str, Any]:
    """(r2), (r3m), (r3n), (rs) and (rs2) against (c) at each load: the item-9 target (issue 47 item 3's for
    the three-replica ones), and the restart's own facts."""
    out: dict[str, Any] = {}
    for cfg in ("r2", "r3m", "r3n", "rs", "rs2"):
        per = []
        for x in (c for c in doc["result"]["cells"] if c["capacity"] == cap and c["config"] == cfg):
            base = _cell(doc, cap, "c", x["offered_rps"])
            if base is None:
                continue
            ws = [within_spread(x, base, m) for m in WITHIN_METRICS]
            entry: dict[str, Any] = {"offered_rps": x["offered_rps"], "metrics": ws,
                                     "met": all(w["inside"] for w in ws)}
            if cfg in ("r2", "r3m", "r3n", "rs2"):  # a repeat where Envoy sent one replica nothing did not test two replicas
                entry["picks_per_picker"] = [r.get("picks_per_picker") for r in x["runs"]]
            if cfg in ("rs", "rs2"):
                entry["restarts"] = [r.get("restart") for r in x["runs"]]
                entry["errors"] = [r["errors"] for r in x["runs"]]
                entry["routed_without_picker"] = [r.get("routed_without_picker") for r in x["runs"]]
                # AIPerf's latencies and cached ratio cover the requests that succeeded: with failures the
                # survivors ran on a lighter load, so quality "within the spread" also needs no failure
                entry["met"] = entry["met"] and not any(entry["errors"])
            per.append(entry)
        if per:
            out[f"{cfg}_within_spread_of_c"] = {"per_load": per, "met": all(p["met"] for p in per)}
    return out


WITHIN_5PCT = 0.95  # issue 47: the relay's window cached ratio at least 95% of the unrestarted picker's


def restart_window_targets(doc: dict[str, Any], cap: str) -> dict[str, Any]:
    """Issue 47's restart proof at one capacity, per load, on the window after the restart (restart_window):
    ``rsn_window_within_5pct_of_c``: (rsn)'s median window cached ratio / (c)'s, met at >= 0.95 (a closeness
    target: a ratio of medians, the spreads beside it, as no claim can show two figures close); met above 1 too.
    ``rsn_beats_e_in_window``: (rsn) against prediction-only (e) on the window cached ratio, met only by a claim.
    ``rsz_beside``: today's figure, (rsz) against (c), (e) and (rsn), reported, no target. ``c_vs_e_in_window``:
    the same window without a restart, for scale."""
    out: dict[str, Any] = {}
    here = [c for c in doc["result"]["cells"] if c["capacity"] == cap and "window_cached_ratio" in c["summary"]]
    rates = sorted({c["offered_rps"] for c in here})

    def k(rate: float, x: str, base: str) -> dict[str, Any] | None:
        got = _find_claim(doc, cap, rate, "window_cached_ratio", x, base)
        return {"median_ratio": got["median_ratio"], "claim": got["claim"]} if got else None

    def cell_facts(rate: float, cfg: str) -> dict[str, Any] | None:
        c = _cell(doc, cap, cfg, rate)
        if c is None or "window_cached_ratio" not in c["summary"]:
            return None
        return {**{m: c["summary"].get(m) for m in WINDOW_METRICS},
                "errors": [r["errors"] for r in c["runs"]],
                "records_match_workers": [(r.get("window") or {}).get("records_match_workers") for r in c["runs"]],
                "sigterm_at_s": [(r.get("window") or {}).get("sigterm_at_s") for r in c["runs"]],
                "picker_back_at_s": [(r.get("window") or {}).get("picker_back_at_s") for r in c["runs"]]}

    near, beats, beside, ce = [], [], [], []
    for rate in rates:
        facts = {cfg: cell_facts(rate, cfg) for cfg in ("c", "e", "rsz", "rsn")}
        if facts["rsn"] and facts["c"]:
            r = k(rate, "rsn", "c")
            ratio = r["median_ratio"] if r else None
            # (c) over the very requests (rsn) served in its window, seed by seed: beside, not the target
            same = S.spread([((x.get("window") or {}).get("matched") or {}).get("rsn")
                             for x in (_cell(doc, cap, "c", rate) or {"runs": []})["runs"]])
            near.append({"offered_rps": rate, "rsn": facts["rsn"], "c": facts["c"], "ratio": ratio,
                         "c_on_rsn_served": same.as_dict() if same else None,
                         "ratio_on_rsn_served": H.ratio((facts["rsn"]["window_cached_ratio"] or {}).get("median"),
                                                        same.median if same else None),
                         "met": ratio is not None and ratio >= WITHIN_5PCT})
        if facts["rsn"] and facts["e"]:
            r = k(rate, "rsn", "e")
            beats.append({"offered_rps": rate, "e": facts["e"], **(r or {}),
                          "met": bool(r and r["claim"] is not None and r["claim"] > 1)})
        if facts["rsz"]:
            beside.append({"offered_rps": rate, "rsz": facts["rsz"], "vs_c": k(rate, "rsz", "c"),
                           "vs_e": k(rate, "rsz", "e"), "rsn_vs_rsz": k(rate, "rsn", "rsz")})
        if facts["c"] and facts["e"]:
            ce.append({"offered_rps": rate, **(k(rate, "c", "e") or {})})
    if near:
        out["rsn_window_within_5pct_of_c"] = {"per_load": near, "met": all(p["met"] for p in near)}
    if beats:
        out["rsn_beats_e_in_window"] = {"per_load": beats, "met": all(p["met"] for p in beats)}
    if beside:
        out["rsz_beside"] = {"per_load": beside}
    if ce:
        out["c_vs_e_in_window"] = {"per_load": ce}
    return out


def replayed_clairvoyant(doc: dict[str, Any], cap: str) -> dict[str, Any] | None:
    """(cv) replayed beside the offline clairvoyant figure at each load."""
    info = next(i for i in doc["result"]["capacities"] if i["name"] == cap)
    per = []
    for x in (c for c in doc["result"]["cells"] if c["capacity"] == cap and c["config"] == "cv"):
        off = next(v for v in info["clairvoyant"] if v["offered_rps"] == x["offered_rps"])
        per.append({"offered_rps": x["offered_rps"], "offline_cached": off["cached_ratio"],
                    "replayed_cached": x["summary"]["aiperf_cached_ratio"],
                    "replayed_ttft_p90_ms": x["summary"]["ttft_p90_ms"],
                    "plan_match": [r.get("plan_match") for r in x["runs"]]})
    return {"per_load": per} if per else None


def item3_targets(doc: dict[str, Any], cap: str) -> dict[str, Any]:
    """Issue 42 item 3 at one capacity: where the picker's own predictions are wrong (two gateways' pickers
    without sync, out-of-band traffic), the KV-aware configuration against prediction-only under the same
    conditions, one entry per pair ``X_beats_BASE``. Met: a claimed win on TTFT p90 (of the picker-routed
    requests) at some load, and no claimed loss on TTFT p90 or output tokens/s at any."""
    here = [c for c in doc["result"]["cells"] if c["capacity"] == cap]
    present = sorted({c["config"] for c in here})
    pairs = [p for p in (*ITEM3_PAIRS, *oob_pairs(present)) if set(p) <= set(present)
             and (p in ITEM3_PAIRS or OB.parse(p[1]) is not None)]
    out: dict[str, Any] = {}
    for x, base in pairs:
        metrics = ("ttft_p90_ms", "output_tokens_per_s", *(OOB_CLAIMED_METRICS if OB.parse(x) else ()))
        per = []
        for rate in sorted({c["offered_rps"] for c in here if c["config"] == x}):
            ks = {m: _find_claim(doc, cap, rate, m, x, base) for m in metrics}
            per.append({"offered_rps": rate, **{m: {"median_ratio": k["median_ratio"], "claim": k["claim"]}
                                                 for m, k in ks.items() if k is not None}})
        won = any((p.get("ttft_p90_ms") or {}).get("claim") is not None and p["ttft_p90_ms"]["claim"] > 1
                  for p in per)
        lost = any((p.get(m) or {}).get("claim") is not None and p[m]["claim"] < 1
                   for p in per for m in ("ttft_p90_ms", "output_tokens_per_s"))
        out[f"{x}_beats_{base}"] = {"per_load": per, "won_somewhere": won, "lost_somewhere": lost,
                                    "met": won and not lost}
    return out


# issue 44's proof: a variant is tiered when its flags turn tier credit on (config.py `_tiered_credit_enabled`)
TIER_FLAGS = ("--tiered-credit", "--router-host-cache-hit-weight", "--router-disk-cache-hit-weight")


def tiered_configs(doc: dict[str, Any]) -> list[str]:
    """The configurations whose picker credits tiers, read from the recorded descriptions (a variant's is
    "picker, KV-aware, FLAGS"), so a recorded run is judged again without its command line."""
    return [k for k, text in doc.get("configs", {}).items() if any(f in text.split() for f in TIER_FLAGS)]


def tier_targets(doc: dict[str, Any], cap: str) -> dict[str, Any]:
    """Issue 44's two targets for each tiered configuration at a capacity run with a host tier: TTFT p90 at
    saturation >= 1.5x lower than GPU-only credit (c), by a claim; and the cached-or-loaded ratio (the mocks'
    cached tokens, which count blocks loaded from host memory) within 10% of the bound that knows both tiers
    (`oracle_gpu_and_host`, the pooled LRU over GPU + host blocks) at every load. Saturation is (a)'s, as for
    issue 16's targets; a run without (a) is judged at its top load."""
    info = next(i for i in doc["result"]["capacities"] if i["name"] == cap)
    if "oracle_gpu_and_host" not in info:
        return {}
    bound = info["oracle_gpu_and_host"]["pooled_lru"]
    cells = [c for c in doc["result"]["cells"] if c["capacity"] == cap]
    sat = saturating_rate(doc, cap)
    if sat is None and cells:
        sat = max(c["offered_rps"] for c in cells)
    out: dict[str, Any] = {}
    for x in tiered_configs(doc):
        xc, cc = (_cell(doc, cap, x, sat), _cell(doc, cap, "c", sat)) if sat is not None else (None, None)
        if xc is not None and cc is not None:  # compared here: `claims` pairs only this run's --variant names
            k = compare(xc, cc, "ttft_p90_ms")
            out[f"{x}_ttft_p90_1.5x_below_c_at_saturation"] = {
                "saturating_rps": sat, **k, "met": k["claim"] is not None and k["claim"] >= 1.5}
        per = []
        for c in sorted((c for c in cells if c["config"] == x), key=lambda c: c["offered_rps"]):
            med = _median(c, "aiperf_cached_ratio")
            per.append({"offered_rps": c["offered_rps"], x: med, "two_tier_bound": bound,
                        "over_bound": H.ratio(med, bound)})
        if per:  # a workload with nothing to reuse (bound 0) has no such target: met is None, not False
            out[f"{x}_cached_or_loaded_within_10pct_of_two_tier_bound"] = {
                "per_load": per, "met": all((p["over_bound"] or 0) >= 0.9 for p in per) if bound > 0 else None}
    return out


def targets(doc: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for i in doc["result"]["capacities"]:
        t = capacity_targets(doc, i["name"])
        t.update(replica_restart_targets(doc, i["name"]))
        t.update(item3_targets(doc, i["name"]))
        t.update(restart_window_targets(doc, i["name"]))
        t.update(tier_targets(doc, i["name"]))
        half = half_gap_targets(doc, i["name"])
        if half is not None:
            t["c_closes_half_the_gap_from_e_to_clairvoyant"] = half
        cv = replayed_clairvoyant(doc, i["name"])
        if cv is not None:
            t["clairvoyant_replayed"] = cv
        out[i["name"]] = t
    return out


# ----------------------------------------------------------------------------- report
def _ratio_text(k: dict[str, Any] | None) -> str:
    if k is None or k["median_ratio"] is None:
        return "-"
    return f"{k['claim']:.2f}" if k["claim"] is not None else f"({k['median_ratio']:.2f})"


def print_report(doc: dict[str, Any]) -> None:
    res = doc["result"]
    wl = res.get("workload", {"name": "mooncake", "seed": 0})
    print(f"\nWorkload {wl['name']} (seed {wl['seed']}), {res['requests']} of {res['trace_requests']} requests, "
          f"{res['prompt_tokens']} prompt "
          f"tokens (mock), working set {res['working_set_blocks']} blocks. Each cell: median [min..max] over "
          f"{doc['plan']['repeats']} jitter seeds. vs (a): a/x for TTFT, x/a for tokens/s; a bare figure is a "
          "claim (spreads disjoint), one in brackets is a ratio of medians whose spreads overlap (no claim).")
    for info in res["capacities"]:
        cap = info["name"]
        cv = ", ".join(f"{x['offered_rps']:g} req/s {S.fmt_spread(x['cached_ratio'], '.3f')}"
                       for x in info["clairvoyant"])
        print(f"\ncapacity {cap}: {info['blocks_per_worker']} blocks/worker, working set "
              f"{info['working_set_over_pool']:.2f}x the pool; (d) pooled LRU {info['oracle']['pooled_lru']:.3f}, "
              f"infinite {info['oracle']['infinite']:.3f}, clairvoyant {cv}")
        rows = []
        for c in (c for c in res["cells"] if c["capacity"] == cap):
            sm = c["summary"]
            k = _find_claim(doc, cap, c["offered_rps"], "ttft_p90_ms", c["config"], "a")
            kt = _find_claim(doc, cap, c["offered_rps"], "output_tokens_per_s", c["config"], "a")
            rows.append([cap, c["config"], f"{c['offered_rps']:g}", len(c["runs"]),
                         int(sum(r["errors"] for r in c["runs"])), S.fmt_spread(sm["ttft_p50_ms"]),
                         S.fmt_spread(sm["ttft_p90_ms"]), _ratio_text(k), S.fmt_spread(sm["itl_p90_ms"], ".1f"),
                         S.fmt_spread(sm["output_tokens_per_s"]), _ratio_text(kt),
                         S.fmt_spread(sm["aiperf_cached_ratio"], ".3f")])
        print(H.table(rows, ["capacity", "cfg", "req/s", "runs", "err", "TTFT p50", "TTFT p90", "a/x p90",
                             "ITL p90", "out tok/s", "x/a", "cached"]))
        oob = [c for c in res["cells"] if c["capacity"] == cap and OB.parse(c["config"])]
        if oob:
            print("  X-oobNN rows above: AIPerf's figures, the picker-routed requests only. Every request:")
            for c in oob:
                sm = c["summary"]
                print(f"  ({c['config']}) {c['offered_rps']:g} req/s: {S.fmt_spread(sm.get('oob_requests'))} out of "
                      f"band, errors {[r['oob']['errors'] for r in c['runs']]}, routed without picker "
                      f"{S.fmt_spread(sm.get('routed_without_picker'))}; TTFT p90 all requests "
                      f"{S.fmt_spread(sm.get('all_ttft_p90_ms'))}, out of band {S.fmt_spread(sm.get('oob_ttft_p90_ms'))}")
        win = [c for c in res["cells"] if c["capacity"] == cap and "window_cached_ratio" in c["summary"]]
        if win:
            print(f"  Restart window (issue 47): requests scheduled from {RESTART_AT:.2f} of the schedule's span, "
                  f"for at most {doc['plan'].get('restart_window_s', 60):g} s or to the last arrival:")
            print(H.table([[c["config"], f"{c['offered_rps']:g}", S.fmt_spread(c["summary"]["window_s"], ".1f"),
                            S.fmt_spread(c["summary"]["window_requests"]),
                            S.fmt_spread(c["summary"]["window_failed"]),
                            S.fmt_spread(c["summary"]["window_cached_ratio"], ".3f"),
                            _ratio_text(_find_claim(doc, cap, c["offered_rps"], "window_cached_ratio", c["config"],
                                                    "c")),
                            _ratio_text(_find_claim(doc, cap, c["offered_rps"], "window_cached_ratio", c["config"],
                                                    "e"))] for c in win],
                          ["cfg", "req/s", "window s", "requests", "failed", "window cached", "x/c", "x/e"]))
    made = [k for k in doc["claims"] if k["claim"] is not None]
    print(f"\nClaims ({len(made)} of {len(doc['claims'])} comparisons have disjoint spreads; > 1 = config better):")
    for k in made:
        print(f"  [{k['capacity']}] {k['offered_rps']:g} req/s {k['metric']}: ({k['config']}) vs "
              f"({k['baseline']}) {k['claim']:.2f}")
    print("\nTargets")
    for cap, ts in doc["targets"].items():
        for name, v in ts.items():
            print(f"  [{cap}] {name}: {json.dumps(v)}")


def _median_rows(doc: dict[str, Any], cap: str) -> list[dict[str, Any]]:
    """One flat row of medians per cell at ``cap``: the shape harness.plot_by_config draws."""
    return [{"config": c["config"], "offered_rps": c["offered_rps"],
             **{m: (c["summary"][m] or {}).get("median") for m in METRICS}}
            for c in doc["result"]["cells"] if c["capacity"] == cap]


def chart(doc: dict[str, Any], path: Path) -> None:
    """One row of panels per capacity: medians per configuration against load, the offline figures dashed."""
    plt = H.pyplot()
    caps = doc["result"]["capacities"]
    fig, grid = plt.subplots(len(caps), 4, figsize=(19, 4.5 * len(caps)), squeeze=False)
    for axes, info in zip(grid, caps, strict=True):
        H.plot_by_config(axes, _median_rows(doc, info["name"]), doc["configs"], "offered_rps",
                         (lambda r: r["ttft_p90_ms"], lambda r: r["itl_p90_ms"], lambda r: r["aiperf_cached_ratio"],
                          lambda r: r["output_tokens_per_s"]))
        cv = info["clairvoyant"]
        axes[2].plot([x["offered_rps"] for x in cv], [x["cached_ratio"]["median"] for x in cv], "k^-",
                     label="clairvoyant router")
        axes[2].axhline(info["oracle"]["pooled_lru"], color="k", ls="--", label="pooled LRU of real capacity")
        axes[2].axhline(info["oracle"]["infinite"], color="k", ls=":", label="infinite cache")
        axes[0].set_yscale("log")
        H.label_axes(axes, (f"[{info['name']}] TTFT p90 median (ms, log)", "ITL p90 median (ms)",
                            "cached-token ratio", "output tokens/s"), "offered load (req/s of simulated time)")
        axes[0].legend(fontsize=7)
        axes[2].legend(fontsize=7)
    name = doc["result"].get("workload", {}).get("name", "mooncake")
    H.save_figure(fig, f"{name} via AIPerf on 4 iteration-scheduled mock workers, per KV capacity", path)


def parse_capacities(text: str) -> tuple[str, ...]:
    """``--capacities ample,75,scarce``: names checked here, so a typo fails before any worker starts."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in CAPACITIES]
    if bad or not names:
        raise SystemExit(f"--capacities: unknown {bad or text!r}; choose from {','.join(CAPACITIES)}")
    return names


def mock_args_template(plan: Plan) -> list[str]:
    """The workers' flags with the capacity left open (it is per capacity: result.capacities[].blocks_per_worker)."""
    args = plan.mock_args(0)
    args[args.index("--num-blocks") + 1] = "<blocks_per_worker>"
    return args


def register_oob(names: Sequence[str]) -> None:
    """``--only`` may name any ``X-oobNN`` (NN% of the requests out of band in front of configuration X,
    bench/out_of_band.py) beside the four listed in CONFIGS; a restart or the clairvoyant plan cannot take it."""
    for n in names:
        p = OB.parse(n)
        if p is None or n in CONFIGS:
            continue
        if p[0] not in CONFIGS or p[0] in OB.NO_OOB or OB.parse(p[0]):
            raise SystemExit(f"--only {n}: out-of-band traffic needs one of "
                             f"{','.join(k for k in CONFIGS if k not in OB.NO_OOB and not OB.parse(k))} in front")
        CONFIGS[n] = f"{CONFIGS[p[0]]}, {p[1]:.0%} of requests out of band (straight to a worker)"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = H.bench_parser(__doc__, "trace")
    ap.add_argument("--only", help="comma-separated subset of configurations (a,b,c,c1,e; r2,r3m,r3n,rs,rs2,rsz,rsn,cv,"
                                   "g2,g2e,g3 and the out-of-band X-oobNN, e.g. c-oob10,e-oob10, only when named here)")
    ap.add_argument("--oob-seed", type=int, default=0,
                    help="which requests the X-oobNN configurations send out of band (bench/out_of_band.py)")
    ap.add_argument("--rates", help="comma-separated offered loads (req/s of simulated time); default 10,17.5,25 "
                                    "for the trace, the workload's own three per capacity with --workload")
    ap.add_argument("--rate", type=float, help="one offered load (the same as --rates R)")
    ap.add_argument("--workload", choices=sorted(W.WORKLOADS), default="mooncake",
                    help="which workload of bench/workloads.py (default: the Mooncake trace, as before)")
    ap.add_argument("--seed", type=int, default=0, help="the workload's content seed (repeats still jitter "
                                                           "arrivals of the same requests; --repeats)")
    ap.add_argument("--requests", type=int, help="requests per replay (default: the workload's; trace: its sample)")
    ap.add_argument("--worker-speeds", help="relative speed per worker, e.g. 0.5,1,1,1 (default: the workload's, "
                                            "else all 1)")
    ap.add_argument("--speedup", type=float, help="mock speedup (wall-clock compression)")
    ap.add_argument("--repeats", type=int, help="runs per cell, one per arrival-jitter seed (default 3, quick 2)")
    ap.add_argument("--capacities", help=f"comma-separated KV capacities per worker ({','.join(CAPACITIES)}; "
                                         "default ample,75,scarce)")
    ap.add_argument("--work", help="directory for AIPerf inputs, artifacts and logs (default: a temp dir)")
    ap.add_argument("--envoy-timings", action="store_true",
                    help="issue 47: Envoy's per-request timing log in every run, joined with AIPerf's records "
                         "(work dir requests-*.jsonl) and compared request by request with (c) of the same seed")
    ap.add_argument("--proc-counters", action="store_true",
                    help="issue 47: each process's CPU and context switches over every replay (proc_counters)")
    ap.add_argument("--host-tier", type=float, default=0.0,
                    help="issue 44: every worker also keeps host memory of this many times its GPU blocks, "
                         "published as vLLM's self-describing offload events (e.g. 4, with --variant "
                         "'t=--tiered-credit')")
    ap.add_argument("--restart-window-s", type=float, default=60.0,
                    help="issue 47: the restart window's longest span, wall seconds from the restart's scheduled "
                         "time (it ends earlier at the last arrival); computed when --only names a restart")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="another KV-aware picker, compared with (c) and (e), e.g. 'c30=--prediction-ttl-s 30'")
    ap.add_argument("--prediction-variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="another prediction-only picker ((e)'s flags, then these), compared with (e) and (c), "
                         "e.g. 'eb=--affinity-load-bound 0.5'")
    a = ap.parse_args(argv)
    for v in a.prediction_variant:
        name, _, flags = v.partition("=")
        CONFIGS[name] = f"picker, prediction only, {flags}"
        E_VARIANTS[name] = flags.split()
    for v in a.variant:
        name, _, flags = v.partition("=")
        CONFIGS[name] = f"picker, KV-aware, {flags}"
        VARIANTS[name] = flags.split()
    plan = QUICK if a.quick else Plan()
    configs = ["c"] if a.quick else [k for k in CONFIGS if k not in OPT_IN]  # --quick: does it run at all
    if a.only:
        register_oob(a.only.split(","))
        configs = [k for k in CONFIGS if k in a.only.split(",")]
    plan.oob_seed = a.oob_seed
    plan.restart_window_s = a.restart_window_s
    plan.envoy_timings = a.envoy_timings
    plan.proc_counters = a.proc_counters
    plan.workload, plan.workload_seed = a.workload, a.seed
    if a.requests:
        plan.requests = a.requests
    speeds = a.worker_speeds or ",".join(map(str, W.WORKLOADS[a.workload].worker_speeds or ()))
    if speeds:
        plan.worker_speeds = tuple(float(x) for x in speeds.split(","))
        if len(plan.worker_speeds) != plan.workers or min(plan.worker_speeds) <= 0:
            raise SystemExit(f"--worker-speeds: {plan.workers} positive figures, got {speeds!r}")
    if a.workload != "mooncake" and not (a.rates or a.rate or a.quick):  # its own loads per capacity
        plan.rates_by_capacity = {c: W.rates(a.workload, c) for c in CAPACITIES}
    if a.rates:
        plan.rates = tuple(float(x) for x in a.rates.split(","))
    if a.rate:
        plan.rates = (a.rate,)
    if a.speedup:
        plan.speedup = a.speedup
    elif W.WORKLOADS[a.workload].speedup and not a.quick:  # the workload's own (workloads.Spec.speedup)
        plan.speedup = W.WORKLOADS[a.workload].speedup
    plan.host_tier = a.host_tier
    if a.repeats:
        plan.repeats = a.repeats
    if a.capacities:
        plan.capacities = parse_capacities(a.capacities)
    import tempfile

    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="epp-trace-work-"))
    work.mkdir(parents=True, exist_ok=True)
    loads = {c: plan.rates_for(c) for c in plan.capacities}
    print(f"trace: {plan.workload} (seed {plan.workload_seed}) via AIPerf, configs {configs}, loads {loads} req/s, "
          f"capacities {plan.capacities}, "
          f"{plan.repeats} repeats, work dir {work}", flush=True)
    load_before = os.getloadavg()
    result = run(plan, configs, work)
    result["loadavg_1m_before_after"] = [load_before[0], os.getloadavg()[0]]
    doc = {"bench": "trace", **H.meta(a.quick), "configs": {k: CONFIGS[k] for k in configs},
           "plan": {**asdict(plan), "scale": plan.scale.describe()}, "mock_args": mock_args_template(plan),
           "aiperf_command": aiperf_command("http://<gateway>", Path("<trace.jsonl>"), Path("<tokenizer dir>"),
                                            Path("<artifacts>"), plan.aiperf_timeout_s)[1:],
           "result": result}
    doc["claims"] = claims(doc)
    doc["targets"] = targets(doc)
    return H.publish(doc, a.out, "trace", print_report, chart)


if __name__ == "__main__":
    main()
