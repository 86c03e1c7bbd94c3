"""Roles from the pod label in Kubernetes discovery, against the fake apiserver (tests/fake_k8s.py)."""

from __future__ import annotations

import pytest

from epp_extproc.core.contract import Role
from tests.fake_k8s import PODS, make_pod
from tests.integration.test_k8s_discovery import kube, seed, start  # noqa: F401  (fixtures)
from tests.waiting import until_async

pytestmark = pytest.mark.timeout(20)


def roles(r) -> dict[str, Role]:  # noqa: ANN001
    return {e.name: e.role for e in r.registry.all()}


async def test_pods_take_their_role_from_llm_d_s_label(kube, start) -> None:  # noqa: F811
    seed(kube, make_pod("p", "10.0.0.1", labels={"app": "llm", "llm-d.ai/role": "prefill"}),
         make_pod("d", "10.0.0.2", labels={"app": "llm", "llm-d.ai/role": "decode"}),
         make_pod("a", "10.0.0.3"))
    r = await start()
    await r.wait_names("a", "d", "p")
    assert roles(r) == {"p": Role.PREFILL, "d": Role.DECODE, "a": Role.BOTH}
    assert r.registry.has_prefill()


async def test_a_relabelled_pod_changes_role(kube, start) -> None:  # noqa: F811
    seed(kube, make_pod("w", "10.0.0.1", labels={"app": "llm", "llm-d.ai/role": "decode"}))
    r = await start()
    await r.wait_names("w")
    kube.patch(PODS, "w", lambda p: p["metadata"]["labels"].update({"llm-d.ai/role": "prefill"}))
    await until_async(lambda: roles(r) == {"w": Role.PREFILL}, "the new role")


async def test_another_role_label_can_be_named(kube, start) -> None:  # noqa: F811
    seed(kube, make_pod("w", "10.0.0.1", labels={"app": "llm", "example.com/phase": "prefill"}))
    r = await start(role_label="example.com/phase")
    await r.wait_names("w")
    assert roles(r) == {"w": Role.PREFILL}


async def test_a_pod_with_a_role_the_picker_cannot_serve_is_not_an_endpoint(kube, start) -> None:  # noqa: F811
    seed(kube, make_pod("e", "10.0.0.1", labels={"app": "llm", "llm-d.ai/role": "encode"}),
         make_pod("w", "10.0.0.2"))
    r = await start()
    await r.wait_names("w")
