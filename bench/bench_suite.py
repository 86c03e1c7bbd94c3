"""Issue 42's workload suite in one command: bench_trace once per workload, resumable.

    python -m bench.bench_suite [--quick] [--out DIR] [--only system-prompt,rag] [--capacities 75,scarce]
                                [--configs a,b,c,e] [--repeats 5] [--seed 0] [--force] [--dry-run]

Each workload of bench/workloads.py runs as its own ``python -m bench.bench_trace --workload NAME`` process (a
crash in one loses only that one) and records ``DIR/NAME/trace.json`` and ``.png`` the moment it finishes; a
workload whose ``trace.json`` is already there is skipped, so an interrupted suite resumes where it stopped
(``--force`` runs everything again). ``DIR/suite.jsonl`` gets one line per finished workload: its command,
exit status and wall time. Why one process per workload and not one long run: the full suite takes hours on
a 2-core machine (7 workloads x 2 capacities x 3 loads x 4 configurations x 5 repeats = 840 replays of
~15-25 s, about 4-6 hours), longer than any one sitting.

The defaults are the issue's judging settings: capacities 75 and scarce, each workload at its own three
loads (workloads.RATES), configurations (c) the default, (b) load only, (e) prediction only and (a)
round-robin, 5 repeats (with 3, chance alone makes about one comparison in twenty look claimable in a given
direction). ``--quick`` runs bench_trace's own ``--quick`` per workload (24 requests, one load, (c) only):
that it runs end to end, in about 25 s per workload (23 s measured for system-prompt), ~3 minutes for all seven.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench import workloads as W

RESULTS = Path(__file__).resolve().parent / "results" / "suite"
CONFIGS = "c,b,e,a"  # the default, load only, prediction only, round-robin (issue 42)


def command(name: str, out: Path, *, quick: bool, capacities: str, configs: str, repeats: int,
            seed: int) -> list[str]:
    """The bench_trace invocation for one workload (also what a user re-runs to redo one cell by hand)."""
    cmd = [sys.executable, "-m", "bench.bench_trace", "--workload", name, "--seed", str(seed),
           "--out", str(out / name)]
    if quick:
        return [*cmd, "--quick"]
    return [*cmd, "--capacities", capacities, "--only", configs, "--repeats", str(repeats)]


def pending(out: Path, names: Sequence[str], force: bool) -> list[str]:
    """The workloads still to run: those without a recorded ``trace.json`` (all of them with ``force``)."""
    return [n for n in names if force or not (out / n / "trace.json").exists()]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="bench_trace --quick per workload (does it run at all)")
    ap.add_argument("--out", type=Path, help=f"results directory (default {RESULTS}; --quick: a temp dir)")
    ap.add_argument("--only", help=f"comma-separated workloads (default all: {','.join(W.WORKLOADS)})")
    ap.add_argument("--capacities", default="75,scarce")
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="every workload's content seed")
    ap.add_argument("--force", action="store_true", help="run workloads already recorded again")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = ap.parse_args(argv)
    names = a.only.split(",") if a.only else list(W.WORKLOADS)
    unknown = [n for n in names if n not in W.WORKLOADS]
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; choose from {','.join(W.WORKLOADS)}")
    if a.out is None:
        import tempfile

        a.out = Path(tempfile.mkdtemp(prefix="epp-suite-")) if a.quick else RESULTS
    a.out.mkdir(parents=True, exist_ok=True)
    todo = pending(a.out, names, a.force)
    print(f"suite: {len(todo)} of {len(names)} workloads to run ({', '.join(todo) or 'none'}), results in {a.out}",
          flush=True)
    failed = 0
    for name in todo:
        cmd = command(name, a.out, quick=a.quick, capacities=a.capacities, configs=a.configs,
                      repeats=a.repeats, seed=a.seed)
        print("$ " + shlex.join(cmd), flush=True)
        if a.dry_run:
            continue
        t0 = time.monotonic()
        rc = subprocess.call(cmd, cwd=Path(__file__).resolve().parents[1])
        wall = round(time.monotonic() - t0, 1)
        failed += rc != 0
        with (a.out / "suite.jsonl").open("a") as f:
            f.write(json.dumps({"workload": name, "rc": rc, "wall_s": wall, "command": cmd[1:],
                                "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
        print(f"suite: {name} {'done' if rc == 0 else f'FAILED ({rc})'} in {wall} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
