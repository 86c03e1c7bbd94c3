"""Issue 47 (s47): earlier bench_trace work dirs read again request by request from AIPerf's own records.

    python earlier_runs_ack.py WORK_DIR r3n,r3m,g3

`request_ack_ns` is the response's first bytes (the mock sends its headers once it has parsed the request), so
`ack` is everything before the worker; TTFT - ack is the worker and the way back. Pairs every request with the
same request under (c) of the same seed (capacity 75, 5 req/s), over the requests with the same cached tokens.
"""
import json
import statistics as st
import sys
from pathlib import Path


def load(d: Path) -> dict[int, dict[str, float]]:
    out = {}
    for line in open(d / "profile_export.jsonl"):
        r = json.loads(line)
        m = r["metadata"]
        if m.get("benchmark_phase") != "profiling" or r.get("error") or not m.get("request_ack_ns"):
            continue
        x = r["metrics"]
        out[int(m["conversation_id"].rsplit("_", 1)[1])] = {
            "ttft": x["time_to_first_token"]["value"],
            "cached": (x.get("usage_prompt_cache_read_tokens") or {}).get("value") or 0,
            "ack": (m["request_ack_ns"] - m["request_start_ns"]) / 1e6}
    return out


work, cfgs = Path(sys.argv[1]), sys.argv[2].split(",")
for cfg in cfgs:
    ack, rest = [], []
    for seed in range(5):
        try:
            c, o = load(work / f"aiperf-c-75-5rps-s{seed}"), load(work / f"aiperf-{cfg}-75-5rps-s{seed}")
        except FileNotFoundError:
            continue
        same = [i for i in c if i in o and c[i]["cached"] == o[i]["cached"]]
        ack += [o[i]["ack"] - c[i]["ack"] for i in same]
        rest += [(o[i]["ttft"] - o[i]["ack"]) - (c[i]["ttft"] - c[i]["ack"]) for i in same]
    if ack:
        print(f"{cfg}: {len(ack)} requests, median d ack {st.median(ack):+.2f} ms, d (TTFT - ack) {st.median(rest):+.2f} ms")
