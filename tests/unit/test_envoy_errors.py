"""`envoy/errors.py` is the one table from a core `Problem` to what the client sees: every member has a
status, a body and a metric label, so no `PickError` the core raises can fail at the edge."""

from __future__ import annotations

import orjson
import pytest

from epp_extproc.core.errors import PickError, Problem
from epp_extproc.core.render import RenderError, RenderFailure
from epp_extproc.envoy.errors import http_error


@pytest.mark.parametrize("problem", list(Problem))
def test_every_problem_maps_to_an_error_status_an_openai_body_and_its_label(problem: Problem) -> None:
    e = http_error(PickError(problem, "why"), "/v1/chat/completions")
    assert 400 <= e.status <= 599
    assert e.code == problem.value
    assert orjson.loads(e.body())["error"]["message"] == "why"


@pytest.mark.parametrize("problem", list(Problem))
def test_every_problem_maps_to_a_text_body_off_the_openai_routes(problem: Problem) -> None:
    e = http_error(PickError(problem, "why"), "/other")
    assert e.body() == b"why\n" and e.content_type.startswith(b"text/plain")


def test_a_render_failure_takes_its_status_and_label_from_the_renderer() -> None:
    err = RenderError(RenderFailure.TIMEOUT, "slow")
    e = http_error(PickError(Problem.RENDER_FAILED, "slow", render=err), "/v1/chat/completions")
    assert (e.status, e.code) == (504, f"render_{err.label}")
