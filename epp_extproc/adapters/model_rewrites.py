"""Where model rewrites come from: a file (`--model-rewrites-file`), or the InferenceModelRewrite CRD when
discovery is Kubernetes. The same two sources, and the same rules for failures, as the objectives
(adapters/objectives.py): every successful read replaces the whole `RewriteTable` (core/model_rewrite.py), a
failed one keeps the rules in service, so a bad edit or an API outage never silently sends a rollout's
traffic back to the old model (or all of it to the new one).

The CRD is `v1alpha2`, plural `inferencemodelrewrites`, namespaced, read from both API groups that serve it:
llm-d's `llm-d.ai` (llm-d router v0.10.0) and GAIE's deprecated `inference.networking.x-k8s.io` (GAIE v1.5.0;
both in manifests/crds/), merged with `llm-d.ai` winning a name in both (adapters/crd_poll.py says why). A
resource shadowed that way is dropped before precedence is worked out, so it never competes on age. Only
resources whose `spec.poolRef` names this pool count. Rewrites are few and change rarely, so a periodic list is
enough (no watch to keep alive); the ServiceAccount needs `list` on them in both groups. One
invalid resource is skipped (logged once) and the others stay in service: the apiserver's schema already
refuses most mistakes, and one team's typo must not undo another team's rollout.
"""

from __future__ import annotations

import logging
from typing import Any

import yaml

from epp_extproc.adapters.crd_poll import INFERENCE_API_GROUPS, CrdListPoller
from epp_extproc.core.model_rewrite import (
    RewriteError,
    RewriteRules,
    RewriteTable,
    Rule,
    parse_resource,
    parse_rewrites,
    rules_in_order,
)
from epp_extproc.file_watch import FileWatch

log = logging.getLogger(__name__)

REWRITE_GROUPS = INFERENCE_API_GROUPS  # (group, version), llm-d.ai first: it wins a name in both
REWRITE_PLURAL = "inferencemodelrewrites"


def read_rewrites_file(path: str) -> RewriteRules:
    """The file's rules in precedence order (documents and list items in the order written). Raises
    ValueError (RewriteError) naming the file, the resource, the field and the problem."""
    with open(path, encoding="utf-8") as f:
        try:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]  # JSON is YAML; `---` separated too
        except yaml.YAMLError as e:
            raise RewriteError(f"{path}: {e}") from None
    rules: list[Rule] = []
    try:
        for i, doc in enumerate(docs):
            rules += parse_rewrites(doc, where=f"document {i}")
    except RewriteError as e:
        raise RewriteError(f"{path}: {e}") from None
    if not rules:
        raise RewriteError(f"{path}: no InferenceModelRewrite in the file")
    return RewriteRules(rules)


class ModelRewritesFile:
    """Polls the file's (mtime, size, inode) and reloads on change (`file_watch.FileWatch`, like the
    objectives file); a version that does not load is logged once and the previous rules stay."""

    def __init__(self, table: RewriteTable, path: str, interval_s: float = 2.0) -> None:
        self.table = table
        self.path = path
        self._watch: FileWatch[RewriteRules] = FileWatch(
            [path], lambda: read_rewrites_file(path), table.replace, on_error=self._refused,
            interval_s=interval_s, stamp=None)

    def _refused(self, e: Exception) -> None:
        kept = len(self.table.rules)
        if isinstance(e, FileNotFoundError):
            log.error("model rewrites file %s is missing; keeping the %d rules in service", self.path, kept)
        else:
            log.error("cannot load model rewrites file (keeping the %d rules in service): %s", kept, e)

    def load_once(self) -> None:
        self._watch.check_sync()

    async def run(self) -> None:
        await self._watch.run()


def rewrites_for_pool(items: list[dict[str, Any]], pool_name: str) -> tuple[RewriteRules, list[str]]:
    """The rules of the InferenceModelRewrites whose poolRef names this pool, oldest resource first (GAIE's
    precedence; the name breaks a tie so every replica orders them alike), and why any was skipped."""
    kept: list[tuple[tuple[str, str], list[Rule]]] = []
    refused: list[str] = []
    for it in items:
        ref = (it.get("spec") or {}).get("poolRef") or {}
        if ref.get("name") != pool_name or ref.get("kind", "InferencePool") != "InferencePool":
            continue
        meta = it.get("metadata") or {}
        try:
            rules = parse_resource(it)
        except RewriteError as e:
            refused.append(str(e))
            continue
        kept.append(((str(meta.get("creationTimestamp") or ""), str(meta.get("name"))), rules))
    return rules_in_order(kept), refused


class ModelRewriteCrdPoller(CrdListPoller):
    """Lists the namespace's InferenceModelRewrites (both API groups) every `interval_s` and keeps those of
    our pool."""

    def __init__(self, table: RewriteTable, pool_name: str, namespace: str, *, kubeconfig: str | None = None,
                 interval_s: float = 10.0, api_client: Any = None) -> None:
        self.table = table
        self.pool_name = pool_name
        self._refused: list[str] = []
        super().__init__("InferenceModelRewrite", REWRITE_GROUPS, REWRITE_PLURAL, namespace,
                         apply=self._keep, in_service=lambda: f"{len(table.rules)} rules", kubeconfig=kubeconfig,
                         interval_s=interval_s, api_client=api_client)

    def _keep(self, items: list[dict[str, Any]]) -> None:
        rules, refused = rewrites_for_pool(items, self.pool_name)
        if refused != self._refused:  # once per change, not every poll
            for why in refused:
                log.error("skipping an InferenceModelRewrite: %s", why)
            self._refused = refused
        self.table.replace(rules)
