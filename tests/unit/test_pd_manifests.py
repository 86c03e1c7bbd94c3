"""The P/D overlay (manifests/pd-mock): validated like the other variants, and agreeing with the picker's roles,
the sidecar's flags and the pool it serves. Rendering and schemas are tests/unit/test_manifests.py's."""

from __future__ import annotations

import asyncio
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
    _kubeconfig,
    arg_after,
    build,
    crd_validator,
    env_of,
    find,
    picker,
    picker_deployment,
    role_grants,
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
    assert {"NetworkPolicy", "Deployment", "ServiceAccount", "Role", "RoleBinding"} <= {o["kind"] for o in builtin}
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
    """The same flag names in the manifest and in `make run ARGS=--pd` (epp_extproc/dev/procs.pd_sidecar), but
    where the allowlist comes from: a static list locally (no cluster), the pool in Kubernetes."""
    import epp_extproc.dev.procs as procs

    monkeypatch.setattr(procs, "PD_SIDECAR", shutil.which("true") or "/bin/true")
    local = pd_sidecar(tmp_path, decode_url="http://127.0.0.1:1", allowed_prefillers=["127.0.0.1:2"], port=3)
    (sc,) = pod(workers(objs)["decode"])["initContainers"]
    flags = lambda argv: [a for a in argv if a.startswith("--")]  # noqa: E731
    common = ["--host", "--port", "--decode-url", "--engine"]
    assert flags(local.argv) == [*common, "--allowed-prefillers"]
    assert flags(sc["args"]) == [*common, "--inference-pool"]
    assert arg_after(sc["args"], "--engine") in ("trtllm", "vllm")


def _sidecar_config(objs: list[dict[str, Any]]):
    from epp_extproc.pd_sidecar.cli import config_from_args

    (sc,) = pod(workers(objs)["decode"])["initContainers"]
    return config_from_args(sc["args"])[0]


def test_the_sidecar_follows_the_pool_the_manifests_ship_in_its_own_namespace(objs) -> None:
    from epp_extproc.pd_sidecar.allowlist import parse_pool_ref

    cfg = _sidecar_config(objs)
    assert cfg.inference_pool is not None
    assert parse_pool_ref(cfg.inference_pool) == (None, find(objs, "InferencePool")["metadata"]["name"])
    assert cfg.allowed_prefillers == frozenset()  # no hand-kept list of pod IPs
    assert not [o for o in objs if o["kind"] == "ConfigMap" and "prefiller" in o["metadata"]["name"]]


def test_the_sidecar_reads_the_role_label_the_picker_reads(objs) -> None:
    """A pod the picker names as a prefill worker is one the sidecar allows: the same label decides both."""
    assert _sidecar_config(objs).role_label == env_of(picker(objs))["DYN_EPP_ROLE_LABEL"]["value"]


def test_the_decode_pods_run_as_the_sidecar_account_bound_to_its_role(objs) -> None:
    sa = pod(workers(objs)["decode"])["serviceAccountName"]
    assert find(objs, "ServiceAccount", sa)
    (rb,) = [o for o in objs if o["kind"] == "RoleBinding" and o["subjects"] == [{"kind": "ServiceAccount",
                                                                                    "name": sa}]]
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": rb["roleRef"]["name"]}
    read = {"get", "list", "watch"}
    assert role_grants(objs, rb["roleRef"]["name"]) == {
        (g, r, v) for g, r in (("", "pods"), ("inference.networking.k8s.io", "inferencepools")) for v in read}
    assert "serviceAccountName" not in pod(workers(objs)["prefill"])  # prefill pods need no API access


def test_only_the_sidecar_container_gets_the_api_token(objs) -> None:
    """The worker runs the model and parses requests: it gets no credentials. The projected volume is the one the
    kubelet's automount would make, at the paths the client reads the token, the CA and the namespace from."""
    from kubernetes_asyncio.config.incluster_config import SERVICE_CERT_FILENAME, SERVICE_TOKEN_FILENAME

    from epp_extproc.adapters.discovery_k8s import SERVICE_ACCOUNT_NAMESPACE_FILE

    spec = pod(workers(objs)["decode"])
    assert spec["automountServiceAccountToken"] is False
    (sc,) = spec["initContainers"]
    (mount,) = sc["volumeMounts"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    files = {}
    for src in vol["projected"]["sources"]:
        if "serviceAccountToken" in src:
            files[src["serviceAccountToken"]["path"]] = "token"
        for item in (src.get("configMap") or src.get("downwardAPI") or {}).get("items", []):
            files[item["path"]] = item.get("key") or item["fieldRef"]["fieldPath"]
    base = mount["mountPath"]
    assert {f"{base}/{p}": what for p, what in files.items()} == {
        SERVICE_TOKEN_FILENAME: "token", SERVICE_CERT_FILENAME: "ca.crt",
        SERVICE_ACCOUNT_NAMESPACE_FILE: "metadata.namespace"}
    assert mount["readOnly"] is True
    assert all("volumeMounts" not in c for c in spec["containers"])


async def test_the_sidecar_reads_exactly_the_resources_its_role_grants(objs, tmp_path, monkeypatch) -> None:
    """Run the sidecar as the manifest configures it against a fake API server and compare what it asks for with
    its Role, both ways: nothing it reads is forbidden, nothing granted is unused."""
    from aiohttp import web

    from epp_extproc.pd_sidecar.server import Sidecar
    from tests.fake_k8s import PODS, POOLS, FakeKube, make_pod, make_pool

    pool = find(objs, "InferencePool")
    groups = {PODS: "", POOLS: "inference.networking.k8s.io"}
    prefill_labels = workers(objs)["prefill"]["spec"]["template"]["metadata"]["labels"]
    async with FakeKube() as kube:
        kube.put(POOLS, make_pool(pool["metadata"]["name"], pool["spec"]["selector"]["matchLabels"],
                                  tuple(p["number"] for p in pool["spec"]["targetPorts"])))
        kube.put(PODS, make_pod("prefill-0", "10.1.0.7", labels=prefill_labels))
        monkeypatch.setenv("KUBECONFIG", str(_kubeconfig(tmp_path, kube.url)))
        sidecar = Sidecar(_sidecar_config(objs))
        runner = web.AppRunner(sidecar.app)
        await runner.setup()  # on_startup starts the pool watch
        try:
            for _ in range(200):
                if sidecar.allowlist.synced and kube.open_watches(PODS) and kube.open_watches(POOLS):
                    break
                await asyncio.sleep(0.05)
        finally:
            await runner.cleanup()
    assert sidecar.allowlist.current == {f"10.1.0.7:{pool['spec']['targetPorts'][0]['number']}"}
    assert len({r.namespace for r in kube.requests}) == 1  # one namespace: a Role suffices
    used = {(groups[r.resource], r.resource, "watch" if r.watch else "list") for r in kube.requests}
    (rb,) = [o for o in objs if o["kind"] == "RoleBinding" and o["metadata"]["name"] == "pd-sidecar"]
    granted = role_grants(objs, rb["roleRef"]["name"])
    assert used - granted == set()
    assert {(g, r) for g, r, _ in used} == {(g, r) for g, r, _ in granted}


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
