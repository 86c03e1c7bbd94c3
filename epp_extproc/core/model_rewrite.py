"""Model rewrites and weighted splits: which `model` a request is sent as (GAIE's InferenceModelRewrite).

Operators roll out a fine-tune or a LoRA adapter by rewriting the `model` clients ask for to one or several
targets with weights (90/10). The API is `InferenceModelRewrite` `v1alpha2`, the same in llm-d's `llm-d.ai`
group (llm-d router v0.10.0) and GAIE v1.5.0's deprecated `inference.networking.x-k8s.io` (manifests/crds/), so
either apiVersion is accepted; it is read with its own precedence rules:

- a rule whose `matches` name the request's model exactly wins over a rule with no `matches` (every model);
- among several, the resource created first wins (a file: the one written first), then the first rule in it;
- a target's share is weight / sum of the rule's weights; targets that all leave `weight` out share equally.

The choice is per request (seeded from `random`), except that a request carrying a session key
(`CONVERSATION_HEADER` by default, `--model-rewrite-session-header`) is placed by a stable hash of the key, so a conversation keeps one target and every
replica places it the same way without talking to the others. Buckets are cumulative, so moving weight from
one target to another (90/10 -> 50/50) moves only the sessions in the slice that changed hands.

This module is plain values: the file reader and the CRD poller (adapters/model_rewrites.py) build the rules
with `parse_rewrites`, the pipeline asks `ModelRewriter.choose` and splices the body (core/body.py).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# llm-d's group first (where llm-d serves the kind now), then GAIE's deprecated one; the fields are the same.
REWRITE_API_VERSIONS = ("llm-d.ai/v1alpha2", "inference.networking.x-k8s.io/v1alpha2")
REWRITE_KIND = "InferenceModelRewrite"
CONVERSATION_HEADER = "x-session-id"  # one conversation -> one target (hashed; never logged, never a label)
ANY_MODEL = "*"  # the metric's `model` label of a rule without `matches`: client-chosen names stay out
MAX_WEIGHT = 1_000_000  # the CRD's bound on one weight

_RESOURCE_KEYS = frozenset({"apiVersion", "kind", "metadata", "spec", "status"})
_SPEC_KEYS = frozenset({"poolRef", "rules"})
_RULE_KEYS = frozenset({"matches", "targets"})
_MATCH_KEYS = frozenset({"model"})
_MODEL_MATCH_KEYS = frozenset({"type", "value"})
_TARGET_KEYS = frozenset({"modelRewrite", "weight"})


class RewriteError(ValueError):
    """A rewrite resource that cannot be used; the message says which resource, which field and why."""


@dataclass(frozen=True, slots=True)
class Target:
    model: str
    weight: int


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule of one resource: `models` empty = every model."""

    resource: str  # the InferenceModelRewrite's name: logs and the metric's `rewrite` label
    models: frozenset[str]
    targets: tuple[Target, ...]

    @property
    def total(self) -> int:
        return sum(t.weight for t in self.targets)


@dataclass(frozen=True, slots=True)
class Rewrite:
    """What one request is rewritten to, and the bounded labels it is counted under (at commit)."""

    resource: str
    model: str  # what the client asked for
    target: str
    label_model: str  # the rule's exact match, or ANY_MODEL

    @property
    def changes(self) -> bool:
        return self.target != self.model


class RewriteRules:
    """Rules in precedence order (resources oldest first, rules in list order), looked up by model."""

    def __init__(self, rules: Sequence[Rule] = ()) -> None:
        self.rules = tuple(rules)
        self._exact: dict[str, Rule] = {}
        self._generic: Rule | None = None
        for r in self.rules:
            if not r.models:
                self._generic = self._generic or r
            for m in r.models:
                self._exact.setdefault(m, r)

    def rule_for(self, model: str) -> Rule | None:
        return self._exact.get(model) or self._generic

    def __len__(self) -> int:
        return len(self.rules)

    def snapshot(self) -> list[dict[str, Any]]:
        return [{"rewrite": r.resource, "models": sorted(r.models) or [ANY_MODEL],
                 "targets": {t.model: t.weight for t in r.targets}} for r in self.rules]


class RewriteTable:
    """The rules in service, replaced wholesale by whichever source feeds them (file or CRD)."""

    def __init__(self, rules: RewriteRules | None = None) -> None:
        self.rules = rules or RewriteRules()

    def replace(self, rules: RewriteRules) -> None:
        if rules.snapshot() != self.rules.snapshot():
            log.info("model rewrites: %s", rules.snapshot())
        self.rules = rules


def bucket(rule: Rule, model: str, session: str | None, rng: random.Random) -> int:
    """A point in [0, total): random per request, or the session key's stable hash (the same on every
    replica and every restart; the model is mixed in so one session's draws for two models are unrelated)."""
    if session is None:
        return rng.randrange(rule.total)
    digest = hashlib.blake2b(f"{model}\n{session}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return (int.from_bytes(digest, "big") * rule.total) >> 64


def pick(rule: Rule, point: int) -> Target:
    """The target whose cumulative slice holds `point` (a zero weight owns no slice)."""
    upto = 0
    for t in rule.targets:
        upto += t.weight
        if point < upto:
            return t
    raise ValueError(f"point {point} outside the rule's total {rule.total}")


class ModelRewriter:
    """The per-request choice over the table in service; `rng` is injectable so a test can seed it."""

    def __init__(self, table: RewriteTable, rng: random.Random | None = None, *,
                 session_header: str = CONVERSATION_HEADER) -> None:
        self.table = table
        self.rng = rng or random.Random()
        # the request header naming a conversation (--model-rewrite-session-header); headers arrive lower-cased
        self.session_header = session_header.strip().lower()

    def choose(self, model: object, headers: Mapping[str, list[str]]) -> Rewrite | None:
        """The rewrite of a request whose body names `model`; None when no rule applies (or `model` is not a
        string: such a body is the worker's to refuse)."""
        if not isinstance(model, str):
            return None
        rule = self.table.rules.rule_for(model)
        if rule is None:
            return None
        target = pick(rule, bucket(rule, model, session_key(headers, self.session_header), self.rng))
        return Rewrite(rule.resource, model, target.model, model if model in rule.models else ANY_MODEL)


def session_key(headers: Mapping[str, list[str]], name: str = CONVERSATION_HEADER) -> str | None:
    """The conversation key a request carries in header `name` (its last value), None when absent or blank."""
    values = headers.get(name)
    if not values:
        return None
    v = values[-1].strip()
    return v or None


# ------------------------------------------------------------------------------------------------ parsing
def parse_rewrites(doc: object, *, where: str = "") -> list[Rule]:
    """The rules of one file document: an InferenceModelRewrite manifest, a YAML list of them, or a
    `kind: List` (`items`). Raises RewriteError naming the resource and the field."""
    if isinstance(doc, dict) and "items" in doc and "spec" not in doc:
        doc = doc["items"]
    items = doc if isinstance(doc, list) else [doc]
    rules: list[Rule] = []
    for i, it in enumerate(items):
        rules += parse_resource(it, where=f"{where}[{i}]" if isinstance(doc, list) else where)
    return rules


def parse_resource(item: object, *, where: str = "") -> list[Rule]:
    """One InferenceModelRewrite's rules, validated. Fields outside the API are refused (a misspelt
    `modelrewrite` must not silently send 100% of traffic elsewhere)."""
    if not isinstance(item, dict):
        raise RewriteError(f"{where or 'document'}: an InferenceModelRewrite must be a mapping, got "
                           f"{type(item).__name__}")
    meta = item.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    label = f"InferenceModelRewrite {name!r}" if isinstance(name, str) else f"InferenceModelRewrite {where}".strip()
    _known(item, _RESOURCE_KEYS, label)
    if item.get("apiVersion", REWRITE_API_VERSIONS[0]) not in REWRITE_API_VERSIONS:
        raise RewriteError(f"{label}: apiVersion must be one of {', '.join(REWRITE_API_VERSIONS)}, "
                           f"got {item.get('apiVersion')!r}")
    if item.get("kind", REWRITE_KIND) != REWRITE_KIND:
        raise RewriteError(f"{label}: kind must be {REWRITE_KIND}, got {item.get('kind')!r}")
    if not isinstance(name, str) or not name:
        raise RewriteError(f"{label}: metadata.name is missing (it names the rewrite in logs and metrics)")
    spec = item.get("spec")
    if not isinstance(spec, dict):
        raise RewriteError(f"{label}: spec is missing")
    _known(spec, _SPEC_KEYS, f"{label} spec")
    rules = spec.get("rules")
    if not isinstance(rules, list) or not rules:
        raise RewriteError(f"{label}: spec.rules must list at least one rule")
    return [_rule(name, r, f"{label} spec.rules[{i}]") for i, r in enumerate(rules)]


def _rule(name: str, raw: object, at: str) -> Rule:
    if not isinstance(raw, dict):
        raise RewriteError(f"{at}: a rule must be a mapping")
    _known(raw, _RULE_KEYS, at)
    matches = raw.get("matches") or []
    if not isinstance(matches, list):
        raise RewriteError(f"{at}.matches must be a list")
    models: set[str] = set()
    for j, m in enumerate(matches):
        mat = f"{at}.matches[{j}]"
        if not isinstance(m, dict) or not isinstance(m.get("model"), dict):
            raise RewriteError(f"{mat}: needs `model: {{value: NAME}}`")
        _known(m, _MATCH_KEYS, mat)
        mm = m["model"]
        _known(mm, _MODEL_MATCH_KEYS, f"{mat}.model")
        if mm.get("type", "Exact") != "Exact":
            raise RewriteError(f"{mat}.model.type: only Exact is supported, got {mm.get('type')!r}")
        models.add(_name(mm.get("value"), f"{mat}.model.value"))
    targets = raw.get("targets")
    if not isinstance(targets, list) or not targets:
        raise RewriteError(f"{at}.targets must list at least one target")
    weighted = [isinstance(t, dict) and "weight" in t for t in targets]
    if any(weighted) and not all(weighted):
        raise RewriteError(f"{at}.targets: give every target a weight, or none (equal shares)")
    out: list[Target] = []
    for j, t in enumerate(targets):
        tat = f"{at}.targets[{j}]"
        if not isinstance(t, dict):
            raise RewriteError(f"{tat}: a target must be a mapping")
        _known(t, _TARGET_KEYS, tat)
        w = t.get("weight", 1)
        if type(w) is not int or not 0 <= w <= MAX_WEIGHT:
            raise RewriteError(f"{tat}.weight must be an integer in [0, {MAX_WEIGHT}], got {w!r}")
        out.append(Target(_name(t.get("modelRewrite"), f"{tat}.modelRewrite"), w))
    rule = Rule(name, frozenset(models), tuple(out))
    if rule.total <= 0:
        raise RewriteError(f"{at}.targets: the weights sum to 0; at least one must be positive")
    return rule


def _name(value: object, at: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise RewriteError(f"{at} must be a non-empty string, got {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RewriteError(f"{at} is not valid Unicode: {value!r}") from None
    return value


def _known(d: dict[str, Any], allowed: frozenset[str], at: str) -> None:
    unknown = sorted(str(k) for k in d if k not in allowed)
    if unknown:
        raise RewriteError(f"{at}: unknown field(s) {', '.join(unknown)}; expected {', '.join(sorted(allowed))}")


def rules_in_order(resources: Iterable[tuple[Any, list[Rule]]]) -> RewriteRules:
    """Resources sorted by their key (e.g. creation time, then name), each one's rules in list order."""
    return RewriteRules([r for _, rules in sorted(resources, key=lambda kv: kv[0]) for r in rules])
