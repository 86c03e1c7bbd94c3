#!/bin/bash
# one instrumented round: $1 = tag
set -e
T=$1
cd /work/new61
rm -f /tmp/p45/gc-$T.log /tmp/p45/d-$T.log
cat /proc/loadavg > /tmp/p45/load-$T.txt
[ -n "$AG" ] && echo $AG > /proc/self/autogroup; cat /proc/self/autogroup
perf record -q -k CLOCK_MONOTONIC -e sched:sched_switch -e sched:sched_wakeup -a -o /tmp/p45/sched-$T.data &
PP=$!
nice -n ${NICE:-0} env PYTHONPATH=/work/new61:/tmp/p45/site P45_GCLOG=/tmp/p45/gc-$T.log P45_DLOG=/tmp/p45/d-$T.log /work/main/.venv/bin/python /tmp/p45/diag.py --parts scale --modes apart --sizes 8,1000 --pin $EXTRA --out /tmp/p45/r-$T.json 2>&1 | tail -3
kill -INT $PP; wait $PP || true
cat /proc/loadavg >> /tmp/p45/load-$T.txt
