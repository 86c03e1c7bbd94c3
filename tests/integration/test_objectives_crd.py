"""The InferenceObjective poller against the fake apiserver (tests/fake_k8s.py): the real client, the real
list JSON, the group/version/plural the CRD is served under, in both groups (llm-d's `llm-d.ai` and GAIE's
deprecated `inference.networking.x-k8s.io`)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from epp_extproc.adapters.objectives import ObjectiveCrdPoller
from epp_extproc.core.flow_objectives import ObjectiveTable
from tests.fake_k8s import LLMD_OBJECTIVES, OBJECTIVES, FakeKube


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


# ---------------------------------------------------------------------------------------------- both API groups
POLL_LOG = "epp_extproc.adapters.crd_poll"


async def test_an_llm_d_objective_is_honoured(kube: FakeKube) -> None:
    kube.put(LLMD_OBJECTIVES, objective("premium", 10))
    kube.put(LLMD_OBJECTIVES, objective("theirs", 99, pool="other-pool"))
    table = ObjectiveTable()
    p = poller(kube, table)
    assert await p.poll_once()
    assert table.snapshot() == {"premium": 10}
    assert [r.namespace for r in kube.lists(LLMD_OBJECTIVES)] == ["default"]
    await p._api.close()


async def test_objectives_of_both_groups_are_kept_and_llm_d_wins_a_name_in_both_logged_once(
        kube: FakeKube, caplog: pytest.LogCaptureFixture) -> None:
    kube.put(LLMD_OBJECTIVES, objective("premium", 10))
    kube.put(OBJECTIVES, objective("premium", 1))  # the legacy copy of a migrated objective
    kube.put(OBJECTIVES, objective("batch", -1))  # not migrated yet
    table = ObjectiveTable()
    p = poller(kube, table)
    with caplog.at_level(logging.INFO, logger=POLL_LOG):
        assert await p.poll_once()
        assert await p.poll_once()
    assert table.snapshot() == {"premium": 10, "batch": -1}
    shadow = [r for r in caplog.records if "more than one API group" in r.getMessage()]
    assert len(shadow) == 1 and "premium" in shadow[0].getMessage() and "llm-d.ai" in shadow[0].getMessage()
    await p._api.close()


async def test_objectives_of_the_deprecated_group_are_logged_once(
        kube: FakeKube, caplog: pytest.LogCaptureFixture) -> None:
    kube.put(OBJECTIVES, objective("premium", 10))
    table = ObjectiveTable()
    p = poller(kube, table)
    with caplog.at_level(logging.INFO, logger=POLL_LOG):
        for _ in range(3):
            assert await p.poll_once()
    assert [r.levelno for r in caplog.records if "deprecated API group" in r.getMessage()] == [logging.INFO]
    await p._api.close()


@pytest.mark.parametrize("missing, present", [(LLMD_OBJECTIVES, OBJECTIVES), (OBJECTIVES, LLMD_OBJECTIVES)])
async def test_a_group_without_its_crd_is_skipped_after_one_info_log_and_the_other_serves(
        kube: FakeKube, caplog: pytest.LogCaptureFixture, missing: str, present: str) -> None:
    kube.uninstall(missing)
    kube.put(present, objective("premium", 10))
    table = ObjectiveTable()
    p = poller(kube, table)
    with caplog.at_level(logging.INFO, logger=POLL_LOG):
        for _ in range(3):
            assert await p.poll_once()  # a CRD not installed is not a failure
    assert table.snapshot() == {"premium": 10}
    assert len(kube.lists(missing)) == 3  # still asked at every poll: a CRD installed later is picked up
    absent = [r for r in caplog.records if "CRD is installed" in r.getMessage()]
    assert [r.levelno for r in absent] == [logging.INFO]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    await p._api.close()


async def test_a_crd_installed_later_is_read_without_a_restart(kube: FakeKube) -> None:
    kube.uninstall(LLMD_OBJECTIVES)
    kube.put(OBJECTIVES, objective("batch", -1))
    table = ObjectiveTable()
    p = poller(kube, table)
    assert await p.poll_once()
    kube.uninstalled.discard(LLMD_OBJECTIVES)
    kube.put(LLMD_OBJECTIVES, objective("premium", 10))
    assert await p.poll_once()
    assert table.snapshot() == {"premium": 10, "batch": -1}
    await p._api.close()


async def test_a_failing_group_keeps_its_objectives_while_the_other_groups_changes_apply(kube: FakeKube) -> None:
    kube.put(OBJECTIVES, objective("batch", -1))
    kube.put(LLMD_OBJECTIVES, objective("premium", 10))
    table = ObjectiveTable()
    p = poller(kube, table)
    assert await p.poll_once()
    kube.fail_next(1, 500, resource=OBJECTIVES)
    kube.put(LLMD_OBJECTIVES, objective("premium", 20))
    assert not await p.poll_once()  # one group failed: not a clean poll
    assert table.snapshot() == {"premium": 20, "batch": -1}
    await p._api.close()
