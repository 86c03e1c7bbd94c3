#!/bin/bash
# issue 47 (s47): sync CPU per request, NATS sync before (base: bench-only commit 10247f7's picker) and after
# (0c2b789: no echo, read-loop dispatch), 3 replicas, 20 req/s, one locked session, same seeds
set -x
cat /proc/loadavg; date -u
cd /tmp/s47/base && PYTHONPATH=/tmp/s47/base timeout 420 .venv/bin/python -m bench.bench_sync_cpu --configs nosync,nats --repeats 3 --name sync_cpu-before --out /work/wt-s47/bench/results/sync-issue47-s47/sync-cpu
cat /proc/loadavg; date -u
cd /work/wt-s47 && PYTHONPATH=/work/wt-s47 timeout 420 .venv/bin/python -m bench.bench_sync_cpu --configs nosync,nats --repeats 3 --name sync_cpu-after --out /work/wt-s47/bench/results/sync-issue47-s47/sync-cpu
cat /proc/loadavg; date -u
