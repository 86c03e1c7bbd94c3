"""The Kubernetes manifests parse, validate against the real schemas, and agree with each other and the code.

Built-in kinds are checked with kubernetes-validate (strict: unknown fields fail); InferencePool, HTTPRoute and
Gateway with the description-free schemas derived from the upstream CRDs (manifests/schemas/). Overlays are
rendered by a minimal kustomize (resources + JSON6902 patches, the only features the manifests use; anything
else fails the test), cross-checked against `kubectl kustomize` when kubectl is installed.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml

from epp_extproc.config import ENV_NAMES, load_config

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
SCHEMAS = MANIFESTS / "schemas"
CRD_DIR = MANIFESTS / "crds"  # the pinned upstream CRDs (manifests/crds/README.md)
K8S_VERSION = "1.33"  # native sidecars are GA here; kubernetes-validate ships schemas up to 1.37
VARIANTS = ("trtllm", "cpu-mock", "nats-plane")
CRD_KINDS = {("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
             ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json",
             ("gateway.networking.k8s.io/v1", "Gateway"): "gateway-v1.json"}
KUSTOMIZE_KEYS = {"apiVersion", "kind", "resources", "patches"}

sys.path.insert(0, str(SCHEMAS))
import derive  # noqa: E402  (manifests/schemas/derive.py: not a package)

# ---------------------------------------------------------------------------------------------- rendering


def yaml_files() -> list[Path]:
    """Our own manifests; the vendored upstream CRDs are checked by the tests of their own section."""
    return sorted(p for p in MANIFESTS.rglob("*.yaml") if CRD_DIR not in p.parents)


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def apply_json6902(obj: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = obj
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        key: Any = int(last) if isinstance(node, list) and last != "-" else last
        if op["op"] == "replace":
            assert key in node if isinstance(node, dict) else key < len(node), f"replace of missing {op['path']}"
            node[key] = copy.deepcopy(op["value"])
        elif op["op"] == "add":
            if isinstance(node, list):
                node.insert(len(node) if key == "-" else key, copy.deepcopy(op["value"]))
            else:
                node[key] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del node[key]
        else:
            raise AssertionError(f"unsupported patch op {op['op']}")


def _targets(obj: dict[str, Any], target: dict[str, str]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    return all(target.get(k) in (None, v) for k, v in (("group", group), ("version", version),
                                                       ("kind", obj["kind"]),
                                                       ("name", obj["metadata"]["name"])))


def build(directory: Path) -> list[dict[str, Any]]:
    """What `kubectl kustomize directory` renders, for the subset of kustomize these manifests use."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kust) - KUSTOMIZE_KEYS
    assert not unknown, f"{directory}: kustomization uses {unknown}; extend tests/unit/test_manifests.py build()"
    objs: list[dict[str, Any]] = []
    for res in kust.get("resources", []):
        path = directory / res
        objs.extend(build(path) if path.is_dir() else load_docs(path))
    for patch in kust.get("patches", []):
        assert set(patch) == {"target", "patch"}, f"{directory}: only inline JSON6902 patches are supported"
        ops = yaml.safe_load(patch["patch"])
        hits = [o for o in objs if _targets(o, patch["target"])]
        assert len(hits) == 1, f"{directory}: patch target {patch['target']} matched {len(hits)} objects"
        apply_json6902(hits[0], ops)
    return objs


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def env_value(container: dict[str, Any], name: str) -> str:
    return env_of(container)[name]["value"]


def arg_after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def picker_deployment(objs: list[dict[str, Any]]) -> dict[str, Any]:
    pool = find(objs, "InferencePool")
    svc = find(objs, "Service", pool["spec"]["endpointPickerRef"]["name"])
    deps = [d for d in objs if d["kind"] == "Deployment"
            and all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items())]
    assert len(deps) == 1, "the picker Service must select exactly one Deployment"
    return deps[0]


def picker(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return picker_deployment(objs)["spec"]["template"]["spec"]["containers"][0]


def sidecar(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (renderer,) = picker_deployment(objs)["spec"]["template"]["spec"]["initContainers"]
    return renderer


def worker_deployment(objs: list[dict[str, Any]]) -> dict[str, Any]:
    pool = find(objs, "InferencePool")
    sel = pool["spec"]["selector"]["matchLabels"]
    deps = [d for d in objs if d["kind"] == "Deployment"
            and all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())]
    assert len(deps) == 1, f"the pool selector {sel} must select exactly one Deployment, got {len(deps)}"
    return deps[0]


def worker(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return worker_deployment(objs)["spec"]["template"]["spec"]["containers"][0]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: build(MANIFESTS / name) for name in ("base", *VARIANTS)}


def crd_validator(filename: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads((SCHEMAS / filename).read_text()))


# ---------------------------------------------------------------------------------------------- parsing and schemas


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(MANIFESTS)))
def test_every_yaml_file_parses_into_objects_with_kind_and_api_version(path):
    docs = load_docs(path)
    assert docs
    assert all(isinstance(d, dict) and d.get("apiVersion") and d.get("kind") for d in docs)


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(MANIFESTS)))
def test_manifests_are_namespace_agnostic(path):
    assert all("namespace" not in d.get("metadata", {}) for d in load_docs(path))


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_builtin_kinds_validate_strictly_against_the_kubernetes_schemas(rendered, variant):
    builtin = [o for o in rendered[variant] if (o["apiVersion"], o["kind"]) not in CRD_KINDS]
    assert builtin
    for obj in builtin:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_kubernetes_validation_rejects_an_unknown_container_field(rendered):
    dep = copy.deepcopy(picker_deployment(rendered["base"]))
    dep["spec"]["template"]["spec"]["containers"][0]["envv"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_custom_objects_validate_against_the_derived_crd_schemas(rendered, variant):
    custom = [o for o in rendered[variant] if (o["apiVersion"], o["kind"]) in CRD_KINDS]
    assert {o["kind"] for o in custom} == {"InferencePool", "HTTPRoute", "Gateway"}
    for obj in custom:
        crd_validator(CRD_KINDS[(obj["apiVersion"], obj["kind"])]).validate(obj)


def test_derived_schema_rejects_an_unknown_failure_mode(rendered):
    pool = copy.deepcopy(find(rendered["base"], "InferencePool"))
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    with pytest.raises(jsonschema.ValidationError):
        crd_validator("inferencepool-v1.json").validate(pool)


def test_derived_schemas_carry_no_descriptions():
    for name in CRD_KINDS.values():
        assert '"description":' not in (SCHEMAS / name).read_text()


def test_derived_schemas_are_up_to_date_with_the_upstream_crds():
    for name, text in derive.derive(CRD_DIR).items():
        assert (SCHEMAS / name).read_text() == text, f"{name} is stale: run python manifests/schemas/derive.py"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_kubectl_kustomize_renders_what_the_test_renderer_renders(rendered, variant):
    out = subprocess.run(["kubectl", "kustomize", str(MANIFESTS / variant)], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted((d for d in yaml.safe_load_all(out) if d), key=key) == sorted(rendered[variant], key=key)


# ---------------------------------------------------------------------------------------------- cross-references


@pytest.mark.parametrize("variant", VARIANTS)
def test_pool_selector_selects_the_worker_pods_and_not_the_picker(rendered, variant):
    objs = rendered[variant]
    sel = find(objs, "InferencePool")["spec"]["selector"]["matchLabels"]
    labels = picker_deployment(objs)["spec"]["template"]["metadata"]["labels"]
    assert worker_deployment(objs)  # exactly one Deployment carries the selected labels
    assert not all(labels.get(k) == v for k, v in sel.items())


@pytest.mark.parametrize("variant", VARIANTS)
def test_pool_target_ports_are_worker_container_ports(rendered, variant):
    objs = rendered[variant]
    ports = {p["containerPort"] for p in worker(objs)["ports"]}
    assert {p["number"] for p in find(objs, "InferencePool")["spec"]["targetPorts"]} <= ports


@pytest.mark.parametrize("variant", VARIANTS)
def test_worker_readiness_probes_the_served_port(rendered, variant):
    w = worker(rendered[variant])
    probe = w["readinessProbe"]["httpGet"]
    named = {p["name"]: p["containerPort"] for p in w["ports"]}
    port = named.get(probe["port"], probe["port"])
    assert (probe["path"], port) == ("/health", find(rendered[variant], "InferencePool")["spec"]["targetPorts"][0]["number"])


def test_endpoint_picker_ref_names_the_picker_service_grpc_port(rendered):
    objs = rendered["base"]
    ref = find(objs, "InferencePool")["spec"]["endpointPickerRef"]
    svc = find(objs, "Service", ref["name"])
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert (ref.get("kind", "Service"), ref.get("group", "")) == ("Service", "")
    assert port.get("appProtocol") != "kubernetes.io/h2c"  # the picker serves TLS there (next test)


def test_picker_serves_tls_on_the_ext_proc_port_as_gaie_gateways_expect(rendered):
    env = {k: v.get("value", "ns") for k, v in env_of(picker(rendered["base"])).items()}
    assert load_config([], env=env).secure_serving is True


def test_picker_has_a_writable_tmp_for_its_self_signed_certificate(rendered):
    """readOnlyRootFilesystem: the self-signed certificate file (never the key) needs a writable /tmp."""
    dep = picker_deployment(rendered["base"])
    c = picker(rendered["base"])
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    (mount,) = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in vols[mount["name"]]


def test_picker_service_ports_reach_the_configured_picker_ports(rendered):
    objs = rendered["base"]
    svc = find(objs, "Service", "llm-pool-epp")
    c = picker(objs)
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    cfg = load_config([], env={k: v["value"] for k, v in env_of(c).items() if "value" in v})
    want = {9002: cfg.grpc_port, 9003: cfg.health_port, 9090: cfg.metrics_port, 9004: cfg.replica_sync_port}
    got = {p["port"]: named[p["targetPort"]] for p in svc["spec"]["ports"]}
    assert got == want == {9002: 9002, 9003: 9003, 9090: 9090, 9004: 9004}


def test_replicas_find_each_other_on_the_picker_service_replica_agg_port(rendered):
    from epp_extproc.adapters.discovery_peers import PEER_PORT_NAME

    objs = rendered["base"]
    c = picker(objs)
    svc = find(objs, "Service", env_value(c, "DYN_EPP_PEER_SERVICE"))
    assert PEER_PORT_NAME in {p["name"] for p in svc["spec"]["ports"]}
    assert env_of(c)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_picker_probes_are_grpc_health_services_on_the_health_port(rendered):
    c = picker(rendered["base"])
    port = int(env_value(c, "DYN_EPP_HEALTH_PORT"))
    assert c["livenessProbe"]["grpc"] == {"port": port, "service": "liveness"}
    assert c["readinessProbe"]["grpc"] == {"port": port, "service": "readiness"}


def test_httproute_sends_to_the_pool_through_the_gateway(rendered):
    objs = rendered["base"]
    route = find(objs, "HTTPRoute")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                         "name": find(objs, "InferencePool")["metadata"]["name"]}]
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [find(objs, "Gateway")["metadata"]["name"]]


def test_rolebinding_binds_the_picker_service_account_to_the_role(rendered):
    objs = rendered["base"]
    sa = picker_deployment(objs)["spec"]["template"]["spec"]["serviceAccountName"]
    rb = find(objs, "RoleBinding")
    assert find(objs, "ServiceAccount", sa)
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
    assert find(objs, "Role", rb["roleRef"]["name"])["metadata"]["name"] == rb["roleRef"]["name"]


def test_role_grants_read_and_watch_on_pods_and_inferencepools(rendered):
    rules = find(rendered["base"], "Role")["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    for group, resource in (("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
                            ("discovery.k8s.io", "endpointslices")):
        assert {(group, resource, v) for v in ("get", "list", "watch")} <= granted


def test_role_lets_flow_control_list_the_pools_inference_objectives_in_both_groups(rendered):
    from epp_extproc.adapters.objectives import OBJECTIVE_GROUPS, OBJECTIVE_PLURAL

    assert {g for g, _ in OBJECTIVE_GROUPS} == {"llm-d.ai", "inference.networking.x-k8s.io"}
    granted = role_grants(rendered["base"])
    for group, _ in OBJECTIVE_GROUPS:
        assert (group, OBJECTIVE_PLURAL, "list") in granted, group


def test_role_lets_the_picker_list_the_pools_model_rewrites_in_both_groups(rendered):
    from epp_extproc.adapters.model_rewrites import REWRITE_GROUPS, REWRITE_PLURAL

    assert {g for g, _ in REWRITE_GROUPS} == {"llm-d.ai", "inference.networking.x-k8s.io"}
    granted = role_grants(rendered["base"])
    for group, _ in REWRITE_GROUPS:
        assert (group, REWRITE_PLURAL, "list") in granted, group


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_picker_env_names_are_ones_the_picker_reads(rendered, variant):
    names = {n for n in env_of(picker(rendered[variant])) if n.startswith("DYN_") or n == "POD_NAMESPACE"}
    assert names and names <= ENV_NAMES


def test_picker_env_is_a_valid_picker_configuration(rendered):
    env = {k: v.get("value", "ns-from-downward-api") for k, v in env_of(picker(rendered["base"])).items()}
    cfg = load_config([], env=env)
    assert (cfg.tokenizer_protocol, cfg.kv_cache_block_size) == ("trtllm-render", 32)


def test_picker_watches_the_pool_in_its_own_namespace(rendered):
    objs = rendered["base"]
    c = picker(objs)
    assert env_value(c, "DYN_EPP_INFERENCE_POOL_NAME") == find(objs, "InferencePool")["metadata"]["name"]
    assert env_of(c)["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_the_pod_outlives_the_pickers_grace_period_and_drain(rendered, variant):
    """A SIGKILL before the picker's stop is over would cut the streams its grace period and drain serve."""
    objs = rendered[variant]
    env = {k: v.get("value", "ns-from-downward-api") for k, v in env_of(picker(objs)).items()}
    cfg = load_config([], env=env)
    grace = picker_deployment(objs)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert cfg.graceful_shutdown_grace_period_s > 0
    assert grace > cfg.graceful_shutdown_grace_period_s + cfg.drain_timeout_s


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_renderer_is_a_native_sidecar_whose_readiness_gates_the_pod(rendered, variant):
    r = sidecar(rendered[variant])
    assert r["restartPolicy"] == "Always"
    assert "readinessProbe" in r


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_renderer_url_names_the_sidecar_port_on_loopback(rendered, variant):
    objs = rendered[variant]
    url = urlparse(env_value(picker(objs), "DYN_EPP_TOKENIZER_SERVICE_URL"))
    r = sidecar(objs)
    assert url.hostname == "127.0.0.1"
    assert url.port == int(arg_after(r["args"], "--port"))
    assert url.port in {p["containerPort"] for p in r["ports"]}
    probe = " ".join(r["readinessProbe"]["exec"]["command"])
    assert f"http://127.0.0.1:{url.port}/health" in probe


def test_cpu_mock_sidecar_runs_the_mock_renderer_from_the_picker_image(rendered):
    objs = rendered["cpu-mock"]
    r = sidecar(objs)
    assert (r["image"], r["command"], arg_after(r["args"], "--role")) == \
        (picker(objs)["image"], ["trtllm-mock"], "renderer")


def _trtllm_options(objs: list[dict[str, Any]]) -> dict[str, Any]:
    w = worker(objs)
    path = Path(arg_after(w["args"], "--extra_llm_api_options"))
    (mount,) = [m for m in w["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    (vol,) = [v for v in worker_deployment(objs)["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    cm = find(objs, "ConfigMap", vol["configMap"]["name"])
    return yaml.safe_load(cm["data"][path.name])


def _kv_endpoint_and_block_size(variant: str, objs: list[dict[str, Any]]) -> tuple[str, int]:
    if variant == "trtllm":
        kv = _trtllm_options(objs)["kv_cache_config"]
        assert (kv["kv_events_config"]["enable_kv_cache_events"], kv["kv_events_config"]["publisher"]) == \
            (True, "zmq")
        return kv["kv_events_config"]["endpoint"], kv["tokens_per_block"]
    args = worker(objs)["args"]
    return arg_after(args, "--kv-events-endpoint"), int(arg_after(args, "--tokens-per-block"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_worker_kv_events_port_is_the_pickers_kv_event_port(rendered, variant):
    objs = rendered[variant]
    endpoint, _ = _kv_endpoint_and_block_size(variant, objs)
    port = int(re.fullmatch(r"tcp://\*:(\d+)", endpoint).group(1))
    assert port == int(env_value(picker(objs), "DYN_EPP_KV_EVENT_PORT"))
    assert {"name": "kv-events", "containerPort": port, "protocol": "TCP"} in worker(objs)["ports"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_worker_tokens_per_block_is_the_pickers_block_size(rendered, variant):
    objs = rendered[variant]
    _, block = _kv_endpoint_and_block_size(variant, objs)
    assert block == int(env_value(picker(objs), "DYN_KV_CACHE_BLOCK_SIZE"))


def test_trtllm_worker_enables_render_endpoints_and_requests_a_gpu(rendered):
    w = worker(rendered["trtllm"])
    assert env_value(w, "TRTLLM_ENABLE_RENDER_ENDPOINTS") == "1"
    assert w["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert w["image"].startswith("nvcr.io/nvidia/tensorrt-llm/release:")


def test_trtllm_worker_and_renderer_serve_the_same_model(rendered):
    objs = rendered["trtllm"]
    assert worker(objs)["args"][0] == sidecar(objs)["args"][0]


def test_trtllm_worker_serves_on_the_pool_target_port(rendered):
    objs = rendered["trtllm"]
    port = int(arg_after(worker(objs)["args"], "--port"))
    assert port in {p["number"] for p in find(objs, "InferencePool")["spec"]["targetPorts"]}


def test_mock_worker_serves_on_the_pool_target_port_with_render_endpoints(rendered):
    objs = rendered["cpu-mock"]
    args = worker(objs)["args"]
    assert int(arg_after(args, "--port")) in {p["number"] for p in find(objs, "InferencePool")["spec"]["targetPorts"]}
    assert "--enable-render-endpoints" in args and arg_after(args, "--role") == "worker"


# ---------------------------------------------------------------------------------------------- Dockerfile


def _dockerfile() -> list[tuple[str, str]]:
    text = (MANIFESTS / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instr, _, rest = line.partition(" ")
            out.append((instr.upper(), rest.strip()))
    return out


def _console_scripts() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


def test_dockerfile_copy_sources_exist_in_the_repository_root():
    copies = [shlex.split(rest)[:-1] for instr, rest in _dockerfile() if instr == "COPY"]
    assert copies
    for sources in copies:
        for src in sources:
            assert (ROOT / src).exists(), f"COPY source {src} missing (build context is the repo root)"


def test_dockerfile_builds_the_ingest_accelerator():
    """setup.py declares kvindex._native (optional): the image copies it and has a compiler while installing."""
    copied = {Path(s).name for instr, rest in _dockerfile() if instr == "COPY" for s in shlex.split(rest)[:-1]}
    assert {"setup.py", "MANIFEST.in"} <= copied
    install = next(rest for instr, rest in _dockerfile() if instr == "RUN" and "pip install ." in rest)
    assert install.index("install -y --no-install-recommends gcc") < install.index("pip install .")


def test_dockerfile_copies_every_package_pyproject_installs():
    copied = {Path(s).name for instr, rest in _dockerfile() if instr == "COPY" for s in shlex.split(rest)[:-1]}
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert {p.rstrip("*") for p in include["include"]} <= copied


def test_dockerfile_entrypoint_is_the_picker_console_script():
    (entry,) = [json.loads(rest) for instr, rest in _dockerfile() if instr == "ENTRYPOINT"]
    assert entry[0] == "epp-extproc" and entry[0] in _console_scripts()


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_container_commands_from_our_image_are_console_scripts(rendered, variant):
    image = picker(rendered[variant])["image"]
    for dep in (o for o in rendered[variant] if o["kind"] == "Deployment"):
        spec = dep["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c["image"] == image and "command" in c:
                assert c["command"][0] in _console_scripts()


def _mock_containers(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for d in objs if d["kind"] == "Deployment"
            for c in d["spec"]["template"]["spec"].get("initContainers", []) + d["spec"]["template"]["spec"]["containers"]
            if c.get("command") == ["trtllm-mock"]]


def test_cpu_mock_arguments_are_accepted_by_the_mock_cli(rendered):
    from trtllm_mock.cli import config_from_args

    containers = _mock_containers(rendered["cpu-mock"])
    roles = set()
    for c in containers:
        cfg, _ = config_from_args([a.replace("$(POD_NAME)", "mock-worker-0") for a in c["args"]])
        cfg.validate()
        roles.add(cfg.role)
    assert roles == {"worker", "renderer"}


# ------------------------------------------------------------------------------------------ observability
OBSERVABILITY = MANIFESTS / "observability"


def exported_sample_names() -> set[str]:
    """Every sample name the picker's /metrics can carry (picker metrics + the KV index and subscriber
    collectors, as KvRouting registers them)."""
    from epp_extproc.metrics import PickerMetrics
    from kvindex.index import KvIndex
    from kvindex.metrics import register_subscribers

    metrics = PickerMetrics()
    KvIndex(registry=metrics.registry)
    register_subscribers(dict, metrics.registry)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {f.name + s for f in metrics.registry.collect() for s in suffixes[f.type]}


def dashboard_exprs() -> list[str]:
    doc = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    return [t["expr"] for p in doc["panels"] for t in p["targets"]]


def test_every_metric_a_dashboard_panel_queries_is_one_the_picker_exports():
    exported = exported_sample_names()
    queried = {m for e in dashboard_exprs() for m in re.findall(r"\b(?:epp|dynamo)_[a-z0-9_]+", e)}
    assert queried and queried - exported == set()


def test_the_metric_check_catches_a_name_the_picker_does_not_export():
    exported = exported_sample_names()
    assert "epp_requests_total" in exported and "epp_requests" not in exported  # counters need _total
    assert "epp_kv_blocks_indexed" in exported and "epp_kv_seq_gaps_total" in exported


def test_dashboard_has_the_panels_an_operator_looks_at():
    doc = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    titles = " | ".join(p["title"].lower() for p in doc["panels"])
    for words in ("decisions/s by outcome", "decision latency", "render latency", "observed vs predicted",
                  "kv index blocks per worker", "kv events per worker", "in-flight load per worker",
                  "rejections by reason"):
        assert words in titles, words
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"])


def test_podmonitor_scrapes_the_picker_pods_metrics_port(rendered):
    (pm,) = load_docs(OBSERVABILITY / "podmonitor.yaml")
    assert (pm["apiVersion"], pm["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    dep = picker_deployment(rendered["base"])
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    named = {p["name"]: p["containerPort"] for p in picker(rendered["base"])["ports"]}
    assert ep["port"] in named and ep["path"] == "/metrics"
    assert named[ep["port"]] == int(env_value(picker(rendered["base"]), "DYN_EPP_METRICS_PORT"))


# ---------------------------------------------------------------------------------------------- network exposure


def _ingress_rules_for(objs: list[dict[str, Any]], container_port: int) -> list[dict[str, Any]]:
    """The ingress rules of NetworkPolicies selecting the picker pods that admit `container_port`."""
    labels = picker_deployment(objs)["spec"]["template"]["metadata"]["labels"]
    named = {p["name"]: p["containerPort"] for p in picker(objs)["ports"]}
    out = []
    for np in (o for o in objs if o["kind"] == "NetworkPolicy"):
        sel = np["spec"]["podSelector"].get("matchLabels", {})
        if not all(labels.get(k) == v for k, v in sel.items()):
            continue
        for rule in np["spec"].get("ingress", []):
            ports = {named.get(p["port"], p["port"]) for p in rule.get("ports", [])}
            if not rule.get("ports") or container_port in ports:
                out.append(rule)
    return out


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_a_network_policy_isolates_the_picker_pods_for_ingress(rendered, variant):
    objs = rendered[variant]
    np = find(objs, "NetworkPolicy", picker_deployment(objs)["metadata"]["name"])
    assert np["spec"]["policyTypes"] == ["Ingress"]
    labels = picker_deployment(objs)["spec"]["template"]["metadata"]["labels"]
    sel = np["spec"]["podSelector"]["matchLabels"]
    assert sel and all(labels.get(k) == v for k, v in sel.items())


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_no_network_policy_rule_admits_every_peer_or_every_port(rendered, variant):
    for np in (o for o in rendered[variant] if o["kind"] == "NetworkPolicy"):
        for rule in np["spec"]["ingress"]:
            assert rule.get("from") and rule.get("ports"), rule
            for peer in rule["from"]:
                assert "ipBlock" not in peer and any(s.get("matchLabels") for s in peer.values()), peer


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_only_the_gateway_pods_reach_the_ext_proc_and_health_ports(rendered, variant):
    objs = rendered[variant]
    c = picker(objs)
    gateway = find(objs, "Gateway")["metadata"]["name"]
    for port in (int(env_value(c, "DYN_EPP_GRPC_PORT")), int(env_value(c, "DYN_EPP_HEALTH_PORT"))):
        (rule,) = _ingress_rules_for(objs, port)
        assert rule["from"] == [{"podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": gateway}}}]


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_only_prometheus_reaches_the_metrics_port(rendered, variant):
    objs = rendered[variant]
    (rule,) = _ingress_rules_for(objs, int(env_value(picker(objs), "DYN_EPP_METRICS_PORT")))
    (peer,) = rule["from"]
    assert set(peer) == {"namespaceSelector", "podSelector"}  # both: a pod name alone would match any namespace
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_every_picker_container_port_is_covered_by_the_network_policy(rendered, variant):
    objs = rendered[variant]
    for p in picker(objs)["ports"]:
        assert _ingress_rules_for(objs, p["containerPort"]), f"port {p['name']} unreachable for everyone"


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_the_debug_api_stays_on_loopback_and_off_every_port_list(rendered, variant):
    objs = rendered[variant]
    c = picker(objs)
    env = {k: v.get("value", "ns") for k, v in env_of(c).items()}
    cfg = load_config([], env=env)
    assert cfg.admin_bind == "127.0.0.1" and cfg.admin_port != cfg.metrics_port
    assert cfg.admin_port not in {p["containerPort"] for p in c["ports"]}
    svc = find(objs, "Service", "llm-pool-epp")
    assert cfg.admin_port not in {p["port"] for p in svc["spec"]["ports"]}
    assert not _ingress_rules_for(objs, cfg.admin_port)


# ---------------------------------------------------------------------------------------------- shipped CRDs and RBAC
# What a fresh kind cluster needs before `kubectl apply -k`: every custom kind the manifests create and every
# custom resource the Role grants must have its CRD in manifests/crds/ (pinned upstream releases), serving the
# version we use; built-in kinds need nothing.

BUILTIN_GROUPS = {"", "apps", "rbac.authorization.k8s.io", "networking.k8s.io", "discovery.k8s.io"}
RELEASE = re.compile(r"v\d+\.\d+\.\d+")  # a release tag: not main-dev, v0.0.0-dev or an -rc


@pytest.fixture(scope="module")
def crds() -> list[dict[str, Any]]:
    docs = [d for p in sorted(CRD_DIR.glob("*.yaml"))
            for d in yaml.load_all(p.read_text(), Loader=yaml.CSafeLoader) if d]
    return [d for d in docs if d["kind"] == "CustomResourceDefinition"]


def served(crds: list[dict[str, Any]], group: str, *, kind: str | None = None,
           plural: str | None = None) -> set[str]:
    """The versions the shipped CRDs serve for this group and kind (or plural)."""
    return {v["name"] for c in crds if c["spec"]["group"] == group
            and kind in (None, c["spec"]["names"]["kind"]) and plural in (None, c["spec"]["names"]["plural"])
            for v in c["spec"]["versions"] if v.get("served")}


def role_grants(objs: list[dict[str, Any]], name: str | None = None) -> set[tuple[str, str, str]]:
    """(group, resource, verb) the Role grants (`name` picks one where a variant ships several)."""
    return {(g, r, v) for rule in find(objs, "Role", name)["rules"] for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]}


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_every_custom_kind_the_manifests_create_has_a_shipped_crd_serving_its_version(rendered, crds, variant):
    custom = {(o["apiVersion"], o["kind"]) for o in rendered[variant]
              if o["apiVersion"].rpartition("/")[0] not in BUILTIN_GROUPS}
    assert custom  # InferencePool, HTTPRoute, Gateway
    for api_version, kind in custom:
        group, _, version = api_version.rpartition("/")
        assert version in served(crds, group, kind=kind), f"no shipped CRD serves {api_version} {kind}"


@pytest.mark.parametrize("variant", ("base", *VARIANTS))
def test_builtin_groups_hold_only_kinds_kubernetes_itself_validates(rendered, variant):
    """BUILTIN_GROUPS cannot hide a custom kind: every object there has a Kubernetes 1.33 schema."""
    for obj in (o for o in rendered[variant] if o["apiVersion"].rpartition("/")[0] in BUILTIN_GROUPS):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_every_custom_resource_the_role_grants_has_a_shipped_crd(rendered, crds):
    for group, resource, _ in role_grants(rendered["base"]):
        if group not in BUILTIN_GROUPS:
            assert served(crds, group, plural=resource), f"no shipped CRD for {resource}.{group}"


def test_the_crd_versions_the_picker_asks_for_are_served_by_the_shipped_crds(crds):
    from epp_extproc.adapters.discovery_k8s import POOL_GROUP, POOL_PLURAL, POOL_VERSION
    from epp_extproc.adapters.model_rewrites import REWRITE_GROUPS, REWRITE_PLURAL
    from epp_extproc.adapters.objectives import OBJECTIVE_GROUPS, OBJECTIVE_PLURAL

    assert POOL_VERSION in served(crds, POOL_GROUP, plural=POOL_PLURAL)
    for group, version in OBJECTIVE_GROUPS:
        assert version in served(crds, group, kind="InferenceObjective", plural=OBJECTIVE_PLURAL), group
    for group, version in REWRITE_GROUPS:
        assert version in served(crds, group, kind="InferenceModelRewrite", plural=REWRITE_PLURAL), group


def _crd(crds: list[dict[str, Any]], group: str, kind: str) -> dict[str, Any]:
    (crd,) = [c for c in crds if c["spec"]["group"] == group and c["spec"]["names"]["kind"] == kind]
    return crd


@pytest.mark.parametrize("kind", ["InferenceObjective", "InferenceModelRewrite"])
def test_the_llm_d_and_gaie_crds_of_a_kind_are_one_api_so_one_parser_reads_both(crds, kind):
    """The picker reads both groups with the same code: same names, scope and versions, and the same schema
    up to llm-d's one addition (InferenceObjective's `spec.priority` is `format: int32`)."""
    new, old = _crd(crds, "llm-d.ai", kind), _crd(crds, "inference.networking.x-k8s.io", kind)
    assert new["spec"]["names"] == old["spec"]["names"] and new["spec"]["scope"] == old["spec"]["scope"]
    assert [v["name"] for v in new["spec"]["versions"]] == [v["name"] for v in old["spec"]["versions"]]
    for nv, ov in zip(new["spec"]["versions"], old["spec"]["versions"], strict=True):
        n_schema, o_schema = nv["schema"]["openAPIV3Schema"], ov["schema"]["openAPIV3Schema"]
        if kind == "InferenceObjective":
            prio = n_schema["properties"]["spec"]["properties"]["priority"]
            assert prio.pop("format") == "int32"
        assert n_schema == o_schema


def test_shipped_crds_are_upstream_releases_named_in_the_crds_readme(crds):
    readme = (CRD_DIR / "README.md").read_text()
    files = sorted(CRD_DIR.glob("*.yaml"))
    assert files
    for path in files:
        text = path.read_text()
        docs = [d for d in yaml.load_all(text, Loader=yaml.CSafeLoader) if d]
        (version,) = {v for d in docs for k, v in (d["metadata"].get("annotations") or {}).items()
                      if k.endswith("/bundle-version")}  # one release per file, on every object in it
        if version == "main-dev":  # llm-d stamps even its releases so: the file's leading comment pins them
            head = "".join(line for line in text.splitlines(keepends=True)[:3] if line.startswith("#"))
            pinned = re.search(rf"llm-d/llm-d-router ({RELEASE.pattern}), commit [0-9a-f]{{40}},", head)
            assert pinned, f"{path.name}: main-dev without a leading comment naming the release and commit"
            version = pinned.group(1)
        assert RELEASE.fullmatch(version), f"{path.name}: {version} is not a release"
        row = next((line for line in readme.splitlines() if f"`{path.name}`" in line), "")
        assert version in row, f"{path.name} ({version}) is not listed with its version in crds/README.md"
    assert len(crds) == len(files) - 1  # one CRD per file, plus the Gateway API's upgrade-safety policy


def test_shipped_crds_validate_strictly_as_kubernetes_objects(crds):
    """What `kubectl apply --dry-run=client` checks without a cluster: each CRD is a valid v1 object."""
    for crd in crds:
        kubernetes_validate.validate(crd, K8S_VERSION, strict=True)


def _kubeconfig(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u", "namespace": "llm"}}],
        "users": [{"name": "u", "user": {}}]}))
    return path


async def test_the_picker_reads_exactly_the_resources_its_role_grants(rendered, tmp_path):
    """Run the picker as the manifest configures it against a fake API server and compare what it asks for
    (resource, list/watch) with the Role, both ways: nothing it reads is forbidden, nothing granted is unused."""
    from epp_extproc.app import PickerApp
    from tests.fake_k8s import (
        LLMD_OBJECTIVES,
        LLMD_REWRITES,
        OBJECTIVES,
        PODS,
        POOLS,
        REWRITES,
        SLICES,
        FakeKube,
        make_pool,
    )
    from tests.netutil import free_port

    groups = {PODS: ("", PODS), POOLS: ("inference.networking.k8s.io", POOLS), SLICES: ("discovery.k8s.io", SLICES),
              OBJECTIVES: ("inference.networking.x-k8s.io", OBJECTIVES),
              REWRITES: ("inference.networking.x-k8s.io", REWRITES),
              LLMD_OBJECTIVES: ("llm-d.ai", OBJECTIVES), LLMD_REWRITES: ("llm-d.ai", REWRITES)}
    objs = rendered["cpu-mock"]
    env = {k: v["value"] for k, v in env_of(picker(objs)).items() if "value" in v}
    env.update(POD_NAMESPACE="llm", POD_IP="127.0.0.1", POD_NAME="llm-pool-epp-0")
    async with FakeKube() as kube:
        kube.put(POOLS, make_pool(env["DYN_EPP_INFERENCE_POOL_NAME"],
                                  find(objs, "InferencePool")["spec"]["selector"]["matchLabels"]), namespace="llm")
        env["KUBECONFIG"] = str(_kubeconfig(tmp_path, kube.url))
        if "DYN_EPP_CONFIG_FILE" in env:  # the ConfigMap's file, where the pod mounts it
            config = tmp_path / "config.yaml"
            config.write_text(find(objs, "ConfigMap", "llm-pool-epp-config")["data"]["config.yaml"])
            env["DYN_EPP_CONFIG_FILE"] = str(config)
        args = ["--grpc-port", "0", "--health-port", "0", "--metrics-port", "0", "--admin-port", "0",
                "--bind", "127.0.0.1", "--replica-sync-port", str(free_port())]
        app = PickerApp(load_config(args, env=env))
        await app.start()
        try:
            for _ in range(200):
                asked = {(r.resource, "watch" if r.watch else "list") for r in kube.requests}
                if {(PODS, "watch"), (POOLS, "watch"), (SLICES, "watch"), (OBJECTIVES, "list"),
                        (REWRITES, "list"), (LLMD_OBJECTIVES, "list"), (LLMD_REWRITES, "list")} <= asked:
                    break
                await asyncio.sleep(0.05)
        finally:
            await app.stop(0)
    assert {r.namespace for r in kube.requests} == {"llm"}  # its own namespace only: a Role suffices
    used = {(*groups.get(res, (res, res)), verb) for res, verb in asked}
    granted = role_grants(objs)
    assert used - granted == set()
    assert {(g, r) for g, r, _ in used} == {(g, r) for g, r, _ in granted}


# ---------------------------------------------------------------------------------------------- manifests/README.md

README = MANIFESTS / "README.md"


def _readme_shell_lines() -> list[str]:
    text = README.read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    assert blocks
    return [line.split("#", 1)[0] for b in blocks for line in b.replace("\\\n", " ").splitlines()]


OUTSIDE = ("..", "shared")  # the workspace folder above a checkout, which a clone elsewhere does not have


def test_manifests_readme_reads_nothing_outside_the_repository():
    outside = "/".join(OUTSIDE)
    for path in (README, CRD_DIR / "README.md", SCHEMAS / "derive.py"):
        assert outside not in path.read_text() and f"/{OUTSIDE[1]}/" not in path.read_text(), path


def test_manifests_readme_commands_name_files_that_exist():
    named = []
    for line in _readme_shell_lines():
        for word in shlex.split(line, posix=True) if line.strip() else []:
            if re.match(r"(manifests|tests)/", word):
                named.append(word)
    assert "manifests/crds/" in named and "manifests/cpu-mock" in named and "manifests/Dockerfile" in named
    for word in named:
        assert (ROOT / word).exists(), f"manifests/README.md names {word}, which does not exist"


def test_manifests_readme_runs_tests_the_projects_way():
    text = README.read_text()
    assert "pytest tests/test_manifests.py" not in text
    assert ".venv/bin/python -m pytest tests/unit/test_manifests.py" in text


def test_manifests_readme_lists_every_resource_the_role_grants(rendered):
    text = README.read_text()
    (para,) = [p for p in text.split("\n\n") if p.startswith("**ServiceAccount + Role + RoleBinding")]
    for _, resource, _ in role_grants(rendered["base"]):
        assert f"`{resource}`" in para, f"the RBAC paragraph does not mention {resource}"


def test_manifests_readme_states_the_replica_count_the_base_ships(rendered):
    replicas = picker_deployment(rendered["base"])["spec"]["replicas"]
    (said,) = re.findall(r"ships `replicas: (\d+)`", README.read_text())
    assert int(said) == replicas


def test_the_scheduling_config_map_is_what_the_picker_s_defaults_compile_to(rendered):
    """The base ships its scheduling as an EndpointPickerConfig file (issue 41): it loads, and it decides as
    the flags the Deployment sets would without it."""
    from epp_extproc.core.scheduling.config_file import parse_config, spec_from_config

    objs = rendered["base"]
    env = {k: v.get("value", "ns") for k, v in env_of(picker(objs)).items()}
    assert env["DYN_EPP_CONFIG_FILE"] == "/etc/epp/config/config.yaml"
    text = find(objs, "ConfigMap", "llm-pool-epp-config")["data"]["config.yaml"]
    assert parse_config(text) == spec_from_config(load_config([], env=env))
