"""Per wake-up of a thread issued from CPU FROM (default 0: the shard woken by the decider's lookup), how long
until it ran on CPU TO (default 1), and who ran meanwhile: python wakelat.py TAG PID [FROM TO].

Reads /tmp/p45/sched-TAG.txt (`perf script -F cpu,time,event,trace` of diagrun.sh's sched-TAG.data)."""

import collections
import re
import sys

T, pid = sys.argv[1], sys.argv[2]
frm, to = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (0, 1)
ev = []
for ln in open(f"/tmp/p45/sched-{T}.txt"):
    m = re.match(r"\s*\[(\d+)\]\s+([\d.]+): sched:(\w+): (.*)", ln)
    if m:
        ev.append((int(m[1]), float(m[2]), m[3], m[4]))
lat = []
who: collections.Counter[str] = collections.Counter()
for i, (cpu, t, kind, tr) in enumerate(ev):
    if kind != "sched_wakeup" or cpu != frm or f"pid={pid} " not in tr:
        continue
    ran: collections.Counter[str] = collections.Counter()
    last = t
    for cpu2, t2, k2, tr2 in ev[i + 1:]:
        if cpu2 != to or k2 != "sched_switch":
            continue
        prev = tr2.split("prev_comm=")[1].split(" prev_pid=")[0] + "/" + tr2.split("prev_pid=")[1].split()[0]
        ran[prev] += t2 - last
        last = t2
        if tr2.split("next_pid=")[1].split()[0] == pid:
            break
    d = (last - t) * 1000
    lat.append(d)
    if d > 0.5:
        for k, v in ran.items():
            who[k] += v * 1000
lat.sort()
n = len(lat)
print(f"{n} wake-ups of {pid} from CPU {frm}; p50 {lat[n // 2]:.3f} p90 {lat[int(n * .9)]:.3f} "
      f"p99 {lat[int(n * .99)]:.3f} max {lat[-1]:.3f} ms; over 0.5 ms: {sum(x > 0.5 for x in lat)}, "
      f"over 1 ms: {sum(x > 1 for x in lat)}")
print(f"CPU {to} time in the waits over 0.5 ms, by task (ms):", {k: round(v, 1) for k, v in who.most_common(8)})
