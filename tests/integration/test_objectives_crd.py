"""The InferenceObjective poller against the fake apiserver (tests/fake_k8s.py): the real client, the real
list JSON, the group/version/plural GAIE's CRD is served under."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from epp_extproc.adapters.objectives import ObjectiveCrdPoller
from epp_extproc.core.flow_control import ObjectiveTable
from tests.fake_k8s import OBJECTIVES, FakeKube


def objective(name: str, priority: Any, pool: str = "llm-pool", kind: str | None = None) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": pool}
    if kind is not None:
        ref["kind"] = kind
    spec: dict[str, Any] = {"poolRef": ref}
    if priority is not None:
        spec["priority"] = priority
    return {"metadata": {"name": name}, "spec": spec}


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as k:
        yield k


def poller(kube: FakeKube, table: ObjectiveTable) -> ObjectiveCrdPoller:
    return ObjectiveCrdPoller(table, "llm-pool", "default", api_client=kube.api_client())


async def test_the_pools_objectives_are_read_from_the_namespace_list(kube: FakeKube) -> None:
    kube.put(OBJECTIVES, objective("premium", 10))
    kube.put(OBJECTIVES, objective("standard", None))  # unset priority = 0, as in GAIE
    kube.put(OBJECTIVES, objective("theirs", 99, pool="other-pool"))
    kube.put(OBJECTIVES, objective("elsewhere", 50), namespace="other")
    table = ObjectiveTable()
    p = poller(kube, table)
    assert await p.poll_once()
    assert table.snapshot() == {"premium": 10, "standard": 0}
    assert table.flow_key({"x-gateway-inference-objective": ["premium"]}).priority == 10
    assert [r.namespace for r in kube.lists(OBJECTIVES)] == ["default"]
    await p._api.close()


async def test_a_changed_or_deleted_objective_is_seen_at_the_next_poll(kube: FakeKube) -> None:
    kube.put(OBJECTIVES, objective("premium", 10))
    kube.put(OBJECTIVES, objective("batch", -1))
    table = ObjectiveTable()
    p = poller(kube, table)
    assert await p.poll_once()
    kube.put(OBJECTIVES, objective("premium", 20))
    kube.delete(OBJECTIVES, "batch")
    assert await p.poll_once()
    assert table.snapshot() == {"premium": 20}
    await p._api.close()


@pytest.mark.parametrize("status", [403, 404, 500])
async def test_an_api_that_refuses_keeps_the_objectives_already_known(kube: FakeKube, status: int) -> None:
    """RBAC missing (403), CRD not installed (404), apiserver trouble (500): the last table stays."""
    kube.put(OBJECTIVES, objective("premium", 10))
    table = ObjectiveTable()
    p = poller(kube, table)
    assert await p.poll_once()
    kube.fail_next(1, status, resource=OBJECTIVES)
    kube.put(OBJECTIVES, objective("premium", 1))
    assert not await p.poll_once()
    assert table.snapshot() == {"premium": 10}
    assert await p.poll_once()  # and it recovers on the next poll
    assert table.snapshot() == {"premium": 1}
    await p._api.close()


async def test_objectives_with_a_non_integer_priority_or_another_kind_of_pool_are_skipped(kube: FakeKube) -> None:
    kube.put(OBJECTIVES, objective("fractional", 1.5))
    kube.put(OBJECTIVES, objective("text", "10"))
    kube.put(OBJECTIVES, objective("service-ref", 5, kind="Service"))
    kube.put(OBJECTIVES, objective("good", 3, kind="InferencePool"))
    table = ObjectiveTable()
    p = poller(kube, table)
    assert await p.poll_once()
    assert table.snapshot() == {"good": 3}
    await p._api.close()
