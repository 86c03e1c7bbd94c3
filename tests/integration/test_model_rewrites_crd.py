"""The InferenceModelRewrite poller against the fake apiserver (tests/fake_k8s.py): the real client, the real
list JSON, the group/version/plural the CRD is served under in both groups (llm-d router v0.10.0's `llm-d.ai`
and GAIE v1.5.0's deprecated `inference.networking.x-k8s.io`), scoped to this pool by spec.poolRef."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from epp_extproc.adapters.model_rewrites import ModelRewriteCrdPoller
from epp_extproc.core.model_rewrite import RewriteTable
from tests.fake_k8s import LLMD_REWRITES, REWRITES, FakeKube


def rewrite(name: str, model: str, targets: dict[str, Any], pool: str = "llm-pool",
            created: str = "2025-01-01T00:00:00Z") -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": created},
            "spec": {"poolRef": {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool},
                     "rules": [{"matches": [{"model": {"type": "Exact", "value": model}}],
                                "targets": [{"modelRewrite": t, "weight": w} for t, w in targets.items()]}]}}


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as k:
        yield k


def poller(kube: FakeKube, table: RewriteTable) -> ModelRewriteCrdPoller:
    return ModelRewriteCrdPoller(table, "llm-pool", "default", api_client=kube.api_client())


def split(table: RewriteTable, model: str) -> dict[str, int]:
    rule = table.rules.rule_for(model)
    return {t.model: t.weight for t in rule.targets} if rule else {}


async def test_the_pools_rewrites_are_read_from_the_namespace_list(kube: FakeKube) -> None:
    kube.put(REWRITES, rewrite("canary", "llama", {"llama": 90, "llama-ft-v2": 10}))
    kube.put(REWRITES, rewrite("theirs", "mistral", {"x": 1}, pool="other-pool"))
    kube.put(REWRITES, rewrite("elsewhere", "qwen", {"y": 1}), namespace="other")
    table = RewriteTable()
    p = poller(kube, table)
    assert await p.poll_once()
    assert split(table, "llama") == {"llama": 90, "llama-ft-v2": 10}
    assert split(table, "mistral") == {} and split(table, "qwen") == {}
    assert [r.namespace for r in kube.lists(REWRITES)] == ["default"]
    await p._api.close()


async def test_a_changed_or_deleted_rewrite_is_seen_at_the_next_poll(kube: FakeKube) -> None:
    kube.put(REWRITES, rewrite("canary", "llama", {"llama": 90, "llama-ft-v2": 10}))
    kube.put(REWRITES, rewrite("alias", "gpt-4o", {"llama": 1}))
    table = RewriteTable()
    p = poller(kube, table)
    assert await p.poll_once()
    kube.put(REWRITES, rewrite("canary", "llama", {"llama": 0, "llama-ft-v2": 1}))
    kube.delete(REWRITES, "alias")
    assert await p.poll_once()
    assert split(table, "llama") == {"llama": 0, "llama-ft-v2": 1} and split(table, "gpt-4o") == {}
    await p._api.close()


@pytest.mark.parametrize("status", [403, 404, 500])
async def test_an_api_that_refuses_keeps_the_rewrites_in_service(kube: FakeKube, status: int) -> None:
    """RBAC missing (403), CRD not installed (404), apiserver trouble (500): the last rules stay."""
    kube.put(REWRITES, rewrite("canary", "llama", {"llama": 90, "llama-ft-v2": 10}))
    table = RewriteTable()
    p = poller(kube, table)
    assert await p.poll_once()
    kube.fail_next(1, status, resource=REWRITES)
    kube.put(REWRITES, rewrite("canary", "llama", {"llama": 50, "llama-ft-v2": 50}))
    assert not await p.poll_once()
    assert split(table, "llama") == {"llama": 90, "llama-ft-v2": 10}
    assert await p.poll_once()
    assert split(table, "llama") == {"llama": 50, "llama-ft-v2": 50}
    await p._api.close()


async def test_an_invalid_resource_is_logged_once_and_skipped_while_the_others_serve(
        kube: FakeKube, caplog: pytest.LogCaptureFixture) -> None:
    kube.put(REWRITES, rewrite("good", "llama", {"llama-ft-v2": 1}))
    kube.put(REWRITES, rewrite("bad", "mistral", {"a": 0, "b": 0}))
    table = RewriteTable()
    p = poller(kube, table)
    with caplog.at_level(logging.ERROR, logger="epp_extproc.adapters.model_rewrites"):
        assert await p.poll_once()
        assert await p.poll_once()
    assert split(table, "llama") == {"llama-ft-v2": 1} and split(table, "mistral") == {}
    assert caplog.text.count("'bad'") == 1 and "sum to 0" in caplog.text
    await p._api.close()


async def test_the_oldest_resource_wins_two_exact_matches_for_one_model(kube: FakeKube) -> None:
    kube.put(REWRITES, rewrite("a-new", "llama", {"from-new": 1}, created="2025-03-01T00:00:00Z"))
    kube.put(REWRITES, rewrite("z-old", "llama", {"from-old": 1}, created="2025-01-01T00:00:00Z"))
    table = RewriteTable()
    p = poller(kube, table)
    assert await p.poll_once()
    assert split(table, "llama") == {"from-old": 1}
    await p._api.close()


# ---------------------------------------------------------------------------------------------- both API groups


async def test_an_llm_d_rewrite_is_honoured(kube: FakeKube) -> None:
    kube.put(LLMD_REWRITES, rewrite("canary", "llama", {"llama": 90, "llama-ft-v2": 10}))
    kube.put(LLMD_REWRITES, rewrite("theirs", "mistral", {"x": 1}, pool="other-pool"))
    table = RewriteTable()
    p = poller(kube, table)
    assert await p.poll_once()
    assert split(table, "llama") == {"llama": 90, "llama-ft-v2": 10} and split(table, "mistral") == {}
    assert [r.namespace for r in kube.lists(LLMD_REWRITES)] == ["default"]
    await p._api.close()


async def test_rewrites_of_both_groups_serve_and_the_llm_d_copy_of_a_name_replaces_the_legacy_one(
        kube: FakeKube) -> None:
    """The legacy copy is older, so if it were kept it would win GAIE's oldest-first precedence: it is dropped
    before precedence is worked out."""
    kube.put(REWRITES, rewrite("canary", "llama", {"old": 1}, created="2025-01-01T00:00:00Z"))
    kube.put(LLMD_REWRITES, rewrite("canary", "llama", {"new": 1}, created="2025-06-01T00:00:00Z"))
    kube.put(REWRITES, rewrite("alias", "gpt-4o", {"llama": 1}))  # not migrated yet
    table = RewriteTable()
    p = poller(kube, table)
    assert await p.poll_once()
    assert split(table, "llama") == {"new": 1} and split(table, "gpt-4o") == {"llama": 1}
    await p._api.close()


async def test_a_missing_crd_group_does_not_break_the_other(kube: FakeKube) -> None:
    kube.uninstall(REWRITES)
    kube.put(LLMD_REWRITES, rewrite("canary", "llama", {"llama-ft-v2": 1}))
    table = RewriteTable()
    p = poller(kube, table)
    assert await p.poll_once() and await p.poll_once()
    assert split(table, "llama") == {"llama-ft-v2": 1}
    await p._api.close()
