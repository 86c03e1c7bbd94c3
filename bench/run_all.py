"""Run every benchmark: ``python -m bench.run_all [--quick] [--out DIR] [--only NAME,...]``.

Each benchmark runs in its own process (so one crash or Ctrl-C stops cleanly and never leaks the next one's
ports) and writes ``DIR/<name>.json`` (+ ``<name>.png``). ``make bench`` runs the full set; on a 2-core machine
it takes well over 15 minutes (each benchmark prints its own time). ``--quick`` is the tiny smoke setting
(seconds per benchmark).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import RESULTS

BENCHES = ("kvindex", "overhead", "routing", "scale", "passthrough", "flow_control", "trace", "tokens",
           "replicas")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--only", help=f"comma-separated subset of {', '.join(BENCHES)}")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = a.only.split(",") if a.only else list(BENCHES)
    failed = []
    for name in names:
        if name not in BENCHES:
            raise SystemExit(f"unknown benchmark {name!r}; choose from {BENCHES}")
        target = str(out / "kvindex.json") if name == "kvindex" else str(out)
        cmd = [sys.executable, "-m", f"bench.bench_{name}", "--out", target, *(["--quick"] if a.quick else [])]
        print(f"=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call(cmd)
        print(f"=== {name}: exit {rc} after {time.monotonic() - t0:.0f}s", flush=True)
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
