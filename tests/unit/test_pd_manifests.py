"""The P/D overlay (manifests/pd-mock): validated like the other variants, and agreeing with the picker's roles,
the sidecar's flags and the pool it serves. Rendering and schemas are tests/unit/test_manifests.py's."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from epp_extproc.config import ENV_NAMES, load_config
from epp_extproc.core.contract import Role
from epp_extproc.core.endpoints import parse_role
from epp_extproc.dev.procs import pd_sidecar
from tests.unit.test_manifests import (
    CRD_KINDS,
    K8S_VERSION,
    MANIFESTS,
    arg_after,
    build,
    crd_validator,
    env_of,
    find,
    picker,
    picker_deployment,
)

VARIANT = "pd-mock"


@pytest.fixture(scope="module")
def objs() -> list[dict[str, Any]]:
    return build(MANIFESTS / VARIANT)


def workers(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The Deployments the pool selects, by their role label value."""
    pool = find(objs, "InferencePool")
    sel = pool["spec"]["selector"]["matchLabels"]
    label = env_of(picker(objs))["DYN_EPP_ROLE_LABEL"]["value"]
    deps = [d for d in objs if d["kind"] == "Deployment"
            and all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())]
    return {d["spec"]["template"]["metadata"]["labels"][label]: d for d in deps}


def pod(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]


def test_builtin_kinds_validate_strictly_against_the_kubernetes_schemas(objs) -> None:
    builtin = [o for o in objs if (o["apiVersion"], o["kind"]) not in CRD_KINDS]
    assert {"NetworkPolicy", "Deployment", "ConfigMap"} <= {o["kind"] for o in builtin}
    for obj in builtin:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_custom_objects_validate_against_the_derived_crd_schemas(objs) -> None:
    for obj in objs:
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            crd_validator(CRD_KINDS[(obj["apiVersion"], obj["kind"])]).validate(obj)


def test_the_pool_selects_one_prefill_and_one_decode_deployment_and_not_the_picker(objs) -> None:
    deps = workers(objs)
    assert {parse_role(v) for v in deps} == {Role.PREFILL, Role.DECODE}
    assert picker_deployment(objs) not in deps.values()


def test_the_role_label_is_llm_d_s_and_the_picker_env_is_a_valid_configuration(objs) -> None:
    env = {k: v.get("value", "ns") for k, v in env_of(picker(objs)).items()}
    assert {n for n in env if n.startswith("DYN_")} <= ENV_NAMES
    cfg = load_config([], env=env)
    assert (cfg.role_label, cfg.pd_min_uncached_tokens) == ("llm-d.ai/role", 16)


def test_each_deployment_s_selector_carries_its_role_so_rollouts_do_not_mix_them(objs) -> None:
    for role, dep in workers(objs).items():
        assert dep["spec"]["selector"]["matchLabels"]["llm-d.ai/role"] == role


def test_the_sidecar_is_a_native_sidecar_on_the_decode_pods_only(objs) -> None:
    deps = workers(objs)
    (sc,) = pod(deps["decode"])["initContainers"]
    assert sc["restartPolicy"] == "Always" and sc["command"] == ["epp-pd-sidecar"] and "readinessProbe" in sc
    assert "initContainers" not in pod(deps["prefill"])


def test_the_sidecar_owns_the_pool_port_and_the_worker_hides_on_loopback(objs) -> None:
    deps = workers(objs)
    (sc,) = pod(deps["decode"])["initContainers"]
    (w,) = pod(deps["decode"])["containers"]
    target = find(objs, "InferencePool")["spec"]["targetPorts"][0]["number"]
    assert int(arg_after(sc["args"], "--port")) == target
    assert {p["containerPort"] for p in sc["ports"]} == {target}
    assert arg_after(w["args"], "--host") == "127.0.0.1"
    assert arg_after(sc["args"], "--decode-url") == f"http://127.0.0.1:{arg_after(w['args'], '--port')}"


def test_the_sidecar_gets_the_flags_make_run_gives_it(objs, tmp_path, monkeypatch) -> None:
    """The same flag names in the manifest and in `make run ARGS=--pd` (epp_extproc/dev/procs.pd_sidecar)."""
    import epp_extproc.dev.procs as procs

    monkeypatch.setattr(procs, "PD_SIDECAR", shutil.which("true") or "/bin/true")
    local = pd_sidecar(tmp_path, decode_url="http://127.0.0.1:1", allowed_prefillers=["127.0.0.1:2"], port=3)
    (sc,) = pod(workers(objs)["decode"])["initContainers"]
    flags = lambda argv: [a for a in argv if a.startswith("--")]  # noqa: E731
    assert flags(sc["args"]) == flags(local.argv) == ["--host", "--port", "--decode-url", "--engine",
                                                      "--allowed-prefillers"]
    assert arg_after(sc["args"], "--engine") in ("trtllm", "vllm")


def _ingress_from(objs: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    (np,) = [o for o in objs if o["kind"] == "NetworkPolicy"
             and o["spec"]["podSelector"]["matchLabels"].get("llm-d.ai/role") == role]
    assert np["spec"]["podSelector"]["matchLabels"].items() <= \
        workers(objs)[role]["spec"]["template"]["metadata"]["labels"].items()
    return [peer for rule in np["spec"]["ingress"] for peer in rule["from"]]


def test_the_gateway_reaches_decode_pods_but_never_prefill_pods(objs) -> None:
    gateway = {"gateway.networking.k8s.io/gateway-name": find(objs, "Gateway")["metadata"]["name"]}
    assert any(p.get("podSelector", {}).get("matchLabels") == gateway for p in _ingress_from(objs, "decode"))
    assert all(p.get("podSelector", {}).get("matchLabels") != gateway for p in _ingress_from(objs, "prefill"))


def test_prefill_pods_admit_the_decode_pods_and_the_picker(objs) -> None:
    selectors = [p["podSelector"]["matchLabels"] for p in _ingress_from(objs, "prefill")]
    assert workers(objs)["decode"]["spec"]["selector"]["matchLabels"] in selectors
    assert picker_deployment(objs)["spec"]["selector"]["matchLabels"] in selectors


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kubectl_kustomize_renders_what_the_test_renderer_renders(objs) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(MANIFESTS / VARIANT)], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted((d for d in yaml.safe_load_all(out) if d), key=key) == sorted(objs, key=key)
