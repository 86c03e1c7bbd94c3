"""Worker roles: from the endpoints flag and file, and from the pod label in Kubernetes discovery."""

from __future__ import annotations

import pytest

from epp_extproc.adapters.discovery_k8s import DEFAULT_ROLE_LABEL, pod_endpoints
from epp_extproc.adapters.discovery_static import EndpointSpecError, parse_bytes, parse_flag
from epp_extproc.config import Config, load_config
from epp_extproc.core.contract import Role
from epp_extproc.core.endpoints import Endpoint, EndpointRegistry, parse_role

PORTS = {"kv_event_port": None, "replay_port": None}


def pod(labels: dict[str, str] | None = None, ip: str = "10.0.0.5") -> dict[str, object]:
    return {"metadata": {"name": "p", "labels": labels or {}},
            "status": {"podIP": ip, "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def test_an_endpoint_without_a_role_serves_both() -> None:
    [ep] = parse_flag("w=10.0.0.1:8000", **PORTS)
    assert ep.role is Role.BOTH


def test_the_flag_takes_a_role_option_beside_the_others() -> None:
    eps = parse_flag("p=10.0.0.1:8000;role=prefill;kv=tcp://10.0.0.1:5557,d=10.0.0.2:8000;role=decode", **PORTS)
    assert [(e.name, e.role, e.kv_events) for e in eps] == [
        ("p", Role.PREFILL, "tcp://10.0.0.1:5557"), ("d", Role.DECODE, None)]


def test_the_file_takes_a_role_member() -> None:
    raw = b"endpoints:\n  - {address: 10.0.0.1:8000, role: prefill}\n  - {address: 10.0.0.2:8000}\n"
    assert [e.role for e in parse_bytes(raw, **PORTS)] == [Role.PREFILL, Role.BOTH]


@pytest.mark.parametrize("bad", ["encode", "prefil", "", "1"])
def test_an_unknown_role_in_a_flag_is_refused_with_the_allowed_names(bad: str) -> None:
    with pytest.raises(EndpointSpecError, match="prefill, decode or both"):
        parse_flag(f"w=10.0.0.1:8000;role={bad}", **PORTS)


def test_a_non_string_role_in_a_file_is_refused() -> None:
    with pytest.raises(EndpointSpecError):
        parse_bytes(b'[{"address": "10.0.0.1:8000", "role": 3}]', **PORTS)


@pytest.mark.parametrize(("name", "role"), [("prefill", Role.PREFILL), ("decode", Role.DECODE),
                                            ("both", Role.BOTH), ("prefill-decode", Role.BOTH),
                                            ("encode-prefill", Role.PREFILL), ("DECODE", Role.DECODE),
                                            ("encode", None), ("encode-decode", None)])
def test_llm_d_role_names_map_to_the_phases_they_serve(name: str, role: Role | None) -> None:
    assert parse_role(name) is role


def test_a_pod_takes_its_role_from_llm_d_s_label() -> None:
    [ep] = pod_endpoints(pod({DEFAULT_ROLE_LABEL: "prefill"}), (8000,), 5557, None)
    assert DEFAULT_ROLE_LABEL == "llm-d.ai/role" and ep.role is Role.PREFILL


def test_an_unlabelled_pod_serves_both() -> None:
    [ep] = pod_endpoints(pod(), (8000,), 5557, None)
    assert ep.role is Role.BOTH


def test_another_label_name_can_be_configured() -> None:
    labels = {"example.com/phase": "decode", DEFAULT_ROLE_LABEL: "prefill"}
    [ep] = pod_endpoints(pod(labels), (8000,), 5557, None, role_label="example.com/phase")
    assert ep.role is Role.DECODE


def test_a_pod_whose_role_the_picker_cannot_serve_is_left_out() -> None:
    assert pod_endpoints(pod({DEFAULT_ROLE_LABEL: "encode"}), (8000,), 5557, None) == []


def test_the_role_label_and_threshold_flags_read_their_dynamo_style_env_names() -> None:
    cfg = load_config([], {"DYN_EPP_ROLE_LABEL": "x/role", "DYN_EPP_PD_MIN_UNCACHED_TOKENS": "64"})
    assert (cfg.role_label, cfg.pd_min_uncached_tokens) == ("x/role", 64)
    cfg = load_config(["--role-label", "y/role", "--pd-min-uncached-tokens", "0"], {})
    assert (cfg.role_label, cfg.pd_min_uncached_tokens) == ("y/role", 0)


def test_a_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="pd-min-uncached-tokens"):
        Config(pd_min_uncached_tokens=-1).validate()


def test_the_registry_counts_roles_and_knows_when_the_pool_is_disaggregated() -> None:
    reg = EndpointRegistry()
    reg.replace([Endpoint("a", "10.0.0.1:1"), Endpoint("d", "10.0.0.2:1", role=Role.DECODE)])
    assert not reg.has_prefill()
    reg.replace([Endpoint("a", "10.0.0.1:1"), Endpoint("p", "10.0.0.3:1", role=Role.PREFILL)])
    assert reg.has_prefill() and reg.role_counts() == {"both": 1, "prefill": 1, "decode": 0}
