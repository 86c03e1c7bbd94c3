import json
import subprocess
import sys

T = sys.argv[1]
runs = [json.loads(x) for x in open(f"/tmp/p45/d-{T}.log")]
out = subprocess.run(
    ["perf", "script", "-i", f"/tmp/p45/sched-{T}.data", "-F", "cpu,time,event,trace"],
    capture_output=True,
    text=True,
).stdout
last = {}
sl = []
for line in out.splitlines():
    if "sched_switch" not in line:
        continue
    cpu = int(line.split("[")[1].split("]")[0])
    t = float(line.split("]")[1].split(":")[0])
    tr = line.split("sched_switch:")[1]
    nxt = tr.split("next_comm=")[1].split(" next_pid=")[0] + "/" + tr.split("next_pid=")[1].split()[0]
    if cpu in last and last[cpu][1].startswith("tokio-rt-worker/81"):
        sl.append((last[cpu][0], cpu, (t - last[cpu][0]) * 1000))
    last[cpu] = (t, nxt)
# episodes: slices of tid 81 merged when gaps < 2 ms
eps = []
for s, cpu, ms in sorted(sl):
    if eps and s - eps[-1][1] < 0.002:
        eps[-1][1] = s + ms / 1000
        eps[-1][2] += ms
        eps[-1][3].add(cpu)
    else:
        eps.append([s, s + ms / 1000, ms, {cpu}])
for r in runs:
    w0 = r["w0"]
    print(
        "run",
        r["n"],
        [
            (round(a - w0, 2), round(ms, 1), sorted(c))
            for a, b, ms, c in eps
            if w0 - 1 <= a <= w0 + 16 and ms > 2.0
        ],
    )
