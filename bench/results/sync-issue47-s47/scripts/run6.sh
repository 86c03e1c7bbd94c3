#!/bin/bash
cd /work/wt-s47
export PYTHONPATH=/work/wt-s47
echo "smoke $(date -u +%T) $(cat /proc/loadavg)"
timeout 150 .venv/bin/python -m bench.bench_trace --quick --only c1n --repeats 1 --out /tmp/s47/smoke6 > /tmp/s47/smoke6.log 2>&1 || { echo "smoke failed"; tail -20 /tmp/s47/smoke6.log; exit 1; }
echo "run $(date -u +%T) $(cat /proc/loadavg)"
timeout 840 .venv/bin/python -m bench.bench_trace --only c,c3i,c1n --capacities 75 --rate 5 --repeats 5 --envoy-timings --work /tmp/s47/run6 --out bench/results/sync-issue47-s47/75-5-c1n
echo "exit $? $(date -u +%T) $(cat /proc/loadavg)"
