"""For each stalled decision (late start from its due time), what CPU 0 ran meanwhile (perf sched_switch),
which slow loop callbacks and which collections overlapped it."""

import bisect
import collections
import json
import subprocess
import sys

T = sys.argv[1]
TH = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
runs = [json.loads(x) for x in open(f"/tmp/p45/d-{T}.log")]
gcs = []
for line_ in open(f"/tmp/p45/gc-{T}.log"):
    p = line_.split()
    gcs.append((float(p[2]), int(p[1]), " ".join(p[3:6])))
out = subprocess.run(
    ["perf", "script", "-i", f"/tmp/p45/sched-{T}.data", "-F", "cpu,time,event,trace"],
    capture_output=True,
    text=True,
).stdout
sw = collections.defaultdict(list)  # cpu -> [(t, prev, next)]
for line in out.splitlines():
    if "sched_switch" not in line:
        continue
    cpu = int(line.split("[")[1].split("]")[0])
    t = float(line.split("]")[1].split(":")[0])
    tr = line.split("sched_switch:")[1]
    prev = tr.split("prev_comm=")[1].split(" prev_pid=")[0] + "/" + tr.split("prev_pid=")[1].split()[0]
    nxt = tr.split("next_comm=")[1].split(" next_pid=")[0] + "/" + tr.split("next_pid=")[1].split()[0]
    sw[cpu].append((t, prev, nxt))


def ran(cpu, a, b):
    """what ran on cpu in [a, b]: {task: ms}"""
    L = sw[cpu]
    ts = [x[0] for x in L]
    i = max(bisect.bisect_left(ts, a) - 1, 0)
    acc = collections.Counter()
    while i < len(L) and L[i][0] < b:
        t0 = max(L[i][0], a)
        t1 = min(L[i + 1][0] if i + 1 < len(L) else b, b)
        if t1 > t0:
            acc[L[i][2]] += (t1 - t0) * 1000
        i += 1
    return {k: round(v, 2) for k, v in acc.most_common(6)}


for r in runs:
    w0, pid = r["w0"], r["pid"]
    recs = r["recs"]
    print(f"=== {r['n']} workers, picker pid {pid}, shards {r['shard_pids']}")
    stalls = []
    base = min(b - i * 0.005 for i, (b, e) in enumerate(recs))  # the first due, from the least-late decision
    for i, (b, e) in enumerate(recs):
        due = base + i * 0.005
        late = (b - due) * 1000
        lat = (e - due) * 1000
        if lat > TH:
            stalls.append((i, due, b, e, late, lat))
    print(f"  decisions over {TH} ms from due: {len(stalls)}")
    # merge into episodes
    eps = []
    for s in stalls:
        if eps and s[1] - eps[-1][-1][3] < 0.01:
            eps[-1].append(s)
        else:
            eps.append([s])
    for ep in sorted(eps, key=lambda ep: -max(s[5] for s in ep))[:12]:
        a, b = ep[0][1], ep[-1][3]
        worst = max(s[5] for s in ep)
        print(
            f"  @{a - w0:7.3f}s  {len(ep)} decisions, worst {worst:.1f} ms, late start {max(s[4] for s in ep):.1f}; span {1000 * (b - a):.1f} ms"
        )
        print(f"     cpu0: {ran(0, a, b)}")
        print(f"     cpu1: {ran(1, a, b)}")
        for t, d, c, rp in r["slow"]:
            if a - 0.03 <= t <= b:
                print(f"     slow cb @{t - w0:.4f} wall {d:.1f} ms cpu {c:.1f} ms {rp}")
        for t, p, g in gcs:
            if a - 0.03 <= t <= b:
                print(f"     gc @{t - w0:.4f} pid {p} {g}")
