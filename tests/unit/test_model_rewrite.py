"""Model rewrites (GAIE InferenceModelRewrite): parsing, validation, precedence, the weighted split and sticky
sessions, on the in-process chooser."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from epp_extproc.core.model_rewrite import (
    ANY_MODEL,
    CONVERSATION_HEADER,
    ModelRewriter,
    RewriteError,
    RewriteRules,
    RewriteTable,
    Rule,
    Target,
    parse_resource,
    parse_rewrites,
    rules_in_order,
)


def resource(name: str, *rules: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceModelRewrite",
            "metadata": {"name": name}, "spec": {"poolRef": {"name": "llm-pool"}, "rules": list(rules)}}


def rule(models: list[str] | None, targets: dict[str, int | None]) -> dict[str, Any]:
    out: dict[str, Any] = {"targets": [{"modelRewrite": m, **({} if w is None else {"weight": w})}
                                       for m, w in targets.items()]}
    if models is not None:
        out["matches"] = [{"model": {"type": "Exact", "value": m}} for m in models]
    return out


def rewriter(*rules: Rule, seed: int = 7) -> ModelRewriter:
    return ModelRewriter(RewriteTable(RewriteRules(rules)), random.Random(seed))


# ------------------------------------------------------------------------------------------------ parsing
def test_a_manifest_becomes_rules_with_their_matches_targets_and_weights() -> None:
    (r,) = parse_rewrites(resource("canary", rule(["llama"], {"llama": 90, "llama-ft-v2": 10})))
    assert r == Rule("canary", frozenset({"llama"}), (Target("llama", 90), Target("llama-ft-v2", 10)))


def test_a_list_a_kind_list_and_a_single_manifest_are_all_accepted() -> None:
    a, b = resource("a", rule(["x"], {"y": 1})), resource("b", rule(["p"], {"q": 1}))
    assert [r.resource for r in parse_rewrites([a, b])] == ["a", "b"]
    assert [r.resource for r in parse_rewrites({"apiVersion": "v1", "kind": "List", "items": [a, b]})] == ["a", "b"]
    assert [r.resource for r in parse_rewrites(a)] == ["a"]


def test_targets_without_weights_share_equally_and_a_rule_without_matches_matches_every_model() -> None:
    (r,) = parse_rewrites(resource("all", rule(None, {"a": None, "b": None})))
    assert r.models == frozenset() and [t.weight for t in r.targets] == [1, 1]


BAD: list[tuple[str, Any, str]] = [
    ("negative weight", resource("n", rule(["m"], {"a": -1, "b": 2})), "weight must be an integer"),
    ("fractional weight", resource("n", rule(["m"], {"a": 1.5})), "weight must be an integer"),  # type: ignore[dict-item]
    ("boolean weight", resource("n", rule(["m"], {"a": True})), "weight must be an integer"),
    ("zero sum", resource("n", rule(["m"], {"a": 0, "b": 0})), "sum to 0"),
    ("some weighted", resource("n", rule(["m"], {"a": 1, "b": None})), "every target a weight, or none"),
    ("no targets", resource("n", {"matches": [{"model": {"value": "m"}}], "targets": []}), "at least one target"),
    ("no rules", resource("n"), "at least one rule"),
    ("empty match value", resource("n", rule([""], {"a": 1})), "value must be a non-empty string"),
    ("match without model", resource("n", {"matches": [{}], "targets": [{"modelRewrite": "a"}]}), "needs `model"),
    ("prefix match", resource("n", {"matches": [{"model": {"type": "Prefix", "value": "m"}}],
                                     "targets": [{"modelRewrite": "a"}]}), "only Exact"),
    ("misspelt field", resource("n", {"matches": [{"model": {"value": "m"}}], "targets": [{"modelrewrite": "a"}]}),
     "unknown field(s) modelrewrite"),
    ("empty target", resource("n", rule(["m"], {"": 1})), "modelRewrite must be a non-empty string"),
    ("no name", {"spec": {"rules": [rule(["m"], {"a": 1})]}}, "metadata.name is missing"),
    ("other kind", {**resource("n", rule(["m"], {"a": 1})), "kind": "InferenceObjective"}, "kind must be"),
    ("not a mapping", ["just a string"], "must be a mapping"),
]


@pytest.mark.parametrize(("doc", "why"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_an_invalid_rewrite_is_refused_naming_the_resource_field_and_problem(doc: Any, why: str) -> None:
    with pytest.raises(RewriteError) as e:
        parse_rewrites(doc)
    assert why in str(e.value)


def test_the_error_names_the_rule_and_target_index() -> None:
    with pytest.raises(RewriteError, match=r"'canary' spec.rules\[1\].targets\[0\].weight"):
        parse_resource(resource("canary", rule(["a"], {"b": 1}), rule(["c"], {"d": -5})))


# ------------------------------------------------------------------------------------------------ precedence
def test_an_exact_match_wins_over_an_older_catch_all_and_the_oldest_resource_wins_a_tie() -> None:
    old_all = parse_resource(resource("catch-all", rule(None, {"everything": 1})))
    old = parse_resource(resource("old", rule(["m"], {"from-old": 1})))
    new = parse_resource(resource("new", rule(["m"], {"from-new": 1})))
    rules = rules_in_order([(("2025-01-03", "new"), new), (("2025-01-01", "catch-all"), old_all),
                            (("2025-01-02", "old"), old)])
    assert rules.rule_for("m").targets[0].model == "from-old"  # type: ignore[union-attr]
    assert rules.rule_for("anything-else").targets[0].model == "everything"  # type: ignore[union-attr]


def test_a_model_no_rule_names_is_not_rewritten_and_a_non_string_model_is_left_alone() -> None:
    rw = rewriter(Rule("r", frozenset({"m"}), (Target("t", 1),)))
    assert rw.choose("other", {}) is None
    assert rw.choose(["m"], {}) is None
    assert rw.choose(None, {}) is None


def test_the_metric_label_of_a_catch_all_rule_is_not_the_clients_model_name() -> None:
    rw = rewriter(Rule("all", frozenset(), (Target("t", 1),)))
    rewrite = rw.choose("client-invented-name-123", {})
    assert rewrite is not None and rewrite.label_model == ANY_MODEL and rewrite.target == "t"


# ------------------------------------------------------------------------------------------------ the split
@pytest.mark.parametrize("weights", [(90, 10), (50, 30, 20), (1, 1, 1, 1), (70, 0, 30)])
def test_the_observed_split_over_10000_decisions_is_within_two_percent_of_the_weights(
        weights: tuple[int, ...]) -> None:
    targets = tuple(Target(f"t{i}", w) for i, w in enumerate(weights))
    rw = rewriter(Rule("split", frozenset({"m"}), targets), seed=12345)
    seen = Counter(rw.choose("m", {}).target for _ in range(10_000))  # type: ignore[union-attr]
    total = sum(weights)
    for t in targets:
        assert abs(seen[t.model] / 10_000 - t.weight / total) <= 0.02, (t, seen)
    if weights[1] == 0:
        assert seen["t1"] == 0  # a zero weight never receives traffic


def test_the_split_is_random_per_request_without_a_session_key() -> None:
    rw = rewriter(Rule("split", frozenset({"m"}), (Target("a", 1), Target("b", 1))), seed=3)
    assert len({rw.choose("m", {}).target for _ in range(50)}) == 2  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------------ sessions
def test_a_session_keeps_one_target_and_another_replica_places_it_the_same_way() -> None:
    rules = (Rule("split", frozenset({"m"}), (Target("a", 50), Target("b", 50))),)
    one, other = rewriter(*rules, seed=1), rewriter(*rules, seed=2)  # two replicas, different random state
    for s in range(200):
        headers = {CONVERSATION_HEADER: [f"conversation-{s}"]}
        first = one.choose("m", headers).target  # type: ignore[union-attr]
        assert all(one.choose("m", headers).target == first for _ in range(5))  # type: ignore[union-attr]
        assert other.choose("m", headers).target == first  # type: ignore[union-attr]


def test_sessions_spread_over_the_targets_by_their_weights() -> None:
    rw = rewriter(Rule("split", frozenset({"m"}), (Target("a", 90), Target("b", 10))))
    seen = Counter(rw.choose("m", {CONVERSATION_HEADER: [f"s{i}"]}).target for i in range(10_000))  # type: ignore[union-attr]
    assert abs(seen["b"] / 10_000 - 0.10) <= 0.02, seen


def test_shifting_weight_moves_only_the_sessions_in_the_slice_that_changed_hands() -> None:
    before = rewriter(Rule("r", frozenset({"m"}), (Target("a", 90), Target("b", 10))))
    after = rewriter(Rule("r", frozenset({"m"}), (Target("a", 50), Target("b", 50))))
    for i in range(2000):
        h = {CONVERSATION_HEADER: [f"s{i}"]}
        if before.choose("m", h).target == "b":  # type: ignore[union-attr]
            assert after.choose("m", h).target == "b"  # type: ignore[union-attr]


def test_a_blank_session_header_counts_as_none() -> None:
    rw = rewriter(Rule("split", frozenset({"m"}), (Target("a", 1), Target("b", 1))), seed=5)
    assert len({rw.choose("m", {CONVERSATION_HEADER: ["  "]}).target for _ in range(50)}) == 2  # type: ignore[union-attr]


@pytest.mark.parametrize("api_version", ["llm-d.ai/v1alpha2", "inference.networking.x-k8s.io/v1alpha2"])
def test_both_api_groups_serving_the_kind_are_accepted(api_version: str) -> None:
    """llm-d moved the kind to llm-d.ai with the same fields; GAIE's group is deprecated but still read."""
    doc = resource("canary", {"targets": [{"modelRewrite": "llama-ft", "weight": 1}]}) | {"apiVersion": api_version}
    assert [r.resource for r in parse_resource(doc)] == ["canary"]


def test_an_api_version_neither_group_serves_is_refused() -> None:
    doc = resource("canary", {"targets": [{"modelRewrite": "llama-ft"}]}) | {"apiVersion": "llm-d.ai/v1"}
    with pytest.raises(RewriteError, match="apiVersion must be one of llm-d.ai/v1alpha2"):
        parse_resource(doc)
