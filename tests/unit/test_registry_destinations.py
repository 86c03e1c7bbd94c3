"""The registry's destinations (healthy endpoints that decode) are kept until the pool or a probe verdict
changes: a thousand endpoints must not be filtered again on every decision."""

from __future__ import annotations

from epp_extproc.core.contract import Role
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry


def ep(i: int, role: Role = Role.BOTH) -> Endpoint:
    return Endpoint(f"w{i}", f"10.0.0.{i}:8000", role=role)


def test_destinations_are_the_healthy_endpoints_that_decode() -> None:
    reg = EndpointRegistry()
    reg.replace([ep(1), ep(2, Role.PREFILL), ep(3, Role.DECODE)])
    assert reg.destinations() == ("10.0.0.1:8000", "10.0.0.3:8000")


def test_destinations_follow_a_probe_verdict_and_a_new_pool() -> None:
    reg = EndpointRegistry()
    reg.replace([ep(1), ep(2)])
    assert reg.destinations() == ("10.0.0.1:8000", "10.0.0.2:8000")
    reg.set_healthy("10.0.0.1:8000", False)
    assert reg.destinations() == ("10.0.0.2:8000",)
    reg.replace([ep(1), ep(2), ep(3)])
    assert reg.destinations() == ("10.0.0.2:8000", "10.0.0.3:8000")
    reg.set_healthy("10.0.0.1:8000", True)
    assert reg.destinations() == ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")


def test_with_every_endpoint_down_all_of_them_are_destinations_as_envoy_panics() -> None:
    reg = EndpointRegistry()
    reg.replace([ep(1), ep(2)])
    reg.set_healthy("10.0.0.1:8000", False)
    reg.set_healthy("10.0.0.2:8000", False)
    assert reg.destinations() == ("10.0.0.1:8000", "10.0.0.2:8000")
