"""--cost-model time behind a real Envoy: the picker learns that its only worker is slow to answer, and then a
sheddable request whose x-slo-ttft-ms that worker cannot meet gets 429, while a request of the default
objective with the same SLO is still served (best effort); both are counted in epp_slo_decisions_total."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stack import GatewayStack
from tests.waiting import until

PREFILL_MS_PER_TOKEN = 10.0  # a ~20-token prompt: ~200 ms to the first token, far above the SLO below
SLO_MS = "50"
WARM_UP = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    objectives = Path(tmp_path_factory.mktemp("slo")) / "objectives.yaml"
    objectives.write_text("batch: -1\n")
    s = GatewayStack(workers=1, worker_args=["--prefill-ms-per-token", str(PREFILL_MS_PER_TOKEN)],
                     picker={"cost_model": "time", "inference_objectives_file": str(objectives)}).start()
    for i in range(WARM_UP):  # the picker's stopwatch teaches it how slow the worker is
        r = s.stream_chat([{"role": "user", "content": f"warm up the time model, please, request {i}"}])
        assert r[0] == 200
    until(lambda: s.picker_metric("epp_ttft_prediction_error_ms_count") >= WARM_UP, "the TTFT samples", 10)
    yield s
    s.stop()


def ask(stack: GatewayStack, objective: str | None) -> int:
    headers = {"x-slo-ttft-ms": SLO_MS}
    if objective:
        headers["x-llm-d-inference-objective"] = objective
    return stack.chat([{"role": "user", "content": "a question for a worker that is too slow"}],
                      headers=headers).status


def test_sheddable_request_the_only_worker_is_predicted_too_slow_for_gets_429(stack: GatewayStack) -> None:
    assert ask(stack, "batch") == 429
    assert stack.picker_metric("epp_slo_decisions_total", '{outcome="rejected"}') >= 1


def test_default_objective_request_with_the_same_slo_is_served_best_effort(stack: GatewayStack) -> None:
    assert ask(stack, None) == 200
    assert stack.picker_metric("epp_slo_decisions_total", '{outcome="best_effort"}') >= 1
