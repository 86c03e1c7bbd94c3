"""Not a test (run by hand: `python tests/measure_allowlist_rebuild.py`). The P/D sidecar's event-loop time per
pod event of its pool watch: discovery's publish (`InferencePoolDiscovery.endpoints`) plus `Allowlist.replace`,
at 100, 1,000 and 4,096 selected pods (half of them prefill), one pod modified per event, no network: what a
rollout costs the loop between two requests. Pure Python on one core; figures in docs/pd-pools.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epp_extproc.adapters.discovery_k8s import InferencePoolDiscovery  # noqa: E402
from epp_extproc.pd_sidecar.allowlist import Allowlist  # noqa: E402
from tests.fake_k8s import make_pod, make_pool  # noqa: E402

LABELS = {"app": "llm"}


def ip(i: int) -> str:
    return f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}"


def measure(n: int, events: int = 50) -> float:
    """Seconds per pod event at `n` pods, the reflector's list and event handlers called directly."""
    allowlist = Allowlist(from_pool=True)
    disc = InferencePoolDiscovery(allowlist, "p", "default", api_client_factory=lambda: None)
    # the pool as `_set_pool` leaves it, without starting the pod watch task (no loop, no server here)
    disc._pool, disc._pool_synced, disc._match_labels, disc._ports = make_pool("p", LABELS), True, LABELS, (8000,)
    pods = [make_pod(f"p{i:05d}", ip(i), labels={**LABELS, "llm-d.ai/role": "prefill" if i % 2 else "decode"})
            for i in range(n)]
    disc._on_pod_list(disc._pod_generation, pods)
    t0 = time.perf_counter()
    for r in range(events):
        pod = make_pod("p00001", f"10.200.{r // 256}.{r % 256}", labels={**LABELS, "llm-d.ai/role": "prefill"})
        disc._on_pod_event(disc._pod_generation, "MODIFIED", pod)
    return (time.perf_counter() - t0) / events


if __name__ == "__main__":
    for n in (100, 1000, 4096):
        print(f"{n:5d} pods: {measure(n) * 1000:.2f} ms per pod event")
